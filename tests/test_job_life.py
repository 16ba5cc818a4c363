"""A queue job's life (issue 13, item 3): retries, backoff, dead letters, not-before, priority, a bound."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from concurrent.futures import Future
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ratequeue
from ratequeue import Backoff, ConfigurationError, DeadLetter, Queue, QueueFull, aio
from ratequeue.core.jobs import Job, PendingJobs
from ratequeue.state.memory import MemoryState

LONG = 30.0
QUICK = Backoff(base=0.02, factor=2, max=1, jitter=True)


class Flaky:
    """A job that fails its first ``failures`` calls, noting when each call came."""

    def __init__(self, failures: int, error: type[Exception] = OSError) -> None:
        self.failures, self.error = failures, error
        self.calls: list[float] = []

    def __call__(self, value: int) -> int:
        self.calls.append(time.monotonic())
        if len(self.calls) <= self.failures:
            raise self.error(f"try {len(self.calls)} fails")
        return value


def test_a_failing_job_is_retried_after_its_backoff_each_try_a_new_turn() -> None:
    state = MemoryState(private=True)
    # max_late=None: a late wake-up under load would give a turn up and take another ticket
    queue = Queue(state, name="q", interval=0.005, retries=3, backoff=QUICK, max_late=None)
    job = Flaky(failures=2)
    assert queue.add(job, 7).result(LONG) == 7
    assert len(job.calls) == 3
    for retry, (earlier, later) in enumerate(itertools.pairwise(job.calls), start=1):
        assert later - earlier >= QUICK.least(retry), "a retry waits its backoff first"
    record = state.read("q").record
    assert record is not None
    assert record.pos == 3, "each try took a turn of its own"
    queue.close()


def test_only_the_exceptions_asked_for_are_retried() -> None:
    queue = Queue(MemoryState(private=True), name="q", interval=0.005, retries=3, backoff=QUICK)
    job = Flaky(failures=1, error=KeyError)
    with pytest.raises(KeyError):
        queue.add(job, 1, retry_on=OSError).result(LONG)
    assert len(job.calls) == 1
    queue.close()


def test_a_job_whose_retries_run_out_goes_to_the_dead_letter_handler_and_fails() -> None:
    letters: list[DeadLetter] = []
    queue = Queue(MemoryState(private=True), name="q", interval=0.005, dead_letter=letters.append)
    job = Flaky(failures=10)
    future = queue.add(job, 5, retries=2, backoff=QUICK)
    with pytest.raises(OSError, match="try 3 fails"):
        future.result(LONG)
    queue.join(LONG)
    assert len(letters) == 1
    letter = letters[0]
    assert (letter.fn, letter.args, letter.kwargs, letter.attempts) == (job, (5,), {}, 3)
    assert str(letter.exception) == "try 3 fails"
    queue.close()


def test_a_failing_dead_letter_handler_loses_nothing(caplog: pytest.LogCaptureFixture) -> None:
    def broken(letter: DeadLetter) -> None:
        raise RuntimeError("the sink is down")

    queue = Queue(MemoryState(private=True), name="q", interval=0.005, dead_letter=broken)
    with pytest.raises(OSError, match="try 1 fails"):
        queue.add(Flaky(failures=1), 1).result(LONG)
    queue.close()
    assert "dead-letter handler of queue 'q' failed" in caplog.text


def test_a_held_job_takes_no_turn_and_later_jobs_pass_it() -> None:
    state = MemoryState(private=True)
    # max_late=None: a late wake-up under load would give a turn up and take another ticket
    queue = Queue(state, name="q", interval=0.005, max_late=None)
    order: list[str] = []
    start = time.monotonic()
    later = queue.add(order.append, "held", not_before=1.0)
    first = queue.add(order.append, "now")
    first.result(LONG)
    record = state.read("q").record
    assert record is not None
    assert record.ticket == 2, "only the ready job took a ticket; the held one holds none"
    later.result(LONG)
    assert order == ["now", "held"]
    assert time.monotonic() - start >= 1.0
    queue.close()


def test_higher_priority_starts_first_then_the_order_added() -> None:
    queue = Queue(MemoryState(private=True), name="q", interval=0.002)
    queue.pause()
    order: list[str] = []
    for name, priority in (("low-1", 0), ("high-1", 5), ("low-2", 0), ("high-2", 5), ("mid", 1)):
        queue.add(order.append, name, priority=priority)
    queue.resume()
    assert queue.join(LONG)
    assert order == ["high-1", "high-2", "mid", "low-1", "low-2"]
    queue.close()


def test_a_full_queue_rejects_or_drops_its_oldest() -> None:
    release = threading.Event()
    rejecting = Queue(MemoryState(private=True), name="r", interval=0.002, max_running=1, max_waiting=2)
    rejecting.add(release.wait)  # runs, and holds the only running place
    assert _waits_for(lambda: rejecting.pending == 0)
    kept = [rejecting.add(print, "a"), rejecting.add(print, "b")]
    with pytest.raises(QueueFull, match="max_waiting=2"):
        rejecting.add(print, "c")
    dropping = Queue(
        MemoryState(private=True),
        name="d",
        interval=0.002,
        max_running=1,
        max_waiting=2,
        overflow="drop_oldest",
    )
    dropping.add(release.wait)
    assert _waits_for(lambda: dropping.pending == 0)
    oldest, middle = dropping.add(lambda: "oldest"), dropping.add(lambda: "middle")
    newest = dropping.add(lambda: "newest")
    with pytest.raises(QueueFull, match="dropped"):
        oldest.result(LONG)
    release.set()
    assert [middle.result(LONG), newest.result(LONG)] == ["middle", "newest"]
    for future in kept:
        future.result(LONG)
    rejecting.close()
    dropping.close()


def _waits_for(condition: Any, deadline: float = LONG) -> bool:
    end = time.monotonic() + deadline
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.001)  # polling a condition set by the queue's own thread, with a deadline
    return True


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"retries": -1}, "retries must be a whole number >= 0"),
        ({"retries": 1.5}, "retries"),
        ({"backoff": 3}, "backoff must be a ratequeue.Backoff"),
        ({"retry_on": "OSError"}, "retry_on must be an exception class"),
        ({"retry_on": ()}, "retry_on"),
        ({"dead_letter": 42}, "dead_letter must be callable"),
        ({"priority": "high"}, "priority must be a whole number"),
        ({"priority": 1.5}, "priority"),
        ({"not_before": -1}, "not_before in seconds from now must be >= 0"),
        ({"not_before": float("nan")}, "not_before must be a finite time"),
        ({"not_before": "tomorrow"}, "not_before must be a datetime"),
        ({"cost": 2}, "cost"),
    ],
)
def test_bad_job_options_are_refused_before_anything_is_queued(options: dict[str, Any], words: str) -> None:
    queue = Queue(MemoryState(private=True), name="q", interval=0.01)
    with pytest.raises(ConfigurationError, match=words):
        queue.add(print, **options)
    assert queue.pending == 0
    queue.close()


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: Backoff(base=-1), "Backoff base must be a finite number >= 0"),
        (lambda: Backoff(factor=0.5), "Backoff factor must be a finite number >= 1"),
        (lambda: Backoff(max=float("inf")), "Backoff max"),
        (lambda: Backoff(jitter="yes"), "jitter"),  # type: ignore[arg-type]
        (lambda: Queue("memory://", name="q", interval=1, max_waiting=0), "max_waiting"),
        (lambda: Queue("memory://", name="q", interval=1, overflow="drop_newest"), "overflow must be one of"),
        (lambda: Queue("memory://", name="q", interval=1, retries=-2), "retries"),
    ],
)
def test_bad_queue_settings_are_refused(make: Any, words: str) -> None:
    with pytest.raises(ConfigurationError, match=words):
        make()


@given(
    base=st.floats(0, 10),
    factor=st.floats(1, 4),
    top=st.floats(0, 100),
    retry=st.integers(1, 50),
    draw=st.floats(0, 0.999999),
)
def test_a_backoff_is_never_shorter_than_its_delay_nor_past_its_max(
    base: float, factor: float, top: float, retry: int, draw: float
) -> None:
    backoff = Backoff(base=base, factor=factor, max=top, jitter=True)
    delay = backoff.delay(retry, lambda: draw)
    assert backoff.least(retry) <= delay <= max(top, backoff.least(retry))
    assert delay <= top or base == 0


@settings(max_examples=200)
@given(
    st.lists(
        st.one_of(
            st.tuples(
                st.just("push"), st.integers(-2, 2), st.one_of(st.none(), st.floats(0, 10)), st.booleans()
            ),
            st.tuples(st.just("pop"), st.floats(0, 12)),
            st.tuples(st.just("remove"), st.integers(0, 30)),
            st.tuples(st.just("ungate"), st.integers(0, 30)),
        ),
        max_size=60,
    )
)
def test_pending_jobs_come_out_by_priority_then_order_never_held_and_never_lost(
    ops: list[tuple[Any, ...]],
) -> None:
    """With gated jobs too (a group's, waiting for its place): none out before it is ungated, nor twice."""
    pending: PendingJobs[Future[Any]] = PendingJobs()
    inside: list[Job[Future[Any]]] = []
    now = 0.0  # the monotonic clock the queue reads
    for op in ops:
        if op[0] == "push":
            job: Job[Future[Any]] = Job(Future(), print, priority=op[1], not_before=op[2], gated=op[3])
            job.seq = pending.number()
            pending.push(job)
            inside.append(job)
        elif op[0] == "ungate":
            gated = [j for j in inside if j.gated]
            if gated:
                pending.ungate(gated[op[1] % len(gated)])
        elif op[0] == "pop":
            now = max(now, op[1])
            pending.release_due(now)
            ready = [j for j in inside if not j.gated and (j.not_before is None or j.not_before <= now)]
            head = pending.head()
            if not ready:
                assert head is None
                continue
            expected = min(ready, key=lambda j: (-j.priority, j.seq))
            assert head is expected
            assert pending.pop_head() is expected
            inside.remove(expected)
        elif inside:
            victim = inside[op[1] % len(inside)]
            assert pending.remove(victim)
            assert not pending.remove(victim)
            inside.remove(victim)
        assert len(pending) == len(inside)
    assert sorted(j.seq for j in pending.drain()) == sorted(j.seq for j in inside)


def test_asyncio_retries_dead_letters_holds_and_priorities() -> None:
    async def main() -> None:
        letters: list[DeadLetter] = []

        async def sink(letter: DeadLetter) -> None:
            letters.append(letter)

        queue = aio.Queue(MemoryState(private=True), name="a", interval=0.002, dead_letter=sink)
        flaky = Flaky(failures=1)

        async def call(value: int) -> int:
            return flaky(value)

        assert await queue.add(call, 3, retries=1, backoff=QUICK) == 3
        with pytest.raises(OSError, match="try 2 fails"):
            await queue.add(Flaky(failures=5), 1, retries=1, backoff=QUICK)
        await queue.join(LONG)
        assert [letter.attempts for letter in letters] == [2]
        queue.pause()
        order: list[str] = []
        queue.add(order.append, "held", not_before=0.05, priority=9)
        queue.add(order.append, "low")
        queue.add(order.append, "high", priority=1)
        queue.resume()
        assert await queue.join(LONG)
        assert order == ["high", "low", "held"]
        await queue.close()

    asyncio.run(main())


def test_the_public_names() -> None:
    assert ratequeue.Backoff is Backoff
    assert issubclass(ratequeue.QueueFull, ratequeue.RateQueueError)


def test_closing_with_cancel_pending_settles_a_retry_that_waits_its_backoff() -> None:
    queue = Queue(
        MemoryState(private=True), name="q", interval=0.002, retries=1, backoff=Backoff(base=30, jitter=False)
    )
    future = queue.add(Flaky(failures=1), 1)
    assert _waits_for(lambda: queue.pending == 1 and future.running())  # failed once, held for 30 s
    queue.close(wait=True, cancel_pending=True)
    with pytest.raises(ratequeue.QueueClosed, match="closed before its retry"):
        future.result(5)


def test_cancelling_a_held_job_lets_the_queue_go_idle_at_once() -> None:
    queue = Queue(MemoryState(private=True), name="q", interval=0.002)
    future = queue.add(print, "never", not_before=3600)
    assert future.cancel()
    assert queue.join(5), "the pacer stopped waiting for the cancelled job"
    queue.close()


def test_a_huge_retry_number_waits_the_max() -> None:
    assert Backoff(factor=3, max=60).delay(700) == 60
    assert Backoff(factor=3, max=60, jitter=False).least(10**6) == 60
