"""The ``on_event`` hook: what limiters, queues and groups report, how it is delivered, and Prometheus.

Real states (memory and file, which need no server), real threads and
tasks. The events that need a fault are provoked for real, from inside a
state call (the hook runs later, in the reporter thread, so it cannot
provoke them in time): a record reset from another state object (a lost
ticket), a record file overwritten (a state error), a job that raises
(retries), a clock shifted forward when a turn is granted (a late wake-up,
as a process descheduled at that moment sees it).

Lateness is real on a busy host: where it is not under test a limiter has
``max_late=None``; where it is, real late wake-ups may add events, so the
tests look for the events they caused among the others.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import os
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
from ratequeue import AcquireTimeout, Backoff, ConfigurationError, Event, StateCorrupted, aio, events
from ratequeue.core.flow import Flow
from ratequeue.core.operation import Operation
from ratequeue.core.protocol import Started, Wait
from ratequeue.events import KINDS, flush
from ratequeue.running import runner_of
from ratequeue.state.memory import MemoryState

from ._far import FarMemory
from .ops import is_step, make_shard

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from ratequeue.prometheus import PrometheusMetrics  # noqa: E402

INTERVAL = 0.01
#: how long a test waits at most for what should take milliseconds
LONG = 10.0


class Recorder:
    """An ``on_event`` hook that keeps every event (list.append is atomic: threads may share it)."""

    def __init__(self, then: Callable[[Event], object] | None = None) -> None:
        self.events: list[Event] = []
        self.threads: set[str] = set()
        self._then = then

    def __call__(self, event: Event) -> None:
        self.events.append(event)
        self.threads.add(threading.current_thread().name)
        if self._then is not None:
            self._then(event)

    def of(self, kind: str) -> list[Event]:
        return [event for event in self.events if event.kind == kind]


def fresh(prefix: str = "events") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def test_a_first_slow_answer_checked_before_its_start_is_not_reported_late() -> None:
    """A start 50 ms ahead, granted by a process's first answer (20 ms round-trip): the limiter
    asks again at once to check its conversion. That is no late wake-up: no ``late`` event says
    so (it did, with a negative lateness), and the job begins."""
    store, name = fresh(), fresh()
    # max_late=None (the setup's turn only): a late wake-up under load would give ticket 1 up
    with ratequeue.Limiter(MemoryState(store), name=name, interval=0.05, max_late=None) as first:
        assert first.ticket == 1
    hook = Recorder()
    far = ratequeue.Limiter(
        FarMemory(store), name=name, interval=0.05, lead=0.06, max_late=0.005, on_event=hook
    )
    turn = far.acquire(timeout=LONG)
    far.close()
    late = hook.of("late")
    assert all(event.lateness is not None and event.lateness > 0.005 for event in late), late
    [start] = hook.of("begin")
    assert start.ticket == turn.ticket


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


def after_answers(state: Any, then: Callable[[object], object]) -> None:
    """Have ``state`` call ``then(answer)`` in the caller's thread after each start, try and re-time.

    Runs where the limiter waits for the state's answer, holding no lock
    -- where a hook ran before hooks were delivered off the acquire path.
    Works on thread and asyncio states alike.
    """
    original = state.execute
    tries = ("take_and_try", "try_start", "retime")
    if inspect.iscoroutinefunction(original):

        async def wrapper_async(op: Operation) -> Any:
            answer = await original(op)
            if op.kind in tries:
                then(answer)
            return answer

        state.execute = wrapper_async
    else:

        def wrapper(op: Operation) -> Any:
            answer = original(op)
            if op.kind in tries:
                then(answer)
            return answer

        state.execute = wrapper


def subsequence(wanted: list[str], found: list[str]) -> bool:
    """Whether ``wanted`` appears in ``found`` in order, other items allowed between."""
    rest = iter(found)
    return all(item in rest for item in wanted)


# --------------------------------------------------------------------------- the limiter's events


def test_every_acquire_reports_one_start_with_its_wait_and_lateness(url: str) -> None:
    hook = Recorder()
    limiter = ratequeue.Limiter(url, name=fresh(), interval=INTERVAL, max_late=None, on_event=hook)
    turns: list[ratequeue.Turn] = []

    def worker() -> None:
        for _ in range(5):
            turns.append(limiter.acquire())

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    limiter.close()  # delivers the events reported so far

    starts = hook.of("begin")
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
    assert hook.threads == {"ratequeue-events"}, "every event is delivered by the reporter thread"


def test_a_timeout_is_reported_and_a_try_acquire_without_a_turn_is_not(url: str) -> None:
    hook = Recorder()
    limiter = ratequeue.Limiter(url, name=fresh(), interval=60.0, max_late=None, on_event=hook)
    limiter.acquire()
    assert limiter.try_acquire() is None
    assert flush(LONG)
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

    def reset_while_waiting(answer: object) -> None:
        if isinstance(answer, Wait) and not reset:
            reset.append(other.reset(name))  # the shard holds ticket 2, not started

    hook = Recorder()
    limiter = ratequeue.Limiter(url, name=name, interval=0.2, max_late=None, on_event=hook)
    after_answers(limiter.state, reset_while_waiting)
    assert limiter.acquire().ticket == 1
    turn = limiter.acquire()
    limiter.close()
    other.close()

    assert reset == [True]
    [passed] = hook.of("passed")
    assert (passed.queue, passed.ticket) == (name, 2)
    # without the lateness check no turn is given up: the fresh record's first ticket begins
    assert turn.ticket == 1, "the caller took a new ticket of the fresh record"
    assert [event.ticket for event in hook.of("begin")] == [1, 1]


def test_late_wake_ups_are_reported_moved_then_given_up() -> None:
    """Three wake-ups 30 ms late: later than any move of a start reaches ahead, even on a busy host."""
    clock = ShiftedClock()
    late = [3]  # the next three answers that start a turn (a grant, two moves) are each woken late
    woken_late = [False]

    def wake_late(answer: object) -> None:
        if isinstance(answer, Started) and late[0]:
            late[0] -= 1
            woken_late[0] = True

    hook = Recorder()
    limiter = ratequeue.Limiter(f"memory://{fresh()}", name=fresh(), interval=0.1, clock=clock, on_event=hook)
    after_answers(limiter.state, wake_late)
    runner = runner_of(limiter)
    call_flow = runner.call_flow

    def answered_then_late(op: Operation, lost: Any = None) -> Flow[Any]:
        """The answer is read; the process resumes 30 ms later, past max_late."""
        timed = yield from call_flow(op, lost)
        if woken_late[0]:
            woken_late[0] = False
            clock.shift += 0.03
        return timed

    runner.call_flow = answered_then_late  # type: ignore[method-assign]
    turn = limiter.acquire()
    limiter.close()

    late_events = hook.of("late")
    # a real late wake-up of this busy host may add a move or a turn given up: look for ours
    outcomes = [event.outcome or "" for event in late_events]
    assert subsequence(["moved", "moved", "given_up"], outcomes), outcomes
    assert all(event.lateness is not None and event.lateness > 0 for event in late_events)
    assert sum(event.lateness is not None and event.lateness > 0.0003 for event in late_events) >= 3
    given_up = [event.ticket or 0 for event in late_events if event.outcome == "given_up"]
    [start] = hook.of("begin")
    assert start.ticket == turn.ticket
    assert turn.ticket > max(given_up), "the turn given up was replaced by a new ticket"
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


class Stop(BaseException):
    """Not an ``Exception``: the reporter thread logs it too, and goes on."""


def test_a_hook_that_raises_does_not_break_acquire() -> None:
    calls: list[str] = []

    def broken(event: Event) -> None:
        calls.append(event.kind)
        if len(calls) % 2:
            raise RuntimeError("the metrics backend is down")
        raise Stop

    limiter = ratequeue.Limiter(
        f"memory://{fresh()}", name=fresh(), interval=INTERVAL, max_late=None, on_event=broken
    )
    tickets = [limiter.acquire().ticket for _ in range(3)]
    limiter.close()
    assert tickets == [1, 2, 3]
    assert calls.count("begin") == 3


def test_on_event_must_be_callable_and_is_not_pickled() -> None:
    with pytest.raises(ConfigurationError, match="on_event"):
        ratequeue.Limiter("memory://", name="x", interval=1.0, on_event="print")  # type: ignore[arg-type]
    limiter = ratequeue.Limiter("memory://", name=fresh(), interval=1.0, on_event=Recorder())
    copy = pickle.loads(pickle.dumps(limiter))
    assert not runner_of(copy).reporter.on


def test_a_coroutine_function_hook_is_refused() -> None:
    async def hook(event: Event) -> None:
        pass

    class AsyncHook:
        async def __call__(self, event: Event) -> None:
            pass

    for bad in (hook, AsyncHook(), functools.partial(hook)):
        with pytest.raises(ConfigurationError, match="coroutine function"):
            ratequeue.Limiter("memory://", name=fresh(), interval=1.0, on_event=bad)
        with pytest.raises(ConfigurationError, match="coroutine function"):
            aio.Limiter("memory://", name=fresh(), interval=1.0, on_event=bad)


def test_kinds_are_listed_once_and_an_event_is_immutable() -> None:
    assert len(set(KINDS)) == len(KINDS) == 12
    event = Event("begin", "q", ticket=3, wait=0.5)
    assert (event.kind, event.queue, event.ticket, event.wait, event.lateness) == ("begin", "q", 3, 0.5, None)
    with pytest.raises(AttributeError):
        event.kind = "timeout"  # type: ignore[misc]


# --------------------------------------------------------------------------- delivery, off the acquire path


def test_a_blocked_hook_does_not_hold_up_acquire() -> None:
    """The hook runs in the reporter thread: acquires go on while it is stuck, and get there in order."""
    gate = threading.Event()
    hook = Recorder(lambda event: gate.wait(LONG))
    limiter = ratequeue.Limiter(
        f"memory://{fresh()}", name=fresh(), interval=0.001, max_late=None, on_event=hook
    )
    began = time.monotonic()
    tickets = [limiter.acquire(timeout=LONG).ticket for _ in range(5)]
    assert time.monotonic() - began < LONG / 2, "no acquire waited for the hook"
    assert len(hook.events) <= 1, "the hook is stuck on its first event"
    assert not flush(0.05), "the events are not delivered yet"
    gate.set()
    assert flush(LONG)
    limiter.close()
    assert [event.ticket for event in hook.of("begin")] == tickets == [1, 2, 3, 4, 5]


def test_a_hook_may_call_its_limiter() -> None:
    """No deadlock: the hook holds none of the limiter's locks, and no acquire waits for it."""
    statuses: list[ratequeue.Status] = []
    taken: list[ratequeue.Turn] = []
    nested: list[bool] = []

    def hook(event: Event) -> None:
        if event.kind == "begin":
            statuses.append(limiter.status())
            if not taken:
                taken.append(limiter.acquire(timeout=LONG))  # a turn taken from the hook itself
            nested.append(flush(LONG))  # the reporter cannot wait for itself: False at once

    limiter = ratequeue.Limiter(
        f"memory://{fresh()}", name=fresh(), interval=0.002, max_late=None, on_event=hook
    )
    threads = [threading.Thread(target=lambda: [limiter.acquire() for _ in range(5)]) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(LONG)
    assert not any(thread.is_alive() for thread in threads)
    assert flush(LONG)
    limiter.close()
    assert len(statuses) == 16, "15 acquires in threads and the hook's own"
    assert len(taken) == 1
    assert nested == [False] * 16


def test_an_interrupted_begin_gives_its_place_back() -> None:
    """A KeyboardInterrupt between a turn's grant and its return ends its lease (max_running)."""
    limiter = ratequeue.Limiter(
        f"memory://{fresh()}",
        name=fresh(),
        interval=0.001,
        max_running=1,
        lease=LONG,
        max_late=None,
        on_event=Recorder(),
    )
    reporter = runner_of(limiter).reporter
    report_begin = reporter.begin
    interrupted: list[int] = []

    def interrupt_once(turn: ratequeue.Turn, now: float, since: float, tenant: str | None = None) -> None:
        if not interrupted:
            interrupted.append(turn.ticket)
            raise KeyboardInterrupt
        report_begin(turn, now, since, tenant)

    reporter.begin = interrupt_once  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        limiter.acquire()
    began = time.monotonic()
    turn = limiter.acquire(timeout=LONG / 2)  # the place is free again: not after a lease's expiry
    assert time.monotonic() - began < LONG / 2
    limiter.release(turn)
    limiter.close()
    assert interrupted == [1]


def test_a_hook_raising_keyboard_interrupt_on_start_takes_no_place(caplog: pytest.LogCaptureFixture) -> None:
    """It ends the reporter thread (logged), never a caller's acquire; the next event starts a new one."""
    starts: list[int] = []

    def hook(event: Event) -> None:
        if event.kind == "begin":
            starts.append(event.ticket or 0)
            if len(starts) == 1:
                raise KeyboardInterrupt

    caplog.set_level(logging.WARNING, logger="ratequeue.events")
    limiter = ratequeue.Limiter(
        f"memory://{fresh()}",
        name=fresh(),
        interval=0.001,
        max_running=1,
        lease=LONG,
        max_late=None,
        on_event=hook,
    )
    first = limiter.acquire()
    assert flush(LONG)
    limiter.release(first)
    began = time.monotonic()
    second = limiter.acquire(timeout=LONG / 2)
    assert time.monotonic() - began < LONG / 2
    limiter.release(second)
    limiter.close()
    assert starts == [1, 2], "the reporter delivers again after the interrupt"
    assert any("KeyboardInterrupt" in record.getMessage() for record in caplog.records)


def test_a_reservation_waited_for_twice_begins_once() -> None:
    hook = Recorder()
    limiter = ratequeue.Limiter(
        f"memory://{fresh()}",
        name=fresh(),
        interval=0.001,
        max_running=1,
        lease=LONG,
        max_late=None,
        on_event=hook,
    )
    reservation = limiter.reserve()
    turn = reservation.wait(timeout=LONG)
    assert turn is not None
    assert limiter.release(turn)
    assert reservation.wait(timeout=LONG) is turn, "the same turn, not begun again"
    leases = runner_of(limiter).leases
    assert leases is not None
    assert len(leases.book) == 0, "no lease held again for a job that has ended"
    limiter.acquire(timeout=LONG / 2)  # the only place is free
    limiter.close()
    assert [event.ticket for event in hook.of("begin")] == [1, 2]


def test_all_of_reports_one_start_per_limiter_when_the_job_begins() -> None:
    """The turns are taken one by one and moved: each limiter reports its start once, at the begin."""
    store = f"memory://{fresh()}"
    hooks = Recorder(), Recorder()
    scarce = ratequeue.Limiter(store, name=fresh(), interval=0.5, max_late=None, on_event=hooks[0])
    busy = ratequeue.Limiter(store, name=fresh(), interval=0.2, max_late=None, on_event=hooks[1])
    busy.acquire()  # the next turn of ``busy`` comes 0.2 s from now; ``scarce`` is free at once
    called = time.monotonic()
    turns = ratequeue.all_of(scarce, busy, timeout=LONG)
    begun = time.monotonic()
    scarce.close()
    busy.close()

    [start] = hooks[0].of("begin")
    assert start.ticket == turns[0].ticket
    assert start.wait is not None
    assert start.lateness is not None
    # its wait counts from the all_of() call to the begin, not to the grant of its own turn
    assert 0.1 < start.wait <= begun - called
    assert start.lateness >= 0
    first, second = hooks[1].of("begin")
    assert (first.ticket, second.ticket) == (1, turns[1].ticket)
    assert second.wait is not None
    assert second.wait > 0.1


def test_all_of_from_threads_reports_as_many_starts_as_begins() -> None:
    store = f"memory://{fresh()}"
    hook = Recorder()
    slow = ratequeue.Limiter(store, name=fresh(), interval=0.02, on_event=hook)
    fast = ratequeue.Limiter(store, name=fresh(), interval=0.005, on_event=hook)
    results: list[list[ratequeue.Turn]] = []

    def worker() -> None:
        for _ in range(3):
            results.append(ratequeue.all_of(slow, fast, timeout=LONG))

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    slow.close()
    fast.close()
    for limiter, index in ((slow, 0), (fast, 1)):
        starts = [event for event in hook.of("begin") if event.queue == limiter.name]
        assert sorted(event.ticket or 0 for event in starts) == sorted(
            turns[index].ticket for turns in results
        )


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
    assert len(hook.of("begin")) == 2, "each try takes a turn"


def test_a_group_reports_each_key_as_its_queue() -> None:
    hook = Recorder()
    group = ratequeue.LimiterGroup(f"memory://{fresh()}", name="customers", interval=INTERVAL, on_event=hook)
    group["acme"].acquire()
    group["globex"].acquire()
    group.close()
    assert flush(LONG)  # a group's close() leaves its keys' events to come
    assert [event.queue for event in hook.of("begin")] == ["customers:acme", "customers:globex"]


def test_the_shard_counts_a_state_clock_that_steps_back() -> None:
    """A server's clock (no direct offset): an answer bounding the offset far above the best is a step."""
    shard = make_shard(1.0)
    job = shard.add()
    assert is_step(shard.step(job, 0.0), "take_and_try")
    shard.receive(job, Wait(ticket=1, slot=1_200_000, now=1_000_000), 0.0, 0.001)
    assert shard.estimator.steps == 0
    assert is_step(shard.step(job, 0.2), "try_start")  # at its slot
    # 0.2 s later on this host, the state's clock says 0.1 s later: it stepped back by 0.1 s
    shard.receive(job, Wait(ticket=1, slot=1_200_000, now=1_100_000), 0.2, 0.201)
    assert shard.estimator.steps == 1
    assert shard.estimator.step == pytest.approx(0.1, abs=0.002)


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
    limiter = ratequeue.Limiter(url, name="api", interval=0.05, max_late=None, on_event=metrics)
    for _ in range(4):
        limiter.acquire()
    with pytest.raises(AcquireTimeout):
        limiter.acquire(timeout=0)
    limiter.heed({"Retry-After": "0.01"}, status=429)
    limiter.hold(0.02)
    limiter.close()
    queue = ratequeue.Queue(
        url,
        name="jobs",
        interval=INTERVAL,
        retries=2,
        backoff=Backoff(0.01, jitter=False),
        on_event=metrics,
    )
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
    assert found["ratequeue_begins_total", api] == 4
    assert found["ratequeue_timeouts_total", api] == 1
    assert found["ratequeue_acquire_wait_seconds_count", api] == 4
    assert found["ratequeue_begin_lateness_seconds_count", api] == 4
    key = (("operation", "take_and_try"), ("queue", "api"))
    calls = found["ratequeue_state_call_duration_seconds_count", key]
    assert calls >= 4
    assert found["ratequeue_begins_total", jobs] == 3
    assert found["ratequeue_retries_total", jobs] == 2
    assert found["ratequeue_dead_letters_total", jobs] == 1
    key = (("error", "StateCorrupted"), ("operation", "take_and_try"), ("queue", "disk"))
    assert found["ratequeue_state_errors_total", key] == 1
    assert found["ratequeue_holds_total", (("cause", "429"), ("queue", "api"))] == 1
    assert found["ratequeue_holds_total", (("cause", "call"), ("queue", "api"))] == 1
    assert ("ratequeue_passed_tickets_total", api) not in found  # none happened: no series yet


def test_a_second_exporter_on_one_registry_is_refused() -> None:
    registry = prometheus_client.CollectorRegistry()
    metrics = PrometheusMetrics(registry)
    with pytest.raises(ConfigurationError, match="one PrometheusMetrics per registry"):
        PrometheusMetrics(registry)
    PrometheusMetrics(registry, namespace="other")  # another namespace is other metrics
    limiter = ratequeue.Limiter(f"memory://{fresh()}", name="api", interval=INTERVAL, on_event=metrics)
    limiter.acquire()
    limiter.close()
    assert samples(registry)["ratequeue_begins_total", (("queue", "api"),)] == 1, "the first one still counts"


def test_the_prometheus_exporter_counts_late_wakeups_by_outcome() -> None:
    registry = prometheus_client.CollectorRegistry()
    metrics = PrometheusMetrics(registry)
    metrics(Event("late", "api", ticket=1, lateness=0.004, outcome="moved"))
    metrics(Event("late", "api", ticket=1, lateness=0.004, outcome="given_up"))
    found = samples(registry)
    for outcome in ("moved", "given_up"):
        assert found["ratequeue_late_wakeups_total", (("outcome", outcome), ("queue", "api"))] == 1


def test_a_late_send_is_counted_as_a_late_wakeup_sent() -> None:
    """``Limiter.sent`` of a send later than ``max_late`` reaches the exporter as ``outcome="sent"``."""
    registry = prometheus_client.CollectorRegistry()
    metrics = PrometheusMetrics(registry)
    limiter = ratequeue.Limiter(MemoryState(private=True), name="api", interval=0.2, on_event=metrics)
    try:
        turn = limiter.acquire()
        assert limiter.sent(turn) is False  # in time: nothing counted
        assert limiter.sent(turn._replace(local_start=turn.local_start - 0.05)) is True  # sent 50 ms late
        flush()
    finally:
        limiter.close()
    found = samples(registry)
    assert found["ratequeue_late_wakeups_total", (("outcome", "sent"), ("queue", "api"))] == 1


def test_the_prometheus_exporter_can_label_a_group_by_its_name() -> None:
    registry = prometheus_client.CollectorRegistry()
    metrics = PrometheusMetrics(registry, namespace="app", queue_label=lambda name: name.split(":")[0])
    group = ratequeue.LimiterGroup(
        f"memory://{fresh()}", name="customers", interval=INTERVAL, on_event=metrics
    )
    for key in ("a", "b", "c"):
        group[key].acquire()
    group.close()
    assert flush(LONG)  # a group's close() leaves its keys' events to come
    assert samples(registry)["app_begins_total", (("queue", "customers"),)] == 3


def test_the_prometheus_exporter_counts_a_fair_queues_tenants_only_when_told_how_to_label_them() -> None:
    registry = prometheus_client.CollectorRegistry()
    by_tenant = PrometheusMetrics(registry, tenant_label=lambda name: name if name == "acme" else "other")
    plain_registry = prometheus_client.CollectorRegistry()
    plain = PrometheusMetrics(plain_registry)
    url = f"memory://{fresh()}"
    for hook in (by_tenant, plain):
        limiter = ratequeue.Limiter(url, name=f"fair-{id(hook)}", interval=10.0, fair=True, on_event=hook)
        try:
            limiter.acquire(tenant="acme")
            with pytest.raises(ratequeue.AcquireTimeout):
                limiter.acquire(timeout=0.01, tenant="globex")  # the next turn is 10 s away
            with pytest.raises(ratequeue.AcquireTimeout):
                limiter.acquire(timeout=0.01, tenant="initech")
        finally:
            limiter.close()
    assert flush(LONG)
    found = samples(registry)
    queue = ("queue", f"fair-{id(by_tenant)}")
    assert found["ratequeue_tenant_begins_total", (queue, ("tenant", "acme"))] == 1
    assert found["ratequeue_tenant_timeouts_total", (queue, ("tenant", "other"))] == 2, "folded as told"
    assert found["ratequeue_tenant_acquire_wait_seconds_count", (queue, ("tenant", "acme"))] == 1
    assert found["ratequeue_begins_total", (queue,)] == 1
    assert not [key for key in samples(plain_registry) if "tenant" in key[0]], "no series per tenant unasked"
    with pytest.raises(ConfigurationError, match="tenant_label must be None or a callable"):
        PrometheusMetrics(prometheus_client.CollectorRegistry(), tenant_label="tenant")  # type: ignore[arg-type]


def test_the_prometheus_exporter_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # as if it were not installed
    with pytest.raises(ConfigurationError, match=r"pip install 'ratequeue\[prometheus\]'"):
        PrometheusMetrics()


# --------------------------------------------------------------------------- asyncio


def test_aio_every_acquire_reports_one_start(url: str) -> None:
    hook = Recorder()

    async def main() -> list[ratequeue.Turn]:
        limiter = aio.Limiter(url, name=fresh(), interval=INTERVAL, max_late=None, on_event=hook)
        turns = await asyncio.gather(*(limiter.acquire() for _ in range(6)))
        await limiter.close()
        return list(turns)

    turns = asyncio.run(main())
    starts = hook.of("begin")
    assert sorted(event.ticket or 0 for event in starts) == sorted(turn.ticket for turn in turns)
    assert len(starts) == 6
    assert all(event.wait is not None and event.wait >= 0 for event in starts)
    assert all(event.lateness is not None for event in starts)
    assert len(hook.of("call")) >= 6
    assert hook.threads == {"MainThread"}, "on the event loop's thread"
    assert all(isinstance(event, aio.Event) for event in starts), "ratequeue.aio names the event type too"


def test_aio_the_hook_runs_on_the_loop_after_the_task_yields() -> None:
    tasks: list[object] = []
    hook = Recorder(lambda event: tasks.append(asyncio.current_task()))

    async def main() -> None:
        limiter = aio.Limiter(f"memory://{fresh()}", name=fresh(), interval=INTERVAL, on_event=hook)
        await limiter.acquire()
        assert not hook.of("begin"), "not called during the acquire"
        await asyncio.sleep(0)  # lets the events reported so far reach the hook
        assert len(hook.of("begin")) == 1
        await limiter.close()

    asyncio.run(main())
    assert tasks
    assert all(task is None for task in tasks), "called by the loop (call_soon), outside any task"


def test_aio_timeout_and_a_raising_hook() -> None:
    seen: list[str] = []

    def broken(event: Event) -> None:
        seen.append(event.kind)
        raise RuntimeError("boom")

    async def main() -> int:
        limiter = aio.Limiter(
            f"memory://{fresh()}", name=fresh(), interval=60.0, max_late=None, on_event=broken
        )
        turn = await limiter.acquire()
        assert await limiter.try_acquire() is None
        with pytest.raises(AcquireTimeout):
            await limiter.acquire(timeout=0.05)
        await limiter.close()
        return turn.ticket

    assert asyncio.run(main()) == 1
    assert seen.count("begin") == 1
    assert seen.count("timeout") == 1


def test_aio_a_reset_record_reports_the_held_ticket_passed(tmp_path: Path) -> None:
    url = (tmp_path / "state.json").as_uri()
    name = fresh()
    other = ratequeue.open_state(url)
    reset: list[bool] = []

    def reset_while_waiting(answer: object) -> None:
        if isinstance(answer, Wait) and not reset:
            reset.append(other.reset(name))

    hook = Recorder()

    async def main() -> int:
        limiter = aio.Limiter(url, name=name, interval=0.2, max_late=None, on_event=hook)
        after_answers(limiter.state, reset_while_waiting)
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
    assert len(hook.of("begin")) == 3


# --------------------------------------------------------------------------- a slow hook: a bounded backlog


class Blocked:
    """A hook that holds the reporter thread in its first call until released; records the rest."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.tickets: list[int | None] = []

    def __call__(self, event: Event) -> None:
        self.entered.set()
        assert self.release.wait(LONG), "released"
        self.tickets.append(event.ticket)


def test_a_slow_hook_drops_the_newest_events_past_the_bound_and_counts_them(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 27, item 12a: 30k acquires beside a 0.5 ms hook left 59,000 events (14 MB) waiting."""
    assert flush(LONG), "no other test's events wait"
    monkeypatch.setattr(events, "_warned_at", None)  # (another test may have warned within the minute)
    hook = Blocked()
    outlet = events.Outlet(hook, "a slow hook")
    excess = 500
    dropped = events.dropped()
    events.report(outlet, Event("begin", "slow", ticket=0))
    try:
        assert hook.entered.wait(LONG), "the reporter thread is in the hook, held there"
        with caplog.at_level(logging.WARNING, logger="ratequeue.events"):
            for ticket in range(1, events.MAX_PENDING_EVENTS + excess + 1):
                events.report(outlet, Event("begin", "slow", ticket=ticket))
                assert events._pending.qsize() <= events.MAX_PENDING_EVENTS, "the backlog stays bounded"
    finally:
        hook.release.set()  # (a failure here must not hold the reporter thread for the next tests)
    assert events.dropped() - dropped == excess, "every event past the bound is counted, exactly"
    warnings = [record for record in caplog.records if "on_event events dropped" in record.getMessage()]
    assert len(warnings) == 1, "one WARNING, not one per event"
    assert warnings[0].levelno == logging.WARNING
    assert flush(LONG)
    # the events kept, in the order reported: the one in the hook, then the first that fitted
    assert hook.tickets == list(range(events.MAX_PENDING_EVENTS + 1))


def test_the_prometheus_exporter_exports_the_events_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    registry = prometheus_client.CollectorRegistry()
    PrometheusMetrics(registry)
    assert flush(LONG)
    monkeypatch.setattr(events, "MAX_PENDING_EVENTS", 0)  # every event is dropped: none waits
    before = events.dropped()
    assert registry.get_sample_value("ratequeue_events_dropped_total") == before
    outlet = events.Outlet(lambda event: None, "a hook")
    for _ in range(7):
        events.report(outlet, Event("begin", "q", ticket=1))
    assert events.dropped() == before + 7
    assert registry.get_sample_value("ratequeue_events_dropped_total") == before + 7


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork")
def test_a_forked_child_counts_its_own_drops_from_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(events, "MAX_PENDING_EVENTS", 0)
    events.report(events.Outlet(lambda event: None, "a hook"), Event("begin", "q", ticket=1))
    assert events.dropped() >= 1
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what it counts, and leave at once (no pytest teardown here)
        try:
            os.write(write, str(events.dropped()).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        counted = pipe.read()
    os.waitpid(pid, 0)
    assert counted == "0", "the child starts its count afresh"
