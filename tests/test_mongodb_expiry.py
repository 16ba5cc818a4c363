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
from ratequeue.core.protocol import MAX_LEAD_US, NEVER, US, Started
from ratequeue.errors import StateCorrupted
from ratequeue.state.mongodb import AsyncMongoState, MongoState
from ratequeue.state.mongodb.codec import EXPIRES, TTL_INDEX, datetime_us
from ratequeue.state.records import FIELDS

from .ops import ado, do
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
    assert state.sweep() == 0
    time.sleep(0.6)
    assert state.sweep() == 1
    assert state.names() == ["forever", "kept"]
    assert state.sweep() == 0


def test_creating_a_record_sweeps_now_and_then(state: MongoState) -> None:
    do(state, "take_and_try", "going", 1000, 0, keep_us=1000)
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
    assert set(document) == {"_id", *FIELDS, "not_before"}
    assert (document["burst"], document["due"], document["max_running"]) == (1, document["at"], 0)
    assert (document["paused"], document["leases"], document["held"]) == (False, [], NEVER)
    assert document["not_before"] == NEVER
    do(state, "take_and_try", "three", US, 0, burst=3, cost=3)
    document = stored(state, "three") or {}
    assert set(document) == {"_id", *FIELDS, "not_before"}
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
        {"burst": 2, "due": 4},
    ],
    ids=["burst double", "burst text", "due double", "due null", "due before at"],
)
def test_malformed_burst_fields_are_corrupted_and_unchanged(
    state: MongoState, fields: dict[str, Any]
) -> None:
    document = document_of("bad", **fields)
    state.collection.insert_one(document)
    with pytest.raises(StateCorrupted):
        do(state, "take_and_try", "bad", 1000, 0, burst=2, keep_us=US)
    assert stored(state, "bad") == document


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
            await asyncio.sleep(0.05)
            assert await state.names() == ["going", "kept"]
            assert await state.sweep() == 1
            assert await state.names("k") == ["kept"]
        finally:
            await state.close()

    asyncio.run(main())
