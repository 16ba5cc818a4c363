"""The ``on_event`` hook: what limiters, queues and groups report, and the Prometheus exporter.

Real states (memory and file, which need no server), real threads and
tasks. The events that need a fault are provoked for real: a record reset
from another state object (a lost ticket), a record file overwritten (a
state error), a job that raises (retries), a clock shifted forward while a
turn is granted (a late wake-up, as a process descheduled at that moment
sees it).
"""

from __future__ import annotations

import asyncio
import pickle
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

import ratequeue
from ratequeue import AcquireTimeout, Backoff, ConfigurationError, Event, StateCorrupted, aio
from ratequeue.events import KINDS
from ratequeue.shard import Shard, TakeAndTry, TryStart

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from ratequeue.prometheus import PrometheusMetrics  # noqa: E402

INTERVAL = 0.01


class Recorder:
    """An ``on_event`` hook that keeps every event (list.append is atomic: threads may share it)."""

    def __init__(self, then: Callable[[Event], object] | None = None) -> None:
        self.events: list[Event] = []
        self._then = then

    def __call__(self, event: Event) -> None:
        self.events.append(event)
        if self._then is not None:
            self._then(event)

    def of(self, kind: str) -> list[Event]:
        return [event for event in self.events if event.kind == kind]


def fresh(prefix: str = "events") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


@pytest.fixture(params=["memory", "file"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A state URL of a store no other test uses: memory, then file."""
    if request.param == "memory":
        return f"memory://{fresh()}"
    return (tmp_path / "state.json").as_uri()


class ShiftedClock:
    """``time.monotonic`` plus a shift the test moves forward: a wake-up that came late, for real."""

    def __init__(self) -> None:
        self.shift = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.shift


# --------------------------------------------------------------------------- the limiter's events


def test_every_acquire_reports_one_start_with_its_wait_and_lateness(url: str) -> None:
    hook = Recorder()
    limiter = ratequeue.Limiter(url, name=fresh(), interval=INTERVAL, on_event=hook)
    turns: list[ratequeue.Turn] = []

    def worker() -> None:
        for _ in range(5):
            turns.append(limiter.acquire())

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    limiter.close()

    starts = hook.of("start")
    assert len(starts) == len(turns) == 10
    assert sorted(event.ticket or 0 for event in starts) == sorted(turn.ticket for turn in turns)
    for event in starts:
        assert event.queue == limiter.name
        assert event.wait is not None
        assert event.wait >= 0
        assert event.lateness is not None
        assert event.lateness >= 0
    calls = hook.of("call")
    assert len(calls) >= 10  # at least one answered call per start
    assert {event.operation for event in calls} <= {"take_and_try", "try_start", "retime"}
    assert all(event.duration is not None and event.duration >= 0 for event in calls)
    assert sum(event.outcome == "started" for event in calls) >= 10
    assert not hook.of("timeout")
    assert not hook.of("state_error")
    assert not hook.of("passed")


def test_a_timeout_is_reported_and_a_try_acquire_without_a_turn_is_not(url: str) -> None:
    hook = Recorder()
    limiter = ratequeue.Limiter(url, name=fresh(), interval=60.0, on_event=hook)
    limiter.acquire()
    assert limiter.try_acquire() is None
    assert not hook.of("timeout")
    with pytest.raises(AcquireTimeout):
        limiter.acquire(timeout=0.05)
    limiter.close()
    [timeout] = hook.of("timeout")
    assert timeout.queue == limiter.name
    assert timeout.wait is not None
    assert 0 <= timeout.wait <= 0.05


def test_a_reset_record_reports_the_held_ticket_passed(tmp_path: Path) -> None:
    url = (tmp_path / "state.json").as_uri()
    name = fresh()
    other = ratequeue.open_state(url)  # an administrator's own state object
    reset: list[bool] = []

    def reset_while_waiting(event: Event) -> None:
        if event.kind == "call" and event.outcome == "wait" and not reset:
            reset.append(other.reset(name))  # the shard holds ticket 2, not started

    hook = Recorder(reset_while_waiting)
    limiter = ratequeue.Limiter(url, name=name, interval=0.2, on_event=hook)
    assert limiter.acquire().ticket == 1
    turn = limiter.acquire()
    limiter.close()
    other.close()

    assert reset == [True]
    [passed] = hook.of("passed")
    assert (passed.queue, passed.ticket) == (name, 2)
    assert turn.ticket == 1, "the caller took a new ticket of the fresh record"
    assert [event.ticket for event in hook.of("start")] == [1, 1]


def test_late_wake_ups_are_reported_moved_then_given_up() -> None:
    clock = ShiftedClock()
    late = [3]  # the next three answers of the state (a grant, two moves) are each woken late

    def wake_late(event: Event) -> None:
        if event.kind == "call" and event.outcome == "started" and late[0]:
            late[0] -= 1
            clock.shift += 0.005  # the process resumes 5 ms after the answer: past max_late

    hook = Recorder(wake_late)
    limiter = ratequeue.Limiter(
        f"memory://{fresh()}", name=fresh(), interval=0.05, clock=clock, on_event=hook
    )
    turn = limiter.acquire()
    limiter.close()

    late_events = hook.of("late")
    assert [event.outcome for event in late_events] == ["moved", "moved", "given_up"]
    assert all(event.lateness is not None and event.lateness > 0.004 for event in late_events)
    [start] = hook.of("start")
    assert start.ticket == turn.ticket == 2, "the turn given up was replaced by a new ticket"
    assert start.lateness is not None
    assert start.lateness <= 0.0003 + 1e-6


def test_a_corrupted_record_reports_a_state_error(tmp_path: Path) -> None:
    hook = Recorder()
    name = fresh()
    limiter = ratequeue.Limiter(
        (tmp_path / "state.json").as_uri(), name=name, interval=INTERVAL, on_event=hook
    )
    limiter.acquire()
    record_file, _ = limiter.state.record_files(name)  # type: ignore[attr-defined]
    Path(record_file).write_bytes(b"not json")
    with pytest.raises(StateCorrupted):
        limiter.acquire()
    limiter.close()
    [error] = hook.of("state_error")
    assert (error.queue, error.operation, error.error) == (name, "take_and_try", "StateCorrupted")
    assert error.duration is not None
    assert error.duration >= 0


def test_a_hook_that_raises_does_not_break_acquire() -> None:
    calls: list[str] = []

    def broken(event: Event) -> None:
        calls.append(event.kind)
        raise RuntimeError("the metrics backend is down")

    limiter = ratequeue.Limiter(f"memory://{fresh()}", name=fresh(), interval=INTERVAL, on_event=broken)
    tickets = [limiter.acquire().ticket for _ in range(3)]
    limiter.close()
    assert tickets == [1, 2, 3]
    assert calls.count("start") == 3


def test_on_event_must_be_callable_and_is_not_pickled() -> None:
    with pytest.raises(ConfigurationError, match="on_event"):
        ratequeue.Limiter("memory://", name="x", interval=1.0, on_event="print")  # type: ignore[arg-type]
    limiter = ratequeue.Limiter("memory://", name=fresh(), interval=1.0, on_event=Recorder())
    copy = pickle.loads(pickle.dumps(limiter))
    assert copy._on_event is None


def test_kinds_are_listed_once() -> None:
    assert len(set(KINDS)) == len(KINDS) == 8


# --------------------------------------------------------------------------- queues and groups


def failing(n: int) -> None:
    raise ValueError(f"job {n} fails")


def test_a_failing_queue_job_reports_its_retry_then_its_dead_letter() -> None:
    hook = Recorder()
    queue = ratequeue.Queue(
        f"memory://{fresh()}",
        name=fresh(),
        interval=INTERVAL,
        retries=1,
        backoff=Backoff(base=0.01, jitter=False),
        on_event=hook,
    )
    future: Future[Any] = queue.add(failing, 7)
    with pytest.raises(ValueError, match="job 7 fails"):
        future.result(timeout=30)
    queue.close()
    [retry] = hook.of("retry")
    assert (retry.queue, retry.error, retry.attempt, retry.wait) == (queue.name, "ValueError", 1, 0.01)
    [dead] = hook.of("dead_letter")
    assert (dead.error, dead.attempt) == ("ValueError", 2)
    assert len(hook.of("start")) == 2, "each try takes a turn"


def test_a_group_reports_each_key_as_its_queue() -> None:
    hook = Recorder()
    group = ratequeue.LimiterGroup(f"memory://{fresh()}", name="customers", interval=INTERVAL, on_event=hook)
    group["acme"].acquire()
    group["globex"].acquire()
    group.close()
    assert [event.queue for event in hook.of("start")] == ["customers:acme", "customers:globex"]


def test_the_shard_counts_a_state_clock_that_steps_back() -> None:
    """A server's clock (no direct offset): an answer bounding the offset far above the best is a step."""
    from ratequeue.protocol import Wait

    shard = Shard(1.0)
    job = shard.add()
    assert isinstance(shard.step(job, 0.0), TakeAndTry)
    shard.receive(job, Wait(ticket=1, slot=1_200_000, now=1_000_000), 0.0, 0.001)
    assert shard.clock_steps == 0
    assert isinstance(shard.step(job, 0.2), TryStart)  # at its slot
    # 0.2 s later on this host, the state's clock says 0.1 s later: it stepped back by 0.1 s
    shard.receive(job, Wait(ticket=1, slot=1_200_000, now=1_100_000), 0.2, 0.201)
    assert shard.clock_steps == 1
    assert shard.clock_step == pytest.approx(0.1, abs=0.002)


# --------------------------------------------------------------------------- Prometheus


def samples(registry: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = prometheus_client.generate_latest(registry).decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_the_prometheus_exporter_counts_what_happened(tmp_path: Path) -> None:
    registry = prometheus_client.CollectorRegistry()
    metrics = PrometheusMetrics(registry)
    url = f"memory://{fresh()}"
    limiter = ratequeue.Limiter(url, name="api", interval=0.05, on_event=metrics)
    for _ in range(4):
        limiter.acquire()
    with pytest.raises(AcquireTimeout):
        limiter.acquire(timeout=0)
    limiter.close()
    queue = ratequeue.Queue(
        url, name="jobs", interval=INTERVAL, retries=2, backoff=Backoff(0.01, jitter=False)
    )
    queue._limiter._on_event = metrics  # (the same as on_event=: kept short here)
    with pytest.raises(ValueError, match="job 1 fails"):
        queue.add(failing, 1).result(timeout=30)
    queue.close()
    name = (tmp_path / "state.json").as_uri()
    broken = ratequeue.Limiter(name, name="disk", interval=INTERVAL, on_event=metrics)
    broken.acquire()
    Path(broken.state.record_files("disk")[0]).write_text("{")  # type: ignore[attr-defined]
    with pytest.raises(StateCorrupted):
        broken.acquire()
    broken.close()

    found = samples(registry)
    api, jobs = (("queue", "api"),), (("queue", "jobs"),)
    assert found["ratequeue_starts_total", api] == 4
    assert found["ratequeue_timeouts_total", api] == 1
    assert found["ratequeue_wait_seconds_count", api] == 4
    assert found["ratequeue_begin_lateness_seconds_count", api] == 4
    calls = found["ratequeue_state_call_seconds_count", (("operation", "take_and_try"), ("queue", "api"))]
    assert calls >= 4
    assert found["ratequeue_starts_total", jobs] == 3
    assert found["ratequeue_retries_total", jobs] == 2
    assert found["ratequeue_dead_letters_total", jobs] == 1
    key = (("error", "StateCorrupted"), ("operation", "take_and_try"), ("queue", "disk"))
    assert found["ratequeue_state_errors_total", key] == 1
    assert ("ratequeue_passed_tickets_total", api) not in found  # none happened: no series yet


def test_the_prometheus_exporter_can_label_a_group_by_its_name() -> None:
    registry = prometheus_client.CollectorRegistry()
    metrics = PrometheusMetrics(registry, namespace="app", queue_label=lambda name: name.split(":")[0])
    group = ratequeue.LimiterGroup(
        f"memory://{fresh()}", name="customers", interval=INTERVAL, on_event=metrics
    )
    for key in ("a", "b", "c"):
        group[key].acquire()
    group.close()
    assert samples(registry)["app_starts_total", (("queue", "customers"),)] == 3


def test_the_prometheus_exporter_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # as if it were not installed
    with pytest.raises(ConfigurationError, match=r"pip install 'ratequeue\[prometheus\]'"):
        PrometheusMetrics()


# --------------------------------------------------------------------------- asyncio


def test_aio_every_acquire_reports_one_start(url: str) -> None:
    hook = Recorder()

    async def main() -> list[ratequeue.Turn]:
        limiter = aio.Limiter(url, name=fresh(), interval=INTERVAL, on_event=hook)
        turns = await asyncio.gather(*(limiter.acquire() for _ in range(6)))
        await limiter.close()
        return list(turns)

    turns = asyncio.run(main())
    starts = hook.of("start")
    assert sorted(event.ticket or 0 for event in starts) == sorted(turn.ticket for turn in turns)
    assert len(starts) == 6
    assert all(event.wait is not None and event.wait >= 0 for event in starts)
    assert all(event.lateness is not None for event in starts)
    assert len(hook.of("call")) >= 6


def test_aio_timeout_and_a_raising_hook() -> None:
    seen: list[str] = []

    def broken(event: Event) -> None:
        seen.append(event.kind)
        raise RuntimeError("boom")

    async def main() -> int:
        limiter = aio.Limiter(f"memory://{fresh()}", name=fresh(), interval=60.0, on_event=broken)
        turn = await limiter.acquire()
        assert await limiter.try_acquire() is None
        with pytest.raises(AcquireTimeout):
            await limiter.acquire(timeout=0.05)
        await limiter.close()
        return turn.ticket

    assert asyncio.run(main()) == 1
    assert seen.count("start") == 1
    assert seen.count("timeout") == 1


def test_aio_a_reset_record_reports_the_held_ticket_passed(tmp_path: Path) -> None:
    url = (tmp_path / "state.json").as_uri()
    name = fresh()
    other = ratequeue.open_state(url)
    reset: list[bool] = []

    def reset_while_waiting(event: Event) -> None:
        if event.kind == "call" and event.outcome == "wait" and not reset:
            reset.append(other.reset(name))

    hook = Recorder(reset_while_waiting)

    async def main() -> int:
        limiter = aio.Limiter(url, name=name, interval=0.2, on_event=hook)
        await limiter.acquire()
        turn = await limiter.acquire()
        await limiter.close()
        return turn.ticket

    assert asyncio.run(main()) == 1
    other.close()
    assert [event.ticket for event in hook.of("passed")] == [2]


def test_aio_a_failing_queue_job_reports_its_retry_then_its_dead_letter() -> None:
    hook = Recorder()

    async def job() -> None:
        raise KeyError("gone")

    async def main() -> None:
        queue = aio.Queue(
            f"memory://{fresh()}",
            name=fresh(),
            interval=INTERVAL,
            retries=2,
            backoff=Backoff(base=0.01, jitter=False),
            on_event=hook,
        )
        with pytest.raises(KeyError):
            await queue.add(job)
        await queue.close()

    asyncio.run(main())
    assert [(event.attempt, event.error) for event in hook.of("retry")] == [(1, "KeyError"), (2, "KeyError")]
    assert [(event.attempt, event.error) for event in hook.of("dead_letter")] == [(3, "KeyError")]
    assert len(hook.of("start")) == 3
