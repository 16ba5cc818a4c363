"""Records the protocol could not have written, on every backend: refused, named, unchanged, reset.

Each test writes a raw record straight into the backend (a memory store's
dict, the file state's JSON, a Redis hash, a MongoDB document), then checks
that every operation answers :class:`StateCorrupted` naming the field and its
value, that nothing was written, and that ``reset`` clears the queue. The
backend table is the contract suite's (``backend`` in conftest).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from hypothesis import given
from hypothesis import strategies as st
from psycopg import sql

import ratequeue
from ratequeue.core import protocol
from ratequeue.core.flow import run
from ratequeue.core.protocol import MAX_LEAD_US, NEVER, US, Record, Started, Wait
from ratequeue.core.shard import RECHECK, SleepUntil
from ratequeue.errors import ConfigurationError, StateCorrupted
from ratequeue.state import State
from ratequeue.state.file import FileState
from ratequeue.state.memory import MemoryState
from ratequeue.state.mongodb import MongoState
from ratequeue.state.postgresql import PostgresState
from ratequeue.state.redis import RedisState

from .backends import Backend
from .ops import Step, do, is_step, make_shard

INTERVAL = 10_000  # us
LAST_TICKET = 2**52 - 1
TEN_YEARS_US = 10 * 365 * 24 * 3600 * US
NOW = 1_800_000_000_000_000  # a fixed state clock (us), for the tests on a clocked state


# -- raw records -------------------------------------------------------------


def full(fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` with the fields a record has and they leave out, as a fresh record has them."""
    at = fields.get("at", NEVER)
    defaults = {"due": at, "burst": 1, "paused": False, "max_running": 0, "leases": [], "held": NEVER}
    return {**defaults, **fields}


def record_of(fields: dict[str, Any]) -> Record:
    """The :class:`Record` ``fields`` stand for (those left out as :func:`full` fills them)."""
    fields = full(fields)
    leases = tuple(map(tuple, fields.pop("leases")))
    return Record(**{**fields, "max_running": fields["max_running"] or None, "leases": leases})


def poke(backend: Backend, state: State, name: str, fields: dict[str, Any]) -> None:
    """Store ``fields`` (and the fields they leave out, as a fresh record has them) as ``name``'s record."""
    if isinstance(state, MemoryState):
        state._records[name] = record_of(fields)
        return
    fields = full(fields)
    if isinstance(state, FileState):
        do(state, "take", name, fields["interval"] if isinstance(fields.get("interval"), int) else INTERVAL)
        if hasattr(state, "record_files"):  # one file per queue
            file = state.record_files(name)[0]
            data = json.loads(file.read_text())
            data["record"] = fields
            file.write_text(json.dumps(data))
        else:  # one file holding every queue
            data = json.loads(state.path.read_text())
            data["queues"][name] = fields
            state.path.write_text(json.dumps(data))
    elif isinstance(state, RedisState):
        client: redis.Redis = state.client
        client.delete(state.key(name))
        stored = {
            key: str(int(value)) if isinstance(value, bool) else str(value) for key, value in fields.items()
        }
        stored["leases"] = (
            ",".join(":".join(map(str, lease)) for lease in fields["leases"])
            if isinstance(fields["leases"], list)
            else str(fields["leases"])
        )
        client.hset(state.key(name), mapping=stored)
    elif isinstance(state, PostgresState):
        state.read(name)  # the table exists
        row = {
            f"{key}_us" if key in ("at", "interval", "due", "held", "not_before") else key: v
            for key, v in fields.items()
        }
        row["leases"] = [number for lease in row["leases"] for number in lease]
        run(state._fetch_flow(sql.SQL("DELETE FROM {} WHERE name = %s").format(state.table), (name,)))
        insert = sql.SQL("INSERT INTO {} ({}) VALUES ({})").format(
            state.table,
            sql.SQL(", ").join(map(sql.Identifier, ["name", *row])),
            sql.SQL(", ").join([sql.Placeholder()] * (len(row) + 1)),
        )
        run(state._fetch_flow(insert, (name, *row.values())))
    else:
        assert isinstance(state, MongoState)
        state.collection.replace_one({"_id": name}, {"_id": name, **fields}, upsert=True)


def raw(state: State, name: str) -> object:
    """``name``'s record exactly as stored (on MongoDB, the document's fields but ``answer``)."""
    if isinstance(state, MemoryState):
        return state._records.get(name)
    if isinstance(state, FileState):
        if hasattr(state, "record_files"):
            return state.record_files(name)[0].read_bytes()
        return json.loads(state.path.read_text())["queues"].get(name)
    if isinstance(state, RedisState):
        return state.client.hgetall(state.key(name))
    if isinstance(state, PostgresState):
        rows, _ = run(
            state._fetch_flow(sql.SQL("SELECT * FROM {} WHERE name = %s").format(state.table), (name,))
        )
        return rows
    assert isinstance(state, MongoState)
    # without ``answer``: the reply of the last operation, left beside the record (a refusal's too)
    return state.collection.find_one({"_id": name}, {"answer": False})


def operations(name: str, interval: int, **terms: Any) -> dict[str, Callable[[State], object]]:
    calls: dict[str, Callable[[State], object]] = {
        "take": lambda s: do(s, "take", name, interval, **terms),
        "take_and_try": lambda s: do(s, "take_and_try", name, interval, 0, **terms),
        "try_start": lambda s: do(s, "try_start", name, interval, 2, 0, **terms),
        "retime": lambda s: do(s, "retime", name, interval, 1, 0, **terms),
        "set_paused": lambda s: do(s, "set_paused", name, interval, True, **terms),
        "read": lambda s: s.read(name),
    }
    if terms.get("max_running"):
        calls["release"] = lambda s: do(s, "release", name, interval, 1, token=5, **terms)
        calls["renew"] = lambda s: do(s, "renew", name, interval, 1, token=5, **terms)
    return calls


def assert_refused(
    state: State, name: str, calls: dict[str, Callable[[State], object]], pattern: str
) -> None:
    """Every call raises :class:`StateCorrupted` matching ``pattern``, and the record stays as it was."""
    before = raw(state, name)
    for op, call in calls.items():
        with pytest.raises(StateCorrupted, match=pattern) as caught:
            call(state)
        assert caught.value.where, f"{op}: the error names where the record is"
        assert raw(state, name) == before, f"{op} changed the refused record"


def assert_reset_clears(state: State, name: str) -> None:
    assert state.reset(name) is True
    assert state.read(name).record is None
    assert isinstance(do(state, "take_and_try", name, INTERVAL, 0), Started)


# -- a start further ahead than any lead --------------------------------------


def test_a_far_future_at_is_refused_by_every_operation(backend: Backend) -> None:
    """``at`` ten years ahead (the issue's poisoned key): StateCorrupted naming it; reset clears it."""
    state = backend.open()
    name = backend.fresh_name()
    now = state.read(name).now
    at = now + TEN_YEARS_US
    poke(backend, state, name, {"ticket": 3, "pos": 1, "at": at, "interval": INTERVAL})
    pattern = rf"has at={at}, more than 3600 s ahead of the state clock \(now=\d+\).*reset the queue"
    assert_refused(state, name, operations(name, INTERVAL), pattern)
    assert_reset_clears(state, name)


@pytest.mark.parametrize("field", ["held", "leases"])
def test_a_far_future_held_or_lease_is_refused_by_every_operation(backend: Backend, field: str) -> None:
    """``held``, or a lease's expiry, ten years ahead (issue 27): refused as ``at`` is; reset clears it.

    Such a record stalled its queue silently before: every start waited for
    the lease, or for the grace after ``held``, for ten years.
    """
    state = backend.open()
    name = backend.fresh_name()
    now = state.read(name).now
    far = now + TEN_YEARS_US
    fields: dict[str, Any] = {
        "ticket": 3,
        "pos": 1,
        "at": now - INTERVAL,
        "interval": INTERVAL,
        "max_running": 2,
    }
    fields |= {"held": far} if field == "held" else {"leases": [[1, far, 5]]}
    poke(backend, state, name, fields)
    pattern = rf"has {field}={far}, more than \d+ s ahead of the state clock \(now=\d+\).*reset the queue"
    assert_refused(state, name, operations(name, INTERVAL, max_running=2, lease_us=10**6), pattern)
    assert_reset_clears(state, name)


@pytest.mark.parametrize(
    "leases",
    [[[1, 0, 5], [1, 0, 6]], [[2, 0, 5]], [[1, 0]], [[1, 0, -1]]],
    ids=["two leases on one ticket", "a lease on a ticket not started", "no token", "a negative token"],
)
def test_leases_the_protocol_could_not_have_written_are_refused(backend: Backend, leases: list[Any]) -> None:
    """A lease on a ticket twice, on one not started (above ``pos``), or without a valid token: corrupt."""
    if backend.kind == "memory":
        pytest.skip("the memory state stores Record objects ratequeue made, never raw fields")
    state = backend.open()
    name = backend.fresh_name()
    now = state.read(name).now
    leases = [[t, now + 10**6, *rest[1:]] for t, *rest in leases]
    fields = {
        "ticket": 3,
        "pos": 1,
        "at": now - INTERVAL,
        "interval": INTERVAL,
        "max_running": 2,
        "leases": leases,
    }
    poke(backend, state, name, fields)
    assert_refused(state, name, operations(name, INTERVAL, max_running=2, lease_us=10**6), "leases")
    assert state.reset(name) is True


def test_the_lead_limit_is_exact(backend: Backend) -> None:
    """On the state's clock, ``at = now + MAX_LEAD_US`` is accepted and one microsecond more is not."""
    state, clock = backend.clocked()
    clock[0] = NOW
    name = backend.fresh_name()
    poke(backend, state, name, {"ticket": 3, "pos": 1, "at": NOW + MAX_LEAD_US, "interval": INTERVAL})
    assert state.read(name).record == Record(
        ticket=3, pos=1, at=NOW + MAX_LEAD_US, interval=INTERVAL, due=NOW + MAX_LEAD_US
    )
    assert do(state, "try_start", name, INTERVAL, 2, 0) == Wait(
        ticket=2, slot=NOW + MAX_LEAD_US + INTERVAL, now=NOW
    )
    bad = NOW + MAX_LEAD_US + 1
    poke(backend, state, name, {"ticket": 3, "pos": 1, "at": bad, "interval": INTERVAL})
    assert_refused(state, name, operations(name, INTERVAL), rf"has at={bad}, .*\(now={NOW}\)")
    clock[0] = NOW + 1  # the clock catches up: the same record is one the protocol writes
    assert state.read(name).record == Record(ticket=3, pos=1, at=bad, interval=INTERVAL, due=bad)
    assert state.reset(name) is True


def test_a_far_future_at_with_another_interval_is_a_mismatch_first(backend: Backend) -> None:
    """The interval is checked before the record's times, on every backend alike."""
    state = backend.open()
    name = backend.fresh_name()
    at = state.read(name).now + TEN_YEARS_US
    poke(backend, state, name, {"ticket": 3, "pos": 1, "at": at, "interval": INTERVAL})
    with pytest.raises(ConfigurationError, match="interval"):
        do(state, "take", name, 2 * INTERVAL)
    assert state.reset(name) is True


# -- the last ticket ------------------------------------------------------------


def test_the_last_ticket_is_never_taken(backend: Backend) -> None:
    """A record at ticket 2**52 - 1 hands out no more: a take would write a record every reader refuses."""
    state = backend.open()
    name = backend.fresh_name()
    now = state.read(name).now
    fields = {"ticket": LAST_TICKET, "pos": LAST_TICKET - 1, "at": now - 10 * INTERVAL, "interval": INTERVAL}
    poke(backend, state, name, fields)
    pattern = rf"has ticket={LAST_TICKET}, the last ticket a record can hold.*reset the queue"
    calls = operations(name, INTERVAL)
    assert_refused(state, name, {op: calls[op] for op in ("take", "take_and_try")}, pattern)
    assert state.read(name).record == record_of(fields)  # the record itself is one ratequeue writes
    assert_reset_clears(state, name)


def test_the_reference_refuses_the_last_ticket_and_a_far_at() -> None:
    record = Record(ticket=LAST_TICKET, pos=0, at=NEVER, interval=1, due=NEVER)
    with pytest.raises(protocol.Unwritten) as caught:
        protocol.take(record, 0)
    assert (caught.value.field, caught.value.value) == ("ticket", LAST_TICKET)
    far = Record(ticket=2, pos=1, at=MAX_LEAD_US + 1, interval=1, due=MAX_LEAD_US + 1)
    for call in (
        lambda: protocol.take(far, 0),
        lambda: protocol.try_start(far, 1, 0, 0),
        lambda: protocol.take_and_try(far, 0, 0),
        lambda: protocol.retime(far, 1, 0, 0),
        lambda: protocol.check(far, 0),
    ):
        with pytest.raises(protocol.Unwritten, match=rf"at={MAX_LEAD_US + 1} at now=0"):
            call()
    assert protocol.check(far, 1) == far


@given(
    interval=st.integers(1, 3 * 3600 * US),
    lead=st.integers(0, MAX_LEAD_US),
    gap=st.integers(0, 10 * 3600 * US),
    step=st.integers(0, 2 * 3600 * US),
)
def test_the_protocol_never_writes_what_it_refuses(interval: int, lead: int, gap: int, step: int) -> None:
    """With a lead of at most MAX_LEAD_US, every record written passes the check at the time it is written."""
    now = 10**15
    record = Record(ticket=3, pos=1, at=now - gap, interval=interval, due=now - gap)
    for operation in ("try", "take_and_try", "retime", "try"):
        if operation == "try":
            record, _ = protocol.try_start(record, record.pos + 1, lead, now)
        elif operation == "take_and_try":
            record, _ = protocol.take_and_try(record, lead, now)
        else:
            record, _ = protocol.retime(record, record.pos, lead, now)
        assert protocol.check(record, now) == record
        now += step


# -- wrong types and ranges ---------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "pattern"),
    [
        ({"ticket": 2**53, "pos": 1, "at": 5, "interval": INTERVAL}, rf"ticket={2**53}|ticket/pos.*{2**53}"),
        ({"ticket": 2**52, "pos": 1, "at": 5, "interval": INTERVAL}, rf"ticket={2**52}|ticket/pos.*{2**52}"),
        ({"ticket": 3, "pos": 1, "at": 2**52, "interval": INTERVAL}, rf"at={2**52}|at/interval.*{2**52}"),
    ],
    ids=["ticket 2**53", "ticket 2**52", "at 2**52"],
)
def test_out_of_range_numbers_are_refused(backend: Backend, fields: dict[str, Any], pattern: str) -> None:
    """Whole numbers past 2**52 are refused by every backend and every operation, changing nothing."""
    if backend.kind == "memory":
        pytest.skip("the memory state stores Record objects ratequeue made, never raw fields")
    state = backend.open()
    name = backend.fresh_name()
    poke(backend, state, name, fields)
    assert_refused(state, name, operations(name, INTERVAL), pattern)
    assert_reset_clears(state, name)


@pytest.mark.parametrize(
    ("fields", "pattern"),
    [
        ({"ticket": 3, "pos": 1, "at": 5, "interval": str(INTERVAL)}, f"interval='{INTERVAL}'"),
        ({"ticket": 3, "pos": 1, "at": True, "interval": INTERVAL}, "at=True"),
        ({"ticket": 3, "pos": 1.0, "at": 5, "interval": INTERVAL}, r"pos=1\.0"),
    ],
    ids=["interval text", "at boolean", "pos double"],
)
def test_wrong_types_are_refused(backend: Backend, fields: dict[str, Any], pattern: str) -> None:
    """Typed stores (file JSON, MongoDB BSON) refuse fields of the wrong type by name and value."""
    if backend.kind == "postgresql":
        pytest.skip("PostgreSQL's columns are typed (bigint): they hold no text, boolean or double")
    if backend.kind not in ("file", "mongodb"):
        pytest.skip("Redis stores text (its own tests cover it); memory stores Record objects")
    state = backend.open()
    name = backend.fresh_name()
    poke(backend, state, name, fields)
    assert_refused(state, name, operations(name, INTERVAL), pattern)
    assert_reset_clears(state, name)


@pytest.mark.parametrize("value", ["yes", 1, 0, None], ids=["text", "one", "zero", "null"])
def test_a_paused_flag_that_is_not_a_boolean_is_refused(backend: Backend, value: object) -> None:
    """``paused`` is true or false (Redis: "1" or "0"); anything else is refused by name."""
    if backend.kind == "memory":
        pytest.skip("the memory state stores Record objects ratequeue made, never raw fields")
    if backend.kind == "redis" and value in (None, 1, 0):
        pytest.skip('a Redis hash has no null, and "1" and "0" are how it says paused and not paused')
    if backend.kind == "postgresql":
        pytest.skip("a PostgreSQL boolean NOT NULL column holds true or false only")
    state = backend.open()
    name = backend.fresh_name()
    poke(backend, state, name, {"ticket": 3, "pos": 1, "at": 5, "interval": INTERVAL, "paused": value})
    shown = repr(str(value) if backend.kind == "redis" else value)  # Redis keeps text
    assert_refused(state, name, operations(name, INTERVAL), rf"paused={re.escape(shown)}")
    assert_reset_clears(state, name)


def test_a_paused_record_is_read_by_every_backend(backend: Backend) -> None:
    """A stored paused flag (file and MongoDB: ``true``, Redis: ``"1"``) reads as paused; false as not."""
    state = backend.open()
    name = backend.fresh_name()
    stored: object = True
    fields = {"ticket": 3, "pos": 1, "at": 5, "interval": INTERVAL}
    poke(backend, state, name, {**fields, "paused": stored})
    assert state.read(name).record == record_of({**fields, "paused": True})
    if backend.kind != "memory":
        poke(backend, state, name, {**fields, "paused": False})
        assert state.read(name).record == record_of(fields)
    assert state.reset(name) is True


def test_states_refuse_a_lead_past_the_limit(backend: Backend) -> None:
    """A lead over MAX_LEAD_US could grant a start no reader accepts: refused before anything is sent."""
    state = backend.open()
    name = backend.fresh_name()
    for call in (
        lambda: do(state, "take_and_try", name, INTERVAL, MAX_LEAD_US + 1),
        lambda: do(state, "try_start", name, INTERVAL, 1, MAX_LEAD_US + 1),
        lambda: do(state, "retime", name, INTERVAL, 1, MAX_LEAD_US + 1),
    ):
        with pytest.raises(ConfigurationError, match=rf"lead_us must be at most {MAX_LEAD_US}"):
            call()
    assert state.read(name).record is None
    assert isinstance(do(state, "take_and_try", name, INTERVAL, MAX_LEAD_US), Started)


# -- shards notice a reset ------------------------------------------------------


def test_the_shard_clamps_its_lead() -> None:
    assert make_shard(1.0, lead=7200.0).lead == MAX_LEAD_US / US
    shard = make_shard(1.0, jitter=5000.0)
    assert shard.lead == MAX_LEAD_US / US
    job = shard.add()
    assert shard.step(job, 0.0) == Step("take_and_try", lead_us=MAX_LEAD_US)


def test_a_waiter_on_a_far_slot_gets_its_turn_soon_after_a_reset() -> None:
    """Interval 30 s: the second acquire sleeps toward a slot 30 s away; after a reset it starts at once.

    (At once: within :data:`RECHECK` and a round-trip, not at the old slot.)
    """
    state = MemoryState(private=True)
    # max_late=None: a turn begun late on a busy host is not given up (for 30 s) here
    limiter = ratequeue.Limiter(state, name="far", interval=30, max_late=None)
    try:
        limiter.acquire()
        returned: list[float] = []
        waiter = threading.Thread(
            target=lambda: (limiter.acquire(), returned.append(time.monotonic())), daemon=True
        )
        waiter.start()
        _until_taken(state, "far", 3)  # the waiter holds ticket 2 and sleeps toward its slot
        assert not returned
        reset_at = time.monotonic()
        assert state.reset("far") is True
        waiter.join(timeout=10)
        assert returned, "the waiter never noticed the reset"
        assert returned[0] - reset_at <= RECHECK + 0.5
        after = state.read("far").record
        assert after is not None
        assert (after.ticket, after.pos) == (2, 1), "it took the new record's first ticket"
    finally:
        limiter.close()


def _until_taken(state: State, name: str, next_ticket: int) -> None:
    """Wait (10 s at most) until ``name``'s record hands out ``next_ticket`` next."""
    deadline = time.monotonic() + 10
    while (record := state.read(name).record) is None or record.ticket < next_ticket:
        assert time.monotonic() < deadline, f"the record never reached ticket {next_ticket}: {record}"
        time.sleep(0.005)
    assert record.ticket == next_ticket, record


def test_a_file_state_waiter_notices_a_reset(tmp_path: Path) -> None:
    """The same on the file state, reset by another state object (as ``ratequeue reset`` does)."""
    path = tmp_path / "state.json"
    limiter = ratequeue.Limiter(FileState(path), name="far", interval=30, max_late=None)
    try:
        limiter.acquire()
        returned: list[float] = []
        waiter = threading.Thread(
            target=lambda: (limiter.acquire(), returned.append(time.monotonic())), daemon=True
        )
        waiter.start()
        _until_taken(FileState(path), "far", 3)
        assert not returned
        reset_at = time.monotonic()
        assert FileState(path).reset("far") is True
        waiter.join(timeout=10)
        assert returned, "the waiter never noticed the reset"
        assert returned[0] - reset_at <= RECHECK + 0.5
    finally:
        limiter.close()


@given(
    slot=st.floats(0.0, 3600.0, allow_nan=False),
    lead=st.sampled_from([0.0, 0.002, 0.5]),
    received=st.floats(0.0, 100.0, allow_nan=False),
)
def test_a_head_re_asks_within_the_bound(slot: float, lead: float, received: float) -> None:
    """Told to wait for a slot however far, the head asks the state again within RECHECK of the answer."""
    shard = make_shard(30.0, lead=lead)
    job = shard.add()
    assert is_step(shard.step(job, received), "take_and_try")
    shard.receive(job, Wait(ticket=2, slot=round(slot * US), now=0), received, received, offset=received)
    now = received
    for _ in range(3):  # a sleep may end early (a change of the shard): asking again never goes past
        step = shard.step(job, now)
        if is_step(step, "try_start"):
            break
        assert isinstance(step, SleepUntil)
        assert step.until <= received + RECHECK + 1e-9
        now = step.until
    else:
        raise AssertionError("the head never asked again")
    assert now <= received + RECHECK + 1e-9
