"""Logging: quiet in a normal run, DEBUG per state call when asked, a WARNING for what needs an operator.

Every logger is a child of ``ratequeue``. The faults that warn are made
for real: a record reset by another state object (a lost ticket), a clock
shifted forward between two answers (a clock step, and a wake-up too late
to begin), a hook that raises, a corrupted record under a queue, and a Redis
connection killed by the server (a retried call).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

import ratequeue
from ratequeue import Event, StateCorrupted, aio
from ratequeue.state.redis import RedisState

from .servers import Server

INTERVAL = 0.01


def fresh(prefix: str = "logs") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


@pytest.fixture(params=["memory", "file"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "memory":
        return f"memory://{fresh()}"
    return (tmp_path / "state.json").as_uri()


class ShiftedClock:
    """``time.monotonic`` plus a shift the test moves forward (a late wake-up, a clock step)."""

    def __init__(self) -> None:
        self.shift = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.shift


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [record for record in caplog.records if record.levelno >= logging.WARNING]


def test_every_logger_is_under_ratequeue() -> None:
    import ratequeue.prometheus
    import ratequeue.state.file
    import ratequeue.state.mongodb
    import ratequeue.state.postgresql  # noqa: F401 - their loggers are made on import

    names = {name for name in logging.root.manager.loggerDict if name.startswith("ratequeue")}
    expected = {
        "ratequeue.limiter",
        "ratequeue.limiter.calls",
        "ratequeue.events",
        "ratequeue.queue",
        "ratequeue.state.file",
        "ratequeue.state.redis",
        "ratequeue.state.mongodb",
        "ratequeue.state.postgresql",
    }
    assert expected <= names
    assert all(name == "ratequeue" or name.startswith("ratequeue.") for name in names)


def test_a_debug_line_per_state_call(caplog: pytest.LogCaptureFixture, url: str) -> None:
    caplog.set_level(logging.DEBUG, logger="ratequeue")
    limiter = ratequeue.Limiter(url, name=fresh(), interval=INTERVAL)
    turns = [limiter.acquire() for _ in range(3)]
    limiter.close()
    calls = [record for record in caplog.records if record.name == "ratequeue.limiter.calls"]
    assert len(calls) >= 3
    for record in calls:
        assert record.levelno == logging.DEBUG
        message = record.getMessage()
        assert f"queue={limiter.name!r}" in message
        assert " us" in message
        assert message.split()[0] in ("take_and_try", "try_start", "retime")
    begins = [
        record.getMessage() for record in caplog.records if "begins after a wait" in record.getMessage()
    ]
    assert len(begins) == len(turns)


def test_nothing_is_logged_when_debug_is_off(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="ratequeue")
    limiter = ratequeue.Limiter(f"memory://{fresh()}", name=fresh(), interval=INTERVAL)
    for _ in range(3):
        limiter.acquire()
    limiter.close()
    assert not [record for record in caplog.records if record.name == "ratequeue.limiter.calls"]


def test_a_normal_run_logs_nothing_at_warning(caplog: pytest.LogCaptureFixture, url: str) -> None:
    """Two threads, a queue with a job that fails once, a timeout: all normal, no WARNING."""
    caplog.set_level(logging.DEBUG, logger="ratequeue")
    limiter = ratequeue.Limiter(url, name=fresh(), interval=INTERVAL)

    def worker() -> None:
        for _ in range(10):
            limiter.acquire()

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    with pytest.raises(ratequeue.AcquireTimeout):
        limiter.acquire(timeout=0)
    limiter.close()
    tries: list[int] = []

    def flaky() -> int:
        tries.append(1)
        if len(tries) == 1:
            raise ConnectionError("the service hiccuped")
        return len(tries)

    with ratequeue.Queue(
        url, name=fresh(), interval=INTERVAL, retries=1, backoff=ratequeue.Backoff(0.01)
    ) as queue:
        assert queue.add(flaky).result(timeout=30) == 2
    assert not warnings_of(caplog), [record.getMessage() for record in warnings_of(caplog)]
    assert any("failed on try 1 of 2" in record.getMessage() for record in caplog.records)


def test_a_lost_ticket_warns(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    url = (tmp_path / "state.json").as_uri()
    name = fresh()
    other = ratequeue.open_state(url)
    reset: list[bool] = []

    def reset_while_waiting(event: Event) -> None:
        if event.kind == "call" and event.outcome == "wait" and not reset:
            reset.append(other.reset(name))

    limiter = ratequeue.Limiter(url, name=name, interval=0.2, on_event=reset_while_waiting)
    limiter.acquire()
    with caplog.at_level(logging.WARNING, logger="ratequeue"):
        assert limiter.acquire().ticket == 1
    limiter.close()
    other.close()
    [warning] = warnings_of(caplog)
    assert warning.name == "ratequeue.limiter"
    assert f"queue {name!r}: ticket 2 was lost" in warning.getMessage()
    assert "reset, deleted or lost in a failover" in warning.getMessage()


def test_turns_given_up_in_a_row_warn_once_a_minute(caplog: pytest.LogCaptureFixture) -> None:
    """One turn given up is INFO (a busy moment); two in a row by one caller warn, once a minute."""
    clock = ShiftedClock()
    late = [0]

    def wake_late(event: Event) -> None:
        if event.kind == "call" and event.outcome == "started" and late[0]:
            late[0] -= 1
            clock.shift += 0.005  # the process resumes 5 ms after the answer: past max_late

    caplog.set_level(logging.DEBUG, logger="ratequeue")
    limiter = ratequeue.Limiter(
        f"memory://{fresh()}", name=fresh(), interval=0.02, clock=clock, on_event=wake_late
    )
    late[0] = 3  # a grant and both moves of its start woken late: one turn given up
    limiter.acquire()
    assert not warnings_of(caplog)
    for _ in range(2):
        late[0] = 6  # two turns given up in a row by one caller
        limiter.acquire()
    limiter.close()
    [warning] = warnings_of(caplog)
    assert "a caller gave up 2 turns in a row" in warning.getMessage()
    assert "3 turn(s) given up since the last warning" in warning.getMessage()
    assert "max_late=0.0003" in warning.getMessage()
    given_up = [record for record in caplog.records if "more than max_late: given up" in record.getMessage()]
    assert len(given_up) == 4, "the others are INFO, the second warning within the minute too"
    assert all(record.levelno == logging.INFO for record in given_up)
    moved = [record for record in caplog.records if record.getMessage().endswith("max_late: moved")]
    assert len(moved) == 10
    assert all(record.levelno == logging.DEBUG for record in moved)


def test_a_clock_step_warns(caplog: pytest.LogCaptureFixture) -> None:
    clock = ShiftedClock()
    limiter = ratequeue.Limiter(f"memory://{fresh()}", name=fresh(), interval=INTERVAL, clock=clock)
    limiter.acquire()
    clock.shift += 1.0  # this host's clock jumps a second ahead of the state's
    with caplog.at_level(logging.WARNING, logger="ratequeue"):
        limiter.acquire()
    limiter.close()
    [warning] = [record for record in warnings_of(caplog) if "clock" in record.getMessage()]
    assert "moved -1.0" in warning.getMessage()
    assert "this host's forward" in warning.getMessage()


def test_a_raising_hook_warns_once_per_limiter(caplog: pytest.LogCaptureFixture) -> None:
    def broken(event: Event) -> None:
        raise RuntimeError("metrics backend down")

    caplog.set_level(logging.DEBUG, logger="ratequeue.events")
    limiter = ratequeue.Limiter(f"memory://{fresh()}", name=fresh(), interval=INTERVAL, on_event=broken)
    for _ in range(3):
        limiter.acquire()
    limiter.close()
    failures = [record for record in caplog.records if record.name == "ratequeue.events"]
    assert len(failures) >= 3
    assert [record.levelno for record in failures].count(logging.WARNING) == 1
    assert failures[0].levelno == logging.WARNING
    assert failures[0].exc_info is not None
    assert "metrics backend down" in str(failures[0].exc_info[1])


def test_a_queue_whose_state_fails_warns(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    url = (tmp_path / "state.json").as_uri()
    name = fresh()
    state = ratequeue.open_state(url)
    state.take(name, 10_000)
    record_file, _ = state.record_files(name)  # type: ignore[attr-defined]
    Path(record_file).write_text("[")
    with (
        caplog.at_level(logging.WARNING, logger="ratequeue"),
        ratequeue.Queue(url, name=name, interval=INTERVAL) as queue,
        pytest.raises(StateCorrupted),
    ):
        queue.add(print).result(timeout=30)
    state.close()
    [warning] = warnings_of(caplog)
    assert warning.name == "ratequeue.queue"
    assert "no turn for its next job" in warning.getMessage()
    assert "StateCorrupted" in warning.getMessage()


@pytest.fixture
def admin(redis_server: Server) -> Iterator[redis.Redis]:
    with redis.Redis(port=redis_server.port) as client:
        yield client


def test_a_retried_redis_call_warns(
    caplog: pytest.LogCaptureFixture, redis_server: Server, admin: redis.Redis
) -> None:
    """The server closes the state's connection: the next call is retried (a WARNING) and answered."""
    client_name = fresh("retried")
    state = RedisState(redis.Redis(port=redis_server.port, client_name=client_name))
    limiter = ratequeue.Limiter(state, name=fresh(), interval=INTERVAL)
    limiter.acquire()
    for client in admin.client_list():
        if client.get("name") == client_name:
            admin.execute_command("CLIENT", "KILL", "ID", client["id"])  # type: ignore[no-untyped-call]
    with caplog.at_level(logging.INFO, logger="ratequeue"):
        assert limiter.acquire().ticket == 2
    limiter.close()
    state.close()
    [warning] = warnings_of(caplog)
    assert warning.name == "ratequeue.state.redis"
    assert "retrying, 1 of 8" in warning.getMessage()
    assert any("answered again after 1 retried failure" in record.getMessage() for record in caplog.records)


# --------------------------------------------------------------------------- asyncio


def test_aio_a_normal_run_logs_nothing_at_warning(caplog: pytest.LogCaptureFixture, url: str) -> None:
    caplog.set_level(logging.DEBUG, logger="ratequeue")

    async def main() -> None:
        limiter = aio.Limiter(url, name=fresh(), interval=INTERVAL)
        await asyncio.gather(*(limiter.acquire() for _ in range(10)))
        await limiter.close()

    asyncio.run(main())
    assert not warnings_of(caplog), [record.getMessage() for record in warnings_of(caplog)]
    assert len([record for record in caplog.records if record.name == "ratequeue.limiter.calls"]) >= 10


def test_aio_a_lost_ticket_warns(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    url = (tmp_path / "state.json").as_uri()
    name = fresh()
    other = ratequeue.open_state(url)
    reset: list[bool] = []

    def reset_while_waiting(event: Event) -> None:
        if event.kind == "call" and event.outcome == "wait" and not reset:
            reset.append(other.reset(name))

    async def main() -> None:
        limiter = aio.Limiter(url, name=name, interval=0.2, on_event=reset_while_waiting)
        await limiter.acquire()
        with caplog.at_level(logging.WARNING, logger="ratequeue"):
            await limiter.acquire()
        await limiter.close()

    asyncio.run(main())
    other.close()
    [warning] = warnings_of(caplog)
    assert "ticket 2 was lost" in warning.getMessage()
