"""ratequeue.aio: the contract through the asyncio clients, many tasks, processes with loops, cancel."""

from __future__ import annotations

import asyncio
import inspect
import itertools
import multiprocessing
import pickle
import queue as queue_module
from typing import Any

import pytest
from hypothesis import given, settings

from ratequeue import AcquireTimeout, QueueClosed, aio
from ratequeue.core import protocol
from ratequeue.running import runner_of
from ratequeue.state.memory import MemoryState

from . import _workers
from .backends import Backend
from .ops import ado, flag_step
from .strategies import FLAGS, epochs_us, intervals_us
from .strategies import operations as ops_strategy

LONG = 30.0

operations = ops_strategy(max_size=20, pauses=True)


@settings(max_examples=30)
@given(interval=intervals_us, epoch=epochs_us, ops=operations)
def test_async_backend_answers_as_the_reference(
    backend: Backend, interval: int, epoch: int, ops: list[tuple[object, ...]]
) -> None:
    """Each asyncio client gives exactly the reference protocol's answers."""
    clock = [epoch]
    name = backend.fresh_name()

    async def run() -> None:
        state = backend.open_async(clock=lambda: clock[0])
        reference = protocol.new_record(interval)
        for op in ops:
            kind, now = op[0], clock[0]
            if kind == "clock":
                clock[0] = max(0, now + int(op[1]))  # type: ignore[call-overload]
            elif kind in FLAGS:
                reference, step, args, changed = flag_step(reference, op, now)
                assert await ado(state, step, name, interval, *args) is changed
            elif kind == "take":
                reference, taken = protocol.take(reference, now)
                assert await ado(state, "take", name, interval) == taken
            elif kind == "try":
                ticket = 1 + int(op[1]) % (reference.ticket + 1)  # type: ignore[call-overload]
                lead, doubt = int(op[2]), int(op[3])  # type: ignore[call-overload]
                reference, outcome = protocol.try_start(reference, ticket, lead, now, doubt=doubt)
                assert await ado(state, "try_start", name, interval, ticket, lead, doubt) == outcome
            elif kind in ("take_and_try", "try_take"):
                lead, doubt = int(op[1]), int(op[2])  # type: ignore[call-overload]
                step = protocol.try_take if kind == "try_take" else protocol.take_and_try
                reference, outcome = step(reference, lead, now, doubt=doubt)
                assert await ado(state, kind, name, interval, lead, doubt) == outcome
            else:
                lead = int(op[1])  # type: ignore[call-overload]
                reference, outcome = protocol.take_and_try(reference, lead, now)
                assert await ado(state, "take_and_try", name, interval, lead) == outcome
        snapshot = await state.read(name)
        changed = any(op[0] != "clock" for op in ops)
        assert snapshot.record == (reference if changed else None)
        assert snapshot.now == clock[0]
        await state.close()

    asyncio.run(run())


def test_many_tasks_in_one_loop_share_one_rate(backend: Backend) -> None:
    async def run() -> list[int]:
        limiter = aio.Limiter(backend.open_async(), name=backend.fresh_name(), interval=0.005)
        turns = await asyncio.gather(*(limiter.acquire(timeout=LONG) for _ in range(40)))
        assert len({turn.ticket for turn in turns}) == 40
        assert (await limiter.status()).waiting == 0
        await limiter.state.close()
        return sorted(turn.start_us for turn in turns)

    starts = asyncio.run(run())
    assert min(b - a for a, b in itertools.pairwise(starts)) >= 5000


@pytest.mark.processes
def test_processes_each_with_a_loop_share_one_rate(shared_backend: Backend) -> None:
    """3 processes, each with 4 tasks acquiring 5 turns in its own event loop."""
    context = multiprocessing.get_context("spawn")
    reports: Any = context.Queue()
    name = shared_backend.fresh_name()
    processes = [
        context.Process(
            target=_workers.acquire_many_async, args=(shared_backend.url, name, 0.02, 4, 5, index, reports)
        )
        for index in range(3)
    ]
    for process in processes:
        process.start()
    starts: list[int] = []
    errors: list[str] = []
    finished = 0
    while finished < 3:
        try:
            _index, ticket, value = reports.get(timeout=60)
        except queue_module.Empty:
            pytest.fail("no report for 60 s")
        if ticket is None:
            finished += 1
            errors += [value] if value else []
        else:
            starts.append(value)
    for process in processes:
        process.join(30)
    assert not errors
    assert len(starts) == 60
    starts.sort()
    assert min(b - a for a, b in itertools.pairwise(starts)) >= 20_000


def fresh(interval: float, **kwargs: Any) -> aio.Limiter:
    # max_late=None: a late wake-up under load would give a ticket up and shift the numbers
    kwargs.setdefault("max_late", None)
    return aio.Limiter(MemoryState(private=True), name="q", interval=interval, **kwargs)


def test_cancelling_a_waiting_task_gives_up_its_place_cleanly() -> None:
    async def run() -> None:
        limiter = fresh(LONG)
        await limiter.acquire()
        waiting = asyncio.create_task(limiter.acquire())
        while runner_of(limiter).shard.ticket is None:  # the task took ticket 2 and sleeps until its slot
            await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        status = await limiter.status()
        assert status.waiting == 0
        assert status.held_ticket == 2, "the ticket stays with the shard for the next task"
        with pytest.raises(AcquireTimeout):
            await limiter.acquire(timeout=0)
        assert (await limiter.status()).next_ticket == 3, "no new ticket was taken"

    asyncio.run(run())


def test_zero_timeout_pause_and_resume() -> None:
    async def run() -> None:
        limiter = fresh(0.001)
        assert (await limiter.acquire(timeout=0)).ticket == 1
        limiter.pause()
        task = asyncio.create_task(limiter.acquire(timeout=LONG))
        await asyncio.sleep(0)
        assert (await limiter.status()).waiting == 1
        assert (await limiter.status()).next_ticket == 2, "a paused shard takes no ticket"
        limiter.resume()
        assert (await task).ticket == 2

    asyncio.run(run())


def test_decorating_coroutines_and_functions_keeps_metadata() -> None:
    limiter = fresh(0.001)

    @limiter
    async def fetch(url: str) -> str:
        """Fetch."""
        return url.upper()

    def plain(n: int) -> int:
        return n + 1

    wrapped = limiter.wrap(plain)
    assert fetch.__name__ == "fetch"
    assert fetch.__doc__ == "Fetch."
    assert inspect.iscoroutinefunction(fetch)
    assert inspect.iscoroutinefunction(wrapped)

    async def run() -> None:
        assert await fetch("a") == "A"
        assert await wrapped(1) == 2
        async with limiter as turn:
            assert turn.ticket == 3

    asyncio.run(run())


def test_pickles_as_configuration(tmp_path: Any) -> None:
    limiter = aio.Limiter(f"file://{tmp_path}/state.json", name="q", interval=0.01)
    again = pickle.loads(pickle.dumps(limiter))
    assert (again.name, again.interval, again.state.url) == ("q", 0.01, limiter.state.url)


def test_queue_runs_coroutines_and_functions_in_order() -> None:
    async def run() -> None:
        queue = aio.Queue(MemoryState(private=True), name="q", interval=0.002)
        order: list[int] = []

        async def job(i: int) -> int:
            order.append(i)
            return i * i

        def boom() -> None:
            raise KeyError("x")

        futures = [queue.add(job, i) for i in range(5)]
        bad = queue.add(boom)
        assert await queue.join(LONG)
        assert [f.result() for f in futures] == [0, 1, 4, 9, 16]
        assert order == list(range(5))
        with pytest.raises(KeyError):
            bad.result()
        await queue.close()
        with pytest.raises(QueueClosed):
            queue.add(job, 9)

    asyncio.run(run())


def test_queue_cancel_and_close_withdraw_the_pacer() -> None:
    async def run() -> None:
        queue = aio.Queue(MemoryState(private=True), name="q", interval=LONG)
        first = queue.add(asyncio.sleep, 0)
        await first
        waiting = [queue.add(asyncio.sleep, 0) for _ in range(3)]
        await asyncio.sleep(0)
        await asyncio.wait_for(queue.close(cancel_pending=True), 5)  # not the 30 s interval
        assert all(f.cancelled() for f in waiting)
        assert not queue._pacing

    asyncio.run(run())
