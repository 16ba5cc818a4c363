"""Fair queues in the Redis script (protocol.enqueue, try_turn, enqueue_and_try, run in Lua).

The shared contract (tests/test_fairness.py) drives ``take_and_try`` and
``try_start`` of cost 1; here every operation meets a fair record -- costs
under a burst, leases and tokens, releases, renewals, re-times, settlements,
reads -- on the thread and the asyncio state, against the reference step for
step. Then what the hash holds: the fair fields stored only when fair (as
numbers in decimal, however large, and tenants as JSON strings, whatever
they hold), every malformed fair field refused by name with nothing written,
and fairness a term like the interval.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import redis.asyncio
from hypothesis import given
from hypothesis import strategies as st

from ratequeue import aio
from ratequeue.core import protocol
from ratequeue.core.operation import MAX_WEIGHT, Kind, Operation, Terms, apply, operation
from ratequeue.core.protocol import MAX_US, Record, Started, Taken, Wait
from ratequeue.errors import StateCorrupted, TermsMismatch
from ratequeue.state.base import Snapshot
from ratequeue.state.records import check_record
from ratequeue.state.redis import AsyncRedisState, RedisState, codec

from .servers import Server
from .strategies import epochs_us, intervals_us

_names = itertools.count()

TENANTS = ["t0", "t1", "", 'qu"o\\te/ é ☃ 𝄞']


def fresh_name() -> str:
    """A queue name no other test uses."""
    return f"fair{next(_names)}"


@pytest.fixture
def admin(redis_server: Server) -> Iterator[redis.Redis]:
    with redis.Redis(port=redis_server.port) as client:
        yield client


_tokens = st.sampled_from([0, 0, 1, 2, MAX_US - 1])
_leads = st.one_of(st.just(0), st.integers(0, 50_000), st.just(10**9))
_doubts = st.sampled_from([0, 0, 700, protocol.MAX_DOUBT_US])
_steps = st.one_of(
    st.tuples(st.just("take"), st.integers(0, 3), st.integers(1, 3), st.integers(1, 3)),
    st.tuples(
        st.just("take_and_try"), st.integers(0, 3), st.integers(1, 3), st.integers(1, 3), _leads, _tokens,
        _doubts,
    ),
    st.tuples(
        st.just("try_take"), st.integers(0, 3), st.integers(1, 3), st.integers(1, 3), _leads, _tokens,
        _doubts,
    ),
    st.tuples(st.just("try_start"), st.integers(0, 12), _leads, _tokens, _doubts, st.integers(1, 3)),
    st.tuples(st.just("release"), st.integers(0, 12), _tokens),
    st.tuples(st.just("renew"), st.integers(0, 12), _tokens),
    st.tuples(st.just("retime"), st.integers(0, 12), _leads, _doubts),
    st.tuples(st.just("settle"), st.integers(0, 12), st.integers(1, 3), st.integers(0, 3)),
    st.tuples(st.just("clock"), st.one_of(st.integers(0, 300_000), st.integers(0, 10**8))),
    st.tuples(st.just("set_paused"), st.booleans()),
    st.tuples(st.just("hold"), st.integers(0, 300_000)),
    st.tuples(st.just("lift")),
    st.tuples(st.just("slow"), st.integers(0, 2_000_000)),
)  # fmt: skip


def _operations(name: str, terms: Terms, steps: list[tuple[Any, ...]]) -> Iterator[Operation | int]:
    """The operations ``steps`` make (a clock step: the microseconds it moves the clock by)."""
    seen = [1, 2, 3]  # numbers and tickets answered so far (and a few never handed out)
    for step in steps:
        kind, args = step[0], step[1:]
        cost = lambda wanted: min(wanted, terms.burst)  # noqa: E731
        if kind == "clock":
            yield args[0]
            continue
        made: Operation
        if kind == "take":
            made = operation("take", name, terms, tenant=TENANTS[args[0]], weight=args[1], cost=cost(args[2]))
        elif kind in ("take_and_try", "try_take"):
            which, weight, wanted, lead, token, doubt = args
            made = operation(
                kind, name, terms, tenant=TENANTS[which], weight=weight, cost=cost(wanted),
                lead_us=lead, token=token if terms.max_running else 0, doubt_us=doubt,
            )  # fmt: skip
        elif kind == "try_start":
            which, lead, token, doubt, wanted = args
            made = operation(
                "try_start", name, terms, ticket=seen[which % len(seen)], lead_us=lead,
                token=token if terms.max_running else 0, doubt_us=doubt, cost=cost(wanted),
            )  # fmt: skip
        elif kind in ("release", "renew"):
            if kind == "renew" and not terms.max_running:
                continue
            made = operation(kind, name, terms, ticket=seen[args[0] % len(seen)], token=args[1])
        elif kind == "retime":
            made = operation("retime", name, terms, ticket=seen[args[0] % len(seen)], lead_us=args[1],
                             doubt_us=args[2])  # fmt: skip
        elif kind == "settle":
            made = operation("settle", name, terms, ticket=seen[args[0] % len(seen)],
                             cost=cost(args[1]), lead_us=min(args[2], terms.burst))  # fmt: skip
        elif kind == "set_paused":
            made = operation("set_paused", name, terms, paused=args[0])
        elif kind in ("hold", "slow"):
            made = operation(kind, name, terms, lead_us=args[0])
        else:
            made = operation("lift", name, terms)
        answer = yield made
        if isinstance(answer, (Taken, Started, Wait)) and answer.ticket not in seen:
            seen.append(answer.ticket)


def _drive(
    name: str, terms: Terms, epoch: int, steps: list[tuple[Any, ...]], execute: Any, read: Any
) -> None:
    """Run ``steps`` on the state (``execute``, ``read``) and on the reference: the same, step by step."""
    reference: Record | None = None
    now = epoch
    made = _operations(name, terms, steps)
    answer: object = None
    while True:
        try:
            step = made.send(answer)
        except StopIteration:
            break
        answer = None
        if isinstance(step, int):
            now += step
            continue
        before = reference or protocol.new_record(terms.interval_us, terms.burst, terms.max_running, True)
        reference, expected = apply(protocol.check(before, now), step, now)
        answer = execute(step, now)
        assert answer == expected, (step, before)
        assert read(now) == reference, step


@pytest.mark.parametrize("client", ["sync", "async"])
@given(
    interval=intervals_us,
    epoch=epochs_us,
    burst=st.integers(1, 3),
    max_running=st.sampled_from([None, None, 1, 2]),
    lease=st.sampled_from([1, 50_000, 10**9]),
    steps=st.lists(_steps, min_size=1, max_size=40),
)
def test_every_operation_on_a_fair_record_is_the_reference(
    redis_server: Server,
    client: str,
    interval: int,
    epoch: int,
    burst: int,
    max_running: int | None,
    lease: int,
    steps: list[tuple[Any, ...]],
) -> None:
    terms = Terms.checked(interval, burst, 0, max_running, lease if max_running else 0, fair=True)
    name = fresh_name()
    clock = [epoch]
    if client == "sync":
        state = RedisState(redis.Redis(port=redis_server.port), prefix="fair:", clock=lambda: clock[0])
        try:

            def execute(op: Operation, now: int) -> object:
                clock[0] = now
                return state.execute(op)

            _drive(name, terms, epoch, steps, execute, lambda now: state.read(name).record)
        finally:
            state.reset(name)
            state.close()
        return

    async def main() -> None:
        state = AsyncRedisState(
            redis.asyncio.Redis(port=redis_server.port), prefix="fair:", clock=lambda: clock[0]
        )
        loop = asyncio.get_running_loop()
        try:
            # (the reference runs in a thread: each state call waits for the loop, here)
            def execute(op: Operation, now: int) -> object:
                clock[0] = now
                return asyncio.run_coroutine_threadsafe(state.execute(op), loop).result()

            async def read(name: str) -> Record | None:
                return (await state.read(name)).record

            await asyncio.to_thread(
                _drive, name, terms, epoch, steps, execute,
                lambda now: asyncio.run_coroutine_threadsafe(read(name), loop).result(),
            )  # fmt: skip
        finally:
            await state.reset(name)
            await state.close()

    asyncio.run(main())


def test_only_a_fair_record_stores_the_fair_fields(redis_server: Server, admin: redis.Redis) -> None:
    state = RedisState(redis.Redis(port=redis_server.port), prefix="fair:")
    plain, fair = fresh_name(), fresh_name()
    try:
        state.execute(operation("take_and_try", plain, Terms.checked(1000), lead_us=10**9))
        assert set(admin.hgetall(state.key(plain))) == {
            b"ticket", b"pos", b"at", b"interval", b"due", b"burst", b"max_running", b"held", b"paused",
            b"leases",
        }  # fmt: skip
        terms = Terms.checked(10**6, fair=True)  # a second: the next call cannot come after the interval
        first = state.execute(operation("take_and_try", fair, terms, lead_us=10**9, tenant="a"))
        second = state.execute(operation("take_and_try", fair, terms, tenant="a"))
        third = state.execute(operation("take", fair, terms, tenant="b", weight=2))
        assert isinstance(first, Started)
        assert second == Wait(2, first.start + 10**6, second.now)  # type: ignore[union-attr]
        assert third == Taken(3, 1, first.start, third.now)  # type: ignore[union-attr]
        stored = admin.hgetall(state.key(fair))
        assert stored[b"fair"] == b"1"
        assert stored[b"number"] == b"4"
        assert stored[b"begun"] == b"1"
        assert json.loads(stored[b"waiters"]) == [[2, "a", 1, 1, 2], [3, "b", 2, 1, 3]]
        record = state.read(fair).record
        assert record is not None
        assert (record.fair, record.number, record.begun) == (True, 4, 1)
        assert record.waiters == ((2, "a", 1, 1, 2), (3, "b", 2, 1, 3))
    finally:
        state.reset(plain)
        state.reset(fair)
        state.close()


def test_a_fair_record_stores_paused_at_only_while_paused(redis_server: Server, admin: redis.Redis) -> None:
    """A pause stores paused_at beside the fair fields; a resume deletes it: the hash is then byte for byte
    (DUMP) the one a fair queue never paused holds, and reads as the reference."""
    t0 = 10**15
    clock = [t0]
    state = RedisState(redis.Redis(port=redis_server.port), prefix="fair:", clock=lambda: clock[0])
    paused, never = fresh_name(), fresh_name()
    terms = Terms.checked(10**6, fair=True)
    try:
        for name in (paused, never):
            assert state.execute(operation("take_and_try", name, terms, tenant="a")) == Started(1, t0, t0)
            assert isinstance(state.execute(operation("take", name, terms, tenant="b")), Taken)
        reference = state.read(paused).record
        assert reference is not None
        clock[0] = t0 + 70
        reference, changed = protocol.set_paused(reference, True, clock[0])
        assert changed
        assert state.execute(operation("set_paused", paused, terms, paused=True)) is True
        stored = admin.hgetall(state.key(paused))
        assert (stored[b"paused"], stored[b"paused_at"], stored[b"fair"]) == (b"1", b"%d" % (t0 + 70), b"1")
        assert state.read(paused).record == reference
        assert reference.paused_at == t0 + 70
        clock[0] = t0 + 90
        assert state.execute(operation("take", paused, terms, tenant="c")) == Taken(3, 1, t0, t0 + 90)
        assert state.execute(operation("set_paused", paused, terms, paused=True)) is False
        assert admin.hget(state.key(paused), "paused_at") == b"%d" % (t0 + 70)
        assert state.execute(operation("set_paused", paused, terms, paused=False)) is True
        assert state.execute(operation("take", never, terms, tenant="c")) == Taken(3, 1, t0, t0 + 90)
        assert admin.hgetall(state.key(paused)) == admin.hgetall(state.key(never))
        assert admin.dump(state.key(paused)) == admin.dump(state.key(never))
        record = state.read(paused).record
        assert record is not None
        assert record == state.read(never).record
        assert (record.paused, record.paused_at, record.fair) == (False, protocol.NEVER, True)
    finally:
        state.reset(paused)
        state.reset(never)
        state.close()


@pytest.mark.parametrize("stale", ["100", "x"])
def test_a_fair_record_not_paused_ignores_a_paused_at_left_behind(
    redis_server: Server, admin: redis.Redis, stale: str
) -> None:
    """paused_at on a fair record not paused (an older version's resume left it) is ignored, whatever it
    holds: the record reads NEVER, and the next write drops it, leaving the fair fields as they were."""
    state = RedisState(redis.Redis(port=redis_server.port), prefix="fair:")
    name = fresh_name()
    key = state.key(name)
    try:
        good = {
            "ticket": 3, "pos": 2, "at": 100, "interval": 4096, "due": 100, "burst": 1, "max_running": 0,
            "held": protocol.NEVER, "paused": 0, "leases": "", "fair": 1, "number": 4, "begun": 2,
            "waiters": '[[3, "a", 1, 1, 0]]',
        }  # fmt: skip
        admin.hset(key, mapping={**good, "paused_at": stale})
        record = state.read(name).record
        assert record is not None
        assert (record.paused, record.paused_at, record.fair) == (False, protocol.NEVER, True)
        assert record.waiters == ((3, "a", 1, 1, 0),)
        terms = Terms.checked(4096, fair=True)
        assert isinstance(state.execute(operation("take", name, terms, tenant="b")), Taken)
        stored = admin.hgetall(key)
        assert b"paused_at" not in stored
        assert (stored[b"paused"], stored[b"fair"], stored[b"number"]) == (b"0", b"1", b"5")
        after = state.read(name).record
        assert after is not None
        assert after.paused_at == protocol.NEVER
    finally:
        state.reset(name)
        state.close()


def test_large_numbers_and_odd_tenants_are_stored_exactly(redis_server: Server, admin: redis.Redis) -> None:
    """Numbers near 2**52 in decimal (cjson would write 1e+15), tenants as JSON strings holding anything."""
    now = 1_800_000_000_000_000
    client = redis.Redis(port=redis_server.port, decode_responses=True)
    state = RedisState(client, prefix="fair:", clock=lambda: now)
    name = fresh_name()
    key = state.key(name)
    big = MAX_US - 10
    fields: dict[str, Any] = {
        "ticket": big - 1, "pos": big - 2, "at": now, "interval": 1000, "due": now, "burst": 1,
        "max_running": 0, "held": protocol.NEVER, "paused": False, "leases": [], "fair": True,
        "number": big, "begun": 0, "waiters": [[big - 1, "x", 1, 1, 0]],
    }  # fmt: skip
    try:
        stored = {k: int(v) if isinstance(v, bool) else v for k, v in fields.items()}
        admin.hset(key, mapping={**stored, "leases": "", "waiters": json.dumps(fields["waiters"])})
        terms = Terms.checked(1000, fair=True)
        reference = check_record(fields, where="test")
        for tenant in TENANTS:
            reference, expected = protocol.enqueue(reference, now, tenant)
            assert state.execute(operation("take", name, terms, tenant=tenant)) == expected
        assert state.read(name).record == reference
        assert reference.ticket == big + 4
        assert [w[0] for w in reference.waiters] == list(range(big - 1, big + len(TENANTS)))
        assert b"e+" not in admin.hget(key, "waiters")  # type: ignore[operator]
        assert json.loads(admin.hget(key, "waiters"))[4][1] == TENANTS[3]  # type: ignore[arg-type]
        # the next waiter would need number MAX_US - 1 + 1
        admin.hset(key, "number", MAX_US - 1)
        before = admin.hgetall(key)
        with pytest.raises(StateCorrupted, match=f"number={MAX_US - 1}"):
            state.execute(operation("take", name, terms, tenant="late"))
        assert admin.hgetall(key) == before
        # a ticket that would reach the limit is refused, nothing written
        admin.hset(key, mapping={"number": big + 5, "waiters": "[]", "ticket": MAX_US - 1})
        before = admin.hgetall(key)
        for kind in ("take", "take_and_try"):
            with pytest.raises(StateCorrupted, match=f"ticket={MAX_US - 1}"):
                state.execute(operation(kind, name, terms, tenant="late"))  # type: ignore[arg-type]
        assert admin.hgetall(key) == before
    finally:
        state.reset(name)
        state.close()


def test_fairness_is_a_term(redis_server: Server) -> None:
    state = RedisState(redis.Redis(port=redis_server.port), prefix="fair:")
    fair, plain = fresh_name(), fresh_name()
    try:
        state.execute(operation("take", fair, Terms.checked(1000, fair=True), tenant="a"))
        state.execute(operation("take", plain, Terms.checked(1000)))
        with pytest.raises(TermsMismatch, match="fair") as raised:
            state.execute(operation("take", fair, Terms.checked(1000)))
        assert (raised.value.field, raised.value.stored, raised.value.wanted) == ("fair", True, False)
        with pytest.raises(TermsMismatch, match="fair") as raised:
            state.execute(operation("hold", plain, Terms.checked(1000, fair=True), lead_us=5))
        assert (raised.value.field, raised.value.stored, raised.value.wanted) == ("fair", False, True)
        # any operation creates a fair record for fair terms
        held = fresh_name()
        state.execute(operation("hold", held, Terms.checked(1000, fair=True), lead_us=5))
        record = state.read(held).record
        assert record is not None
        assert record.fair
        state.reset(held)
    finally:
        state.reset(fair)
        state.reset(plain)
        state.close()


_BAD = [
    ({"fair": "0"}, "fair='0'"),
    ({"fair": "yes"}, "fair='yes'"),
    ({"number": "0"}, "number='0'"),
    ({"number": "x"}, "number='x'"),
    ({"number": str(MAX_US)}, f"number='{MAX_US}'"),
    ({"begun": "5"}, "begun='5'"),
    ({"begun": "-1"}, "begun='-1'"),
    ({"waiters": "x"}, "waiters='x'"),
    ({"waiters": "{}"}, "waiters='{}'"),
    ({"waiters": '{"1": [1, "a", 1, 1, 0]}'}, "waiters="),
    ({"waiters": '[[1, "a", 0, 1, 0]]'}, "waiters="),  # weight 0
    ({"waiters": '[[1, "a", 1001, 1, 0]]'}, "waiters="),  # weight past MAX_WEIGHT
    ({"waiters": "[[1, 5, 1, 1, 0]]"}, "waiters="),  # tenant not a string
    ({"waiters": '[[5, "a", 1, 1, 0]]'}, "waiters="),  # number not below number
    ({"waiters": '[[2, "a", 1, 1, 0], [1, "b", 1, 1, 0]]'}, "waiters="),  # not rising
    ({"waiters": '[[1, "a", 1, 1, 2]]'}, "waiters="),  # ticket at pos
    ({"waiters": '[[1, "a", 1, 1, 4]]'}, "waiters="),  # ticket not handed out
    ({"waiters": '[[1, "a", 1, 0, 0]]'}, "waiters="),  # cost 0
    ({"waiters": '[[1.5, "a", 1, 1, 0]]'}, "waiters="),
    ({"waiters": '[[1, "a", 1, 1]]'}, "waiters="),
    ({"waiters": '[[1, "a", 1, 1, 0, 0]]'}, "waiters="),
    ({"waiters": '[[1, "a", 1, 1, null]]'}, "waiters="),
    ({"waiters": '[[1, "a", 1, 1e300, 0]]'}, "waiters="),
    ({"waiters": "[1]"}, "waiters="),
    ({"waiters": "[" * 2000 + "]" * 2000}, "waiters="),
    ({"paused": 1, "paused_at": "x"}, "paused_at='x'"),
]


@pytest.mark.parametrize(("fields", "pattern"), _BAD, ids=[str(i) for i in range(len(_BAD))])
def test_malformed_fair_fields_are_refused(
    redis_server: Server, admin: redis.Redis, fields: dict[str, str], pattern: str
) -> None:
    """Each fair field is checked as records.check_record checks it; every call refuses, writes nothing."""
    state = RedisState(redis.Redis(port=redis_server.port), prefix="fair:")
    name = fresh_name()
    key = state.key(name)
    try:
        good = {
            "ticket": 3, "pos": 2, "at": 100, "interval": 4096, "due": 100, "burst": 1, "max_running": 0,
            "held": protocol.NEVER, "paused": 0, "leases": "", "fair": 1, "number": 4, "begun": 2,
            "waiters": '[[3, "a", 1, 1, 0]]',
        }  # fmt: skip
        admin.hset(key, mapping={**good, **fields})
        before = admin.hgetall(key)
        terms = Terms.checked(4096, fair=True)
        for call in (
            lambda: state.read(name),
            lambda: state.execute(operation("take", name, terms, tenant="a")),
            lambda: state.execute(operation("try_start", name, terms, ticket=3)),
            lambda: state.execute(operation("take_and_try", name, terms, tenant="a")),
            lambda: state.execute(operation("set_paused", name, terms, paused=True)),
        ):
            with pytest.raises(StateCorrupted, match=re.escape(pattern)) as raised:
                call()
            assert raised.value.where == key
        assert admin.hgetall(key) == before
    finally:
        state.reset(name)
        state.close()


def test_a_record_without_the_fair_flag_is_not_fair(redis_server: Server, admin: redis.Redis) -> None:
    """Stray fair fields without ``fair`` are not read (as records.check_record), and left as they are."""
    state = RedisState(redis.Redis(port=redis_server.port), prefix="fair:")
    name = fresh_name()
    key = state.key(name)
    try:
        admin.hset(
            key,
            mapping={
                "ticket": 3, "pos": 2, "at": 100, "interval": 4096, "due": 100, "burst": 1,
                "max_running": 0, "held": protocol.NEVER, "paused": 0, "leases": "", "number": "x",
            },
        )  # fmt: skip
        record = state.read(name).record
        assert record is not None
        assert not record.fair
        assert isinstance(state.execute(operation("take", name, Terms.checked(4096))), Taken)
    finally:
        state.reset(name)
        state.close()


# ------------------------------------------------------------------ the codec (no server)


@pytest.mark.parametrize("now_us", [None, 7])
@pytest.mark.parametrize("tenant", ["", "acme", 'é"\\ /☃'])
@pytest.mark.parametrize("kind", ["take", "take_and_try", "try_start", "hold"])
def test_a_fair_operation_is_packed_as_redis_py_packs_it(kind: Kind, tenant: str, now_us: int | None) -> None:
    connection = redis.Connection()  # type: ignore[no-untyped-call]
    commands = codec.Commands()
    terms = Terms.checked(1000, 2, fair=True)
    arguments: dict[str, Any] = {"take": {"tenant": tenant, "weight": 3}, "hold": {"lead_us": 5}}.get(
        kind, {"ticket": 4} if kind == "try_start" else {"tenant": tenant, "lead_us": 9}
    )
    op = operation(kind, "q", terms, **arguments)
    args = codec.arguments(op)
    assert args[6:8] == (1, op.weight)
    assert args[8] == op.tenant.encode()
    expected = connection.pack_command(  # type: ignore[no-untyped-call]
        "EVALSHA", codec.SHA, 1, "k", *codec.script_args(kind, terms, now_us, args)
    )
    for _ in range(2):  # packed afresh, then from the kept head
        assert b"".join(commands.packed(kind, "k", terms, now_us, args)) == b"".join(expected)
    unfair = operation(kind, "q", Terms.checked(1000, 2), **arguments)
    assert len(codec.arguments(unfair)) == 6, "a queue that is not fair sends what it sent before"


def test_a_fair_snapshot_parses_as_bytes_and_as_text() -> None:
    never = protocol.NEVER
    head = f"record 5 3 2 1 10 1 1 1 0 {never} {never} 0 {never} 0 7"
    tail = '4 1 [[2,"a\\/b",1,1,0],[3,"\\u00e9",2,1,0]]'
    expected = Record(
        ticket=3, pos=2, at=1, interval=10, due=1, paused=True, fair=True, number=4, begun=1,
        waiters=((2, "a/b", 1, 1, 0), (3, "é", 2, 1, 0)), paused_at=7,
    )  # fmt: skip
    for reply in (f"{head}\n{tail}", f"{head}\n{tail}".encode()):
        assert codec.parse_snapshot(reply, "q", "k", codec.READ_TERMS) == Snapshot(record=expected, now=5)


@pytest.mark.parametrize(
    "tail",
    ["", "4", "4 1", "4 1 x", "4 1 [[2]]", '4 1 [[2,"a",1,1]]', '4 1 [[2,3,1,1,0]]', '4 1 [[2,"a",1,1.5,0]]',
     "x 1 []", "4 x []", "4 1 {}"],
)  # fmt: skip
def test_an_unexpected_fair_snapshot_is_corrupted(tail: str) -> None:
    never = protocol.NEVER
    reply = f"record 5 3 2 1 10 1 1 0 0 {never} {never} 0 {never} 0 {never}\n{tail}".encode()
    with pytest.raises(StateCorrupted):
        codec.parse_snapshot(reply, "q", "ratequeue:q", codec.READ_TERMS)
    with pytest.raises(StateCorrupted):
        codec.parse_snapshot(b"none 5\n4 1 []", "q", "ratequeue:q", codec.READ_TERMS)


def test_a_fair_mismatch_names_both() -> None:
    with pytest.raises(TermsMismatch, match=r"is fair in this state \(fair=True\), not fair=False"):
        codec.parse_taken(b"mismatch fair 1", "q", "ratequeue:q", Terms(10))
    with pytest.raises(TermsMismatch, match=r"is not fair in this state"):
        codec.parse_taken(b"mismatch fair 0", "q", "ratequeue:q", Terms(10, fair=True))
    with pytest.raises(StateCorrupted):  # the fairness it was asked for: nonsense
        codec.parse_taken(b"mismatch fair 1", "q", "ratequeue:q", Terms(10, fair=True))


def test_the_scripts_largest_weight_is_the_operations() -> None:
    match = re.search(r"^local MAX_WEIGHT = (\d+)\b", codec.SCRIPT, re.MULTILINE)
    assert match is not None
    assert int(match.group(1)) == MAX_WEIGHT


@pytest.mark.parametrize("path", ["lean", "redis-py", "wait", "decoded"])
def test_every_call_path_carries_the_tenant(redis_server: Server, path: str) -> None:
    """The hand-packed EVALSHA, redis-py's Script call and the WAIT pipeline send the same fair arguments."""
    options: dict[str, Any] = {
        "redis-py": {"single_connection_client": True},
        "decoded": {"decode_responses": True},
    }.get(path, {})
    client = redis.Redis(port=redis_server.port, **options)
    state = RedisState(client, prefix="fair:", wait=1 if path == "wait" else 0, wait_timeout_ms=1)
    name = fresh_name()
    terms = Terms.checked(1000, fair=True)
    try:
        assert (state._lean is None) == (path in ("redis-py", "wait"))
        first = state.execute(operation("take_and_try", name, terms, lead_us=10**9, tenant=TENANTS[3]))
        assert isinstance(first, Started)
        second = state.execute(operation("take", name, terms, tenant=TENANTS[3], weight=7))
        assert isinstance(second, Taken)
        record = state.read(name).record
        assert record is not None
        assert record.waiters == ((2, TENANTS[3], 7, 1, 2),)
        started = state.execute(operation("try_start", name, terms, ticket=2, lead_us=10**9))
        assert isinstance(started, Started)
        assert started.ticket == 2
        assert started.start >= first.start + 1000
    finally:
        state.reset(name)
        state.close()


def test_an_asyncio_limiter_takes_turns_by_tenant(redis_server: Server) -> None:
    async def main() -> None:
        url = f"redis://127.0.0.1:{redis_server.port}/0?prefix=fair:"
        limiter = aio.Limiter(url, name=fresh_name(), interval=0.001, fair=True)
        try:
            first = await limiter.acquire(tenant="a")
            second = await limiter.acquire(tenant="b")
            assert second.start_us - first.start_us >= 1000
            assert (await limiter.status()).tenants == {}
        finally:
            await limiter.close()

    asyncio.run(main())
