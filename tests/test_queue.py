"""Queue: futures, order, failures, cancel, concurrency bound, pause, close, idle threads."""

from __future__ import annotations

import asyncio
import itertools
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import CancelledError
from typing import Any

import pytest
import redis
import redis.asyncio
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.retry import Retry

import ratequeue
from ratequeue import Limiter, Queue, QueueClosed, StateUnavailable, TermsMismatch, aio
from ratequeue.core.operation import Operation
from ratequeue.core.protocol import Answer, Started
from ratequeue.events import REPORTER_THREAD
from ratequeue.state.memory import MemoryState
from ratequeue.state.redis import AsyncRedisState, RedisState

from .servers import free_port

LONG = 30.0
#: how long a queue whose group job failed may take to be idle, joined and closed: at once, on a
#: host that may be busy (before the fix, join(5) returned False and close() never returned)
PROMPT = 1.0


def fresh(interval: float, **kwargs: object) -> Queue:
    # max_late=None: a late wake-up under load would give a ticket up and shift the numbers
    kwargs.setdefault("max_late", None)
    return Queue(MemoryState(private=True), name="q", interval=interval, **kwargs)  # type: ignore[arg-type]


def test_jobs_run_in_order_at_the_rate_with_their_results() -> None:
    queue = fresh(0.003)
    starts: list[tuple[int, int]] = []

    def job(i: int) -> int:
        starts.append((i, queue.status().pos))
        return i * i

    futures = [queue.add(job, i) for i in range(10)]
    assert queue.join(LONG)
    assert [f.result() for f in futures] == [i * i for i in range(10)]
    assert [i for i, _ in starts] == list(range(10)), "jobs start in the order they were added"
    queue.close()


def test_a_failing_job_fails_its_future_only() -> None:
    queue = fresh(0.001)

    def boom() -> None:
        raise KeyError("nope")

    bad = queue.add(boom)
    good = queue.add(lambda: "ok")
    assert queue.join(LONG)
    with pytest.raises(KeyError):
        bad.result()
    assert good.result() == "ok"


def test_cancelled_job_is_removed_and_never_runs() -> None:
    queue = fresh(LONG)
    started, release = threading.Event(), threading.Event()

    def hold() -> bool:
        started.set()
        return release.wait(LONG)

    first = queue.add(hold)  # takes the first turn; the next is 30 s away
    assert started.wait(LONG)
    ran: list[str] = []
    second = queue.add(ran.append, "second")
    third = queue.add(ran.append, "third")
    assert third.cancel()
    assert second.cancel()
    assert queue.pending == 0
    release.set()
    assert queue.join(LONG)
    assert first.result() is True
    assert ran == []
    for thread in queue_threads():
        thread.join(5.0)  # the pacer's wait is withdrawn: it ends now, not after the 30 s interval
        assert not thread.is_alive()
    assert queue.status().pos == 1
    with pytest.raises(CancelledError):
        third.result()


def test_max_running_bounds_concurrency_before_taking_a_turn() -> None:
    queue = fresh(0.001, max_running=2)
    gates = [threading.Event() for _ in range(3)]
    running = threading.Semaphore(0)

    def job(i: int) -> int:
        running.release()
        gates[i].wait(LONG)
        return i

    futures = [queue.add(job, i) for i in range(3)]
    assert running.acquire(timeout=LONG)
    assert running.acquire(timeout=LONG)
    assert queue.status().next_ticket == 3, "the third job took no ticket while two run"
    gates[0].set()
    assert running.acquire(timeout=LONG)
    gates[1].set()
    gates[2].set()
    assert [f.result(LONG) for f in futures] == [0, 1, 2]


def test_pause_and_resume() -> None:
    queue = fresh(0.001)
    queue.pause()
    future = queue.add(lambda: "done")
    assert queue.paused
    assert not future.done()
    assert queue.status().next_ticket == 1, "a paused queue takes no ticket"
    queue.resume()
    assert future.result(LONG) == "done"


def test_close_cancels_pending_and_refuses_new_jobs() -> None:
    queue = fresh(LONG)
    started, release = threading.Event(), threading.Event()

    def job() -> bool:
        started.set()
        return release.wait(LONG)

    running = queue.add(job)
    waiting = [queue.add(lambda: None) for _ in range(3)]
    # close only once the first job runs: a job not yet begun is pending, and cancelled
    assert started.wait(LONG), "the first job never began"
    closer = threading.Thread(target=queue.close, kwargs={"cancel_pending": True})
    closer.start()
    for future in waiting:
        with pytest.raises(CancelledError):
            future.result(LONG)
    with pytest.raises(QueueClosed):
        queue.add(lambda: None)
    release.set()
    closer.join(LONG)
    assert not closer.is_alive()
    assert running.result() is True


def queue_threads() -> list[threading.Thread]:
    """The threads ratequeue runs for this file's queues, all named "q" (and "q:..." for their groups).

    Named ``ratequeue-<role>-<queue name>``: a limiter another test file left
    open (its own lease keeper, say) is that file's failure, not this one's.
    """
    return [
        thread
        for thread in threading.enumerate()
        if thread.name.startswith("ratequeue-")
        and thread.name != REPORTER_THREAD
        and (thread.name.endswith("-q") or "-q:" in thread.name)
    ]


def test_threads_exist_only_while_jobs_exist() -> None:
    """G5: the pacing and job threads end when the queue is empty."""
    queue = fresh(0.001)
    for _ in range(2):  # the pacer starts again on demand
        futures = [queue.add(lambda: threading.current_thread().name) for _ in range(3)]
        assert queue.join(LONG)
        assert {f.result() for f in futures} == {"ratequeue-job-q"}
        for thread in queue_threads():
            thread.join(LONG)
        assert not queue_threads()


def test_status_counts_pending_jobs() -> None:
    queue = fresh(LONG)
    release = threading.Event()
    queue.add(release.wait, LONG)
    for _ in range(4):
        queue.add(lambda: None)
    status = queue.status()
    assert status.waiting >= 3  # the pacer may have taken the next job out already
    assert isinstance(status, ratequeue.Status)
    queue.close(wait=False, cancel_pending=True)
    release.set()


def test_add_needs_a_callable() -> None:
    with pytest.raises(TypeError):
        fresh(0.001).add(42)  # type: ignore[arg-type]


class RecordingState(MemoryState):
    """A real memory state that also remembers every start it granted."""

    def __init__(self) -> None:
        super().__init__(private=True)
        self.starts: list[int] = []

    def _execute(self, op: Operation) -> Answer:
        answer = super()._execute(op)
        if op.kind in ("take_and_try", "try_start") and isinstance(answer, Started):
            self.starts.append(answer.start)
        return answer


def test_starts_are_spaced_on_the_state_clock() -> None:
    state = RecordingState()
    queue = Queue(state, name="q", interval=0.002)
    for _ in range(20):
        queue.add(lambda: None)
    assert queue.join(LONG)
    assert len(state.starts) == 20
    assert min(b - a for a, b in itertools.pairwise(state.starts)) >= 2000


# ------------------------------------------- a group job failed by the state leaves no stuck queue

#: what fails a job of group "bob" of queue "q", and the error its future fails with
CAUSES = {"unreachable": StateUnavailable, "other terms": TermsMismatch}


def group_state(cause: str, *, on_asyncio: bool = False) -> Any:
    """A state on which group "bob" of queue "q" cannot have its place.

    ``"unreachable"``: Redis on a closed port, through a client that does not
    retry (the state's own clients retry for 2.6 s). ``"other terms"``: the
    group's record ``q:group:bob`` made by a limiter of another interval.
    """
    if cause == "unreachable":
        port = free_port()
        if on_asyncio:
            return AsyncRedisState(redis.asyncio.Redis(port=port, retry=AsyncRetry(NoBackoff(), 0)))
        return RedisState(redis.Redis(port=port, retry=Retry(NoBackoff(), 0)))
    state = MemoryState(private=True)
    Limiter(state, name="q:group:bob", interval=5).acquire()
    return state


@pytest.mark.parametrize("cause", CAUSES)
def test_a_group_job_failed_by_the_state_leaves_its_queue_idle_and_closable(cause: str) -> None:
    queue = Queue(group_state(cause), name="q", interval=0.01)
    future = queue.add(lambda: "never", group="bob")
    with pytest.raises(CAUSES[cause]):
        future.result(LONG)
    assert queue.pending == 0
    began = time.monotonic()
    assert queue.join(5)
    closer = threading.Thread(target=queue.close, daemon=True)
    closer.start()
    closer.join(5)
    assert not closer.is_alive(), "close() did not return"
    assert time.monotonic() - began < PROMPT
    for thread in queue_threads():  # the pacer, a non-daemon thread, ends: the interpreter may exit
        thread.join(5)
        assert not thread.is_alive(), thread.name


@pytest.mark.parametrize("cause", CAUSES)
def test_the_interpreter_exits_after_a_group_job_failed_by_the_state(cause: str) -> None:
    """No close(), no join(): a process whose group job failed ends (the pacer thread is no daemon)."""
    script = f"""
        import ratequeue
        from tests.test_queue import group_state
        queue = ratequeue.Queue(group_state({cause!r}), name="q", interval=0.01)
        error = queue.add(lambda: "never", group="bob").exception(30)
        print(type(error).__name__, queue.pending)
    """
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=LONG
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [CAUSES[cause].__name__, "0"]
    assert time.monotonic() - began < 10, "the process waited for a pacer to give up"


@pytest.mark.parametrize("cause", CAUSES)
def test_aio_a_group_job_failed_by_the_state_leaves_its_queue_idle_and_closable(cause: str) -> None:
    async def main() -> float:
        queue = aio.Queue(group_state(cause, on_asyncio=True), name="q", interval=0.01)
        future = queue.add(lambda: "never", group="bob")
        with pytest.raises(CAUSES[cause]):
            await asyncio.wait_for(future, LONG)
        assert queue.pending == 0
        began = time.monotonic()
        assert await queue.join(5)
        await asyncio.wait_for(queue.close(), 5)
        return time.monotonic() - began

    assert asyncio.run(main()) < PROMPT
