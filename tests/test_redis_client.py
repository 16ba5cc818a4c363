"""The Redis backend's codec and lean call path (``LeanScripts``, ``AsyncLeanScripts``).

EVALSHA is packed by hand and sent over the client's own connections; these
tests hold it, against real redis-servers, to what redis-py's script calls
did: NOSCRIPT recovers, a killed connection is retried without losing or
repeating an operation, the protocol the client negotiated (RESP2 or RESP3)
is read, credentials work, threads never share a connection, a fork takes
fresh ones, and clients the lean path does not suit fall back to redis-py's
calls. Then what bursts and keep times add on the server: records from before
bursts, burst and due checked, TTLs set by PEXPIRE and cleared by PERSIST
(keys expiring in real time), and names listed by SCAN. The codec's own
tests (the script's constants, the packing, replies it must refuse) need no
server.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import multiprocessing
import re
import shutil
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio
import redis.cluster

from ratequeue.core import protocol
from ratequeue.core.operation import KINDS, Kind, Operation, Terms, apply, operation
from ratequeue.core.protocol import Passed, Record, Started, Taken, Wait
from ratequeue.errors import ConfigurationError, StateCorrupted, StateUnavailable
from ratequeue.state.base import Snapshot
from ratequeue.state.records import FIELDS
from ratequeue.state.redis import AsyncRedisState, RedisState, codec

from . import servers
from .ops import ado, do
from .ops import op as operation_of
from .servers import Server

INTERVAL = 1000  # us: every test's queue, so that takes and starts never wait
#: the terms the codec's tests parse replies for: interval 10 us, burst 1, no keep time
TERMS = Terms(10)

_names = itertools.count()


def fresh_name() -> str:
    """A queue name no other test uses."""
    return f"lean{next(_names)}"


@pytest.fixture
def admin(redis_server: Server) -> Iterator[redis.Redis]:
    """A plain client of the session's server, for SCRIPT FLUSH, CLIENT KILL and CLIENT LIST."""
    with redis.Redis(port=redis_server.port, protocol=2) as client:
        yield client


@pytest.fixture(scope="module")
def password_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A redis-server that wants the password ``s3cret`` (and, by ACL, user ``rq`` / ``pw``)."""
    executable = shutil.which("redis-server")
    if executable is None:
        servers.unavailable("redis-server is not on PATH: apt-get install redis-server")
    workdir: Path = tmp_path_factory.mktemp("redis-auth")
    port = servers.free_port()
    command = [
        str(executable), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
        "--requirepass", "s3cret", "--user", "rq", "on", ">pw", "~*", "+@all", "--dir", str(workdir),
    ]  # fmt: skip
    yield from servers.serve(Server("redis-auth", command, port, workdir), "redis-server")


def clients_named(admin: redis.Redis, name: str) -> int:
    """How many connections the server has open under client name ``name``."""
    return sum(1 for client in admin.client_list() if client.get("name") == name)


def until(condition: Any, timeout: float = 5.0) -> bool:
    """Whether ``condition()`` holds within ``timeout`` seconds (the server sees a close a moment later)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def kill_named(admin: redis.Redis, name: str) -> int:
    """Close every connection under client name ``name``; how many there were."""
    killed = 0
    for client in admin.client_list():
        if client.get("name") == name:
            killed += int(admin.execute_command("CLIENT", "KILL", "ID", client["id"]))  # type: ignore[no-untyped-call]
    return killed


def every_operation(state: RedisState, name: str) -> list[int]:
    """Run each of the five scripts once; the tickets they named."""
    taken = do(state, "take", name, INTERVAL)
    started = do(state, "try_start", name, INTERVAL, taken.ticket, 10**9)
    retimed = do(state, "retime", name, INTERVAL, taken.ticket, 0)
    outcome = do(state, "take_and_try", name, INTERVAL, 10**9)
    assert isinstance(started, Started)
    assert isinstance(retimed, Started)
    assert isinstance(outcome, Started)
    record = state.read(name).record
    assert record is not None
    return [taken.ticket, outcome.ticket, record.ticket]


@pytest.mark.parametrize("protocol", [2, 3])
def test_a_flushed_script_is_loaded_again(redis_server: Server, admin: redis.Redis, protocol: int) -> None:
    """After SCRIPT FLUSH every script answers: NOSCRIPT loads it and sends the call again."""
    state = RedisState(redis.Redis(port=redis_server.port, protocol=protocol), prefix="lean:")
    try:
        assert state._lean is not None, "a plain client takes the lean path"
        name = fresh_name()
        assert every_operation(state, name) == [1, 2, 3]
        admin.script_flush()
        assert every_operation(state, name) == [3, 4, 5]
    finally:
        state.close()


@pytest.mark.parametrize("protocol", [2, 3])
def test_a_killed_connection_is_retried_transparently(
    redis_server: Server, admin: redis.Redis, protocol: int
) -> None:
    """CLIENT KILL closes the kept connection: the next call reconnects, runs once and loses nothing."""
    client_name = f"killed{protocol}"
    state = RedisState(redis.Redis(port=redis_server.port, protocol=protocol, client_name=client_name))
    try:
        name = fresh_name()
        first = do(state, "take_and_try", name, INTERVAL, 0)
        assert kill_named(admin, client_name) == 1, "the state's connection was open and got killed"
        second = do(state, "take_and_try", name, INTERVAL, 0)
        admin.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")  # type: ignore[no-untyped-call]
        third = do(state, "take_and_try", name, INTERVAL, 0)
        assert [first.ticket, second.ticket, third.ticket] == [1, 2, 3], "no operation ran twice or got lost"
        record = state.read(name).record
        assert record is not None
        assert record.ticket == 4
    finally:
        state.close()


def test_one_connection_is_kept_between_calls(redis_server: Server, admin: redis.Redis) -> None:
    """Calls one after another reuse one connection; close() gives it back to the pool."""
    client = redis.Redis(port=redis_server.port, client_name="kept")
    state = RedisState(client)
    name = fresh_name()
    for _ in range(20):
        do(state, "take_and_try", name, INTERVAL, 0)
    assert clients_named(admin, "kept") == 1
    state.close()
    assert until(lambda: clients_named(admin, "kept") == 0)


def test_threads_never_share_a_connection(redis_server: Server, admin: redis.Redis) -> None:
    """Threads calling one state at once each get a connection of their own; no answer is mixed up."""
    state = RedisState(redis.Redis(port=redis_server.port, client_name="threads"))
    name, threads, calls = fresh_name(), 8, 40
    tickets: list[int] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(threads)

    def work() -> None:
        try:
            barrier.wait()
            for _ in range(calls):
                tickets.append(do(state, "take", name, INTERVAL).ticket)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    pool = [threading.Thread(target=work) for _ in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join(60)
    try:
        assert not errors
        assert sorted(tickets) == list(range(1, threads * calls + 1)), "each take answered once, in order"
        assert 1 <= clients_named(admin, "threads") <= threads
    finally:
        state.close()


def test_connections_go_back_to_a_users_pool(redis_server: Server) -> None:
    """A state on a user's one-connection pool returns it on close(), and when it is collected."""
    pool = redis.BlockingConnectionPool(port=redis_server.port, max_connections=1, timeout=1)  # type: ignore[no-untyped-call]
    client = redis.Redis(connection_pool=pool)
    try:
        state = RedisState(client)
        do(state, "take_and_try", fresh_name(), INTERVAL, 0)
        assert state._lean is not None
        state._lean.close()
        assert client.ping(), "the pool's only connection is free again"
        state = RedisState(client)
        do(state, "take_and_try", fresh_name(), INTERVAL, 0)
        del state
        gc.collect()
        assert client.ping(), "a state that is collected gives its connection back"
    finally:
        pool.disconnect()


def test_a_client_that_decodes_replies(redis_server: Server) -> None:
    """``decode_responses=True`` hands text, not bytes, to the reply parsing: the answers are the same."""
    state = RedisState(redis.Redis(port=redis_server.port, decode_responses=True), prefix="lean:")
    try:
        assert every_operation(state, fresh_name()) == [1, 2, 3]
        assert isinstance(do(state, "retime", fresh_name(), INTERVAL, 1, 0), Passed)
    finally:
        state.close()


class _OwnPool(redis.ConnectionPool):
    """A pool class of the user's own: the lean path leaves it to redis-py."""


@pytest.mark.parametrize("kind", ["single connection", "own pool class"])
def test_clients_the_lean_path_does_not_suit_use_redis_py(redis_server: Server, kind: str) -> None:
    """A single-connection client or an unknown pool class goes through redis-py's Script calls."""
    if kind == "single connection":
        client = redis.Redis(port=redis_server.port, single_connection_client=True)
    else:
        client = redis.Redis(connection_pool=_OwnPool(port=redis_server.port))
    state = RedisState(client, prefix="lean:")
    try:
        assert state._lean is None
        assert every_operation(state, fresh_name()) == [1, 2, 3]
    finally:
        state.close()


def test_an_error_answer_keeps_the_connection(redis_server: Server, admin: redis.Redis) -> None:
    """WRONGTYPE is an answer read in full: the same connection serves the next call."""
    state = RedisState(redis.Redis(port=redis_server.port, client_name="wrongtype"), prefix="lean:")
    try:
        name = fresh_name()
        admin.rpush(f"lean:{name}", "x")
        with pytest.raises(StateCorrupted, match="not a hash"):
            do(state, "take", name, INTERVAL)
        assert do(state, "take", fresh_name(), INTERVAL).ticket == 1
        assert clients_named(admin, "wrongtype") == 1
    finally:
        state.close()


def test_passwords_and_acl_users(password_server: Server) -> None:
    """The password, or an ACL user and password, authenticate the lean path's connections."""
    port = password_server.port
    for url in (f"redis://:s3cret@127.0.0.1:{port}/0", f"redis://rq:pw@127.0.0.1:{port}/0?protocol=2"):
        state = RedisState.from_url(url)
        with state:
            assert state._lean is not None
            assert every_operation(state, fresh_name()) == [1, 2, 3]


def test_a_wrong_password_is_refused(password_server: Server) -> None:
    state = RedisState.from_url(f"redis://:wr0ng-pw@127.0.0.1:{password_server.port}/0")
    with state, pytest.raises(StateUnavailable, match="refused the credentials") as raised:
        do(state, "take", fresh_name(), INTERVAL)
    assert "wr0ng-pw" not in str(raised.value)


def test_an_unreachable_server_is_reported_without_the_password() -> None:
    port = servers.free_port()  # nobody listens there
    client = redis.Redis(
        host="127.0.0.1", port=port, username="u", password="s3cret", socket_connect_timeout=1
    )
    with RedisState(client) as state, pytest.raises(StateUnavailable, match="unreachable") as raised:
        state.read(fresh_name())
    assert raised.value.where == f"127.0.0.1:{port}"
    assert "s3cret" not in str(raised.value)
    assert "s3cret" not in repr(state)


def test_a_server_that_goes_away_and_comes_back(tmp_path: Path) -> None:
    """A stopped server: unreachable after the bounded retries; restarted: the kept connection reconnects."""
    executable = shutil.which("redis-server")
    if executable is None:
        servers.unavailable("redis-server is not on PATH")
    port = servers.free_port()
    options = ["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    command = [str(executable), "--port", str(port), *options]
    server = Server("redis-gone", command, port, tmp_path)
    server.start()
    try:
        state = RedisState.from_url(f"redis://127.0.0.1:{port}/0")
        name = fresh_name()
        assert do(state, "take", name, INTERVAL).ticket == 1
        server.stop()
        began = time.monotonic()
        with pytest.raises(StateUnavailable, match="unreachable"):
            do(state, "take", name, INTERVAL)
        assert time.monotonic() - began < 10, "the retries are bounded"
        server.start()
        assert do(state, "take", name, INTERVAL).ticket == 1, "a fresh server: a fresh record"
        state.close()
    finally:
        server.stop()


def _take_in_child(state: RedisState, name: str, answers: Any) -> None:
    answers.put(do(state, "take", name, INTERVAL).ticket)


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="needs fork")
def test_a_forked_child_takes_connections_of_its_own(redis_server: Server, admin: redis.Redis) -> None:
    """A child forked after the state was used never writes to the parent's socket."""
    state = RedisState(redis.Redis(port=redis_server.port, client_name="forked"))
    name = fresh_name()
    try:
        assert do(state, "take", name, INTERVAL).ticket == 1
        context = multiprocessing.get_context("fork")
        answers: Any = context.Queue()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads (Python 3.12+)
            child = context.Process(target=_take_in_child, args=(state, name, answers))
            child.start()
        child.join(60)
        assert child.exitcode == 0
        assert answers.get(timeout=5) == 2
        assert do(state, "take", name, INTERVAL).ticket == 3, "the parent's connection still answers it alone"
    finally:
        state.close()


# ------------------------------------------------------------------ bursts, keep times and names


def full(fields: dict[str, Any]) -> dict[str, Any]:
    """A hash of every record field: ``fields``, and the others as a fresh record has them."""
    at = fields.get("at", protocol.NEVER)
    defaults = {"due": at, "burst": 1, "paused": "0", "max_running": 0, "leases": "", "held": protocol.NEVER}
    return {**defaults, **fields}


def fresh_prefix() -> str:
    """A key prefix no other test uses, so that names() sees this test's keys only."""
    return f"own{next(_names)}:"


def clocked(redis_server: Server, prefix: str, now: list[int], **kwargs: Any) -> RedisState:
    """A state whose ``now`` is ``now[0]`` (the script's fixed clock; Redis's TTLs still run in real time)."""
    client = redis.Redis(port=redis_server.port, **kwargs)
    return RedisState(client, prefix=prefix, clock=lambda: now[0])


@pytest.mark.parametrize(
    "missing", ["ticket", "pos", "at", "interval", "due", "burst", "max_running", "held"]
)
def test_a_hash_missing_a_field_is_refused(redis_server: Server, admin: redis.Redis, missing: str) -> None:
    """Every field of the record is in the hash: one missing is named, and nothing is written."""
    state = RedisState(redis.Redis(port=redis_server.port), prefix="lean:")
    name = fresh_name()
    try:
        mapping = full({"ticket": 3, "pos": 2, "at": 100, "interval": 4096})
        del mapping[missing]
        admin.hset(state.key(name), mapping=mapping)
        before = admin.hgetall(state.key(name))
        for call in (lambda: state.read(name), lambda: do(state, "take", name, 4096)):
            with pytest.raises(StateCorrupted, match=f"{missing}='\\(missing\\)'"):
                call()
        assert admin.hgetall(state.key(name)) == before
    finally:
        state.close()


@pytest.mark.parametrize(
    ("fields", "pattern"),
    [
        ({"burst": 0, "due": 100}, "burst='0'"),
        ({"burst": "x", "due": 100}, "burst='x'"),
        ({"burst": 2**31 + 1, "due": 100}, f"burst='{2**31 + 1}'"),
        ({"burst": 2**40, "due": 100}, f"burst='{2**40}'"),  # burst * interval reaches 2**52
        # before at by more than a burst of intervals (a refund moves it no further, protocol.settle)
        ({"burst": 3, "due": 100 - 3 * 4096 - 1}, f"due='{100 - 3 * 4096 - 1}'"),
        # past at + 2 of the slowest pace allowed (MAX_SLOW intervals: a due written while slowed),
        # and a starter's doubt (MAX_DOUBT_US)
        (
            {"burst": 3, "due": 100 + 2 * protocol.MAX_SLOW * 4096 + protocol.MAX_DOUBT_US + 1},
            f"due='{100 + 2 * protocol.MAX_SLOW * 4096 + protocol.MAX_DOUBT_US + 1}'",
        ),
        ({"burst": 3, "due": "1.5"}, "due='1.5'"),
        # no burst: burst 1, so due must be at at most, but for a doubt
        ({"due": 100 + protocol.MAX_DOUBT_US + 1}, f"due='{100 + protocol.MAX_DOUBT_US + 1}'"),
        ({"due": 100 - 4096 - 1}, f"due='{100 - 4096 - 1}'"),  # and an interval before it at least
    ],
    ids=[
        "burst 0",
        "burst text",
        "burst 2**31+1",
        "burst*interval",
        "due early",
        "due late",
        "due text",
        "due past at",
        "due an interval early",
    ],
)
def test_a_bad_burst_or_due_is_refused(
    redis_server: Server, admin: redis.Redis, fields: dict[str, Any], pattern: str
) -> None:
    """burst and due are checked as base.check_record checks them; every operation refuses, writes nothing."""
    state = RedisState(redis.Redis(port=redis_server.port), prefix="lean:")
    name = fresh_name()
    key = state.key(name)
    try:
        mapping: dict[Any, Any] = full({"ticket": 3, "pos": 2, "at": 100, "interval": 4096, **fields})
        admin.hset(key, mapping=mapping)
        before = admin.hgetall(key)
        for call in (
            lambda: state.read(name),
            lambda: do(state, "take", name, 4096),
            lambda: do(state, "take_and_try", name, 4096, 0),
            lambda: do(state, "retime", name, 4096, 2, 0),
        ):
            with pytest.raises(StateCorrupted, match=re.escape(pattern)) as raised:
                call()
            assert raised.value.where == key
        assert admin.hgetall(key) == before
        assert admin.pttl(key) == -1
    finally:
        state.close()


def test_leases_are_three_fields_of_the_hash(redis_server: Server, admin: redis.Redis) -> None:
    """max_running, leases ("t:e:k,...") and held are fields of every hash (no cap: 0, no lease, NEVER)."""
    t0 = 10**15
    now = [t0]
    state = clocked(redis_server, "lean:", now)
    capped, plain = fresh_name(), fresh_name()
    terms: dict[str, int] = {"max_running": 2, "lease_us": 5000, "keep_us": 10**9}
    try:
        do(state, "take_and_try", plain, 1000, 0)
        stored = admin.hgetall(f"lean:{plain}")
        assert sorted(stored) == sorted(field.encode() for field in FIELDS)
        assert (stored[b"max_running"], stored[b"leases"], stored[b"paused"]) == (b"0", b"", b"0")
        assert stored[b"held"] == b"%d" % protocol.NEVER
        assert do(state, "take_and_try", capped, 1000, 0, **terms) == Started(1, t0, t0)
        assert admin.hgetall(f"lean:{capped}")[b"leases"] == b"%d:%d:0" % (1, t0 + 5000)
        assert admin.hgetall(f"lean:{capped}")[b"held"] == b"%d" % protocol.NEVER
        now[0] = t0 + 1000
        assert do(state, "take_and_try", capped, 1000, 0, **terms) == Started(2, t0 + 1000, t0 + 1000)
        now[0] = t0 + 2000
        assert do(state, "take_and_try", capped, 1000, 0, **terms) == Wait(3, t0 + 5000, t0 + 2000)
        stored = admin.hgetall(f"lean:{capped}")
        assert stored[b"max_running"] == b"2"
        assert stored[b"leases"] == b"1:%d:0,2:%d:0" % (t0 + 5000, t0 + 6000)
        assert stored[b"held"] == b"%d" % (t0 + 2000)
        # the TTL runs from the latest of the leases' expiries and the grace after held (t0 + 302 ms),
        # 300 ms after now, plus the keep time (the TTL itself runs in real time)
        assert 1_000_300 - 1000 < admin.pttl(f"lean:{capped}") <= 1_000_300
        assert do(state, "release", capped, 1000, 1, **terms) is True
        assert do(state, "renew", capped, 1000, 1, **terms) is False
        assert do(state, "renew", capped, 1000, 2, **terms) is True
        record = state.read(capped).record
        assert record is not None
        assert (record.leases, record.held) == (((2, t0 + 7000, 0),), t0 + 2000)
        with pytest.raises(ConfigurationError, match="has max_running 2 in this state, not 3"):
            do(state, "release", capped, 1000, 2, max_running=3, lease_us=1)
        with pytest.raises(ConfigurationError, match="has max_running no cap"):
            do(state, "take", plain, 1000, max_running=1, lease_us=1)
    finally:
        state.close()


@pytest.mark.parametrize(
    ("fields", "pattern"),
    [
        ({"max_running": "x"}, "max_running='x'"),
        ({"max_running": 1001}, "max_running='1001'"),
        ({"max_running": 1, "leases": "1:5,2:6"}, "leases='1:5,2:6'"),  # more than max_running
        ({"max_running": 2, "leases": "1:5,"}, "leases='1:5,'"),
        ({"max_running": 2, "leases": "3:5"}, "leases='3:5'"),  # a ticket not yet handed out
        ({"max_running": 2, "leases": "0:5"}, "leases='0:5'"),
        ({"max_running": 2, "leases": "1:x"}, "leases='1:x'"),
        ({"leases": "1:5"}, "leases='1:5'"),  # no cap, yet a lease
        ({"max_running": 2, "held": "1.5"}, "held='1.5'"),
        ({"max_running": 2, "held": -(2**52) - 1}, f"held='{-(2**52) - 1}'"),
    ],
)
def test_bad_leases_are_refused(
    redis_server: Server, admin: redis.Redis, fields: dict[str, Any], pattern: str
) -> None:
    """max_running, leases and held are checked as base.check_record checks them; nothing is written."""
    state = RedisState(redis.Redis(port=redis_server.port), prefix="lean:")
    name = fresh_name()
    key = state.key(name)
    try:
        admin.hset(key, mapping=full({"ticket": 3, "pos": 2, "at": 100, "interval": 4096, **fields}))
        before = admin.hgetall(key)
        for call in (
            lambda: state.read(name),
            lambda: do(state, "release", name, 4096, 1, max_running=2, lease_us=1),
            lambda: do(state, "take_and_try", name, 4096, 0, max_running=2, lease_us=1),
        ):
            with pytest.raises(StateCorrupted, match=re.escape(pattern)):
                call()
        assert admin.hgetall(key) == before
    finally:
        state.close()


@pytest.mark.parametrize(
    ("fields", "pattern"),
    [
        ({"settled": "x"}, "settled='x'"),
        ({"settled": "-1"}, "settled='-1'"),
        ({"settled": "1.5"}, "settled='1.5'"),
        ({"settled": 3}, "settled='3'"),  # a ticket not yet started (pos is 2)
        ({"settled": 2**53}, f"settled='{2**53}'"),
    ],
    ids=["text", "negative", "double", "past pos", "huge"],
)
def test_a_bad_settled_is_refused(
    redis_server: Server, admin: redis.Redis, fields: dict[str, Any], pattern: str
) -> None:
    """settled (absent: 0) is a ticket from 0 to pos, as base.check_record checks it; nothing is written."""
    state = RedisState(redis.Redis(port=redis_server.port), prefix="lean:")
    name = fresh_name()
    key = state.key(name)
    try:
        admin.hset(key, mapping=full({"ticket": 3, "pos": 2, "at": 100, "interval": 4096, **fields}))
        before = admin.hgetall(key)
        for call in (
            lambda: state.read(name),
            lambda: do(state, "take", name, 4096),
            lambda: do(state, "settle", name, 4096, 1, 1, 0),
        ):
            with pytest.raises(StateCorrupted, match=re.escape(pattern)):
                call()
        assert admin.hgetall(key) == before
    finally:
        state.close()


def test_a_pause_stores_when_it_began_and_a_resume_leaves_no_trace(
    redis_server: Server, admin: redis.Redis
) -> None:
    """paused_at is a field of the hash only while paused: the first pause's now, carried through.

    A pause asked again keeps it, other operations carry it, and a resume
    deletes it: the hash is then byte for byte (DUMP) the one a queue never
    paused holds. Each step is held to the reference (protocol.set_paused).
    """
    t0 = 10**15
    now = [t0]
    state = clocked(redis_server, "lean:", now)
    paused, never = fresh_name(), fresh_name()
    key = state.key(paused)
    try:
        for name in (paused, never):
            assert do(state, "take_and_try", name, 1000, 0, burst=2) == Started(1, t0, t0)
        before = admin.hgetall(key)
        assert b"paused_at" not in before
        now[0] = t0 + 5000
        reference = state.read(paused).record
        assert reference is not None
        for pause, changed in ((True, True), (True, False)):
            reference, expected = protocol.set_paused(reference, pause, now[0])
            assert expected is changed
            assert do(state, "set_paused", paused, 1000, pause, burst=2) is changed
            assert state.read(paused).record == reference
            assert reference.paused_at == t0 + 5000
            now[0] += 2000  # (a pause asked again, later, keeps the first's time)
        assert admin.hgetall(key) == {**before, b"paused": b"1", b"paused_at": b"%d" % (t0 + 5000)}
        assert admin.pttl(key) == -1
        assert do(state, "take", paused, 1000, burst=2) == Taken(2, 1, t0, now[0])
        assert do(state, "try_start", paused, 1000, 2, 10**9, burst=2) == Wait(
            2, now[0] + protocol.PAUSED_RECHECK_US, now[0]
        )
        assert admin.hget(key, "paused_at") == b"%d" % (t0 + 5000)
        record = state.read(paused).record
        assert record is not None
        assert (record.paused, record.paused_at) == (True, t0 + 5000)
        # resumed: as the queue never paused that took the same ticket
        assert do(state, "set_paused", paused, 1000, False, burst=2) is True
        assert do(state, "take", never, 1000, burst=2) == Taken(2, 1, t0, now[0])
        assert admin.hgetall(key) == admin.hgetall(state.key(never))
        assert admin.dump(key) == admin.dump(state.key(never))
        record = state.read(paused).record
        assert record == state.read(never).record
        assert record is not None
        assert (record.paused, record.paused_at) == (False, protocol.NEVER)
        assert do(state, "set_paused", paused, 1000, False, burst=2) is False
        assert admin.dump(key) == admin.dump(state.key(never))
    finally:
        state.close()


def test_a_record_paused_without_paused_at_reads_never(redis_server: Server, admin: redis.Redis) -> None:
    """A hash paused by a version before paused_at lacks it: paused_at reads NEVER ("since when" unknown).

    A pause asked again does not make one up; a resume works as on any
    record, and stores no paused_at.
    """
    now = [10**15]
    state = clocked(redis_server, "lean:", now)
    name = fresh_name()
    key = state.key(name)
    try:
        admin.hset(key, mapping=full({"ticket": 3, "pos": 2, "at": 100, "interval": 4096, "paused": "1"}))
        expected = Record(ticket=3, pos=2, at=100, interval=4096, due=100, paused=True)
        assert expected.paused_at == protocol.NEVER
        assert state.read(name).record == expected
        assert do(state, "set_paused", name, 4096, True) is False
        assert do(state, "take", name, 4096) == Taken(3, 2, 100, now[0])
        stored = admin.hgetall(key)
        assert b"paused_at" not in stored
        assert stored[b"paused"] == b"1"
        assert state.read(name).record == expected._replace(ticket=4)
        assert do(state, "set_paused", name, 4096, False) is True
        assert b"paused_at" not in admin.hgetall(key)
        assert state.read(name).record == expected._replace(ticket=4, paused=False)
    finally:
        state.close()


_NOW = 10**15


@pytest.mark.parametrize(
    ("fields", "pattern"),
    [
        ({"paused": "1", "paused_at": "x"}, "paused_at='x'"),
        ({"paused": "1", "paused_at": ""}, "paused_at=''"),
        ({"paused": "1", "paused_at": "1.5"}, "paused_at='1.5'"),
        ({"paused": "1", "paused_at": "1e15"}, "paused_at='1e15'"),
        ({"paused": "1", "paused_at": 2**52}, f"paused_at='{2**52}'"),
        ({"paused": "1", "paused_at": -(2**52) - 1}, f"paused_at='{-(2**52) - 1}'"),
        ({"paused": "1", "paused_at": 10**30}, f"paused_at='{10**30}'"),
        # well formed, but further ahead of now than a pause the protocol makes (protocol.check)
        (
            {"paused": "1", "paused_at": _NOW + protocol.MAX_LEAD_US + 1},
            f"paused_at={_NOW + protocol.MAX_LEAD_US + 1}, more than 3600 s ahead",
        ),
    ],
    ids=["text", "empty", "double", "exponent", "limit", "below never", "huge", "ahead"],
)
def test_a_bad_paused_at_is_refused(
    redis_server: Server, admin: redis.Redis, fields: dict[str, Any], pattern: str
) -> None:
    """On a paused record, paused_at (absent: NEVER) is whole microseconds, as records.check_record checks
    it; every operation refuses, a resume too, and nothing is written."""
    now = [_NOW]
    state = clocked(redis_server, "lean:", now)
    name = fresh_name()
    key = state.key(name)
    try:
        admin.hset(key, mapping=full({"ticket": 3, "pos": 2, "at": _NOW, "interval": 4096, **fields}))
        before = admin.hgetall(key)
        for call in (
            lambda: state.read(name),
            lambda: do(state, "take", name, 4096),
            lambda: do(state, "set_paused", name, 4096, True),
            lambda: do(state, "set_paused", name, 4096, False),
        ):
            with pytest.raises(StateCorrupted, match=re.escape(pattern)) as raised:
                call()
            assert raised.value.where == key
        assert admin.hgetall(key) == before
        assert admin.pttl(key) == -1
    finally:
        state.close()


@pytest.mark.parametrize(
    "stale",
    [_NOW - 5, _NOW + protocol.MAX_LEAD_US + 1, protocol.NEVER, 10**30, -(2**52) - 1, "x", "", "1e15"],
    ids=["earlier", "ahead", "never", "huge", "below never", "text", "empty", "exponent"],
)
def test_a_paused_at_left_on_a_record_not_paused_is_ignored_and_dropped(
    redis_server: Server, admin: redis.Redis, stale: Any
) -> None:
    """An older version's resume leaves paused_at behind: on a record not paused it is ignored, whatever it
    holds (the record reads NEVER, as records.check_record reads it), and the next write drops it.

    Held to a twin hash that lacks it: reads, refused try_takes (which write nothing) and
    writes answer alike, and after the first write the two hashes are byte for byte (DUMP) the same;
    a pause then notes its own now, not the stale value.
    """
    now = [_NOW]
    state = clocked(redis_server, "lean:", now)
    name, twin = fresh_name(), fresh_name()
    key = state.key(name)
    fields = full({"ticket": 3, "pos": 2, "at": _NOW, "interval": 4096})
    try:
        admin.hset(state.key(twin), mapping=fields)
        admin.hset(key, mapping={**fields, "paused_at": stale})
        stored = admin.hgetall(key)
        record = state.read(name).record
        assert record == state.read(twin).record
        assert record is not None
        assert (record.paused, record.paused_at) == (False, protocol.NEVER)
        assert do(state, "try_take", name, 4096) == do(state, "try_take", twin, 4096)
        assert admin.hgetall(key) == stored  # (read and a refused try_take write nothing)
        assert do(state, "take", name, 4096) == do(state, "take", twin, 4096) == Taken(3, 2, _NOW, _NOW)
        assert b"paused_at" not in admin.hgetall(key)
        assert admin.hgetall(key) == admin.hgetall(state.key(twin))
        assert admin.dump(key) == admin.dump(state.key(twin))
        now[0] += 70
        assert do(state, "set_paused", name, 4096, True) is True
        record = state.read(name).record
        assert record is not None
        assert (record.paused, record.paused_at) == (True, _NOW + 70)
        assert admin.hget(key, "paused_at") == b"%d" % (_NOW + 70)
    finally:
        state.close()


def test_a_paused_at_left_on_a_record_not_paused_is_dropped_by_a_resume(
    redis_server: Server, admin: redis.Redis
) -> None:
    """A resume that changes nothing (the record is not paused) still writes it: the stale field goes."""
    now = [_NOW]
    state = clocked(redis_server, "lean:", now)
    name = fresh_name()
    key = state.key(name)
    try:
        admin.hset(key, mapping=full({"ticket": 3, "pos": 2, "at": _NOW, "interval": 4096, "paused_at": "x"}))
        assert do(state, "set_paused", name, 4096, False) is False
        stored = admin.hgetall(key)
        assert b"paused_at" not in stored
        assert stored[b"paused"] == b"0"
    finally:
        state.close()


def test_a_hash_holding_only_paused_at_is_refused(redis_server: Server, admin: redis.Redis) -> None:
    """A hash with paused_at but no record is not a missing record: refused, not overwritten."""
    state = RedisState(redis.Redis(port=redis_server.port), prefix="lean:")
    name = fresh_name()
    try:
        admin.hset(state.key(name), mapping={"paused_at": "5"})
        with pytest.raises(StateCorrupted, match=r"ticket='\(missing\)'"):
            do(state, "set_paused", name, 4096, True)
        assert admin.hgetall(state.key(name)) == {b"paused_at": b"5"}
    finally:
        state.close()


def test_a_doubt_moves_due_and_stays_through_retime_and_overrun(redis_server: Server) -> None:
    """A start's doubt lifts due past its slot or start, above an overrun's cap; a retime carries it.

    Each step is held to the reference (protocol), answer and record.
    """
    t0 = 10**15
    doubt = protocol.MAX_DOUBT_US
    now = [t0]
    state = clocked(redis_server, "lean:", now)
    name = fresh_name()

    def as_the_reference(kind: Kind, *args: Any, **kwargs: Any) -> Any:
        before = state.read(name).record or protocol.new_record(1000, 2)
        expected, answer = apply(before, operation_of(kind, name, 1000, *args, burst=2, **kwargs), now[0])
        assert do(state, kind, name, 1000, *args, burst=2, **kwargs) == answer
        assert state.read(name).record == expected
        return answer

    try:
        assert as_the_reference("take_and_try", 0, doubt) == Started(1, t0, t0)
        record = state.read(name).record
        assert record is not None
        # the cap of an overrun, at + (burst - 1) slowest paces (64 intervals), lies below due now
        assert record.due == t0 + doubt > t0 + protocol.MAX_SLOW * 1000
        assert as_the_reference("settle", 1, 1, 2) is False  # an overrun never moves due back
        assert state.read(name).record == record
        assert as_the_reference("settle", 1, 2, 1) is True  # a refund still moves it back
        # a retime moves due by as much as the start: the doubt stays
        taken = as_the_reference("take")
        assert isinstance(as_the_reference("try_start", taken.ticket, 10**6, doubt), Started)
        now[0] += 300_000
        assert as_the_reference("retime", taken.ticket, 5000) == Started(taken.ticket, now[0] + 5000, now[0])
        record = state.read(name).record
        assert record is not None
        assert record.due >= record.at + doubt
        assert as_the_reference("settle", taken.ticket, 1, 2) is False
    finally:
        state.close()


def test_a_hash_holding_only_settled_is_refused(redis_server: Server, admin: redis.Redis) -> None:
    """A hash with settled but no record is not a missing record: refused, not overwritten."""
    state = RedisState(redis.Redis(port=redis_server.port), prefix="lean:")
    name = fresh_name()
    try:
        admin.hset(state.key(name), mapping={"settled": "0"})
        with pytest.raises(StateCorrupted, match=r"ticket='\(missing\)'"):
            do(state, "take", name, 4096)
        assert admin.hgetall(state.key(name)) == {b"settled": b"0"}
    finally:
        state.close()


def settled_as_the_reference(
    state: RedisState, name: str, now: int, ticket: int, estimate: int, actual: int, **terms: Any
) -> bool:
    """Settle ``ticket`` on the server; assert its answer and record are protocol.settle's; the answer."""
    before = state.read(name).record
    assert before is not None
    expected, changed = protocol.settle(before, ticket, estimate, actual, now)
    interval = before.interval
    assert (
        do(state, "settle", name, interval, ticket, estimate, actual, burst=before.burst, **terms) is changed
    )
    assert state.read(name).record == expected
    return changed


def test_settle_moves_due_and_stores_settled_while_set(redis_server: Server, admin: redis.Redis) -> None:
    """An overrun moves due on, a refund back (even before at); settled is a field of the hash once set."""
    t0 = 10**15
    now = [t0]
    state = clocked(redis_server, "lean:", now)
    name = fresh_name()
    key = state.key(name)
    try:
        assert do(state, "take_and_try", name, 1000, 0, burst=3) == Started(1, t0, t0)
        assert b"settled" not in admin.hgetall(key)
        assert settled_as_the_reference(state, name, t0, 1, 1, 3) is True  # two units over
        record = state.read(name).record
        assert record is not None
        assert (record.due, record.settled) == (t0 + 2000, 1)
        assert admin.hget(key, "settled") == b"1"
        assert settled_as_the_reference(state, name, t0, 1, 1, 3) is False  # re-sent: counted once
        assert settled_as_the_reference(state, name, t0, 1, 1, 0) is False  # ticket 1 settled already
        assert settled_as_the_reference(state, name, t0, 2, 1, 0) is False  # not started
        # ticket 2 starts at now, past its strict slot: due is its start; its refund moves due back
        # an interval, to at + (pos - ticket - cost) intervals at least: an interval before at
        now[0] = t0 + 5000
        assert do(state, "take_and_try", name, 1000, 0, burst=3) == Started(2, t0 + 5000, t0 + 5000)
        assert settled_as_the_reference(state, name, t0 + 5000, 2, 1, 1) is False  # as estimated
        assert settled_as_the_reference(state, name, t0 + 5000, 2, 1, 0) is True
        assert settled_as_the_reference(state, name, t0 + 5000, 2, 1, 0) is False
        # ticket 1, settled no more, may not bring due below at + (2 - 1 - 1) intervals: at
        assert settled_as_the_reference(state, name, t0 + 5000, 1, 1, 0) is False
        record = state.read(name).record
        assert record is not None
        assert (record.at, record.due, record.settled) == (t0 + 5000, t0 + 4000, 2)
        assert admin.hget(key, "due") == b"%d" % (t0 + 4000)
        # every other operation carries settled through
        assert do(state, "take", name, 1000, burst=3).ticket == 3
        assert do(state, "slow", name, 1000, 0, burst=3) is True
        record = state.read(name).record
        assert record is not None
        assert (record.due, record.settled) == (t0 + 4000, 2)
        assert admin.hget(key, "settled") == b"2"
        with pytest.raises(
            ConfigurationError, match="a settled cost must be a whole number from 0 to the burst"
        ):
            do(state, "settle", name, 1000, 2, 1, 4, burst=3)
    finally:
        state.close()


@pytest.mark.parametrize(
    ("fields", "settle", "moved"),
    [
        # due a unit short of at + (burst - 1) slowest paces, near 2**53: an overrun moves it that unit
        ({"due": 2**52 - 10**10 + 2999 * ((2**52 - 1) // 3000) - 1}, (2, 1, 3000), True),
        # there already: nothing moves
        ({"due": 2**52 - 10**10 + 2999 * ((2**52 - 1) // 3000)}, (2, 1, 3000), False),
        # a refund down to at - burst intervals, the lowest due there is
        ({"due": 2**52 - 10**10}, (5, 3000, 0), True),
        # a refund of ticket 1, pos - ticket far past 2**52 intervals: the floor is beyond due
        ({"due": 2**52 - 10**10 + 2999 * ((2**52 - 1) // 3000)}, (1, 3000, 0), False),
    ],
    ids=["overrun to the limit", "overrun at the limit", "refund to the floor", "refund past the floor"],
)
def test_settle_is_exact_near_2_53(
    redis_server: Server,
    admin: redis.Redis,
    fields: dict[str, Any],
    settle: tuple[int, int, int],
    moved: bool,
) -> None:
    """Times and spans near 2**52, sums near 2**53: the script's doubles answer as Python's integers."""
    at = 2**52 - 10**10
    now = [at]
    state = clocked(redis_server, "lean:", now)
    name = fresh_name()
    interval, burst = 2**40, 3000  # burst * interval below 2**52; the slowest pace (2**52 - 1) // burst
    ticket, pos = (2**52 - 2, 2**52 - 3) if settle[0] == 1 else (6, 5)
    try:
        base = {"ticket": ticket, "pos": pos, "at": at, "interval": interval, "burst": burst}
        admin.hset(state.key(name), mapping=full({**base, **fields}))
        assert settled_as_the_reference(state, name, at, *settle) is moved
    finally:
        state.close()


def test_the_last_ticket_counts_the_cost(redis_server: Server, admin: redis.Redis) -> None:
    """A take of cost c is refused once ticket + c reaches 2**52, and the record is left as it was."""
    now = [10**15]
    state = clocked(redis_server, "lean:", now)
    name = fresh_name()
    ticket = 2**52 - 3
    try:
        fields: dict[Any, Any] = {
            "ticket": ticket,
            "pos": ticket - 1,
            "at": 10**15,
            "interval": 10,
            "burst": 3,
            "due": 10**15,
        }
        admin.hset(state.key(name), mapping=full(fields))
        for call in (
            lambda: do(state, "take", name, 10, burst=3, cost=3),
            lambda: do(state, "take_and_try", name, 10, 0, burst=3, cost=3),
        ):
            with pytest.raises(StateCorrupted, match=f"ticket={ticket}, the last ticket"):
                call()
        assert do(state, "take", name, 10, burst=3, cost=2) == Taken(
            ticket=ticket, pos=ticket - 1, at=10**15, now=10**15
        )
        record = state.read(name).record
        assert record is not None
        assert record.ticket == 2**52 - 1
    finally:
        state.close()


def test_a_burst_starts_at_once_then_keeps_the_rate(redis_server: Server) -> None:
    """Burst 3 on an idle queue: three starts at once, the fourth an interval later; costs count."""
    t0 = 10**15
    now = [t0]
    state = clocked(redis_server, "lean:", now)
    name = fresh_name()
    try:
        starts = [do(state, "take_and_try", name, 1000, 0, burst=3) for _ in range(3)]
        assert starts == [Started(ticket=t, start=t0, now=t0) for t in (1, 2, 3)]
        assert do(state, "take_and_try", name, 1000, 0, burst=3) == Wait(ticket=4, slot=t0 + 1000, now=t0)
        now[0] = t0 + 1000
        assert do(state, "try_start", name, 1000, 4, 0, burst=3) == Started(
            ticket=4, start=t0 + 1000, now=t0 + 1000
        )
        now[0] = t0 + 11_000  # idle: the whole burst is free again
        assert do(state, "take_and_try", name, 1000, 0, burst=3, cost=3) == Started(
            5, t0 + 11_000, t0 + 11_000
        )
        # ticket 8 (cost 2) has its strict slot 3 intervals on, and may come one interval early
        assert do(state, "take_and_try", name, 1000, 0, burst=3, cost=2) == Wait(8, t0 + 13_000, t0 + 11_000)
        record = state.read(name).record
        assert record == Record(ticket=10, pos=5, at=t0 + 11_000, interval=1000, burst=3, due=t0 + 11_000)
    finally:
        state.close()


def until_gone(state: RedisState, name: str, timeout: float = 10.0) -> bool:
    """Whether Redis deletes ``name``'s key by itself within ``timeout`` seconds (polled, real time)."""
    return until(lambda: state.client.exists(state.key(name)) == 0, timeout)


def test_keys_with_a_keep_time_expire_by_themselves(redis_server: Server) -> None:
    """On the server's clock: a key written with keep_us goes when idle; one written without has no TTL."""
    state = RedisState(redis.Redis(port=redis_server.port), prefix=fresh_prefix())
    try:
        assert do(state, "take_and_try", "kept", 1000, 0, burst=2, keep_us=50_000) is not None
        assert do(state, "take_and_try", "forever", 1000, 0, burst=2) is not None
        assert state.names() == ["forever", "kept"]
        client = state.client
        # expires = now + 2 ms (two slots of 1 ms), kept 50 ms after that: a TTL of 52 ms at most
        assert 0 < client.pttl(state.key("kept")) <= 52
        assert client.pttl(state.key("forever")) == -1
        assert until_gone(state, "kept")
        assert state.names() == ["forever"]
        assert state.read("kept").record is None
        assert state.read("forever").record is not None
        assert state.sweep() == 0, "Redis deletes expired keys itself"
    finally:
        state.close()


def test_a_write_without_a_keep_time_clears_the_ttl(redis_server: Server) -> None:
    """PERSIST: a record a plain limiter uses never vanishes, though a keyed writer set a TTL before."""
    state = RedisState(redis.Redis(port=redis_server.port), prefix=fresh_prefix())
    try:
        for name in ("gone", "stays"):
            do(state, "take_and_try", name, 1000, 0, keep_us=50_000)
            assert state.client.pttl(state.key(name)) > 0
        do(state, "take", name, 1000)  # "stays", written again without a keep time
        assert state.client.pttl(state.key("stays")) == -1
        assert until_gone(state, "gone"), "its twin, kept as long, has expired"
        assert state.names() == ["stays"]
    finally:
        state.close()


def test_reads_and_refusals_leave_the_ttl_alone(redis_server: Server) -> None:
    """Only a write sets or clears the TTL: a read, a mismatch and a refused record change nothing."""
    state = RedisState(redis.Redis(port=redis_server.port), prefix=fresh_prefix())
    try:
        key = state.key("q")
        do(state, "take_and_try", "q", 1000, 0, keep_us=600_000_000)
        assert state.client.pttl(key) > 599_000
        state.read("q")
        with pytest.raises(ConfigurationError, match="interval"):
            do(state, "take", "q", 2000)
        with pytest.raises(ConfigurationError, match="burst"):
            do(state, "take", "q", 1000, burst=2)
        assert state.client.pttl(key) > 599_000
        state.client.hset(key, "at", "x")
        with pytest.raises(StateCorrupted, match="at='x'"):
            do(state, "take", "q", 1000)
        assert state.client.pttl(key) > 599_000
    finally:
        state.close()


def _tries_without_a_trace(
    execute: Any, stored: Any, pexpire: Any, name: str, fair: bool, t0: int, now: list[int]
) -> None:
    """try_take on a record, against the reference: each wait leaves the hash and its TTL as they were.

    ``execute`` carries out an operation, ``stored`` is the hash and its
    PTTL (ms), ``pexpire`` sets the TTL (ms). A queue of one place, taken:
    tries too early and tries that find the record full (take_and_try would
    note held), of the tenant that holds the place and of another (on a fair
    record, take_and_try would add a waiter); then a retry with the live
    lease's token (its start again: written, the TTL set), and a try that
    starts once the place is free (written).
    """
    terms = Terms.checked(1000, 1, 600 * 10**6, 1, 10**9, fair=fair)
    reference = protocol.new_record(1000, 1, 1, fair)

    def step(kind: Kind, tenant: str = "a", **arguments: Any) -> Any:
        nonlocal reference
        made: Operation = operation(kind, name, terms, tenant=tenant if fair else "", **arguments)
        reference, expected = apply(protocol.check(reference, now[0]), made, now[0])
        answer = execute(made)
        assert answer == expected, (kind, arguments)
        return answer

    assert step("take_and_try", token=5) == Started(1, t0, t0)
    pexpire(123_456_789)  # a TTL no write sets (the keep time makes some 600_000 ms)
    before = stored()
    for lead, tenant in ((0, "a"), (10**9, "a"), (10**9, "b"), (0, "b")):
        now[0] += 1
        answer = step("try_take", tenant, lead_us=lead, token=6)
        assert isinstance(answer, Wait), answer
        after = stored()
        assert after[0] == before[0], (lead, tenant)  # byte for byte
        assert before[1] - 10_000 < after[1] <= before[1] <= 123_456_789
    record = protocol.check(reference, now[0])
    assert (record.ticket, record.held, record.waiters) == (2, protocol.NEVER, ())
    assert step("try_take", token=5) == Started(1, t0, now[0])  # the lease's start again: written
    assert stored()[0] == before[0]  # (the same record)
    assert 1_600_000 - 10_000 < stored()[1] <= 1_600_000  # to the lease's expiry (1000 s), plus the keep
    assert step("release", ticket=1, token=5) is True
    now[0] = t0 + 1000
    assert step("try_take", "b", lead_us=0, token=7) == Started(2, t0 + 1000, t0 + 1000)
    assert stored()[0] != before[0]


@pytest.mark.parametrize("fair", [False, True], ids=["plain", "fair"])
@pytest.mark.parametrize("path", ["lean", "redis-py", "wait", "async", "cluster"])
def test_a_try_take_that_waits_writes_nothing(
    redis_server: Server, request: pytest.FixtureRequest, path: str, fair: bool
) -> None:
    """try_take writes only when it starts, on every call path: the lean EVALSHA, redis-py's Script
    calls, the script + WAIT pipeline, the asyncio state and a Redis Cluster."""
    t0 = 10**15
    now = [t0]
    prefix, name = fresh_prefix(), fresh_name()
    key = prefix + name
    if path == "async":
        _tries_async(redis_server, prefix, name, fair, t0, now)
        return
    client: Any
    if path == "cluster":
        seed = request.getfixturevalue("redis_cluster").ports[0]
        client = redis.cluster.RedisCluster(host="127.0.0.1", port=seed)
    else:
        client = redis.Redis(port=redis_server.port, single_connection_client=path == "redis-py")
    # (wait: no replica answers; each write waits 1 ms and stands)
    state = RedisState(
        client, prefix=prefix, clock=lambda: now[0], wait=int(path == "wait"), wait_timeout_ms=1
    )
    try:
        assert (state._lean is not None) == (path == "lean")
        _tries_without_a_trace(
            state.execute,
            lambda: (client.hgetall(key), client.pttl(key)),
            lambda ms: client.pexpire(key, ms),
            name, fair, t0, now,
        )  # fmt: skip
        assert state.read(name).record is not None
    finally:
        state.reset(name)
        state.close()


def _tries_async(redis_server: Server, prefix: str, name: str, fair: bool, t0: int, now: list[int]) -> None:
    """:func:`_tries_without_a_trace` on the asyncio state (the scenario in a thread, calls on the loop)."""

    async def main() -> None:
        state = AsyncRedisState(
            redis.asyncio.Redis(port=redis_server.port), prefix=prefix, clock=lambda: now[0]
        )
        loop = asyncio.get_running_loop()
        key = prefix + name

        def run(made: Any) -> Any:
            return asyncio.run_coroutine_threadsafe(made, loop).result()

        async def stored() -> tuple[Any, int]:
            return await state.client.hgetall(key), await state.client.pttl(key)

        try:
            await asyncio.to_thread(
                _tries_without_a_trace,
                lambda op: run(state.execute(op)),
                lambda: run(stored()),
                lambda ms: run(state.client.pexpire(key, ms)),
                name, fair, t0, now,
            )  # fmt: skip
        finally:
            await state.reset(name)
            await state.close()

    asyncio.run(main())


@pytest.mark.parametrize("now_us", [0, 10**15])
@pytest.mark.parametrize(
    ("keep_us", "ms"),
    [
        (10**9 + 1, 1_000_003),  # 2 ms to expiry + 1000 s + 1 us, rounded up to whole ms
        (10**9, 1_000_002),
        (2**52 - 1, 2**52 // 1000 + 1),  # a span past 2**52 us is cut to it: some 142 years
    ],
)
def test_the_ttl_counts_from_the_scripts_now(
    redis_server: Server, now_us: int, keep_us: int, ms: int
) -> None:
    """PEXPIRE is relative: with a fixed now far from the server's, the TTL is still keep + time to expiry."""
    now = [now_us]
    state = clocked(redis_server, fresh_prefix(), now)
    try:
        assert do(state, "take_and_try", "q", 1000, 0, burst=2, keep_us=keep_us) == Started(1, now_us, now_us)
        assert ms - 1000 < state.client.pttl(state.key("q")) <= ms
    finally:
        state.close()


def test_names_escape_glob_characters(redis_server: Server, admin: redis.Redis) -> None:
    """names(prefix) matches the state's key prefix and the name prefix literally, glob characters too."""
    prefix = f"g*[{next(_names)}]?\\:"
    state = RedisState(redis.Redis(port=redis_server.port), prefix=prefix)
    other = RedisState(redis.Redis(port=redis_server.port), prefix=prefix.replace("*", "x"))
    names = ["a*b", "a?b", "a[b]", "a\\b", "axb", "b", "é*"]
    try:
        for name in [*names, "a"]:
            do(state, "take", name, INTERVAL)
        do(other, "take", "a*b", INTERVAL)  # a key the escaped pattern must not match
        admin.set(prefix + "junk", "x")  # a key under the prefix that is no record: listed, for a reset
        assert state.names() == sorted([*names, "a", "junk"])
        assert state.names("a") == sorted(["a", "a*b", "a?b", "a[b]", "a\\b", "axb"])
        assert state.names("a*") == ["a*b"]
        assert state.names("a?") == ["a?b"]
        assert state.names("a[") == ["a[b]"]
        assert state.names("a\\") == ["a\\b"]
        assert state.names("é") == ["é*"]
        assert state.names("zz") == []
        assert other.names() == ["a*b"]
    finally:
        state.close()
        other.close()


def test_names_on_a_client_that_decodes_replies(redis_server: Server) -> None:
    prefix = fresh_prefix()
    state = RedisState(redis.Redis(port=redis_server.port, decode_responses=True), prefix=prefix)
    try:
        for name in ("b", "a", "é"):
            do(state, "take", name, INTERVAL)
        assert state.names() == ["a", "b", "é"]
    finally:
        state.close()


def test_names_page_through_scan(redis_server: Server) -> None:
    """More keys than one SCAN reply holds are all listed, each once."""
    prefix = fresh_prefix()
    state = RedisState(redis.Redis(port=redis_server.port), prefix=prefix)
    try:
        with state.client.pipeline(transaction=False) as pipe:
            for i in range(2500):
                pipe.hset(f"{prefix}n{i}", mapping={"ticket": 1, "pos": 0, "at": 0, "interval": 1})
            pipe.execute()
        assert state.names() == sorted(f"n{i}" for i in range(2500))
        assert state.names("n1") == sorted(f"n{i}" for i in range(2500) if str(i).startswith("1"))
    finally:
        state.close()


# ------------------------------------------------------------------ asyncio


async def every_async_operation(state: AsyncRedisState, name: str) -> list[int]:
    """Run each of the five scripts once through the asyncio state; the tickets they named."""
    taken = await ado(state, "take", name, INTERVAL)
    assert isinstance(await ado(state, "try_start", name, INTERVAL, taken.ticket, 10**9), Started)
    assert isinstance(await ado(state, "retime", name, INTERVAL, taken.ticket, 0), Started)
    outcome = await ado(state, "take_and_try", name, INTERVAL, 10**9)
    assert isinstance(outcome, Started)
    record = (await state.read(name)).record
    assert record is not None
    return [taken.ticket, outcome.ticket, record.ticket]


@pytest.mark.parametrize("protocol", [2, 3])
def test_async_flush_and_killed_connections(redis_server: Server, admin: redis.Redis, protocol: int) -> None:
    """The asyncio lean path reloads flushed scripts and retries killed connections, losing nothing."""
    client_name = f"async{protocol}"

    async def run() -> None:
        client = redis.asyncio.Redis(port=redis_server.port, protocol=protocol, client_name=client_name)
        state = AsyncRedisState(client, prefix="lean:")
        try:
            assert state._lean is not None
            name = fresh_name()
            assert await every_async_operation(state, name) == [1, 2, 3]
            admin.script_flush()
            assert await every_async_operation(state, name) == [3, 4, 5]
            assert kill_named(admin, client_name) == 1
            assert (await ado(state, "take", name, INTERVAL)).ticket == 5
            assert clients_named(admin, client_name) == 1
        finally:
            await state.close()
        assert until(lambda: clients_named(admin, client_name) == 0)

    asyncio.run(run())


def test_async_tasks_never_share_a_connection(redis_server: Server, admin: redis.Redis) -> None:
    """Tasks calling one asyncio state at once each get a connection of their own."""

    async def run() -> None:
        state = AsyncRedisState(redis.asyncio.Redis(port=redis_server.port, client_name="tasks"))
        name = fresh_name()

        async def takes() -> list[int]:
            return [(await ado(state, "take", name, INTERVAL)).ticket for _ in range(20)]

        try:
            results = await asyncio.gather(*(takes() for _ in range(8)))
            assert sorted(t for tickets in results for t in tickets) == list(range(1, 161))
            assert 1 <= clients_named(admin, "tasks") <= 8
        finally:
            await state.close()

    asyncio.run(run())


def test_async_names_keep_times_and_sweep(redis_server: Server) -> None:
    """The asyncio state lists names, keeps with a TTL, persists without one, and sweeps nothing."""

    async def run() -> None:
        prefix = fresh_prefix()
        state = AsyncRedisState(redis.asyncio.Redis(port=redis_server.port), prefix=prefix)
        try:
            await ado(state, "take_and_try", "kept", 1000, 0, burst=2, keep_us=50_000)
            await ado(state, "take_and_try", "forever", 1000, 0, burst=2)
            assert await state.names() == ["forever", "kept"]
            assert await state.names("k") == ["kept"]
            assert await state.client.pttl(prefix + "forever") == -1
            assert 0 < await state.client.pttl(prefix + "kept") <= 52
            record = (await state.read("kept")).record
            assert record is not None
            assert (record.burst, record.due) == (2, record.at)
            assert await state.sweep() == 0
        finally:
            await state.close()

    asyncio.run(run())


def test_async_single_connection_client_uses_redis_py(redis_server: Server) -> None:
    async def run() -> None:
        client = redis.asyncio.Redis(port=redis_server.port, single_connection_client=True)
        state = AsyncRedisState(client, prefix="lean:")
        try:
            assert state._lean is None
            assert await every_async_operation(state, fresh_name()) == [1, 2, 3]
        finally:
            await state.close()

    asyncio.run(run())


# ------------------------------------------------------------------ the codec (no server)


def test_the_script_serves_every_operation() -> None:
    """Each operation the codec can ask for is one the script's dispatch knows, and its header names."""
    header = codec.SCRIPT.split("]]", 1)[0]
    for op in (*KINDS, "read"):
        assert re.search(rf'op == "{op}"', codec.SCRIPT), op
        assert op in header, op


@pytest.mark.parametrize("now_us", [None, 0, 1_700_000_000_000_000])
@pytest.mark.parametrize(
    "terms", [Terms(10_000), Terms(10_000, 7, 2**52 - 1), Terms(10_000, 1, 0, 1000, 2**52 - 1)]
)
@pytest.mark.parametrize(
    ("op", "args"),
    [
        ("take", (0, 0, 1, 0, 0, 0)),
        ("try_start", (7, 0, 3, 0, 2**52 - 1, 100_000)),
        ("take_and_try", (0, 250, 2, 0, 99, 0)),
        ("try_take", (0, 250, 2, 0, 99, 0)),
        ("retime", (7, 9, 1, 0, 0, 0)),
        ("set_paused", (0, 0, 1, 1, 0, 0)),
        ("release", (7, 0, 1, 0, 12, 0)),
        ("renew", (7, 0, 1, 0, 12, 0)),
        ("settle", (7, 3, 2, 0, 0, 0)),
        ("read", codec.READ_ARGUMENTS),
    ],
)
def test_the_packing_is_redis_pys(op: str, args: tuple[int, ...], terms: Terms, now_us: int | None) -> None:
    """The hand-packed EVALSHA is byte for byte what redis-py's packer makes of the same call."""
    connection = redis.Connection()  # type: ignore[no-untyped-call]
    commands = codec.Commands()
    key = "ratequeue:q\u00e9"
    expected = connection.pack_command(  # type: ignore[no-untyped-call]
        "EVALSHA", codec.SHA, 1, key, *codec.script_args(op, terms, now_us, args)
    )
    for _ in range(2):  # packed afresh, then from the kept head
        assert b"".join(commands.packed(op, key, terms, now_us, args)) == b"".join(expected)


@pytest.mark.parametrize("fair", [False, True], ids=["plain", "fair"])
def test_try_take_is_packed_as_take_and_try(fair: bool) -> None:
    """try_take sends take_and_try's ARGV (the fair ARGV[14..16] too) under its own name, on every
    path: the hand-packed EVALSHA (the lean calls) and redis-py's (Script, the WAIT pipeline, a
    cluster) alike."""
    terms = Terms.checked(10_000, 3, 5, 2, 7, fair=fair)
    fields = {"tenant": "t\u00e9 \U0001d11e", "weight": 4} if fair else {}
    made = {
        kind: operation(kind, "q", terms, lead_us=250, cost=2, token=99, doubt_us=7, **fields)  # type: ignore[arg-type]
        for kind in ("take_and_try", "try_take")
    }
    args = codec.arguments(made["try_take"])
    assert args == codec.arguments(made["take_and_try"])
    assert args == (
        (0, 250, 2, 0, 99, 7, 1, 4, "t\u00e9 \U0001d11e".encode()) if fair else (0, 250, 2, 0, 99, 7)
    )
    connection = redis.Connection()  # type: ignore[no-untyped-call]
    key = "ratequeue:q\u00e9"
    for now_us in (None, 0, 1_700_000_000_000_000):
        argv = codec.script_args("try_take", terms, now_us, args)
        assert argv == ["try_take", *codec.script_args("take_and_try", terms, now_us, args)[1:]]
        expected = b"".join(connection.pack_command("EVALSHA", codec.SHA, 1, key, *argv))  # type: ignore[no-untyped-call]
        commands = codec.Commands()
        for _ in range(2):  # packed afresh, then from the kept head
            packed = b"".join(commands.packed("try_take", key, terms, now_us, args))
            assert packed == expected
            assert packed == b"".join(commands.packed("take_and_try", key, terms, now_us, args)).replace(
                b"$12\r\ntake_and_try\r\n", b"$8\r\ntry_take\r\n"
            )
    assert codec.PARSERS["try_take"] is codec.PARSERS["take_and_try"]


def test_kept_heads_tell_terms_apart() -> None:
    """Calls differing only in burst, keep time, max_running or lease are packed with their own numbers."""
    commands = codec.Commands()
    every = (
        Terms(10),
        Terms(10, 2),
        Terms(10, 1, 3),
        Terms(10, 1, 0, 2, 7),
        Terms(10, 1, 0, 2, 8),
        Terms(10),
    )
    packed = {terms: b"".join(commands.packed("take", "k", terms, 5, (0, 0, 1, 0, 0, 0))) for terms in every}
    assert len(set(packed.values())) == 5
    numbers = b"".join(
        b"$%d\r\n%b\r\n" % (len(n), n)
        for n in (b"10", b"1", b"3", b"0", b"0", b"5", b"0", b"0", b"1", b"0", b"0", b"0")
    )
    assert packed[Terms(10, 1, 3)].endswith(numbers)


def test_replies_parse_as_bytes_and_as_text() -> None:
    for reply in (b"started 3 -5 7", "started 3 -5 7"):
        assert codec.parse_outcome(reply, "q", "k", TERMS) == Started(ticket=3, start=-5, now=7)
    assert codec.parse_outcome(b"wait 3 20 7", "q", "k", TERMS) == Wait(ticket=3, slot=20, now=7)
    assert codec.parse_outcome(b"passed 3 4 7", "q", "k", TERMS) == Passed(ticket=3, pos=4, now=7)
    never = protocol.NEVER
    taken = codec.parse_taken(f"taken 1 0 {never} 9", "q", "k", TERMS)
    assert taken == Taken(ticket=1, pos=0, at=never, now=9)
    assert codec.parse_snapshot(b"none 5", "q", "k", codec.READ_TERMS) == Snapshot(record=None, now=5)
    for reply in (
        f"record 5 3 2 1 10 4 21 0 0 {never} {never} 0 {never} 0 {never}".encode(),
        f"record 5 3 2 1 10 4 21 0 0 {never} {never} 0 {never} 0 {never}",
    ):
        assert codec.parse_snapshot(reply, "q", "k", codec.READ_TERMS) == Snapshot(
            record=Record(ticket=3, pos=2, at=1, interval=10, burst=4, due=21), now=5
        )
    paused = Record(ticket=3, pos=2, at=1, interval=10, burst=4, due=21, paused=True)
    reply = f"record 5 3 2 1 10 4 21 1 0 {never} {never} 0 {never} 0 {never}".encode()
    assert codec.parse_snapshot(reply, "q", "k", codec.READ_TERMS).record == paused
    reply = f"record 5 3 2 1 10 4 21 1 0 {never} {never} 0 {never} 0 -3".encode()
    assert codec.parse_snapshot(reply, "q", "k", codec.READ_TERMS).record == paused._replace(paused_at=-3)
    leased = Record(
        ticket=3, pos=2, at=1, interval=10, due=1, max_running=2, leases=((1, 7, 0), (2, -3, 9)), held=4
    )
    reply = f"record 5 3 2 1 10 1 1 0 2 4 {never} 0 {never} 0 {never} 1 7 0 2 -3 9".encode()
    assert codec.parse_snapshot(reply, "q", "k", codec.READ_TERMS).record == leased
    on_hold = Record(ticket=3, pos=2, at=1, interval=10, due=1, held=4, not_before=70)
    reply = f"record 5 3 2 1 10 1 1 0 0 4 70 0 {never} 0 {never}".encode()
    assert codec.parse_snapshot(reply, "q", "k", codec.READ_TERMS).record == on_hold
    slowed = Record(ticket=3, pos=2, at=1, interval=10, due=1, pace=40, paced_at=-2)
    reply = f"record 5 3 2 1 10 1 1 0 0 {never} {never} 40 -2 0 {never}".encode()
    assert codec.parse_snapshot(reply, "q", "k", codec.READ_TERMS).record == slowed
    settled = Record(ticket=3, pos=2, at=1, interval=10, burst=4, due=-9, settled=2)
    reply = f"record 5 3 2 1 10 4 -9 0 0 {never} {never} 0 {never} 2 {never}".encode()
    assert codec.parse_snapshot(reply, "q", "k", codec.READ_TERMS).record == settled
    for reply in (b"set 1 5", "set 1 5"):
        assert codec.parse_changed(reply, "q", "k", TERMS) is True
    assert codec.parse_changed(b"set 0 5", "q", "k", TERMS) is False
    for reply in (b"live 1 5", "live 1 5"):
        assert codec.parse_live(reply, "q", "k", TERMS) is True
    assert codec.parse_live(b"live 0 5", "q", "k", TERMS) is False


@pytest.mark.parametrize(
    "reply",
    [
        b"granted 3 4 7",  # an unknown kind is never taken for an answer
        b"taken 3 4 7 8",  # a take's answer to a try_start
        b"Started 3 4 7",
        b"started 3 4",
        b"started 3 4 7 8",
        b"started 3 4.5 7",
        b"started three 4 7",
        b"",
        [b"started", 3, 4, 7],  # an array: not what the script answers
        7,
        None,
        b"corrupt at 1e20",
        b"mismatch",
        b"mismatch 20",  # not a reply this script gives
        b"mismatch interval 10",  # the interval it was asked for: nonsense, not a mismatch
        b"mismatch burst 1",  # the burst it was asked for
        b"mismatch cost 3",
        b"mismatch burst -2",
    ],
)
def test_an_unexpected_outcome_is_corrupted(reply: Any) -> None:
    with pytest.raises(StateCorrupted, match="ratequeue:q") as raised:
        codec.parse_outcome(reply, "q", "ratequeue:q", TERMS)
    assert raised.value.where == "ratequeue:q"


@pytest.mark.parametrize("reply", [b"started 1 2 3", b"taken 1 2 3", b"taken 1 2 3 4 5", b"none 5"])
def test_an_unexpected_taken_is_corrupted(reply: bytes) -> None:
    with pytest.raises(StateCorrupted):
        codec.parse_taken(reply, "q", "ratequeue:q", TERMS)


@pytest.mark.parametrize(
    "reply",
    [
        b"taken 1 0 1 5",
        b"none",
        b"record 5 3 2 1",
        b"record 5 3 2 1 10",
        b"record 5 3 2 1 10 1",
        b"record 5 3 2 1 10 1 x",
        b"record 5 3 2 1 10 1 1",
        b"record 5 3 2 1 10 1 1 2",
        b"record 5 3 2 1 10 1 1 1",
        b"record 5 3 2 1 10 1 1 1 1",
        b"record 5 3 2 1 10 1 1 2 0 0",
        b"record 5 3 2 1 10 1 1 1 2 0",  # no not_before
        b"record 5 3 2 1 10 1 1 1 2 0 x",
        b"record 5 3 2 1 10 1 1 1 2 0 0",  # no pace nor paced_at
        b"record 5 3 2 1 10 1 1 1 2 0 0 0",  # no paced_at
        b"record 5 3 2 1 10 1 1 1 2 0 0 0 x",
        b"record 5 3 2 1 10 1 1 1 2 0 0 0 0",  # no settled
        b"record 5 3 2 1 10 1 1 1 2 0 0 0 0 x",
        b"record 5 3 2 1 10 1 1 1 2 0 0 0 0 0",  # no paused_at
        b"record 5 3 2 1 10 1 1 1 2 0 0 0 0 0 x",
        b"record 5 3 2 1 10 1 1 1 2 0 0 0 0 0 0 1",  # half a lease
        b"record 5 3 2 1 10 1 1 1 2 0 0 0 0 0 0 1 x",
        b"record 5 3 2 1 10 1 1 1 2 0 0 0 0 0 0 1 7",  # two thirds of a lease
        b"?",
    ],
)
def test_an_unexpected_snapshot_is_corrupted(reply: bytes) -> None:
    with pytest.raises(StateCorrupted):
        codec.parse_snapshot(reply, "q", "ratequeue:q", codec.READ_TERMS)


@pytest.mark.parametrize(
    "reply", [b"set 2 5", b"set 1", b"set x 5", b"started 1 2 3", b"mismatch burst 3", b"live 1 5"]
)
def test_an_unexpected_set_paused_answer_is_refused(reply: bytes) -> None:
    with pytest.raises((StateCorrupted, ConfigurationError)):
        codec.parse_changed(reply, "q", "ratequeue:q", TERMS)


@pytest.mark.parametrize(
    "reply", [b"live 2 5", b"live 1", b"live x 5", b"set 1 5", b"started 1 2 3", b"mismatch max_running 3"]
)
def test_an_unexpected_release_or_renew_answer_is_refused(reply: bytes) -> None:
    with pytest.raises((StateCorrupted, ConfigurationError)):
        codec.parse_live(reply, "q", "ratequeue:q", TERMS)


def test_a_mismatch_names_both_intervals_or_both_bursts() -> None:
    for parse in (codec.parse_taken, codec.parse_outcome):
        with pytest.raises(ConfigurationError, match=r"interval 0\.02 s .* not 0\.01 s"):
            parse(b"mismatch interval 20000", "q", "ratequeue:q", Terms(10_000))
        with pytest.raises(ConfigurationError, match=r"has burst 3 in this state, not 2"):
            parse(b"mismatch burst 3", "q", "ratequeue:q", Terms(10_000, 2))
        with pytest.raises(ConfigurationError, match=r"has max_running 3 in this state, not 2"):
            parse(b"mismatch max_running 3", "q", "ratequeue:q", Terms(10_000, 1, 0, 2, 5))
        with pytest.raises(ConfigurationError, match=r"has max_running no cap in this state, not 2"):
            parse(b"mismatch max_running 0", "q", "ratequeue:q", Terms(10_000, 1, 0, 2, 5))
        with pytest.raises(StateCorrupted):  # the max_running it was asked for: nonsense
            parse(b"mismatch max_running 2", "q", "ratequeue:q", Terms(10_000, 1, 0, 2, 5))


@pytest.mark.parametrize(
    ("text", "pattern"),
    [("plain", "plain"), ("a*b", "a\\*b"), ("?[x]", "\\?\\[x\\]"), ("back\\slash", "back\\\\slash")],
)
def test_glob_escape(text: str, pattern: str) -> None:
    assert codec.glob_escape(text) == pattern


def test_a_bad_url_is_reported_without_the_password() -> None:
    with pytest.raises(ConfigurationError, match="Redis URL") as raised:
        RedisState.from_url("redis://user:s3cret@localhost:notaport/0")
    assert "s3cret" not in str(raised.value)
