"""Reservations (``limiter.reserve()``), and the fixes of issue 10's review, each failing before its fix."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future
from typing import Any

import pytest

import ratequeue
from ratequeue import AcquireTimeout, Limiter, Queue, StateUnavailable, aio
from ratequeue.core.operation import Operation
from ratequeue.core.protocol import US, Answer
from ratequeue.running import runner_of
from ratequeue.state.memory import MemoryState

LONG = 30.0  # an interval no test waits out


def wait_until(predicate: Any, timeout: float = 10.0) -> None:
    """Poll ``predicate`` until true; fail after ``timeout`` s (a condition, not a sleep)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.001)


class CountedCloses(MemoryState):
    """A memory state that counts how often it was closed."""

    def __init__(self) -> None:
        super().__init__(private=True)
        self.closes = 0

    def close(self) -> None:
        self.closes += 1


class Unreachable(MemoryState):
    """A memory state whose starts fail as an unreachable server's would, noting when."""

    def __init__(self) -> None:
        super().__init__(private=True)
        self.failures: list[float] = []

    def _execute(self, op: Operation) -> Answer:
        if op.kind != "take_and_try":
            return super()._execute(op)
        self.failures.append(time.monotonic())
        raise StateUnavailable("down for the test", where="nowhere")


def test_a_reservation_keeps_its_place_and_waits_later() -> None:
    """reserve() takes the place at once: a later acquire comes after it."""
    # max_late=None: a late wake-up under load would give a ticket up and shift the numbers
    limiter = Limiter(MemoryState(private=True), name="q", interval=0.01, max_late=None)
    first = limiter.reserve()
    second = limiter.reserve()
    turns: list[ratequeue.Turn] = []
    thread = threading.Thread(target=lambda: turns.append(limiter.acquire()))
    thread.start()
    wait_until(lambda: runner_of(limiter).shard.waiting == 3)
    a, b = first.wait(), second.wait()
    thread.join()
    assert a is not None
    assert b is not None
    assert [a.ticket, b.ticket, turns[0].ticket] == [1, 2, 3]
    assert first.turn == a
    assert not first.cancelled


def test_cancel_from_another_thread_ends_the_wait_without_a_turn() -> None:
    """A reservation cancelled while its wait sleeps returns None, and the next caller gets the slot."""
    limiter = Limiter(MemoryState(private=True), name="q", interval=LONG)
    limiter.acquire()  # the next slot is LONG away
    reservation = limiter.reserve()
    results: list[ratequeue.Turn | None] = []
    thread = threading.Thread(target=lambda: results.append(reservation.wait()))
    thread.start()
    wait_until(lambda: runner_of(limiter).shard.ticket is not None)  # it holds a ticket and sleeps
    reservation.cancel()
    thread.join(5)
    assert not thread.is_alive()
    assert results == [None]
    assert reservation.cancelled
    assert reservation.turn is None
    assert runner_of(limiter).shard.waiting == 0
    with pytest.raises(AcquireTimeout):
        limiter.acquire(timeout=0)  # the held ticket went to the next caller, still LONG away


def test_a_reservation_times_out_from_its_wait() -> None:
    limiter = Limiter(MemoryState(private=True), name="q", interval=LONG)
    limiter.acquire()
    with limiter.reserve() as reservation, pytest.raises(AcquireTimeout):
        reservation.wait(timeout=0.01)
    assert runner_of(limiter).shard.waiting == 0


def test_an_unwaited_reservation_is_cancelled_on_exit() -> None:
    # max_late=None: a late wake-up under load would give a ticket up and shift the numbers
    limiter = Limiter(MemoryState(private=True), name="q", interval=0.01, max_late=None)
    with limiter.reserve():
        pass
    assert runner_of(limiter).shard.waiting == 0
    assert limiter.acquire(timeout=5).ticket == 1


def test_asyncio_reservation_cancelled_by_another_task() -> None:
    async def run() -> None:
        limiter = aio.Limiter(MemoryState(private=True), name="q", interval=LONG)
        await limiter.acquire()
        reservation = limiter.reserve()
        waiting = asyncio.ensure_future(reservation.wait())
        while runner_of(limiter).shard.ticket is None:
            await asyncio.sleep(0.001)
        reservation.cancel()
        assert await asyncio.wait_for(waiting, 5) is None
        assert reservation.cancelled

    asyncio.run(run())


def test_a_cancelled_task_of_the_sync_decorator_uses_no_turn() -> None:
    """A task cancelled while ``@limiter`` (sync limiter) waits in a thread gives its turn to the next caller.

    Before, the worker thread went on waiting and took the turn for nobody.
    """
    # max_late=None: a late wake-up under load would give a turn up and move the acquire a slot on
    limiter = Limiter(MemoryState(private=True), name="q", interval=0.5, max_late=None)
    calls: list[int] = []

    @limiter
    async def call() -> None:
        calls.append(1)

    async def run() -> ratequeue.Turn:
        first = limiter.acquire()
        task = asyncio.ensure_future(call())
        while runner_of(limiter).shard.ticket is None and not runner_of(limiter).shard.holding:
            await asyncio.sleep(0.001)  # the worker thread holds the next ticket (or its grant)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        turn = await asyncio.to_thread(limiter.acquire, 5)
        # the next slot, not one later (its start is later than the slot only if this acquire
        # came after it, as on a loaded host)
        waited = turn.start_us - first.start_us
        assert limiter.interval * US <= waited < 2 * limiter.interval * US, "the next slot, not one later"
        return turn

    asyncio.run(run())
    assert calls == []


def test_aio_limiter_leaves_a_state_object_passed_in_open() -> None:
    """Like the sync limiter (and as docs/api.md says), aio.Limiter.close() closes only what it opened."""
    state = CountedCloses()

    async def run() -> None:
        limiter = aio.Limiter(state, name="q", interval=0.01)
        await limiter.acquire()
        await limiter.close()

    asyncio.run(run())
    sync = Limiter(state, name="q", interval=0.01)
    sync.close()
    assert state.closes == 0


def test_queues_have_their_docstrings() -> None:
    assert Queue.__doc__
    assert "Runs callables" in Queue.__doc__
    assert aio.Queue.__doc__
    assert "Runs callables" in aio.Queue.__doc__


def test_close_without_waiting_closes_the_state_after_the_last_job() -> None:
    """close(wait=False) used to leave the state open for ever."""
    state = CountedCloses()
    release = threading.Event()
    queue = Queue(state, name="q", interval=0.001)
    queue._limiter._owns_state = True  # as if opened from a URL
    running: Future[bool] = queue.add(release.wait, 10)
    wait_until(lambda: queue.pending == 0 and queue._running == 1)
    queue.close(wait=False)
    assert state.closes == 0, "not while a job runs"
    release.set()
    assert running.result(10)
    assert queue.join(10)
    wait_until(lambda: state.closes == 1)


def test_close_without_waiting_closes_the_state_after_the_last_job_asyncio() -> None:
    state = CountedCloses()

    async def run() -> None:
        release = asyncio.Event()
        queue = aio.Queue(state, name="q", interval=0.001)
        queue._limiter._owns_state = True
        running = queue.add(release.wait)
        while queue._running == 0:
            await asyncio.sleep(0.001)
        await queue.close(wait=False)
        assert state.closes == 0
        release.set()
        await running
        assert await queue.join(10)
        while state.closes == 0:
            await asyncio.sleep(0.001)

    asyncio.run(asyncio.wait_for(run(), 10))
    assert state.closes == 1


@pytest.mark.parametrize("kind", ["thread", "asyncio"])
def test_a_failing_state_fails_jobs_in_order_with_a_growing_pause(kind: str) -> None:
    """Each failed turn fails the head job; the pacer pauses between failures, 50 ms and doubling.

    Before, the thread pacer retried at once (and caught BaseException), the asyncio one too.
    """
    state = Unreachable()
    if kind == "thread":
        queue = Queue(state, name="q", interval=0.001)
        futures = [queue.add(lambda i=i: i) for i in range(3)]
        errors = [f.exception(10) for f in futures]
    else:

        async def run() -> list[BaseException | None]:
            queue = aio.Queue(state, name="q", interval=0.001)
            futures = [queue.add(lambda i=i: i) for i in range(3)]
            done = await asyncio.wait_for(asyncio.gather(*futures, return_exceptions=True), 10)
            return [d if isinstance(d, BaseException) else None for d in done]

        errors = asyncio.run(run())
    assert all(isinstance(e, StateUnavailable) for e in errors)
    gaps = [b - a for a, b in zip(state.failures, state.failures[1:], strict=False)]
    assert len(gaps) == 2
    assert gaps[0] >= 0.05
    assert gaps[1] >= 0.1
