"""MongoDB's keep times on the server's real clock: the ``expires`` field, its TTL index, sweeps, names.

The contract (tests/test_contract.py) drives every backend on a test clock;
these tests run on secantusdb's own ``$$NOW`` and its TTL monitor, which a
test clock cannot reach. secantusdb's monitor passes once a minute, as
MongoDB's does; its ``secantusAdmin.pruneTtl`` command runs a pass at once.
"""

from __future__ import annotations

import asyncio
import datetime
import itertools
import time
from collections.abc import Iterator
from typing import Any

import pytest
from pymongo import AsyncMongoClient, MongoClient
from pymongo.collection import Collection

from ratequeue.core import protocol
from ratequeue.core.operation import Kind, apply
from ratequeue.core.protocol import (
    MAX_DOUBT_US,
    MAX_LEAD_US,
    MAX_SLOW,
    MAX_US,
    NEVER,
    RECOVER_US,
    US,
    Started,
)
from ratequeue.errors import StateCorrupted
from ratequeue.state.mongodb import AsyncMongoState, MongoState
from ratequeue.state.mongodb.codec import EXPIRES, TTL_INDEX, check_document, datetime_us
from ratequeue.state.records import FIELDS

from .ops import ado, do, op
from .servers import Server

DATABASE = "expiry"
_collections = itertools.count()


@pytest.fixture
def client(mongodb_server: Server) -> Iterator[MongoClient[Any]]:
    mongo: MongoClient[Any] = MongoClient(port=mongodb_server.port)
    yield mongo
    mongo.close()


@pytest.fixture
def state(client: MongoClient[Any]) -> MongoState:
    """A state on a collection of its own (sweeps delete across a collection)."""
    return MongoState(client, database=DATABASE, collection=f"c{next(_collections)}")


def stored(state: MongoState, name: str) -> dict[str, Any] | None:
    return state.collection.find_one({"_id": name}, {"answer": False})


def only_sweeps_delete(state: MongoState) -> None:
    """Drop the state's TTL index: the server's monitor, passing once a minute, would now and then
    delete a record a test expects to find, or to sweep, first (CI saw a sweep of 0)."""
    state.collection.drop_index(TTL_INDEX)


def ms_up(us: int) -> int:
    return -(-us // 1000)


def document_of(name: object, **fields: Any) -> dict[str, Any]:
    """A whole stored record, as the state writes one (every field), ``fields`` changed."""
    record = {
        "ticket": 3,
        "pos": 2,
        "at": 5,
        "interval": 1000,
        "due": 5,
        "burst": 1,
        "paused": False,
        "max_running": 0,
        "leases": [],
        "held": NEVER,
    }
    return {"_id": name, **record, **fields}


def test_a_write_with_a_keep_time_stores_when_the_record_may_go(state: MongoState) -> None:
    """``expires`` is the Date ``keep_us`` after the later of ``now`` and the record's expiry, rounded up."""
    interval, keep = 1_234_567, 3_000_001
    outcome = do(state, "take_and_try", "q", interval, 0, burst=3, cost=2, keep_us=keep)
    assert isinstance(outcome, Started)
    record = state.read("q").record
    assert record is not None
    document = stored(state, "q")
    assert document is not None
    until = max(protocol.expires(record), outcome.now) + keep
    assert isinstance(document[EXPIRES], datetime.datetime)
    assert datetime_us(document[EXPIRES]) == ms_up(until) * 1000


def test_a_write_without_a_keep_time_removes_it(state: MongoState) -> None:
    """A record a plain limiter uses never goes away, whatever a keyed one wrote before."""
    do(state, "take", "q", 10_000, keep_us=US)
    assert EXPIRES in (stored(state, "q") or {})
    for call in (
        lambda: do(state, "take", "q", 10_000),
        lambda: do(state, "try_start", "q", 10_000, 1, 0),
        lambda: do(state, "retime", "q", 10_000, 1, 0),
        lambda: do(state, "take_and_try", "q", 10_000, 0),
    ):
        do(state, "take", "q", 10_000, keep_us=US)
        call()
        assert EXPIRES not in (stored(state, "q") or {})


def test_the_ttl_index_is_created_and_deletes_idle_records(
    state: MongoState, client: MongoClient[Any]
) -> None:
    """The server's TTL monitor deletes a record past its keep time, and nothing else."""
    do(state, "take_and_try", "going", 1000, 0, keep_us=1000)
    do(state, "take_and_try", "kept", 1000, 0, keep_us=3600 * US)
    do(state, "take_and_try", "forever", 1000, 0)
    index = state.collection.index_information()[TTL_INDEX]
    assert (index["key"], index["expireAfterSeconds"]) == ([(EXPIRES, 1)], 0)
    time.sleep(0.05)
    client.admin.command("secantusAdmin.pruneTtl")  # the monitor's pass, now
    assert state.names() == ["forever", "kept"]


def test_sweep_deletes_what_has_passed_its_keep_time_on_the_server_clock(state: MongoState) -> None:
    do(state, "take_and_try", "going", 1000, 0, keep_us=US // 2)
    do(state, "take_and_try", "kept", 1000, 0, keep_us=3600 * US)
    do(state, "take_and_try", "forever", 1000, 0)
    only_sweeps_delete(state)
    assert state.sweep() == 0
    going = stored(state, "going")
    assert going is not None
    until = datetime_us(going[EXPIRES])
    deadline = time.monotonic() + 10.0
    while state.read("going").now < until:  # the keep time passes on the server's clock
        assert time.monotonic() < deadline, "the server's clock did not reach the keep time"
        time.sleep(0.05)
    assert state.sweep() == 1
    assert state.names() == ["forever", "kept"]
    assert state.sweep() == 0


def test_creating_a_record_sweeps_now_and_then(state: MongoState) -> None:
    do(state, "take_and_try", "going", 1000, 0, keep_us=1000)
    only_sweeps_delete(state)
    time.sleep(0.05)
    do(state, "take", "other", 1000)  # created within sweep_every_us of the last sweep: no sweep
    assert state.names() == ["going", "other"]
    state.sweep_every_us = 0
    do(state, "take", "another", 1000)
    assert state.names() == ["another", "other"]
    do(state, "take", "another", 1000)  # no record created: no sweep
    assert state.names() == ["another", "other"]


def test_an_expired_record_still_there_behaves_as_a_fresh_one(state: MongoState) -> None:
    do(state, "take_and_try", "q", 1000, 0, burst=2, keep_us=1000)
    time.sleep(0.05)
    assert isinstance(do(state, "take_and_try", "q", 1000, 0, burst=2, cost=2, keep_us=1000), Started)


def test_a_refused_record_keeps_its_keep_time(state: MongoState) -> None:
    """A record the protocol refuses is left exactly as it was, ``expires`` too (or its absence)."""
    now = state.read("q").now
    far = now + MAX_LEAD_US + 10 * US
    until = datetime.datetime(2100, 1, 1)
    for extra in ({EXPIRES: until}, {}):
        document = document_of("q", pos=1, at=far, due=far, **extra)
        state.collection.replace_one({"_id": "q"}, document, upsert=True)
        for keep in (0, US):
            with pytest.raises(StateCorrupted, match="at="):
                do(state, "take", "q", 1000, keep_us=keep)
            assert stored(state, "q") == document


def test_a_test_clock_keeps_integers_which_the_ttl_monitor_leaves_alone(
    state: MongoState, client: MongoClient[Any]
) -> None:
    """On a test clock ``expires`` is whole microseconds on it: the real clock's TTL and sweep skip it."""
    clock = [1_000_000]
    clocked = MongoState(client, database=DATABASE, collection=state.collection.name, clock=lambda: clock[0])
    do(clocked, "take_and_try", "clocked", 1000, 0, keep_us=5000)
    # expires(record) = slot(ticket) + interval = now + 2 ms; kept until 5 ms after that
    assert (stored(clocked, "clocked") or {})[EXPIRES] == 1_000_000 + 2000 + 5000
    do(state, "take_and_try", "real", 1000, 0, keep_us=1000)
    time.sleep(0.05)
    client.admin.command("secantusAdmin.pruneTtl")
    assert state.names() == ["clocked"]
    only_sweeps_delete(state)
    do(state, "take_and_try", "real", 1000, 0, keep_us=1000)
    time.sleep(0.05)
    assert state.sweep() == 1  # the real one only
    assert clocked.sweep() == 0
    clock[0] += 6999
    assert clocked.sweep() == 0
    clock[0] += 1
    assert clocked.sweep() == 1
    assert state.names() == []


def test_every_document_holds_every_field(state: MongoState) -> None:
    """Every field of the record is stored, whatever the terms; ``due`` is the last start's strict slot."""
    do(state, "take_and_try", "one", 1000, 0)
    document = stored(state, "one") or {}
    assert set(document) == {"_id", *FIELDS, *NEWER_FIELDS}
    assert (document["burst"], document["due"], document["max_running"]) == (1, document["at"], 0)
    assert (document["paused"], document["leases"], document["held"]) == (False, [], NEVER)
    assert (document["not_before"], document["pace"], document["paced_at"]) == (NEVER, 0, NEVER)
    assert document["settled"] == 0
    do(state, "take_and_try", "three", US, 0, burst=3, cost=3)
    document = stored(state, "three") or {}
    assert set(document) == {"_id", *FIELDS, *NEWER_FIELDS}
    assert (document["burst"], document["due"] - document["at"]) == (3, 0)
    # ticket 4: its slot is 3 s after the first start, and it may start 2 s early
    do(state, "take_and_try", "three", US, 2 * US, burst=3)
    document = stored(state, "three") or {}
    assert (document["burst"], document["due"] - document["at"]) == (3, 2 * US)


@pytest.mark.parametrize(
    "fields",
    [
        {"burst": 2.0},
        {"burst": "2"},
        {"burst": 2, "due": 2.5},
        {"burst": 2, "due": None},
        {"burst": 2, "due": 5 - 2 * 1000 - 1},
    ],
    ids=["burst double", "burst text", "due double", "due null", "due a burst of intervals before at"],
)
def test_malformed_burst_fields_are_corrupted_and_unchanged(
    state: MongoState, fields: dict[str, Any]
) -> None:
    document = document_of("bad", **fields)
    state.collection.insert_one(document)
    with pytest.raises(StateCorrupted):
        do(state, "take_and_try", "bad", 1000, 0, burst=2, keep_us=US)
    assert stored(state, "bad") == document


#: the fields documents written before holds, slow-downs and settlements lack
NEWER_FIELDS = ("not_before", "pace", "paced_at", "settled")

#: a fixed state clock (us), for the tests on a clocked state
NOW = 1_800_000_000_000_000


@pytest.fixture
def clocked(state: MongoState, client: MongoClient[Any]) -> MongoState:
    """``state``'s collection on a test clock fixed at :data:`NOW`."""
    return MongoState(client, database=DATABASE, collection=state.collection.name, clock=lambda: NOW)


def test_a_document_older_than_slow_downs_reads_as_none_and_is_filled_in(state: MongoState) -> None:
    """A document without ``pace``, ``paced_at`` (or ``not_before``) holds no slow-down; a write adds them."""
    state.collection.insert_one(document_of("old"))
    record = state.read("old").record
    assert record is not None
    assert (record.not_before, record.pace, record.paced_at) == (NEVER, 0, NEVER)
    do(state, "take", "old", 1000)
    document = stored(state, "old") or {}
    assert (document["not_before"], document["pace"], document["paced_at"]) == (NEVER, 0, NEVER)
    assert document["ticket"] == 4


@pytest.mark.parametrize(
    "fields",
    [
        {"pace": 1500.5},
        {"pace": "2000"},
        {"pace": None},
        {"pace": False},
        {"pace": 0.0},
        {"pace": -1},
        {"pace": MAX_SLOW * 1000 + 1},
        {"paced_at": None},
        {"paced_at": 2.0},
        {"paced_at": MAX_US},
        {"paced_at": NEVER - 1},
        {"burst": 2, "due": 5 + MAX_SLOW * 1000 + MAX_DOUBT_US + 1},
    ],
    ids=[
        "pace double",
        "pace text",
        "pace null",
        "pace false",
        "pace zero double",
        "pace negative",
        "pace past MAX_SLOW intervals",
        "paced_at null",
        "paced_at double",
        "paced_at at MAX_US",
        "paced_at before NEVER",
        "due past burst - 1 of the slowest paces and a doubt",
    ],
)
def test_malformed_slow_down_fields_are_corrupted_and_unchanged(
    state: MongoState, fields: dict[str, Any]
) -> None:
    """``pace`` and ``paced_at``, where present, are whole numbers in range, as the file state checks them."""
    document = document_of("bad", **fields)
    state.collection.insert_one(document)
    calls: list[tuple[Kind, tuple[int, ...]]] = [("take", ()), ("take_and_try", (0,)), ("slow", (0,))]
    for kind, args in calls:
        with pytest.raises(StateCorrupted):
            do(state, kind, "bad", 1000, *args, burst=fields.get("burst", 1), keep_us=US)
        assert stored(state, "bad") == document


def test_a_pace_keeps_burst_paces_under_max_us(state: MongoState) -> None:
    """``burst * pace`` under ``MAX_US``: one microsecond less is taken, the limit itself refused."""
    interval, burst = 2**40, 2**11
    for pace, refused in ((2**41 - 1, False), (2**41, True)):
        name = f"p{pace}"
        document = document_of(name, interval=interval, burst=burst, pace=pace, paced_at=NEVER)
        state.collection.insert_one(document)
        if refused:
            with pytest.raises(StateCorrupted):
                do(state, "take", name, interval, burst=burst)
            assert stored(state, name) == document
        else:
            do(state, "take", name, interval, burst=burst)
            assert (stored(state, name) or {})["pace"] == pace


def test_a_due_up_to_burst_paces_after_at_is_taken(state: MongoState) -> None:
    """A slowed record's ``due`` may lie up to ``burst - 1`` paces after ``at`` (the slots count at it)."""
    document = document_of("slowed", burst=3, pace=3000, paced_at=NEVER, due=5 + 2 * 3000)
    state.collection.insert_one(document)
    record = state.read("slowed").record
    assert record is not None
    assert record.due == 5 + 6000
    do(state, "take", "slowed", 1000, burst=3)
    assert (stored(state, "slowed") or {})["ticket"] == 4


def test_a_due_up_to_a_doubt_past_the_slowest_paces_is_taken(state: MongoState) -> None:
    """``due`` may lie up to ``MAX_DOUBT_US`` (a doubt) past ``burst - 1`` slowest paces after ``at``."""
    due = 5 + MAX_SLOW * 1000 + MAX_DOUBT_US
    state.collection.insert_one(document_of("doubted", burst=2, due=due))
    record = state.read("doubted").record
    assert record is not None
    assert record.due == due
    do(state, "take", "doubted", 1000, burst=2)
    assert (stored(state, "doubted") or {})["ticket"] == 4


def test_a_paced_at_too_far_ahead_is_refused(clocked: MongoState) -> None:
    """``paced_at`` more than MAX_LEAD_US past ``now`` was not written by the protocol, as ``held``."""
    for paced_at, refused in ((NOW + MAX_LEAD_US, False), (NOW + MAX_LEAD_US + 1, True)):
        document = document_of("q", pace=2000, paced_at=paced_at)
        clocked.collection.replace_one({"_id": "q"}, document, upsert=True)
        calls: list[tuple[Kind, tuple[int, ...]]] = [("take", ()), ("try_start", (3, 0)), ("slow", (0,))]
        for kind, args in [*calls, ("hold", (0,))]:
            if refused:
                with pytest.raises(StateCorrupted, match=f"paced_at={paced_at}"):
                    do(clocked, kind, "q", 1000, *args)
                assert stored(clocked, "q") == document
            else:
                do(clocked, kind, "q", 1000, *args)
        if refused:
            with pytest.raises(StateCorrupted, match=f"paced_at={paced_at}"):
                clocked.read("q")


@pytest.mark.parametrize(
    ("interval", "pace"),
    [(1, 64), (1000, 1999), (1000, 64_000), (2**45 + 1, 2**51 - 1), (2**45, 2**51)],
    ids=["1 us", "odd excess", "MAX_SLOW", "near MAX_US odd", "near MAX_US even"],
)
def test_a_pace_recovers_as_the_reference_counts_it(clocked: MongoState, interval: int, pace: int) -> None:
    """The effective interval at every halving and about it (exact in the pipeline's doubles), 53 and on.

    ``try_start`` of the ticket after a start made now waits until the
    effective interval has passed: its answer is that interval, exactly.
    """
    since = [-RECOVER_US, -1, 0, 1]
    since += [k * RECOVER_US + d for k in (1, 2, 3, 20, 50, 51, 52, 53, 54, 1000) for d in (-1, 0, 1)]
    since += [NOW - NEVER]
    for ago in since:
        fields = {"ticket": 3, "pos": 1, "at": NOW, "due": NOW, "interval": interval}
        document = document_of("q", **fields, pace=pace, paced_at=NOW - ago)
        clocked.collection.replace_one({"_id": "q"}, document, upsert=True)
        record = check_document(document, "q")
        want = protocol.effective_interval(record, NOW)
        assert want >= interval
        expected = protocol.try_start(record, 2, 0, NOW)[1]
        assert do(clocked, "try_start", "q", interval, 2, 0) == expected, ago
        assert expected.slot == NOW + want  # type: ignore[union-attr]


def test_slow_sets_the_pace_and_the_keep_time_counts_at_it(clocked: MongoState) -> None:
    """``slow`` answers whether it slowed; the keep time counts every slot at the slowest pace held."""
    assert do(clocked, "take_and_try", "q", 1000, 0, keep_us=5000) == Started(1, NOW, NOW)
    assert do(clocked, "slow", "q", 1000, 0, keep_us=5000) is True
    assert do(clocked, "slow", "q", 1000, 1500, keep_us=5000) is False  # no slower than 2 ms
    assert do(clocked, "slow", "q", 1000, 10**9, keep_us=5000) is True  # capped: MAX_SLOW intervals
    record = clocked.read("q").record
    assert record is not None
    assert (record.pace, record.paced_at) == (MAX_SLOW * 1000, NOW)
    do(clocked, "take", "q", 1000, keep_us=5000)
    record = clocked.read("q").record
    assert record is not None
    assert (stored(clocked, "q") or {})[EXPIRES] == protocol.expires(record) + 5000
    assert protocol.expires(record) == NOW + 3 * MAX_SLOW * 1000


def test_names_match_the_prefix_literally(state: MongoState) -> None:
    for name in ("a.b", "axb", "a.b.c", "(x)", "ab", "b"):
        do(state, "take", name, 1000)
    collection: Collection[Any] = state.collection
    collection.insert_one(document_of(7))  # not a queue name
    assert state.names("a.") == ["a.b", "a.b.c"]
    assert state.names("(") == ["(x)"]
    assert state.names() == ["(x)", "a.b", "a.b.c", "ab", "axb", "b"]
    assert state.names("zzz") == []


def test_async_names_and_sweep(mongodb_server: Server) -> None:
    async def main() -> None:
        client: AsyncMongoClient[Any] = AsyncMongoClient(port=mongodb_server.port)
        collection = f"c{next(_collections)}"
        state = AsyncMongoState(client, database=DATABASE, collection=collection)
        try:
            await ado(state, "take_and_try", "going", 1000, 0, keep_us=1000)
            await ado(state, "take_and_try", "kept", 1000, 0)
            assert TTL_INDEX in await client[DATABASE][collection].index_information()
            await client[DATABASE][collection].drop_index(TTL_INDEX)  # as only_sweeps_delete
            await asyncio.sleep(0.05)
            assert await state.names() == ["going", "kept"]
            assert await state.sweep() == 1
            assert await state.names("k") == ["kept"]
        finally:
            await state.close()

    asyncio.run(main())


# -- settle -----------------------------------------------------------------------


def test_a_document_older_than_settlements_reads_as_none_and_is_filled_in(state: MongoState) -> None:
    """A document without ``settled`` holds no settlement (0); any write adds it, a refusal does not."""
    state.collection.insert_one(document_of("old"))
    record = state.read("old").record
    assert record is not None
    assert record.settled == 0
    do(state, "take", "old", 1000)
    assert (stored(state, "old") or {})["settled"] == 0


@pytest.mark.parametrize(
    "fields",
    [
        {"settled": 1.0},
        {"settled": "1"},
        {"settled": None},
        {"settled": True},
        {"settled": -1},
        {"settled": 3},
        {"burst": 2, "due": 5 - 2 * 1000 - 1},
    ],
    ids=[
        "settled double",
        "settled text",
        "settled null",
        "settled true",
        "settled negative",
        "settled above pos",
        "due a burst of intervals before at",
    ],
)
def test_malformed_settlement_fields_are_corrupted_and_unchanged(
    state: MongoState, fields: dict[str, Any]
) -> None:
    """``settled``, where present, is a ticket from 0 to ``pos``; ``due`` at most a burst before ``at``."""
    document = document_of("bad", **fields)
    state.collection.insert_one(document)
    calls: list[tuple[Kind, tuple[int, ...]]] = [("take", ()), ("take_and_try", (0,)), ("settle", (2, 1, 0))]
    for kind, args in calls:
        with pytest.raises(StateCorrupted):
            do(state, kind, "bad", 1000, *args, burst=fields.get("burst", 1), keep_us=US)
        assert stored(state, "bad") == document
    with pytest.raises(StateCorrupted):
        state.read("bad")


@pytest.mark.parametrize("settled", [0, 1, 2])
def test_a_due_up_to_a_burst_before_at_and_a_settled_ticket_are_taken(
    state: MongoState, settled: int
) -> None:
    """``due`` as far back as ``at - burst * interval`` and ``settled`` up to ``pos`` are well formed."""
    document = document_of("refunded", burst=2, due=5 - 2 * 1000, settled=settled)
    state.collection.insert_one(document)
    record = state.read("refunded").record
    assert record is not None
    assert (record.due, record.settled) == (5 - 2000, settled)
    do(state, "take", "refunded", 1000, burst=2)
    assert (stored(state, "refunded") or {})["ticket"] == 4
    assert (stored(state, "refunded") or {})["settled"] == settled


#: records to settle on (fields of :func:`document_of`) and the settlements tried on each
_SETTLEMENTS: list[tuple[dict[str, Any], list[tuple[int, int, int]]]] = [
    # burst 4, ticket 5 started now with its slot 2 ms on (tickets 1-5 handed out, costs 1)
    (
        {"ticket": 6, "pos": 5, "at": NOW, "due": NOW + 2000, "burst": 4},
        [(t, e, a) for t in (1, 4, 5, 6, 9) for e, a in ((1, 0), (1, 4), (2, 1), (3, 0), (4, 4), (2, 3))],
    ),
    # slowed: the overrun counts at the effective interval; capped at burst - 1 slowest paces
    (
        {
            "ticket": 9,
            "pos": 8,
            "at": NOW,
            "due": NOW + 3000,
            "burst": 4,
            "pace": 50_000,
            "paced_at": NOW - 1,
        },
        [(8, 1, 4), (8, 2, 4), (7, 1, 0), (8, 4, 0), (3, 1, 2)],
    ),
    (
        {
            "ticket": 9,
            "pos": 8,
            "at": NOW,
            "due": NOW + 3 * 64_000 - 10,
            "burst": 4,
            "pace": 64_000,
            "paced_at": NOW,
        },
        [(8, 1, 4), (8, 1, 2)],
    ),
    # at the cap already: an overrun moves nothing
    (
        {
            "ticket": 9,
            "pos": 8,
            "at": NOW,
            "due": NOW + 3 * 64_000,
            "burst": 4,
            "pace": 64_000,
            "paced_at": NOW,
        },
        [(8, 1, 4), (8, 2, 1)],
    ),
    # past the cap by a doubt: an overrun moves nothing (never back), a refund moves it
    (
        {
            "ticket": 9,
            "pos": 8,
            "at": NOW,
            "due": NOW + 3 * 64_000 + MAX_DOUBT_US,
            "burst": 4,
            "pace": 64_000,
            "paced_at": NOW,
        },
        [(8, 1, 4), (8, 2, 1)],
    ),
    ({"ticket": 6, "pos": 5, "at": NOW, "due": NOW + 94_000, "burst": 2}, [(5, 1, 2), (5, 2, 1)]),
    # recovering (two halvings): the excess counts at the effective interval now
    (
        {
            "ticket": 9,
            "pos": 8,
            "at": NOW,
            "due": NOW,
            "burst": 4,
            "pace": 41_001,
            "paced_at": NOW - 2 * RECOVER_US,
        },
        [(8, 1, 4), (8, 3, 4)],
    ),
    # the refund's floor: a started ticket far behind pos moves nothing
    (
        {"ticket": 4000, "pos": 3999, "at": NOW, "due": NOW, "burst": 4},
        [(1, 4, 0), (3995, 4, 0), (3996, 4, 0)],
    ),
    # settled already: that ticket again moves nothing, another one does
    ({"ticket": 6, "pos": 5, "at": NOW, "due": NOW + 2000, "burst": 4, "settled": 5}, [(5, 1, 3), (4, 1, 3)]),
    # never started: nothing moves
    ({"ticket": 6, "pos": 5, "at": NEVER, "due": NEVER, "burst": 4}, [(5, 1, 3), (5, 3, 0)]),
    # near MAX_US: the floor's multiplier and every product stay exact
    (
        {
            "ticket": MAX_US - 1,
            "pos": MAX_US - 2,
            "at": NOW,
            "due": NOW + 2**40,
            "burst": 2,
            "interval": 2**41,
        },
        [(1, 2, 0), (MAX_US - 2, 2, 0), (MAX_US - 3, 1, 0), (MAX_US - 2, 1, 2), (MAX_US - 1, 1, 0)],
    ),
]


@pytest.mark.parametrize(("fields", "settlements"), _SETTLEMENTS, ids=lambda value: "")
def test_settle_moves_due_as_the_reference(
    clocked: MongoState, fields: dict[str, Any], settlements: list[tuple[int, int, int]]
) -> None:
    """Each settlement, on the same record, answers and stores what :func:`protocol.settle` does."""
    interval, burst = fields.get("interval", 1000), fields["burst"]
    for ticket, estimate, actual in settlements:
        document = document_of("q", **{"interval": 1000, **fields})
        clocked.collection.replace_one({"_id": "q"}, document, upsert=True)
        record = check_document(document, "q")
        want, moved = protocol.settle(record, ticket, estimate, actual, NOW)
        answer = do(clocked, "settle", "q", interval, ticket, estimate, actual, burst=burst, keep_us=US)
        assert answer is moved, (ticket, estimate, actual)
        assert clocked.read("q").record == want, (ticket, estimate, actual)
        if not moved:
            assert {k: v for k, v in (stored(clocked, "q") or {}).items() if k != EXPIRES} == {
                **document,
                **dict.fromkeys(("not_before", "paced_at"), NEVER),
                "pace": fields.get("pace", 0),
                "settled": fields.get("settled", 0),
                **{k: v for k, v in fields.items() if k in ("not_before", "paced_at")},
            }


def test_a_settlement_runs_on_after_a_refund_below_at(clocked: MongoState) -> None:
    """A refund may leave ``due`` before ``at``; every operation then reads and keeps that record."""
    assert do(clocked, "take_and_try", "q", 1000, 0, burst=4, cost=4, keep_us=US) == Started(1, NOW, NOW)
    assert do(clocked, "settle", "q", 1000, 1, 4, 0, burst=4, keep_us=US) is True
    assert do(clocked, "settle", "q", 1000, 1, 4, 0, burst=4, keep_us=US) is False  # counted once
    record = clocked.read("q").record
    assert record is not None
    # the whole cost refunded: due a burst of intervals before at, the furthest back a record holds
    assert (record.due, record.settled) == (NOW - 4000, 1)
    assert (stored(clocked, "q") or {})[EXPIRES] == max(protocol.expires(record), NOW) + US
    for kind, args in [("take", ()), ("slow", (0,)), ("hold", (0,)), ("lift", ())]:
        do(clocked, kind, "q", 1000, *args, burst=4, keep_us=US)  # type: ignore[arg-type]
    record = clocked.read("q").record
    assert record is not None
    assert (record.due, record.settled) == (NOW - 4000, 1)


def test_a_doubt_moves_due_and_a_retime_keeps_it(clocked: MongoState) -> None:
    """A start adds its doubt to ``due``; a retime moves ``due`` as much as the start; as the reference."""
    reference = protocol.new_record(1000, 2)
    steps: list[tuple[Kind, tuple[int, ...]]] = [
        ("take_and_try", (0, 30_000)),
        ("retime", (1, 5000)),
        ("take", ()),
        ("try_start", (2, MAX_LEAD_US, MAX_DOUBT_US)),
        ("try_start", (2, MAX_LEAD_US, 7)),  # the same start again: nothing moves
        ("settle", (2, 1, 2)),  # past the cap by the doubt: nothing moves
    ]
    for kind, args in steps:
        reference, want = apply(reference, op(kind, "q", 1000, *args, burst=2), NOW)
        assert do(clocked, kind, "q", 1000, *args, burst=2) == want, (kind, args)
        assert clocked.read("q").record == reference, (kind, args)
    assert (reference.at, reference.due) == (NOW + 35_000, NOW + 36_000 + MAX_DOUBT_US)


# -- paused_at ----------------------------------------------------------------------


def test_a_paused_record_stores_paused_at_and_a_resumed_one_is_as_if_never_paused(
    state: MongoState, client: MongoClient[Any]
) -> None:
    """``paused_at`` is the pause's ``now``, kept by every operation and a pause asked again; gone on resume.

    ``p`` is paused and resumed; its twin ``q`` sees the same writes unpaused:
    once resumed, the two documents are the same (``paused_at`` stored no more).
    """
    clock = [NOW]
    ticking = MongoState(client, database=DATABASE, collection=state.collection.name, clock=lambda: clock[0])
    reference = protocol.new_record(1000)

    def on_p(kind: Kind, *args: int | bool) -> Any:
        nonlocal reference
        reference, want = apply(reference, op(kind, "p", 1000, *args, keep_us=US), clock[0])
        got = do(ticking, kind, "p", 1000, *args, keep_us=US)
        assert got == want, (kind, args)
        assert ticking.read("p").record == reference, (kind, args)
        return got

    for name in ("p", "q"):
        do(ticking, "take_and_try", name, 1000, 0, keep_us=US)
    reference = check_document(stored(ticking, "p") or {}, "p")
    clock[0] += 1000
    assert on_p("set_paused", True) is True
    paused = stored(ticking, "p") or {}
    assert (paused["paused"], paused["paused_at"], EXPIRES in paused) == (True, NOW + 1000, False)
    assert reference.paused_at == NOW + 1000
    clock[0] += 1000
    assert on_p("set_paused", True) is False  # the first pause's time stays
    clock[0] += 1000
    writes: list[tuple[Kind, tuple[int, ...]]] = [("take", ()), ("hold", (5000,))]
    for kind, args in writes:
        on_p(kind, *args)
        do(ticking, kind, "q", 1000, *args, keep_us=US)
    before = stored(ticking, "p")
    waits: list[tuple[Kind, tuple[int, ...]]] = [("try_start", (2, 0)), ("try_take", (0,))]
    for kind, args in waits:
        assert isinstance(on_p(kind, *args), protocol.Wait)  # paused: nothing written
        assert stored(ticking, "p") == before
    assert (stored(ticking, "p") or {})["paused_at"] == NOW + 1000
    clock[0] += 1000
    assert on_p("set_paused", False) is True
    assert on_p("set_paused", False) is False
    assert "paused_at" not in (stored(ticking, "p") or {})
    assert reference.paused_at == NEVER
    clock[0] += 1000
    for name in ("p", "q"):
        do(ticking, "take_and_try", name, 1000, 0, keep_us=US)
    resumed, twin = stored(ticking, "p") or {}, stored(ticking, "q") or {}
    assert set(resumed) == {"_id", *FIELDS, *NEWER_FIELDS, EXPIRES}
    assert {**resumed, "_id": "q"} == twin


def test_a_document_paused_by_an_older_version_reads_never(clocked: MongoState) -> None:
    """A paused document without ``paused_at`` reads ``NEVER``; a pause asked again and a write keep it so."""
    clocked.collection.insert_one(document_of("old", paused=True))
    record = clocked.read("old").record
    assert record is not None
    assert (record.paused, record.paused_at) == (True, NEVER)
    assert do(clocked, "set_paused", "old", 1000, True) is False
    do(clocked, "take", "old", 1000, keep_us=US)
    document = stored(clocked, "old") or {}
    assert (document["paused"], document["ticket"], "paused_at" in document) == (True, 4, False)
    assert do(clocked, "set_paused", "old", 1000, False) is True
    assert "paused_at" not in (stored(clocked, "old") or {})
    assert do(clocked, "set_paused", "old", 1000, True) is True
    assert (stored(clocked, "old") or {})["paused_at"] == NOW


@pytest.mark.parametrize(
    "fields",
    [
        {"paused": True, "paused_at": None},
        {"paused": True, "paused_at": 5.0},
        {"paused": True, "paused_at": "5"},
        {"paused": True, "paused_at": True},
        {"paused": True, "paused_at": MAX_US},
        {"paused": True, "paused_at": NEVER - 1},
    ],
    ids=["null", "double", "text", "true", "at MAX_US", "before NEVER"],
)
def test_malformed_paused_at_is_corrupted_and_unchanged(state: MongoState, fields: dict[str, Any]) -> None:
    """``paused_at`` on a paused record, where present, is whole microseconds in range."""
    document = document_of("bad", **fields)
    state.collection.insert_one(document)
    calls: list[tuple[Kind, tuple[int | bool, ...]]] = [
        ("take", ()),
        ("take_and_try", (0,)),
        ("set_paused", (True,)),
        ("set_paused", (False,)),
    ]
    for kind, args in calls:
        with pytest.raises(StateCorrupted, match="paused_at"):
            do(state, kind, "bad", 1000, *args, keep_us=US)
        assert stored(state, "bad") == document
    if fields["paused_at"] is not None:  # (a null reads as none, as a null paced_at does)
        with pytest.raises(StateCorrupted, match="paused_at"):
            state.read("bad")


def test_a_paused_at_too_far_ahead_is_refused(clocked: MongoState) -> None:
    """``paused_at`` more than MAX_LEAD_US past ``now`` was not written by the protocol, as ``held``."""
    for paused_at, refused in ((NOW + MAX_LEAD_US, False), (NOW + MAX_LEAD_US + 1, True)):
        document = document_of("q", paused=True, paused_at=paused_at)
        calls: list[tuple[Kind, tuple[int | bool, ...]]] = [
            ("take", ()),
            ("try_start", (3, 0)),
            ("set_paused", (True,)),
            ("set_paused", (False,)),
        ]
        for kind, args in calls:
            clocked.collection.replace_one({"_id": "q"}, document, upsert=True)
            if refused:
                with pytest.raises(StateCorrupted, match=f"paused_at={paused_at}"):
                    do(clocked, kind, "q", 1000, *args)
                assert stored(clocked, "q") == document
            else:
                do(clocked, kind, "q", 1000, *args)
        clocked.collection.replace_one({"_id": "q"}, document, upsert=True)
        if refused:
            with pytest.raises(StateCorrupted, match=f"paused_at={paused_at}"):
                clocked.read("q")
        else:
            record = clocked.read("q").record
            assert record is not None
            assert record.paused_at == paused_at


#: what an older version's resume may leave in ``paused_at`` (or anything else there): ignored
_STALE_PAUSED_AT = [5, NOW, NOW + MAX_LEAD_US + 1, MAX_US, NEVER - 1, None, 5.0, "5", True, [1]]


@pytest.mark.parametrize("paused_at", _STALE_PAUSED_AT, ids=repr)
def test_a_paused_at_on_a_record_not_paused_is_ignored_and_dropped_by_a_write(
    clocked: MongoState, paused_at: Any
) -> None:
    """An older version's resume leaves ``paused_at`` behind: whatever it holds, it reads ``NEVER``.

    Every operation runs on the record as if it were not there (as the
    reference runs on the record without it) and its write drops it; a
    ``try_take`` that waits writes nothing, and leaves it.
    """
    fresh = document_of("q", not_before=NOW + US)  # held: a try_take waits
    stale = {**fresh, "paused_at": paused_at}
    want = check_document(fresh, "q")
    assert check_document(stale, "q") == want
    calls: list[tuple[Kind, tuple[int | bool, ...]]] = [
        ("take", ()),
        ("try_start", (3, 0)),
        ("take_and_try", (0,)),
        ("retime", (2, 0)),
        ("hold", (2 * US,)),
        ("lift", ()),
        ("slow", (0,)),
        ("settle", (2, 1, 0)),
        ("set_paused", (False,)),
        ("set_paused", (True,)),
    ]
    for kind, args in calls:
        clocked.collection.replace_one({"_id": "q"}, stale, upsert=True)
        snapshot = clocked.read("q")
        assert (snapshot.record, snapshot.now) == (want, NOW), kind
        reference, answer = apply(want, op(kind, "q", 1000, *args), NOW)
        assert do(clocked, kind, "q", 1000, *args) == answer, kind
        assert clocked.read("q").record == reference, kind
        document = stored(clocked, "q") or {}
        if kind == "set_paused" and args == (True,):
            assert (document["paused"], document["paused_at"], reference.paused_at) == (True, NOW, NOW)
        else:
            assert "paused_at" not in document, kind
    clocked.collection.replace_one({"_id": "q"}, stale, upsert=True)
    assert isinstance(do(clocked, "try_take", "q", 1000, 0), protocol.Wait)
    assert stored(clocked, "q") == stale  # nothing written
