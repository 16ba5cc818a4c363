"""Edge cases of the server backends: bad records, wrong key types, URL forms, secrets in output."""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from pymongo import MongoClient

import ratequeue
from ratequeue._redact import redact
from ratequeue.core.operation import Kind
from ratequeue.core.protocol import NEVER, Wait
from ratequeue.core.shard import Expired
from ratequeue.errors import StateCorrupted
from ratequeue.state.base import split_options
from ratequeue.state.mongodb import MongoState
from ratequeue.state.redis import RedisState, split_url

from .ops import do, is_step, make_shard
from .servers import Server


@pytest.fixture
def client(redis_server: Server) -> Iterator[redis.Redis]:
    with redis.Redis(port=redis_server.port) as client:
        yield client


def redis_hash(**fields: Any) -> dict[str, Any]:
    """A whole stored record as the Redis script writes one (every field), ``fields`` changed."""
    record = {
        "ticket": 2,
        "pos": 1,
        "at": 5,
        "interval": 5,
        "due": 5,
        "burst": 1,
        "paused": "0",
        "max_running": 0,
        "leases": "",
        "held": NEVER,
    }
    return {**record, **fields}


@pytest.mark.parametrize(
    "fields",
    [
        redis_hash(at="1e20", due="1e20"),
        redis_hash(at="inf", due="inf"),
        redis_hash(interval="0"),
        redis_hash(interval="2.5"),
        redis_hash(ticket=1),
        redis_hash(at=str(NEVER - 1), due=str(NEVER - 1)),
        redis_hash(due=-1),
        redis_hash(burst=0),
        redis_hash(paused="2"),
        redis_hash(max_running=-1),
        redis_hash(max_running=1, leases="1:9,x"),
        redis_hash(held=2**52),
        {key: value for key, value in redis_hash().items() if key != "leases"},
    ],
    ids=[
        "at 1e20",
        "at inf",
        "interval 0",
        "interval 2.5",
        "pos at ticket",
        "at before NEVER",
        "due a burst before at",
        "burst 0",
        "paused 2",
        "max_running -1",
        "lease not a pair",
        "held at MAX_US",
        "no leases",
    ],
)
def test_redis_record_out_of_range_is_corrupted_and_unchanged(
    client: redis.Redis, fields: dict[str, Any]
) -> None:
    state = RedisState(client, prefix="edge:")
    client.delete("edge:q")
    client.hset("edge:q", mapping=fields)
    before = client.hgetall("edge:q")
    with pytest.raises(StateCorrupted):
        do(state, "take_and_try", "q", 5, 0)
    with pytest.raises(StateCorrupted):
        state.read("q")
    assert client.hgetall("edge:q") == before


def test_redis_key_of_another_type_is_corrupted(client: redis.Redis) -> None:
    client.delete("edge:list")
    client.rpush("edge:list", "x")
    with pytest.raises(StateCorrupted, match="not a hash"):
        do(RedisState(client, prefix="edge:"), "take", "list", 5)


def mongodb_document(**fields: Any) -> dict[str, Any]:
    """A whole stored record as the MongoDB state writes one (every field), ``fields`` changed."""
    record = {
        "ticket": 2,
        "pos": 1,
        "at": 3,
        "interval": 5,
        "due": 3,
        "burst": 1,
        "paused": False,
        "max_running": 0,
        "leases": [],
        "held": NEVER,
    }
    return {**record, **fields}


@pytest.mark.parametrize(
    "document",
    [
        {"interval": 5},
        {key: value for key, value in mongodb_document().items() if key != "at"},
        mongodb_document(ticket=2.5),
        mongodb_document(ticket="2"),
        mongodb_document(pos=2),
        mongodb_document(paused=1),
        mongodb_document(max_running=-1),
        mongodb_document(held=2.5),
        mongodb_document(leases=[[1, 9]]),  # more leases than max_running
    ],
    ids=[
        "interval only",
        "no at",
        "ticket double",
        "ticket text",
        "pos at ticket",
        "paused number",
        "max_running negative",
        "held double",
        "lease without a cap",
    ],
)
def test_mongodb_malformed_record_is_corrupted_and_unchanged(
    mongodb_server: Server, document: dict[str, Any]
) -> None:
    client: MongoClient[Any] = MongoClient(port=mongodb_server.port)
    with MongoState(client, database="edges") as state:
        state.collection.delete_many({})  # type: ignore[attr-defined]
        state.collection.insert_one({"_id": "q", **document})  # type: ignore[attr-defined]
        with pytest.raises(StateCorrupted):
            do(state, "take_and_try", "q", 5, 0)
        assert state.collection.find_one({"_id": "q"}) == {"_id": "q", **document}  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "leases",
    ["none", [7], [[1]], [[1, 9.5]], [[0, 9]], [[2, 9]], [[1, NEVER - 1]], [[1, 9], [1, 9], [1, 9]]],
    ids=[
        "text",
        "not a pair",
        "one number",
        "expiry double",
        "ticket 0",
        "ticket not handed out",
        "expiry before NEVER",
        "more than max_running",
    ],
)
def test_mongodb_malformed_leases_are_corrupted_and_unchanged(mongodb_server: Server, leases: Any) -> None:
    """Operations with the record's own terms (max_running 2) match no malformed lease either."""
    client: MongoClient[Any] = MongoClient(port=mongodb_server.port)
    document = {"_id": "q", **mongodb_document(max_running=2, leases=leases)}
    calls: list[tuple[Kind, int]] = [("take_and_try", 0), ("release", 1), ("renew", 1)]
    state = MongoState(client, database="edges")
    with state:
        state.collection.delete_many({})
        state.collection.insert_one(document)
        for kind, argument in calls:
            with pytest.raises(StateCorrupted, match="leases"):
                do(state, kind, "q", 5, argument, max_running=2, lease_us=1000)
        assert state.collection.find_one({"_id": "q"}) == document


def test_redis_urls_keep_their_form() -> None:
    assert split_url("unix:///run/redis.sock?db=2&prefix=x:") == ("unix:///run/redis.sock?db=2", "x:")
    assert split_url("redis://h/0?prefix=") == ("redis://h/0", "")
    assert split_url("redis://h/0?prefix=a%2Bb%26c&client_name=a%26b") == (
        "redis://h/0?client_name=a%26b",
        "a+b&c",
    )
    assert split_options("mongodb://h/?database=d&w=1", "database") == ("mongodb://h/?w=1", {"database": "d"})


def test_a_limiter_on_a_ready_client_pickles_to_the_same_key(client: redis.Redis) -> None:
    state = RedisState(client, prefix="a&b+c:")
    limiter = ratequeue.Limiter(state, name="q", interval=0.001)
    limiter.acquire()
    again = pickle.loads(pickle.dumps(limiter))
    assert again.state.key("q") == "a&b+c:q"  # type: ignore[attr-defined]
    assert again.status().pos == 1
    again.close()


def test_passwords_are_redacted_in_repr_and_messages() -> None:
    url = "redis://user:s3cret@localhost:6379/0"
    assert redact(url) == "redis://user:***@localhost:6379/0"
    assert redact("redis://localhost/0") == "redis://localhost/0"
    limiter = ratequeue.Limiter(url, name="q", interval=1)
    assert "s3cret" not in repr(limiter)
    assert "s3cret" not in repr(limiter.state)
    limiter.close()


def test_a_late_head_gives_up_after_two_calls() -> None:
    """A head past its deadline tries at most twice, whatever the state answers (no busy loop)."""
    shard = make_shard(1.0, lead=0.0)
    job = shard.add(deadline=0.0)
    assert is_step(shard.step(job, 1.0), "take_and_try")
    shard.receive(job, Wait(ticket=5, slot=0, now=10_000_000), 1.0, 1.0)  # a slot in the past: nonsense
    assert is_step(shard.step(job, 1.0), "try_start")
    shard.receive(job, Wait(ticket=5, slot=0, now=10_000_000), 1.0, 1.0)
    assert isinstance(shard.step(job, 1.0), Expired)


def test_a_ready_clients_url_reconnects_the_same_way() -> None:
    """Limiters on a ready client pickle as this URL: it keeps socket, db, credentials, TLS and prefix."""
    from ratequeue.state.redis import url_of

    assert url_of(redis.Redis(host="h", port=7, db=3, username="u", password="p@ss"), "x:") == (
        "redis://u:p%40ss@h:7/3?prefix=x%3A"
    )
    assert (
        url_of(redis.Redis(unix_socket_path="/run/r.sock", db=2), "a&b")
        == "unix:///run/r.sock?db=2&prefix=a%26b"
    )
    assert url_of(redis.Redis(host="h", ssl=True), "p:").startswith("rediss://h:6379/0?")
    again = RedisState.from_url(url_of(redis.Redis(host="h", password="p@ss", db=3), "x:"))
    kwargs = again.client.connection_pool.connection_kwargs
    assert (kwargs["password"], kwargs["db"], again.key("q")) == ("p@ss", 3, "x:q")
    again.close()


def test_redis_scripts_survive_a_script_flush_and_killed_connections(client: redis.Redis) -> None:
    """The lean script calls reload a flushed script and reconnect a killed connection, losing nothing."""
    state = RedisState(client.__class__(port=client.connection_pool.connection_kwargs["port"]))
    try:
        first = do(state, "take_and_try", "lean", 1000, 0)
        client.script_flush()
        second = do(state, "take_and_try", "lean", 1000, 0)
        killed = client.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
        third = do(state, "take_and_try", "lean", 1000, 0)
        assert killed >= 1, "the state's connection was open and got killed"
        assert [first.ticket, second.ticket, third.ticket] == [1, 2, 3], "no operation ran twice or got lost"
        record = state.read("lean").record
        assert record is not None
        assert record.ticket == 4
    finally:
        state.close()
