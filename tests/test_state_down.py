"""``when_down``: what calls do while the state is down, on a real redis-server stopped mid-run (issue 27).

The server is this module's own (stopping the session's would fail other
tests). With ``"open"`` or a share, turns begin locally while it is down,
spaced on this host's clock, and once it answers again the limiter rejoins
without a burst: the first turn from the state comes at least an interval
after the last local one.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ratequeue import (
    AcquireTimeout,
    ConfigurationError,
    Event,
    Limiter,
    LimiterGroup,
    Queue,
    StateUnavailable,
    aio,
    all_of,
)
from ratequeue.core.operation import Operation
from ratequeue.core.protocol import Answer
from ratequeue.core.shard import Turn
from ratequeue.fallback import LOCAL_TICKET, PROBE_EVERY, PROBE_TASK
from ratequeue.running import runner_of
from ratequeue.state.base import Snapshot, ThreadedState
from ratequeue.state.memory import MemoryState

from . import servers

INTERVAL = 0.05
#: how long a test waits for the state to be found down (the client's retries: ~2.6 s) or back
LONG = 30.0
_names = itertools.count()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[servers.Server]:
    """A redis-server of this module's own, which its tests stop and start again."""
    yield from servers.redis_server(tmp_path_factory.mktemp("redis-down"))


@pytest.fixture
def url(server: servers.Server) -> Iterator[str]:
    """The server's URL, with it running at the start and at the end of the test."""
    if server.process is None:
        server.start()
    yield f"redis://127.0.0.1:{server.port}/0?prefix=down{next(_names)}:"
    if server.process is None:
        server.start()


def _spacing(when_down: Any) -> float:
    return INTERVAL if when_down == "open" else INTERVAL / when_down


@pytest.mark.parametrize("when_down", ["open", 0.5])
def test_turns_begin_locally_while_the_state_is_down_and_rejoin_without_a_burst(
    server: servers.Server, url: str, when_down: Any
) -> None:
    events: list[Event] = []
    limiter = Limiter(
        url,
        name="api",
        interval=INTERVAL,
        when_down=when_down,
        on_event=lambda event: events.append(event) if event.kind in ("state_down", "state_back") else None,
    )
    try:
        before = [limiter.acquire(LONG) for _ in range(3)]
        assert all(turn.ticket > 0 for turn in before)
        server.stop()
        local = [limiter.acquire(LONG) for _ in range(6)]
        assert [turn.ticket for turn in local] == [LOCAL_TICKET] * 6
        gaps = [b.local_start - a.local_start for a, b in itertools.pairwise(local)]
        assert min(gaps) >= _spacing(when_down) - 1e-6
        server.start()
        after: list[Turn] = []
        while not after or after[-1].ticket == LOCAL_TICKET:
            after.append(limiter.acquire(LONG))
            assert len(after) < LONG / _spacing(when_down), "the limiter never rejoined the state"
        last_local, first_back = [*local, *after][-2:]
        assert first_back.local_start - last_local.local_start >= INTERVAL - 1e-3
        again = [first_back, *(limiter.acquire(LONG) for _ in range(3))]
        assert all(turn.ticket > 0 for turn in again)
        assert min(b.start_us - a.start_us for a, b in itertools.pairwise(again)) >= INTERVAL * 1e6
    finally:
        limiter.close()
    mode = "open" if when_down == "open" else "local"
    assert [(event.kind, event.outcome) for event in events] == [("state_down", mode), ("state_back", mode)]
    assert (events[1].wait or 0) > 0


def test_raise_is_the_default(server: servers.Server, url: str) -> None:
    limiter = Limiter(url, name="api", interval=INTERVAL)
    try:
        limiter.acquire(LONG)
        server.stop()
        with pytest.raises(StateUnavailable):
            limiter.acquire(LONG)
    finally:
        limiter.close()


def test_while_down_a_turn_that_cannot_come_in_time_times_out_and_a_try_gets_none(
    server: servers.Server, url: str
) -> None:
    limiter = Limiter(url, name="api", interval=10.0, when_down=0.5)
    try:
        limiter.acquire(LONG)
        server.stop()
        first = limiter.acquire(LONG)  # found down: begins locally at once
        assert first.ticket == LOCAL_TICKET
        with pytest.raises(AcquireTimeout, match="the state is down"):
            limiter.acquire(0.5)  # the next local turn is 20 s away
        assert limiter.try_acquire() is None
    finally:
        limiter.close()


def test_a_queue_runs_its_jobs_while_the_state_is_down(server: servers.Server, url: str) -> None:
    with Queue(url, name="jobs", interval=INTERVAL, when_down="open") as queue:
        assert queue.add(lambda: "up").result(LONG) == "up"
        server.stop()
        futures = [queue.add(lambda n=n: n) for n in range(5)]
        assert [future.result(LONG) for future in futures] == list(range(5))


def test_an_asyncio_limiter_begins_locally_and_rejoins(server: servers.Server, url: str) -> None:
    async def main() -> tuple[list[Turn], list[Turn]]:
        limiter = aio.Limiter(url, name="api", interval=INTERVAL, when_down="open")
        try:
            await limiter.acquire(LONG)
            server.stop()
            local = [await limiter.acquire(LONG) for _ in range(4)]
            server.start()
            after = [await limiter.acquire(LONG)]
            while after[-1].ticket == LOCAL_TICKET:
                after.append(await limiter.acquire(LONG))
            return local, after
        finally:
            await limiter.close()

    local, after = asyncio.run(main())
    assert [turn.ticket for turn in local] == [LOCAL_TICKET] * 4
    assert after[-1].ticket > 0
    turns = [*local, *after]
    assert turns[-1].local_start - turns[-2].local_start >= INTERVAL - 1e-3


@pytest.mark.parametrize("value", ["down", "Raise", 0, 1, 1.5, -0.5, math.nan, True, None, "0.5"])
def test_a_bad_when_down_is_refused(tmp_path: Path, value: Any) -> None:
    with pytest.raises(ConfigurationError, match="when_down"):
        Limiter(f"file://{tmp_path}/s.json", name="api", interval=1, when_down=value)


def test_when_down_takes_no_max_running(tmp_path: Path) -> None:
    """A lease is held in the state: a cap cannot be kept while it is down."""
    with pytest.raises(ConfigurationError, match="max_running"):
        Limiter(f"file://{tmp_path}/s.json", name="api", interval=1, max_running=2, when_down="open")
    Limiter(f"file://{tmp_path}/s.json", name="api", interval=1, max_running=2, when_down="raise").close()


def test_all_of_takes_no_limiter_that_would_begin_locally(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/s.json"
    local = Limiter(url, name="a", interval=1, when_down="open")
    plain = Limiter(url, name="b", interval=1)
    with pytest.raises(ConfigurationError, match="when_down='raise' only"):
        all_of(plain, local)
    assert plain.status().next_ticket == 1  # nothing taken


def test_the_prometheus_gauge_says_while_the_state_is_down(server: servers.Server, url: str) -> None:
    from prometheus_client import CollectorRegistry

    from ratequeue.prometheus import PrometheusMetrics

    registry = CollectorRegistry()
    seen: list[float | None] = []
    metrics = PrometheusMetrics(registry=registry)

    def hook(event: Event) -> None:
        metrics(event)
        if event.kind in ("state_down", "state_back"):
            seen.append(registry.get_sample_value("ratequeue_state_down", {"queue": "api", "mode": "open"}))

    limiter = Limiter(url, name="api", interval=INTERVAL, when_down="open", on_event=hook)
    try:
        limiter.acquire(LONG)
        server.stop()
        assert limiter.acquire(LONG).ticket == LOCAL_TICKET
        server.start()
        while limiter.acquire(LONG).ticket == LOCAL_TICKET:
            pass
    finally:
        limiter.close()
    assert seen == [1.0, 0.0]


# ------------------------------------------------------------ an outage injected into a memory state


class DownState(MemoryState):
    """A memory state whose calls raise ``StateUnavailable`` while ``down`` is set (an injected outage)."""

    def __init__(self) -> None:
        super().__init__(private=True)
        self.down = False
        self.calls = 0

    def _execute(self, op: Operation) -> Answer:
        self.calls += 1
        if self.down:
            raise StateUnavailable("down (injected)")
        return super()._execute(op)

    def _read(self, name: str) -> Snapshot:
        self.calls += 1
        if self.down:
            raise StateUnavailable("down (injected)")
        return super()._read(name)


def _probes(name: str) -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == f"{PROBE_TASK}{name}"]


def test_a_try_while_down_takes_a_free_local_slot_and_only_that() -> None:
    state, now = DownState(), [100.0]
    limiter = Limiter(state, name="try", interval=0.05, when_down="open", clock=lambda: now[0])
    try:
        limiter.acquire()
        state.down = True
        first = limiter.acquire(0)  # found down: begins locally at once
        assert first.ticket == LOCAL_TICKET
        assert limiter.try_acquire() is None  # the next local slot is 50 ms away
        now[0] += 0.05
        second = limiter.try_acquire()
        assert second is not None
        assert second.local_start == pytest.approx(first.local_start + 0.05)
    finally:
        limiter.close()


def test_a_closed_limiter_neither_probes_nor_rejoins() -> None:
    """Closed while its state is down, it takes no turn when the state comes back."""
    state = DownState()
    limiter = Limiter(state, name="closed", interval=0.01, burst=5, when_down="open")
    limiter.acquire()
    before = state.read("closed").record
    state.down = True
    assert limiter.acquire().ticket == LOCAL_TICKET
    probes = _probes("closed")
    assert len(probes) == 1
    limiter.close()
    probes[0].join(PROBE_EVERY + LONG)
    assert not probes[0].is_alive()
    state.down = False  # back, after the close: nothing of the limiter is left to take a turn
    assert state.read("closed").record == before  # no rejoin turn of the burst


def test_an_asyncio_limiter_closes_while_its_state_is_down() -> None:
    async def main() -> list[str]:
        state = DownState()
        limiter = aio.Limiter(ThreadedState(state), name="aclosed", interval=0.05, when_down="open")
        await limiter.acquire()
        state.down = True
        assert (await limiter.acquire()).ticket == LOCAL_TICKET
        await limiter.close()  # cancels its probe: no CancelledError comes out of it
        driver = runner_of(limiter).driver
        return [task.get_name() for task in driver.tasks if not task.done()]  # type: ignore[attr-defined]

    assert asyncio.run(main()) == []


def test_a_reservation_cancelled_while_down_gives_its_slot_back() -> None:
    state = DownState()
    limiter = Limiter(state, name="cancel", interval=0.2, when_down="open")
    try:
        limiter.acquire()
        state.down = True
        first = limiter.acquire()
        reservation = limiter.reserve()
        waited: list[Turn | None] = []
        waiter = threading.Thread(target=lambda: waited.append(reservation.wait(LONG)))
        waiter.start()
        driver = runner_of(limiter).driver
        deadline = time.monotonic() + LONG
        while driver.waiters == 0 and time.monotonic() < deadline:  # until the waiter waits for its slot
            time.sleep(0.001)
        reservation.cancel()
        waiter.join(LONG)
        assert waited == [None]
        assert reservation.turn is None
        again = limiter.acquire(LONG)
        assert again.local_start == pytest.approx(first.local_start + 0.2)  # the slot it gave back
    finally:
        limiter.close()


def test_a_group_keeps_the_limiter_of_a_key_whose_state_is_down_and_stops_it_on_close() -> None:
    state = DownState()
    group = LimiterGroup(state, name="g", interval=0.01, when_down="open", max_keys=1)
    group["a"].acquire()
    state.down = True
    down = group["a"]
    assert down.acquire().ticket == LOCAL_TICKET
    group["b"]  # beyond max_keys: "a" would be dropped if it were idle, and a second probe start
    assert group["a"] is down
    probes = _probes("g:a")
    assert len(probes) == 1
    group.close()
    probes[0].join(PROBE_EVERY + LONG)
    assert not probes[0].is_alive()


def test_the_gauge_stays_up_while_any_limiter_of_the_queue_is_down() -> None:
    from prometheus_client import CollectorRegistry

    from ratequeue.prometheus import PrometheusMetrics

    registry = CollectorRegistry()
    metrics = PrometheusMetrics(registry=registry)
    seen = []
    for kind in ("state_down", "state_down", "state_back", "state_back"):
        metrics(Event(kind, "api", outcome="local"))  # type: ignore[arg-type]
        seen.append(registry.get_sample_value("ratequeue_state_down", {"queue": "api", "mode": "local"}))
    assert seen == [1.0, 1.0, 1.0, 0.0]


def test_the_keys_of_a_group_share_one_probe_and_all_rejoin() -> None:
    """A group's keys share one state: while it is down one thread reads it, not one per key."""
    state = DownState()
    group = LimiterGroup(state, name="many", interval=0.01, when_down="open")
    keys = "abcde"
    for key in keys:
        group[key].acquire()
    state.down = True
    for key in keys:
        assert group[key].acquire().ticket == LOCAL_TICKET
    probes = [thread for thread in threading.enumerate() if thread.name.startswith(f"{PROBE_TASK}many:")]
    assert len(probes) == 1
    state.down = False
    try:
        for key in keys:
            for _ in range(int(LONG / 0.01)):  # local turns until this key has rejoined
                turn = group[key].acquire(LONG)
                if turn.ticket != LOCAL_TICKET:
                    break
            assert turn.ticket > 0, f"key {key!r} never rejoined the state"
    finally:
        group.close()
    probes[0].join(LONG)
    assert not probes[0].is_alive()
