"""A cap on running jobs across every shard (``max_running``): leases taken, renewed, released, expired.

The jobs here write when they begin and end to a recorder of their own (a
list in one process; a file appended to by every process, on the host's
monotonic clock), and the checks read the recorder, not the limiter: at no
moment do more than ``max_running`` jobs run. A job's begin is written after
its turn is granted and its end before its lease is released, so the
recorder can only see more overlap than there was, never less.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from ratequeue import AcquireTimeout, ConfigurationError, Limiter, Queue, aio
from ratequeue.core.operation import Operation
from ratequeue.core.protocol import FULL_RECHECK_US, US, Answer

from . import _workers
from .backends import Backend

INTERVAL = 0.005
#: the longest any single wait may take before a run is declared broken
WAIT = 60.0


def peak(spans: list[tuple[float, float]]) -> int:
    """The most spans ``(begin, end)`` that overlap at any moment."""
    events = sorted([(begin, 1) for begin, _ in spans] + [(end, -1) for _, end in spans])
    running = most = 0
    for _, change in events:
        running += change
        most = max(most, running)
    return most


def assert_capped(spans: list[tuple[float, float]], cap: int, kind: str) -> None:
    """Never more than ``cap`` at once; on the memory state (fast calls), the cap reached too.

    Elsewhere a slow state call (secantusdb takes tens of ms) can keep a
    run's jobs from ever meeting, so reaching the cap is not asserted there.
    """
    most = peak(spans)
    assert most <= cap
    if kind == "memory":
        assert most == cap


def test_peak_counts_overlaps() -> None:
    assert peak([(0, 2), (1, 3), (2.5, 4)]) == 2
    assert peak([(0, 1), (1, 2)]) == 1  # an end and a begin at one moment: the end first
    assert peak([(0, 5), (1, 2), (1.5, 3)]) == 3


def test_threads_never_run_more_than_the_cap(backend: Backend) -> None:
    name = backend.fresh_name()
    limiter = Limiter(backend.url, name=name, interval=INTERVAL, max_running=2, lease=5)
    spans: list[tuple[float, float]] = []
    lock = threading.Lock()

    def work(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(6):
            with limiter:
                begin = time.monotonic()
                time.sleep(rng.uniform(0.005, 0.04))
                end = time.monotonic()
            with lock:
                spans.append((begin, end))

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT)
    assert len(spans) == 30
    assert_capped(spans, 2, backend.kind)  # five threads want to run at once
    assert limiter.status().running == 0  # every lease released
    limiter.close()


def test_the_decorator_and_release_give_the_place_back(backend: Backend) -> None:
    name = backend.fresh_name()
    limiter = Limiter(backend.url, name=name, interval=INTERVAL, max_running=1, lease=5)

    @limiter
    def job() -> int:
        return limiter.status().running

    assert job() == 1  # counted while it runs
    assert limiter.status().running == 0  # and released on return
    turn = limiter.acquire()
    with pytest.raises(AcquireTimeout):
        limiter.acquire(timeout=0.2)  # full: no place within the timeout
    assert limiter.release(turn) is True
    assert limiter.release(turn) is False  # released once only
    limiter.acquire(timeout=1.0)  # the place is back at once
    limiter.close()


def test_release_of_a_turn_this_limiter_never_granted_frees_nothing(backend: Backend) -> None:
    """Another queue's turn with the same ticket number names another lease: its release is refused.

    Before lease tokens (issue 27), ``b.release(a_turn)`` answered True and
    freed b's place while b's job still ran: the cap broken by a wrong argument.
    """
    # max_late=None: a late wake-up under load would give ticket 1 up and make the numbers differ
    a, b = (
        Limiter(
            backend.url, name=backend.fresh_name(), interval=INTERVAL, max_running=1, lease=30, max_late=None
        )
        for _ in range(2)
    )
    try:
        a_turn, b_turn = a.acquire(), b.acquire()
        assert a_turn.ticket == b_turn.ticket
        assert b.release(a_turn) is False
        assert b.status().running == 1, "b's job still holds its place"
        assert b.try_acquire() is None, "b is still full"
        assert a.status().running == 1, "a's place untouched too"
        assert b.release(b_turn) is True
        assert a.release(a_turn) is True
    finally:  # a failed check leaves no lease keeper running into the next tests
        a.close()
        b.close()


def test_a_job_longer_than_its_lease_keeps_its_place_by_renewing_it(backend: Backend) -> None:
    """The lease keeper renews a running job's lease every third of its length."""
    name = backend.fresh_name()
    lease = 0.6  # renewed every 0.2 s: a loaded host delays a renewal by far less
    holder = Limiter(backend.url, name=name, interval=INTERVAL, max_running=1, lease=lease)
    other = Limiter(backend.url, name=name, interval=INTERVAL, max_running=1, lease=lease)
    turn = holder.acquire()
    with pytest.raises(AcquireTimeout):
        other.acquire(timeout=3 * lease)  # three lease lengths later the holder still runs
    assert holder.status().running == 1
    holder.release(turn)
    other.acquire(timeout=1.0)
    holder.close()
    other.close()


def test_a_turn_granted_to_nobody_gives_its_lease_back(backend: Backend) -> None:
    """A reservation cancelled after its turn was granted (not begun) releases the lease."""
    name = backend.fresh_name()
    limiter = Limiter(backend.url, name=name, interval=1.0, max_running=1, lease=30, lead=0.5)
    limiter.release(limiter.acquire())  # the next start is a second away: it is granted 0.5 s ahead
    reservation = limiter.reserve()
    thread = threading.Thread(target=reservation.wait)
    thread.start()
    deadline = time.monotonic() + WAIT
    while limiter.status().running == 0 and time.monotonic() < deadline:
        time.sleep(0.01)  # polling the state: the grant is only visible there
    reservation.cancel()
    thread.join(WAIT)
    while limiter.status().running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert limiter.status().running == 0
    limiter.close()


def test_the_queue_caps_running_jobs_across_queue_objects(backend: Backend) -> None:
    """Two Queue objects of one name (two shards) share the cap."""
    name = backend.fresh_name()
    queues = [Queue(backend.url, name=name, interval=INTERVAL, max_running=2, lease=5) for _ in range(2)]
    spans: list[tuple[float, float]] = []
    lock = threading.Lock()

    def job(seconds: float) -> None:
        begin = time.monotonic()
        time.sleep(seconds)
        with lock:
            spans.append((begin, time.monotonic()))

    rng = random.Random(7)
    futures = [queues[i % 2].add(job, rng.uniform(0.01, 0.05)) for i in range(16)]
    for future in futures:
        future.result(WAIT)
    for queue in queues:
        queue.close()
    assert len(spans) == 16
    assert_capped(spans, 2, backend.kind)


def test_asyncio_tasks_never_run_more_than_the_cap(backend: Backend) -> None:
    async def main() -> list[tuple[float, float]]:
        state = backend.open_async()
        limiter = aio.Limiter(state, name=backend.fresh_name(), interval=INTERVAL, max_running=2)
        spans: list[tuple[float, float]] = []

        @limiter
        async def decorated(seconds: float) -> None:
            begin = time.monotonic()
            await asyncio.sleep(seconds)
            spans.append((begin, time.monotonic()))

        async def with_block(seconds: float) -> None:
            async with limiter:
                begin = time.monotonic()
                await asyncio.sleep(seconds)
                spans.append((begin, time.monotonic()))

        rng = random.Random(3)
        await asyncio.gather(
            *((decorated if i % 2 else with_block)(rng.uniform(0.005, 0.03)) for i in range(20))
        )
        assert (await limiter.status()).running == 0
        await limiter.close()
        await state.close()  # passed in, so the limiter leaves it open
        return spans

    spans = asyncio.run(main())
    assert len(spans) == 20
    assert_capped(spans, 2, backend.kind)


def test_asyncio_queue_caps_running_jobs(backend: Backend) -> None:
    async def main() -> list[tuple[float, float]]:
        state = backend.open_async()
        queue = aio.Queue(state, name=backend.fresh_name(), interval=INTERVAL, max_running=3)
        spans: list[tuple[float, float]] = []

        async def job(seconds: float) -> None:
            begin = time.monotonic()
            await asyncio.sleep(seconds)
            spans.append((begin, time.monotonic()))

        rng = random.Random(5)
        await asyncio.gather(*(queue.add(job, rng.uniform(0.01, 0.04)) for _ in range(15)))
        await queue.close()
        await state.close()
        return spans

    spans = asyncio.run(main())
    assert len(spans) == 15
    assert_capped(spans, 3, backend.kind)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"max_running": 0}, "max_running must be None"),
        ({"max_running": -1}, "max_running must be None"),
        ({"max_running": 1.5}, "max_running must be None"),
        ({"max_running": True}, "max_running must be None"),
        ({"max_running": 2, "lease": 0}, "lease must be"),
        ({"max_running": 2, "lease": -3}, "lease must be"),
        ({"max_running": 2, "lease": "10"}, "lease must be"),
    ],
)
def test_bad_caps_and_leases_are_refused(settings: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        Limiter("memory://", name="bad-cap", interval=0.01, **settings)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=message):
        Queue("memory://", name="bad-cap", interval=0.01, **settings)  # type: ignore[arg-type]


def test_a_limiter_with_a_cap_pickles_with_it() -> None:
    import pickle

    limiter = Limiter("memory://", name="pickled-cap", interval=0.01, max_running=3, lease=2.5)
    copy = pickle.loads(pickle.dumps(limiter))
    assert (copy.max_running, copy.lease) == (3, 2.5)
    assert "max_running=3" in repr(copy)


# Real processes: a recorder file every process appends to, on the host's monotonic clock.


def read_spans(path: Path) -> list[tuple[float, float]]:
    begins: dict[str, float] = {}
    spans = []
    for line in path.read_text().splitlines():
        kind, key, at = line.split()
        if kind == "b":
            begins[key] = float(at)
        else:
            spans.append((begins.pop(key), float(at)))
    assert not begins, f"jobs that began and never ended: {begins}"
    return spans


@pytest.mark.processes
def test_processes_never_run_more_than_the_cap(shared_backend: Backend, tmp_path: Path) -> None:
    """Four processes, max_running=2, jobs of random length: the recorder never sees three at once."""
    name = shared_backend.fresh_name()
    record = tmp_path / "record.txt"
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(4) as pool:
        args = [(shared_backend.url, name, INTERVAL, 2, 5.0, 8, seed, str(record)) for seed in range(4)]
        done = pool.starmap_async(_workers.run_capped_jobs, args).get(WAIT * 2)
    assert done == [8, 8, 8, 8]
    spans = read_spans(record)
    assert len(spans) == 32
    assert peak(spans) <= 2
    print(f"{shared_backend.kind}: at most {peak(spans)} of 32 jobs ran at once (max_running=2)")


@pytest.mark.processes
def test_sigkill_of_a_holder_frees_its_place_within_the_lease(shared_backend: Backend) -> None:
    """A process killed while its job runs never releases; its place comes back when the lease expires."""
    name = shared_backend.fresh_name()
    lease = 1.5
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    holder = ctx.Process(target=_workers.hold_a_place, args=(shared_backend.url, name, lease, child))
    holder.start()
    try:
        assert parent.poll(WAIT), "the holder never took its place"
        assert parent.recv() == "holding"
        limiter = Limiter(shared_backend.url, name=name, interval=INTERVAL, max_running=1, lease=lease)
        with pytest.raises(AcquireTimeout):
            limiter.acquire(timeout=lease / 3)  # taken while the holder lives (and renews)
        assert parent.poll(WAIT)
        assert parent.recv() == "renewed"  # the holder's lease was renewed at least once
        os.kill(holder.pid, signal.SIGKILL)  # type: ignore[arg-type]
        killed = time.monotonic()
        limiter.acquire(timeout=WAIT)
        recovered = time.monotonic() - killed
    finally:
        holder.kill()
        holder.join(WAIT)
    # renewed at most a third of the lease before the kill, so it expires at most a lease after it;
    # the waiting process asks again at least every FULL_RECHECK_US
    print(f"{shared_backend.kind}: a SIGKILLed holder's place came back {recovered:.2f} s after the kill")
    assert recovered <= lease + FULL_RECHECK_US / US + 0.25
    limiter.close()


# Found by a review of the leases, each failing before its fix.


def test_a_queue_jobs_end_frees_its_place_for_another_shard_at_once() -> None:
    """The keeper is woken to release a finished job's lease, not left asleep until its next renewal."""
    queue = Queue("memory://end-frees", name="q", interval=0.001, max_running=1, lease=30)
    other = Limiter("memory://end-frees", name="q", interval=0.001, max_running=1, lease=30)
    started = threading.Event()
    finish = threading.Event()

    def job() -> None:
        started.set()
        finish.wait(WAIT)

    future = queue.add(job)
    assert started.wait(WAIT)
    finish.set()
    future.result(WAIT)
    # the other shard learns of the free place at its next ask (100 ms); before the fix the place
    # stayed taken until the keeper's next renewal, a third of the lease (10 s) away
    other.release(other.acquire(timeout=2.0))
    queue.close()
    other.close()


def test_retries_release_their_own_leases_only() -> None:
    """A retry that gets a new turn before its failed attempt has ended does not lose either lease."""
    from ratequeue import Backoff

    queue = Queue(
        "memory://retry-leases",
        name="q",
        interval=0.0001,
        max_running=4,
        lease=30,
        retries=1,
        backoff=Backoff(base=0.0, jitter=False),
    )
    tries: dict[int, int] = {}
    lock = threading.Lock()

    def job(number: int) -> int:
        with lock:
            tries[number] = tries.get(number, 0) + 1
            first = tries[number] == 1
        if first:
            raise RuntimeError("fails once")
        return number

    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often, so that the race comes up
    try:
        futures = [queue.add(job, number) for number in range(400)]
        assert [future.result(WAIT) for future in futures] == list(range(400))
    finally:
        sys.setswitchinterval(previous)
    queue.close()  # releases what the keeper was handed
    record = Limiter("memory://retry-leases", name="q", interval=0.0001, max_running=4).state.read("q").record
    assert record is not None
    assert record.leases == ()  # before the fix: 1-3 leases held for good (renewed by the keeper)


def test_all_of_gives_the_places_of_its_turns_back_when_it_times_out() -> None:
    from ratequeue import all_of

    # the scarcer limit is waited for first: the capped one (1/s), whose turn is free now
    capped = Limiter("memory://all-of-leases", name="a", interval=1.0, max_running=1, lease=30)
    slow = Limiter("memory://all-of-leases", name="b", interval=0.5)
    slow.acquire()  # b's next turn is half a second away
    with pytest.raises(AcquireTimeout):
        all_of(capped, slow, timeout=0.1)
    # b's turn plainly cannot come in time: a's turn is not even taken (rule 4 of all_of), or, if
    # taken, its place is given back; before the fix it stayed taken until the lease ran out
    assert capped.status().running == 0
    capped.release(capped.acquire(timeout=2.0))


def test_a_reservation_left_after_its_turn_releases_the_lease() -> None:
    limiter = Limiter("memory://reservation-lease", name="q", interval=0.001, max_running=1, lease=30)
    with limiter.reserve() as reservation:
        assert reservation.wait(WAIT) is not None
        assert limiter.status().running == 1
    assert limiter.status().running == 0


def test_a_full_queue_is_not_polled_in_a_loop_whatever_the_lead() -> None:
    """A full queue's "ask again in 100 ms" lies within a long lead: the head waits for it all the same."""
    from ratequeue.state.memory import MemoryState

    class Counting(MemoryState):
        calls = 0

        def _execute(self, op: Operation) -> Answer:
            Counting.calls += op.kind == "try_start"
            return super()._execute(op)

    limiter = Limiter(Counting("full-poll", private=True), name="q", interval=0.01, max_running=1, lead=0.2)
    held = limiter.acquire()
    with pytest.raises(AcquireTimeout):
        limiter.acquire(timeout=1.0)
    limiter.release(held)
    assert Counting.calls <= 15  # one ask per 100 ms; before the fix about 19,000 in that second


def test_an_async_function_cancelled_after_its_turn_began_gives_its_place_back() -> None:
    """``@limiter`` (thread driver) on an ``async def``: a cancel racing the worker thread's begin."""
    limiter = Limiter("memory://async-cancel", name="q", interval=0.01, max_running=1, lease=30)

    @limiter
    async def job() -> str:
        return "ran"

    async def main() -> None:
        task = asyncio.create_task(job())
        await asyncio.sleep(0)  # the worker thread waits for the turn...
        deadline = time.monotonic() + WAIT
        while limiter.status().running == 0 and time.monotonic() < deadline:
            time.sleep(0.001)  # ...and begins it while the loop is blocked here
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    limiter.release(limiter.acquire(timeout=2.0))  # before the fix: taken for good (renewed)


def test_an_asyncio_acquire_cancelled_mid_call_gives_the_granted_place_back() -> None:
    """The state grants a start (and its lease) but the caller is cancelled before the answer comes."""
    from ratequeue.state.memory import MemoryState

    class SlowAnswers(MemoryState):
        def _execute(self, op: Operation) -> Answer:
            answer = super()._execute(op)
            if op.kind == "take_and_try":
                time.sleep(0.3)  # applied on the state; the answer is slow to come back
            return answer

    async def main() -> float:
        state = SlowAnswers("aio-cancel", private=True)
        limiter = aio.Limiter(state, name="q", interval=0.01, max_running=1, lease=30)
        task = asyncio.create_task(limiter.acquire())
        deadline = time.monotonic() + WAIT
        while not state.read("q").record and time.monotonic() < deadline:
            await asyncio.sleep(0.005)  # until the state has applied the call
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        began = time.monotonic()
        turn = await limiter.acquire(timeout=5.0)  # before the fix: the lease ran its 30 s
        waited = time.monotonic() - began
        await limiter.release(turn)
        await limiter.close()
        return waited

    assert asyncio.run(main()) < 2.0
