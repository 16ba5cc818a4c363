"""One job per group at a time across the fleet (``queue.add(fn, group=...)``), groups in first-come order.

The jobs record when they begin and end, per group, on the host's monotonic
clock (a list in one process, a file appended to by every process); the
checks read the record: no two jobs of one group overlap, each group's jobs
run in the order they were added, and groups do not wait for each other.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest

from ratequeue import ConfigurationError, Queue, aio

from . import _workers
from .backends import Backend
from .test_max_running import peak

INTERVAL = 0.002
WAIT = 60.0


class Recorder:
    """Begin and end times of jobs, per group, from several threads."""

    def __init__(self) -> None:
        self.spans: dict[str, list[tuple[float, float]]] = defaultdict(list)
        self.order: dict[str, list[int]] = defaultdict(list)
        self._lock = threading.Lock()

    def job(self, group: str, number: int, seconds: float) -> int:
        begin = time.monotonic()
        with self._lock:
            self.order[group].append(number)
        time.sleep(seconds)
        with self._lock:
            self.spans[group].append((begin, time.monotonic()))
        return number


def test_jobs_of_a_group_run_one_at_a_time_in_order(backend: Backend) -> None:
    name = backend.fresh_name()
    recorder = Recorder()
    queue = Queue(backend.url, name=name, interval=INTERVAL)
    futures = [
        queue.add(recorder.job, group, number, 0.01, group=group)
        for number in range(6)
        for group in ("alice", "bob", "carol")
    ]
    assert [future.result(WAIT) for future in futures] == [n for n in range(6) for _ in range(3)]
    queue.close()
    for group in ("alice", "bob", "carol"):
        assert recorder.order[group] == list(range(6))
        assert peak(recorder.spans[group]) == 1
    if backend.kind == "memory":  # elsewhere a slow state call can keep any two from meeting
        # the groups ran side by side: jobs of different groups overlapped
        assert peak([span for spans in recorder.spans.values() for span in spans]) >= 2


def test_two_queue_objects_share_a_groups_place(backend: Backend) -> None:
    """Two shards of one queue name: a group's jobs never overlap across them."""
    name = backend.fresh_name()
    recorder = Recorder()
    queues = [Queue(backend.url, name=name, interval=INTERVAL) for _ in range(2)]
    futures = [queues[n % 2].add(recorder.job, "shared", n, 0.01, group="shared") for n in range(10)]
    for future in futures:
        future.result(WAIT)
    for queue in queues:
        queue.close()
    assert len(recorder.spans["shared"]) == 10
    assert peak(recorder.spans["shared"]) == 1


def test_a_retried_job_keeps_its_groups_place(backend: Backend) -> None:
    """The next job of the group waits for the retries of the one before (order within the group)."""
    name = backend.fresh_name()
    events: list[str] = []
    tries = {"n": 0}

    def flaky() -> str:
        tries["n"] += 1
        events.append(f"flaky try {tries['n']}")
        if tries["n"] < 3:
            raise ConnectionError("not yet")
        return "ok"

    def after() -> None:
        events.append("after")

    from ratequeue import Backoff

    queue = Queue(
        backend.url, name=name, interval=INTERVAL, retries=3, backoff=Backoff(base=0.02, jitter=False)
    )
    first = queue.add(flaky, group="g")
    second = queue.add(after, group="g")
    assert first.result(WAIT) == "ok"
    second.result(WAIT)
    queue.close()
    assert events == ["flaky try 1", "flaky try 2", "flaky try 3", "after"]


def test_a_cancelled_job_gives_its_groups_line_place_up(backend: Backend) -> None:
    name = backend.fresh_name()
    gate = threading.Event()
    queue = Queue(backend.url, name=name, interval=INTERVAL)
    holder = queue.add(gate.wait, WAIT, group="g")  # holds the place until the test lets it go
    waiting = queue.add(lambda: "never", group="g")
    last = queue.add(lambda: "last", group="g")
    assert waiting.cancel()
    gate.set()
    assert holder.result(WAIT) is True
    assert last.result(WAIT) == "last"
    assert waiting.cancelled()
    queue.close()
    # every group place was given back: the group's record holds no lease
    record = backend.open().read(f"{name}:group:g").record  # the queue closed its own state
    assert record is not None
    assert record.leases == ()


def test_asyncio_groups_run_one_at_a_time_in_order(backend: Backend) -> None:
    async def main() -> tuple[dict[str, list[int]], dict[str, list[tuple[float, float]]]]:
        state = backend.open_async()
        queue = aio.Queue(state, name=backend.fresh_name(), interval=INTERVAL)
        order: dict[str, list[int]] = defaultdict(list)
        spans: dict[str, list[tuple[float, float]]] = defaultdict(list)

        async def job(group: str, number: int) -> None:
            begin = time.monotonic()
            order[group].append(number)
            await asyncio.sleep(0.005)
            spans[group].append((begin, time.monotonic()))

        await asyncio.gather(*(queue.add(job, g, n, group=g) for n in range(5) for g in ("x", "y")))
        await queue.close()
        await state.close()
        return order, spans

    order, spans = asyncio.run(main())
    for group in ("x", "y"):
        assert order[group] == list(range(5))
        assert peak(spans[group]) == 1


@pytest.mark.parametrize("group", ["", 3, b"bytes", "bad\nname"])
def test_a_bad_group_is_refused_before_anything_is_queued(group: object) -> None:
    queue = Queue("memory://", name="bad-group", interval=INTERVAL)
    with pytest.raises(ConfigurationError):
        queue.add(print, group=group)  # type: ignore[arg-type]
    assert queue.pending == 0
    queue.close()


@pytest.mark.processes
def test_processes_run_one_job_per_group_at_a_time(shared_backend: Backend, tmp_path: Path) -> None:
    """Three processes add jobs of two groups: the recorder never sees two jobs of one group at once."""
    name = shared_backend.fresh_name()
    record = tmp_path / "record.txt"
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(3) as pool:
        args = [(shared_backend.url, name, INTERVAL, 6, seed, str(record)) for seed in range(3)]
        done = pool.starmap_async(_workers.run_grouped_jobs, args).get(WAIT * 2)
    assert done == [6, 6, 6]
    spans: dict[str, list[tuple[float, float]]] = defaultdict(list)
    begins: dict[str, float] = {}
    for line in record.read_text().splitlines():
        kind, group, key, at = line.split()
        if kind == "b":
            begins[key] = float(at)
        else:
            spans[group].append((begins.pop(key), float(at)))
    assert not begins
    assert sorted(spans) == ["even", "odd"]
    assert sum(len(s) for s in spans.values()) == 18
    for group_spans in spans.values():
        assert peak(group_spans) == 1
