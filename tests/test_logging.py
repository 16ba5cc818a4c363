"""Logging: quiet in a normal run, DEBUG per state call when asked, a WARNING for what needs an operator.

Every logger is a child of ``ratequeue``. The faults that warn are made
for real: a record reset by another state object (a lost ticket), a clock
shifted forward between two answers (a clock step), wake-ups too late to
begin, a hook that raises, a corrupted record under a queue, and a Redis
server gone (a call that gives up). What must not warn is made for real
too: a stall between two clock reads, a Redis connection killed while idle.

The faults are injected through the state and the limiter's waits, not
through ``on_event`` hooks, so that the tests do not depend on when hooks
are called; where timing on a busy host can add events (a real late
wake-up), counts are lower bounds.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

import ratequeue
from ratequeue import Event, StateCorrupted, aio
from ratequeue.core import protocol
from ratequeue.core.flow import Flow
from ratequeue.core.operation import Operation
from ratequeue.core.protocol import US, Answer, Started, Wait
from ratequeue.core.shard import Begin, BeginAt, Shard, WaitForTurn
from ratequeue.running import runner_of
from ratequeue.state._retries import RetryLog
from ratequeue.state.file import FileState
from ratequeue.state.memory import MemoryState
from ratequeue.state.redis import RedisState

from .ops import do, is_step, make_shard
from .servers import Server, free_port, redis_command, redis_executable, running

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


def without_lateness_check(queue: ratequeue.Queue) -> None:
    """Turn ``queue``'s lateness check off, as ``max_late=None`` does for a limiter (a queue takes none).

    Where lateness is not under test: a busy host's late wake-ups then give no turn up and log nothing.
    """
    runner_of(queue._limiter).shard.max_late = None


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [record for record in caplog.records if record.levelno >= logging.WARNING]


def test_every_logger_is_under_ratequeue() -> None:
    import ratequeue.prometheus
    import ratequeue.state.mongodb
    import ratequeue.state.postgresql  # noqa: F401 - their loggers are made on import

    names = {name for name in logging.root.manager.loggerDict if name.startswith("ratequeue")}
    expected = {
        "ratequeue.limiter",
        "ratequeue.limiter.calls",
        "ratequeue.events",
        "ratequeue.queue",
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
    limiter = ratequeue.Limiter(url, name=fresh(), interval=INTERVAL, max_late=None)

    def worker() -> None:
        for _ in range(10):
            limiter.acquire()

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    limiter.close()
    slow = ratequeue.Limiter(url, name=fresh(), interval=60, max_late=None)
    slow.acquire()
    with pytest.raises(ratequeue.AcquireTimeout):  # the next turn is a minute away, however busy the host
        slow.acquire(timeout=0)
    slow.close()
    tries: list[int] = []

    def flaky() -> int:
        tries.append(1)
        if len(tries) == 1:
            raise ConnectionError("the service hiccuped")
        return len(tries)

    with ratequeue.Queue(
        url, name=fresh(), interval=INTERVAL, retries=1, backoff=ratequeue.Backoff(0.01)
    ) as queue:
        without_lateness_check(queue)
        assert queue.add(flaky).result(timeout=30) == 2
    assert not warnings_of(caplog), [record.getMessage() for record in warnings_of(caplog)]
    assert any("failed on try 1 of 2" in record.getMessage() for record in caplog.records)


class ResetWhileWaiting(FileState):
    """A state file whose record is reset by another state object right after its first WAIT answer."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.reset_once: str | None = None  # the queue to reset at the next WAIT answer

    def _execute(self, op: Operation) -> Answer:
        answer = super()._execute(op)
        if op.kind == "take_and_try" and isinstance(answer, Wait) and self.reset_once == op.name:
            self.reset_once = None
            other = FileState(self.path)
            other.reset(op.name)
            other.close()
        return answer


def test_a_lost_ticket_warns(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    name = fresh()
    state = ResetWhileWaiting(tmp_path / "state.json")
    limiter = ratequeue.Limiter(state, name=name, interval=0.2, max_late=None)
    limiter.acquire()
    state.reset_once = name
    with caplog.at_level(logging.WARNING, logger="ratequeue"):
        turn = limiter.acquire()
    limiter.close()
    state.close()
    assert turn.ticket == 1, "a new ticket of the record made afresh"
    [warning] = warnings_of(caplog)
    assert warning.name == "ratequeue.limiter"
    assert f"queue {name!r}: ticket 2 was lost" in warning.getMessage()
    assert "reset, deleted or lost in a failover" in warning.getMessage()


class LateWakeUps:
    """Makes a limiter resume ``shift`` s late after its next ``count`` answers that grant a start.

    The shift comes after the limiter has read its clock at the answer (as a
    process descheduled right then), so each of those turns is late whatever
    the host's timing. The limiter's clock and its memory state's clock are
    one shifted clock, so this is time passing for both, not a clock step.
    """

    def __init__(self, limiter: ratequeue.Limiter, clock: ShiftedClock, shift: float) -> None:
        self.count = 0
        runner = runner_of(limiter)
        real = runner.call_flow

        def call_flow(op: Operation, lost: Any = None) -> Flow[Any]:
            timed = yield from real(op, lost)
            if self.count and isinstance(timed[0], Started):
                self.count -= 1
                clock.shift += shift
            return timed

        runner.call_flow = call_flow  # type: ignore[method-assign]


def test_turns_given_up_in_a_row_warn_once_a_minute(caplog: pytest.LogCaptureFixture) -> None:
    """One turn given up is INFO (a busy moment); two in a row by one caller warn, once a minute.

    Resumed 200 ms late against a max_late of 20 ms: whatever the lead, each
    such turn is late. A busy host can add late wake-ups of its own (more
    turns given up or moved), never fewer: the counts are lower bounds.
    """
    clock = ShiftedClock()
    state = MemoryState(clock=lambda: round(clock() * US), private=True)
    caplog.set_level(logging.DEBUG, logger="ratequeue")
    limiter = ratequeue.Limiter(state, name=fresh(), interval=0.1, max_late=0.02, clock=clock)
    late = LateWakeUps(limiter, clock, 0.2)
    limiter.acquire()
    late.count = 3  # a grant and both moves of its start resumed late: one turn given up
    limiter.acquire()
    assert not warnings_of(caplog)
    for _ in range(2):
        late.count = 6  # two turns given up in a row by one caller
        limiter.acquire()
    limiter.close()
    state.close()
    [warning] = warnings_of(caplog)
    message = warning.getMessage()
    assert re.search(r"a caller gave up \d+ turns in a row", message), message
    given_up_since = re.search(r"(\d+) turn\(s\) given up since the last warning", message)
    assert given_up_since is not None, message
    assert int(given_up_since.group(1)) >= 2, message
    assert "max_late=0.02" in message
    given_up = [record for record in caplog.records if "more than max_late: given up" in record.getMessage()]
    assert len(given_up) >= 4, "the others are INFO, the second warning within the minute too"
    assert all(record.levelno == logging.INFO for record in given_up)
    moved = [record for record in caplog.records if record.getMessage().endswith("max_late: moved")]
    assert len(moved) >= 10, "each turn given up had its start moved twice"
    assert all(record.levelno == logging.DEBUG for record in moved)


def test_a_turn_given_up_while_paused_is_no_late_wake_up() -> None:
    """A paused shard cannot move a late start: it gives the turn up at once, counted apart."""
    shard = make_shard(0.01, lead=0.002, max_late=0.0003)
    job = shard.add()
    assert is_step(shard.step(job, 10.0), "take_and_try")
    shard.receive(job, Started(ticket=1, start=10_005_000, now=10_000_000), 10.0, 10.0, offset=0.0)
    assert isinstance(shard.step(job, 10.0), BeginAt)
    shard.pause()
    assert isinstance(shard.step(job, 10.007), WaitForTurn), "given up at once, then waits while paused"
    assert job.turn is None
    assert (job.given_up, job.given_up_paused) == (1, 1)
    shard.resume()
    assert is_step(shard.step(job, 10.007), "take_and_try")
    shard.receive(job, Started(ticket=2, start=10_017_000, now=10_007_000), 10.007, 10.007, offset=0.0)
    assert isinstance(shard.step(job, 10.007), BeginAt)
    assert is_step(shard.step(job, 10.019), "retime"), "not paused: moved"
    shard.receive(job, protocol.Passed(ticket=2, pos=3, now=10_019_000), 10.019, 10.019, offset=0.0)
    assert (job.given_up, job.given_up_paused) == (2, 1), "given up for a late wake-up"


class StalledFile(FileState):
    """A state file whose clock, read by the limiter after an answer, is read ``stall`` s late once."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.stall = 0.0

    def local_now(self) -> float | None:
        now = super().local_now()
        stall, self.stall = self.stall, 0.0
        return None if now is None else now + stall


def test_a_stall_between_two_clock_reads_is_no_clock_step(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """The limiter reads its clock, then the state's: a 60 ms stall between them moves one offset only."""
    state = StalledFile(tmp_path / "state.json")
    caplog.set_level(logging.DEBUG, logger="ratequeue")
    limiter = ratequeue.Limiter(state, name=fresh(), interval=INTERVAL, max_late=None)
    limiter.acquire()
    state.stall = 0.06
    for _ in range(3):
        limiter.acquire()
    limiter.close()
    state.close()
    assert not [record for record in caplog.records if "clock" in record.getMessage()]
    assert runner_of(limiter).shard.estimator.steps == 0


def test_a_clock_step_warns_once_confirmed(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    """This host's clock jumps a second ahead of a state file's: the answer after the next confirms it."""
    clock = ShiftedClock()
    limiter = ratequeue.Limiter(
        (tmp_path / "state.json").as_uri(), name=fresh(), interval=INTERVAL, clock=clock, max_late=None
    )
    limiter.acquire()
    clock.shift += 1.0
    with caplog.at_level(logging.WARNING, logger="ratequeue"):
        for _ in range(3):
            limiter.acquire()
    limiter.close()
    [warning] = [record for record in warnings_of(caplog) if "clock" in record.getMessage()]
    moved = re.search(r"moved ([-+][\d.]+) s", warning.getMessage())
    assert moved is not None
    assert float(moved.group(1)) == pytest.approx(-1.0, abs=0.01)
    assert "this host's forward" in warning.getMessage()
    assert runner_of(limiter).shard.estimator.steps == 1


def direct_answers(shard: Shard, offsets: list[float]) -> None:
    """One turn per offset, granted at the state's now, with that offset read directly (sans I/O)."""
    now = 100.0
    for ticket, offset in enumerate(offsets, 1):
        job = shard.add()
        assert is_step(shard.step(job, now), "take_and_try")
        state_now = round((now - offset) * US)
        shard.receive(job, Started(ticket=ticket, start=state_now, now=state_now), now, now, offset=offset)
        assert isinstance(shard.step(job, now + 0.5), Begin)
        now += 1.0


@pytest.mark.parametrize(
    ("offsets", "steps", "by"),
    [
        ([0.0, 0.0, -0.06, 0.0, 0.0], 0, 0.0),  # a one-off 60 ms stall
        ([0.0, 0.0, 0.06, 0.0, -0.06, 0.0], 0, 0.0),  # two of them, apart
        ([0.0, 0.0, 1.0, 1.0, 1.0], 1, 1.0),  # the state's clock stepped back a second
        ([0.0, -0.5, -0.5, -0.5], 1, -0.5),  # this host's went back half a second
        ([0.0, -0.06, 1.0, 1.0], 1, 1.0),  # a stall, then a step: measured from before both
        ([0.0, 0.004, 0.008, 0.012, 0.016], 0, 0.0),  # a slow drift is no step
    ],
)
def test_a_direct_offset_counts_a_step_only_once_the_next_answer_agrees(
    offsets: list[float], steps: int, by: float
) -> None:
    shard = make_shard(1.0, lead=0.0, max_late=None)
    direct_answers(shard, offsets)
    assert shard.estimator.steps == steps
    assert shard.estimator.step == pytest.approx(by)


def test_a_state_on_the_shards_own_clock_has_no_steps() -> None:
    shard = make_shard(1.0, lead=0.0, max_late=None, same_clock=True)
    direct_answers(shard, [0.0, 1.0, 1.0, 1.0])
    assert shard.estimator.steps == 0


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
    do(state, "take", name, 10_000)
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


def kill_client(admin: redis.Redis, client_name: str) -> None:
    """Close the server's side of every connection of ``client_name`` (as a server ``timeout`` does)."""
    killed = 0
    for client in admin.client_list():
        if client.get("name") == client_name:
            admin.execute_command("CLIENT", "KILL", "ID", client["id"])  # type: ignore[no-untyped-call]
            killed += 1
    assert killed, "the state's connection was found"


def test_a_redis_connection_killed_while_idle_is_retried_without_a_warning(
    caplog: pytest.LogCaptureFixture, redis_server: Server, admin: redis.Redis
) -> None:
    """The server closes the state's idle connection: the next call is retried (INFO) and answered."""
    client_name = fresh("idle")
    state = RedisState(redis.Redis(port=redis_server.port, client_name=client_name))
    limiter = ratequeue.Limiter(state, name=fresh(), interval=INTERVAL, max_late=None)
    limiter.acquire()
    kill_client(admin, client_name)
    with caplog.at_level(logging.INFO, logger="ratequeue"):
        assert limiter.acquire().ticket == 2
    limiter.close()
    state.close()
    assert not warnings_of(caplog), [record.getMessage() for record in warnings_of(caplog)]
    [retry] = [record for record in caplog.records if "retrying, 1 of 8" in record.getMessage()]
    assert retry.name == "ratequeue.state.redis"
    assert retry.levelno == logging.INFO
    assert "kept idle since its last call" in retry.getMessage()
    assert any("answered again after 1 retried failure" in record.getMessage() for record in caplog.records)


def test_aio_a_redis_connection_killed_while_idle_is_retried_without_a_warning(
    caplog: pytest.LogCaptureFixture, redis_server: Server, admin: redis.Redis
) -> None:
    client_name = fresh("idle")

    async def main() -> int:
        state = aio.open_state(f"redis://127.0.0.1:{redis_server.port}/0?client_name={client_name}")
        limiter = aio.Limiter(state, name=fresh(), interval=INTERVAL, max_late=None)
        await limiter.acquire()
        kill_client(admin, client_name)
        with caplog.at_level(logging.INFO, logger="ratequeue"):
            ticket = (await limiter.acquire()).ticket
        await limiter.close()
        await state.close()
        return ticket

    assert asyncio.run(main()) == 2
    assert not warnings_of(caplog), [record.getMessage() for record in warnings_of(caplog)]
    assert any("kept idle since its last call" in record.getMessage() for record in caplog.records)


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[Server]:
    """A Redis server of this test's own, to stop (never the session's, nor the machine's)."""
    executable = redis_executable()
    if executable is None:
        pytest.skip("redis-server is not on PATH")
    assert executable is not None
    port = free_port()
    server = Server("redis", redis_command(executable, port, tmp_path, append_only=False), port, tmp_path)
    with running(server):
        yield server


def test_a_redis_call_that_gives_up_warns(caplog: pytest.LogCaptureFixture, own_redis: Server) -> None:
    """The server is gone: the kept connection's retry is INFO, the call giving up a WARNING."""
    state = ratequeue.open_state(f"redis://127.0.0.1:{own_redis.port}/0")
    limiter = ratequeue.Limiter(state, name=fresh(), interval=INTERVAL, max_late=None)
    limiter.acquire()
    own_redis.stop()
    with caplog.at_level(logging.INFO, logger="ratequeue"), pytest.raises(ratequeue.StateUnavailable):
        limiter.acquire(timeout=30)
    limiter.close()
    state.close()
    [warning] = warnings_of(caplog)
    assert warning.name == "ratequeue.state.redis"
    assert "the call gives up after" in warning.getMessage()
    assert f"Redis at 127.0.0.1:{own_redis.port} failed (ConnectionError" in warning.getMessage()


def test_retry_warnings_come_at_most_once_a_minute_per_state(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    log = RetryLog(logging.getLogger("ratequeue.state.redis"), "Redis", "db:6379", clock=lambda: now[0])
    failure = redis.ConnectionError("Connection closed by server.")
    caplog.set_level(logging.DEBUG, logger="ratequeue")
    log.retrying(failure, 1, 8, idle=True)  # a dead idle connection: INFO
    log.retrying(failure, 2, 8)  # the retry failed again: WARNING
    for _ in range(3):  # an outage: every thread's calls fail
        now[0] += 1.0
        log.retrying(failure, 2, 8)
        log.gave_up(failure, 3)
    now[0] = 61.0
    log.gave_up(failure, 9)
    levels = [(record.levelno, record.getMessage()) for record in caplog.records]
    assert [level for level, _ in levels] == [
        logging.INFO,
        logging.WARNING,
        *[logging.DEBUG] * 6,
        logging.WARNING,
    ]
    assert levels[0][1] == (
        "Redis at db:6379 failed (ConnectionError: Connection closed by server.) on a connection kept idle "
        "since its last call; retrying, 1 of 8"
    )
    assert levels[1][1].endswith("again; retrying, 2 of 8")
    assert levels[-1][1].endswith(
        "the call gives up after 9 failure(s) (6 more retried or failed call(s) since the last warning, "
        "logged at DEBUG)"
    )


def test_a_grouped_queue_reports_one_start_per_job(url: str) -> None:
    """A group's place is no start of the queue: six jobs in three groups, six starts, all the queue's."""
    events: list[Event] = []
    lock = threading.Lock()

    def collect(event: Event) -> None:
        with lock:
            events.append(event)

    name = fresh()
    with ratequeue.Queue(url, name=name, interval=INTERVAL, on_event=collect) as queue:
        futures = [queue.add(lambda: None, group=f"g{i % 3}") for i in range(6)]
        for future in futures:
            future.result(timeout=30)

    def starts() -> list[Event]:
        with lock:
            return [event for event in events if event.kind == "begin"]

    deadline = time.monotonic() + 10  # however the hook is called, its events come
    while len(starts()) < 6 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)  # and no more
    assert len(starts()) == 6
    assert {event.queue for event in starts()} == {name}
    with lock:
        assert all(event.queue == name for event in events), {event.queue for event in events}


class LeakyError(Exception):
    """An error whose text holds a secret, as ``HTTPError`` does with the URL it called."""


def test_a_job_error_is_logged_by_its_type_only(caplog: pytest.LogCaptureFixture, url: str) -> None:
    secret = "api_key=S3CRET"

    def call_the_api() -> None:
        raise LeakyError(f"401 Unauthorized for url: https://api.example/v1/items?{secret}")

    letters: list[object] = []
    caplog.set_level(logging.DEBUG, logger="ratequeue")
    with ratequeue.Queue(
        url,
        name=fresh(),
        interval=INTERVAL,
        retries=1,
        backoff=ratequeue.Backoff(0.01),
        dead_letter=letters.append,
    ) as queue:
        without_lateness_check(queue)
        future = queue.add(call_the_api)
        with pytest.raises(LeakyError, match=secret):  # the job's own error, for its owner
            future.result(timeout=30)
    messages = [record.getMessage() for record in caplog.records]
    assert any("failed on try 1 of 2 (LeakyError)" in message for message in messages), messages
    assert any("failed for good on try 2 (LeakyError)" in message for message in messages), messages
    assert not [message for message in messages if "S3CRET" in message]
    assert len(letters) == 1


# --------------------------------------------------------------------------- asyncio


def test_aio_a_normal_run_logs_nothing_at_warning(caplog: pytest.LogCaptureFixture, url: str) -> None:
    caplog.set_level(logging.DEBUG, logger="ratequeue")

    async def main() -> None:
        limiter = aio.Limiter(url, name=fresh(), interval=INTERVAL, max_late=None)
        await asyncio.gather(*(limiter.acquire() for _ in range(10)))
        await limiter.close()

    asyncio.run(main())
    assert not warnings_of(caplog), [record.getMessage() for record in warnings_of(caplog)]
    assert len([record for record in caplog.records if record.name == "ratequeue.limiter.calls"]) >= 10


def test_aio_a_lost_ticket_warns(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    name = fresh()
    state = ResetWhileWaiting(tmp_path / "state.json")

    async def main() -> int:
        limiter = aio.Limiter(state, name=name, interval=0.2, max_late=None)
        await limiter.acquire()
        state.reset_once = name
        with caplog.at_level(logging.WARNING, logger="ratequeue"):
            turn = await limiter.acquire()
        await limiter.close()
        return turn.ticket

    assert asyncio.run(main()) == 1
    state.close()
    [warning] = warnings_of(caplog)
    assert "ticket 2 was lost" in warning.getMessage()
