"""Limiter: many threads, timeouts, pause, the decorator and context manager, pickling."""

from __future__ import annotations

import asyncio
import inspect
import itertools
import pickle
import threading
import time
from pathlib import Path

import pytest

import ratequeue
import ratequeue.aio  # (used as ratequeue.aio below: imported here, not by whichever test ran first)
from ratequeue import AcquireTimeout, Limiter
from ratequeue.state.memory import MemoryState

from .ops import do

LONG = 30.0  # an interval no test waits out


def wait_until(predicate: object, timeout: float = 10.0) -> None:
    """Poll ``predicate`` until true; fail after ``timeout`` s (a condition, not a sleep)."""
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.001)


def fresh(interval: float, **kwargs: object) -> Limiter:
    # max_late=None: a late wake-up under load would give a ticket up and shift the numbers
    kwargs.setdefault("max_late", None)
    return Limiter(MemoryState(private=True), name="q", interval=interval, **kwargs)  # type: ignore[arg-type]


def test_threads_share_one_rate() -> None:
    """G1/G2 with 8 threads on one limiter: distinct tickets, starts one interval apart."""
    limiter = fresh(0.005)
    turns: list[ratequeue.Turn] = []
    lock = threading.Lock()

    def work() -> None:
        for _ in range(10):
            turn = limiter.acquire(timeout=LONG)
            with lock:
                turns.append(turn)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(LONG)
    assert len(turns) == 80
    turns.sort(key=lambda t: t.start_us)
    assert [t.ticket for t in turns] == sorted(t.ticket for t in turns)
    assert len({t.ticket for t in turns}) == 80
    assert min(b.start_us - a.start_us for a, b in itertools.pairwise(turns)) >= 5000
    assert limiter.status().waiting == 0


def test_zero_timeout_takes_a_free_turn_only() -> None:
    limiter = fresh(LONG)
    assert limiter.acquire(timeout=0).ticket == 1
    with pytest.raises(AcquireTimeout) as raised:
        limiter.acquire(timeout=0)
    assert raised.value.name == "q"
    assert raised.value.timeout == 0


def test_timed_out_caller_leaves_its_ticket_to_the_next() -> None:
    """Giving up costs nothing more: the shard keeps the ticket and reuses it."""
    limiter = fresh(LONG)
    limiter.acquire()
    started = time.monotonic()
    with pytest.raises(AcquireTimeout):
        limiter.acquire(timeout=5.0)  # the slot is 30 s away: no need to wait 5 s to know
    assert time.monotonic() - started < 4.0
    status = limiter.status()
    assert status.held_ticket == 2
    for _ in range(3):
        with pytest.raises(AcquireTimeout):
            limiter.acquire(timeout=0.01)
    assert limiter.status().next_ticket == 3, "no new ticket was taken"


def test_a_waiting_caller_behind_the_head_times_out() -> None:
    limiter = fresh(1.0)
    limiter.acquire()
    turns: list[ratequeue.Turn] = []
    head = threading.Thread(target=lambda: turns.append(limiter.acquire(timeout=LONG)))
    head.start()  # waits up to one interval for ticket 2
    wait_until(lambda: limiter.status().held_ticket == 2)
    with pytest.raises(AcquireTimeout):
        limiter.acquire(timeout=0.05)
    head.join(LONG)
    assert [turn.ticket for turn in turns] == [2]


def test_pause_holds_waiting_callers_and_calls_nothing(tmp_path: Path) -> None:
    """G6: a paused shard keeps its callers waiting and does not touch the state; resume releases them."""
    path = tmp_path / "state.json"
    # max_late=None: a late wake-up under load would give a ticket up and shift the numbers
    limiter = Limiter(f"file://{path}", name="q", interval=0.01, max_late=None)
    limiter.acquire()
    limiter.pause()
    assert limiter.paused
    before = path.read_bytes()
    done: list[ratequeue.Turn] = []
    thread = threading.Thread(target=lambda: done.append(limiter.acquire(timeout=LONG)))
    thread.start()
    wait_until(lambda: limiter.status().waiting == 1)
    assert path.read_bytes() == before, "a paused shard called the state"
    assert not done
    limiter.resume()
    thread.join(LONG)
    assert [turn.ticket for turn in done] == [2]


def test_decorator_keeps_metadata_and_waits_for_each_call() -> None:
    limiter = fresh(0.002)
    seen: list[int] = []

    @limiter
    def fetch(url: str, *, retries: int = 3) -> str:
        """Fetch a URL."""
        seen.append(limiter.status().pos)
        return url.upper()

    assert fetch.__name__ == "fetch"
    assert fetch.__doc__ == "Fetch a URL."
    assert str(inspect.signature(fetch)) == "(url: 'str', *, retries: 'int' = 3) -> 'str'"
    assert fetch("a") == "A"
    assert fetch("b", retries=1) == "B"
    assert seen == [1, 2], "each call took one turn before running"


def test_wrap_works_on_methods_and_coroutine_functions() -> None:
    limiter = fresh(0.002)

    class Client:
        def __init__(self) -> None:
            self.calls = 0

        @limiter
        def get(self, key: str) -> str:
            self.calls += 1
            return key

    client = Client()
    assert client.get("x") == "x"
    assert client.calls == 1

    async def fetch(n: int) -> int:
        return n * 2

    wrapped = limiter.wrap(fetch)
    assert inspect.iscoroutinefunction(wrapped)
    assert wrapped.__name__ == "fetch"
    assert asyncio.run(wrapped(21)) == 42
    assert limiter.status().pos == 2


def test_context_manager_returns_the_turn() -> None:
    limiter = fresh(0.001)
    with limiter as turn:
        assert turn.ticket == 1
        assert turn.local_start <= time.monotonic()
    with limiter as turn:
        assert turn.ticket == 2


def test_pickles_as_configuration(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/state.json"
    # max_late=None: a late wake-up under load would give a ticket up and shift the numbers
    limiter = Limiter(url, name="q", interval=0.01, max_late=None)
    limiter.acquire()
    again = pickle.loads(pickle.dumps(limiter))
    assert (again.name, again.interval, again.state.url) == ("q", 0.01, url)
    assert again.acquire(timeout=LONG).ticket == 2


def test_status_reports_record_and_shard() -> None:
    limiter = fresh(LONG)
    status = limiter.status()
    assert (status.next_ticket, status.pos, status.last_start, status.waiting) == (1, 0, None, 0)
    turn = limiter.acquire()
    status = limiter.status()
    assert (status.next_ticket, status.pos, status.interval) == (2, 1, LONG)
    assert status.last_start == turn.start
    assert status.now >= turn.start


def test_memory_urls_share_a_store_per_name() -> None:
    # max_late=None: a late wake-up under load would give ticket 1 up and move pos on
    a = Limiter("memory://shared-test", name="q", interval=LONG, max_late=None)
    b = Limiter("memory://shared-test", name="q", interval=LONG)
    c = Limiter("memory://other-test", name="q", interval=LONG)
    a.acquire()
    assert b.status().pos == 1
    assert c.status().pos == 0


def test_close_leaves_a_callers_state_open(tmp_path: Path) -> None:
    state = ratequeue.open_state(f"file://{tmp_path}/state.json")
    Limiter(state, name="q", interval=0.01).close()
    assert do(state, "take", "q", 10_000).ticket == 1


def test_no_thread_is_left_behind() -> None:
    """G5: acquiring starts no thread; nothing runs once the callers are done."""
    before = threading.active_count()
    limiter = fresh(0.001)
    for _ in range(5):
        limiter.acquire()
    assert threading.active_count() == before


def test_pause_everywhere_stops_every_shard_and_resume_restarts_them() -> None:
    """A flag in the shared record: another shard gets no turn while it is set, and one soon after resume."""
    state = MemoryState(private=True)
    one = Limiter(state, name="q", interval=0.01)
    other = Limiter(state, name="q", interval=0.01)
    one.acquire()
    one.pause_everywhere()
    assert not one.paused, "no shard is paused itself"
    assert not other.paused
    assert one.status().paused_everywhere
    assert other.status().paused_everywhere
    assert other.try_acquire() is None
    with pytest.raises(AcquireTimeout):
        other.acquire(timeout=0.2)  # told to wait a second on: past its deadline, it fails at once
    assert one.pause_everywhere() is False, "paused already"
    got: list[float] = []
    waiter = threading.Thread(target=lambda: got.append((other.acquire(timeout=10), time.monotonic())[1]))
    waiter.start()
    deadline = time.monotonic() + 5
    while state.read("q").record.ticket < 4 and time.monotonic() < deadline:  # type: ignore[union-attr]
        time.sleep(0.01)  # the waiter holds a ticket and waits
    assert not got, "no turn while paused"
    resumed = time.monotonic()
    assert one.resume_everywhere() is True
    waiter.join(timeout=10)
    assert got, "the waiter never started"
    assert got[0] - resumed <= 1.5, "the waiter starts within a recheck of the resume"
    one.resume_everywhere()  # resumed already: nothing changes
    assert not other.status().paused_everywhere


def test_the_shard_that_resumes_asks_again_at_once() -> None:
    """Its waiting caller does not sleep out the paused queue's "ask again in a second"."""
    state = MemoryState(private=True)
    limiter = Limiter(state, name="q", interval=0.01)
    limiter.acquire()
    limiter.pause_everywhere()
    got: list[float] = []
    waiter = threading.Thread(target=lambda: got.append((limiter.acquire(timeout=10), time.monotonic())[1]))
    waiter.start()
    deadline = time.monotonic() + 5
    while state.read("q").record.ticket < 3 and time.monotonic() < deadline:  # type: ignore[union-attr]
        time.sleep(0.01)  # until the waiter holds a ticket and was told to wait
    resumed = time.monotonic()
    limiter.resume_everywhere()
    waiter.join(timeout=10)
    assert got
    # the paused queue told it to ask again a second later; resumed here, it asks at once
    assert got[0] - resumed < 0.8


def test_pause_everywhere_on_asyncio() -> None:
    async def run() -> None:
        state = MemoryState(private=True)
        limiter = ratequeue.aio.Limiter(state, name="q", interval=0.01)
        assert await limiter.pause_everywhere() is True
        assert (await limiter.status()).paused_everywhere
        assert await limiter.try_acquire() is None
        limiter.pause()  # this shard only, a plain method as ever
        limiter.resume()
        assert await limiter.resume_everywhere() is True
        await limiter.acquire(timeout=5)
        assert not (await limiter.status()).paused_everywhere

    asyncio.run(run())


def test_the_state_clock_is_read_between_two_reads_of_this_hosts_and_again_after_a_stall() -> None:
    """A stall between reading the two clocks would convert one turn's start off by the stall (G7)."""
    from ratequeue.running import received_and_state_now

    offset = 1000.0  # the state's clock is this host's plus 1000 s
    host = [10.0]
    stalls = [0.005]  # the first read of the state's clock comes 5 ms late; the second does not

    def clock() -> float:
        host[0] += 1e-6
        return host[0]

    def local_now() -> float:
        now = host[0] + offset
        if stalls:
            host[0] += stalls.pop()  # the process is descheduled right after this read
        return now

    received, state_now = received_and_state_now(clock, local_now)
    assert state_now is not None
    assert abs((state_now - received) - offset) <= 2e-6, "read again: the stalled pair is not used"
    # a server's clock (None) is not read again
    calls: list[int] = []

    def server() -> None:
        calls.append(1)

    assert received_and_state_now(clock, server)[1] is None
    assert calls == [1]


class ConnectsAtFirstUse(MemoryState):
    """A memory state that, like a server's, pays for connecting at its first use: 0.2 s."""

    def __init__(self) -> None:
        super().__init__(private=True)
        self.connected = False
        self.prepares = 0

    def _connect(self) -> None:
        if not self.connected:
            time.sleep(0.2)
            self.connected = True

    def prepare(self) -> None:
        self.prepares += 1
        self._connect()

    def execute(self, op: ratequeue.core.operation.Operation) -> ratequeue.core.protocol.Answer:
        self._connect()
        return super().execute(op)


def test_connecting_is_not_timed_as_a_call() -> None:
    """The state connects (``prepare``) once, before the first call: its cost sets no lead.

    Timed as the first call's round-trip, 0.2 s would make the lead 0.4 s: with a 50 ms interval
    the shard would start tickets eight intervals ahead, passing other shards' tickets.
    """
    state = ConnectsAtFirstUse()
    limiter = Limiter(state, name="connects", interval=0.05)
    for _ in range(3):
        limiter.acquire()
    assert state.prepares == 1
    assert ratequeue.running.runner_of(limiter).shard.lead < 0.1
    limiter.close()


def test_a_failed_preparation_is_the_calls_failure_and_is_tried_again() -> None:
    """A state that cannot connect fails the acquire once (no second wait for the call), then recovers."""

    class DownAtFirst(ConnectsAtFirstUse):
        failed = False

        def prepare(self) -> None:
            if not self.failed:
                self.failed = True
                raise ratequeue.StateUnavailable("not yet", where="memory://")
            super().prepare()

        def execute(self, op: ratequeue.core.operation.Operation) -> ratequeue.core.protocol.Answer:
            assert self.prepares == 1, "a call was made although its preparation failed"
            return super().execute(op)

    state = DownAtFirst()
    limiter = Limiter(state, name="down-at-first", interval=0.05)
    with pytest.raises(ratequeue.StateUnavailable):
        limiter.acquire()
    limiter.acquire()
    limiter.acquire()
    assert state.prepares == 1  # (once it succeeded, never again)
    limiter.close()
