"""Fair queues: tenants with waiters take turns (ratequeue.core.protocol.enqueue, try_turn).

The property test drives the reference protocol with shards of several
tenants that arrive, ask, die, and a queue that is paused, held and slowed,
and checks the guarantees after every step (docs/design.md, "Fair queues"):
starts an interval apart in ticket order (G1), first come first served
inside a tenant, every unstarted ticket held by a waiter and no tenant
holding more than its weight (so a tenant's first waiter starts within the
sum of the waiting tenants' weights of intervals), and no tenant left
without a ticket while its weight allows one.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import multiprocessing
import statistics
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ratequeue import Limiter, aio
from ratequeue.core import protocol
from ratequeue.core.operation import Terms, operation
from ratequeue.core.protocol import Passed, Record, Started, Wait
from ratequeue.core.shard import Shard
from ratequeue.errors import AcquireTimeout, ConfigurationError, StateCorrupted, TermsMismatch
from ratequeue.events import Event, flush
from ratequeue.state import State
from ratequeue.state.file import FileState
from ratequeue.state.mongodb import MongoState
from ratequeue.state.postgresql import PostgresState
from ratequeue.state.records import check_record
from ratequeue.state.redis import RedisState

from .backends import Backend, given_for_backend
from .strategies import epochs_us, intervals_us, leads_us

SHARDS = 6

#: each shared backend's state class: whether it carries out fair queues (the others refuse them)
STATE_CLASSES: dict[str, type[State]] = {
    "file": FileState,
    "redis": RedisState,
    "postgresql": PostgresState,
    "mongodb": MongoState,
}

#: steps: a shard of a tenant takes a number (if it holds none) and tries it; a shard asks with
#: its number; a shard dies (forgets its number); the clock moves; the queue is paused, resumed,
#: held, lifted or slowed
_steps = st.one_of(
    st.tuples(st.just("arrive"), st.integers(0, SHARDS - 1), st.integers(0, 3), leads_us),
    st.tuples(st.just("ask"), st.integers(0, SHARDS - 1), leads_us),
    st.tuples(st.just("try"), st.integers(0, 3), leads_us),  # a try_acquire: a turn now or nothing
    st.tuples(st.just("die"), st.integers(0, SHARDS - 1)),
    st.tuples(st.just("clock"), st.integers(0, 300_000)),
    st.tuples(st.just("pause")),
    st.tuples(st.just("resume")),
    st.tuples(st.just("hold"), st.integers(0, 300_000)),
    st.tuples(st.just("lift")),
    st.tuples(st.just("slow"), st.integers(0, 2_000_000)),
)


def check_waiters(record: Record) -> None:
    """Each unstarted ticket is one waiter's; a tenant holds at most its weight, no fewer while it waits."""
    held = sorted(waiter[4] for waiter in record.waiters if waiter[4])
    assert held == list(range(record.pos + 1, record.ticket)), "each unstarted ticket is a waiter's"
    numbers = [waiter[0] for waiter in record.waiters]
    assert numbers == sorted(numbers)
    assert len(set(numbers)) == len(numbers)
    assert all(number < record.number for number in numbers)
    holding = Counter(waiter[1] for waiter in record.waiters if waiter[4])
    for number, tenant, weight, _, ticket in record.waiters:
        assert holding[tenant] <= weight, f"tenant {tenant!r} holds more tickets than its weight"
        if not ticket:
            assert holding[tenant] >= weight, (
                f"waiter {number} of {tenant!r} has no ticket though one is free"
            )
    # so a tenant's first ticket waits behind at most the other waiting tenants' weights of tickets
    weights = {tenant: weight for _, tenant, weight, _, _ in record.waiters}
    assert record.ticket - record.pos - 1 <= sum(weights.values())


@given(
    interval=intervals_us,
    epoch=epochs_us,
    weights=st.lists(st.integers(1, 3), min_size=4, max_size=4),
    steps=st.lists(_steps, min_size=1, max_size=60),
)
def test_fair_queue_keeps_its_guarantees_after_every_step(
    interval: int, epoch: int, weights: list[int], steps: list[tuple[object, ...]]
) -> None:
    record = protocol.new_record(interval, fair=True)
    now = epoch
    numbers: dict[int, tuple[int, str]] = {}  # shard -> (its number, its tenant)
    starts: list[tuple[int, int]] = []  # (ticket, start)
    for step in steps:
        kind = step[0]
        before = record
        outcome: object = None
        tenant = ""
        shard = int(step[1]) if kind in ("arrive", "ask", "die") else -1  # type: ignore[call-overload]
        if kind == "clock":
            now += int(step[1])  # type: ignore[call-overload]
            continue
        if kind == "die":
            numbers.pop(shard, None)
            continue
        if kind in ("pause", "resume"):
            record, _ = protocol.set_paused(record, kind == "pause", now)
        elif kind == "hold":
            record, _ = protocol.hold(record, int(step[1]), now)  # type: ignore[call-overload]
        elif kind == "lift":
            record, _ = protocol.lift(record, now)
        elif kind == "slow":
            record, _ = protocol.slow(record, int(step[1]), now)  # type: ignore[call-overload]
        elif kind == "try":
            which = int(step[1])  # type: ignore[call-overload]
            tenant, lead = f"t{which}", int(step[2])  # type: ignore[call-overload]
            record, outcome = protocol.try_take(record, lead, now, tenant=tenant, weight=weights[which])
            if not isinstance(outcome, Started):
                assert record is before, "a try that gets no turn changes nothing"
        elif kind == "arrive":
            if shard in numbers:
                continue
            which = int(step[2])  # type: ignore[call-overload]
            tenant, lead = f"t{which}", int(step[3])  # type: ignore[call-overload]
            record, outcome = protocol.enqueue_and_try(record, tenant, weights[which], lead, now)
            assert record.number == before.number + 1
            if not isinstance(outcome, Started):
                assert isinstance(outcome, Wait)
                assert outcome.ticket == before.number
                numbers[shard] = (before.number, tenant)
        else:
            if shard not in numbers:
                continue
            number, tenant = numbers[shard]
            record, outcome = protocol.try_turn(record, number, int(step[2]), now)  # type: ignore[call-overload]
            if not isinstance(outcome, Wait):
                del numbers[shard]
        if isinstance(outcome, Started):
            ticket = outcome.ticket
            assert ticket == record.pos > before.pos
            assert outcome.start >= now
            starter = record.begun
            earlier = [w[0] for w in record.waiters if w[1] == tenant and w[0] < starter]
            assert not earlier, "a tenant's waiters start in the order they came"
            if starts:
                last_ticket, last_start = starts[-1]
                assert ticket > last_ticket
                assert outcome.start - last_start >= interval, "G1: starts an interval apart"
            starts.append((ticket, outcome.start))
        elif isinstance(outcome, Wait):
            assert outcome.slot >= now
        elif outcome is not None:
            assert isinstance(outcome, Passed)
        check_waiters(protocol.check(record, now))
        assert check_record(_stored(record), where="test") == record, "a fair record stores as it is"


def _stored(record: Record) -> dict[str, object]:
    from ratequeue.state.file import _encode

    return json.loads(json.dumps(_encode(record)))  # type: ignore[no-any-return]


def _run_fleet(shards: list[str], weights: dict[str, int], starts: int, interval: int = 1000) -> list[str]:
    """Shards (one per tenant named) asking exactly when told: whose tenant each start was."""
    record = protocol.new_record(interval, fair=True)
    now = 0
    held: dict[int, int] = {}
    wake = dict.fromkeys(range(len(shards)), 0)
    order: list[str] = []
    while len(order) < starts:
        now = min(wake.values())
        for shard, tenant in enumerate(shards):
            if wake[shard] > now:
                continue
            if shard in held:
                record, outcome = protocol.try_turn(record, held[shard], 0, now)
            else:
                record, outcome = protocol.enqueue_and_try(record, tenant, weights.get(tenant, 1), 0, now)
            if isinstance(outcome, Started):
                held.pop(shard, None)
                order.append(tenant)
                wake[shard] = now  # asks again at once for its next job
            elif isinstance(outcome, Wait):
                held[shard] = held.get(shard, outcome.ticket)
                wake[shard] = outcome.slot
            else:
                held.pop(shard, None)
    return order


def test_a_tenant_with_one_shard_gets_its_share_beside_one_with_many() -> None:
    order = _run_fleet(["big"] * 8 + ["small"], {}, 200)
    assert Counter(order[20:])["small"] >= 85, "small, with one shard, has about half the turns"
    # unfair, small would have one turn in nine: its shard holds one ticket among nine
    gaps = [i for i, tenant in enumerate(order) if tenant == "small"]
    assert max(b - a for a, b in itertools.pairwise(gaps)) <= 2, (
        "no tenant waits behind more than the others' weights"
    )


def test_weights_share_the_turns() -> None:
    order = _run_fleet(["a"] * 6 + ["b"] * 6, {"a": 3}, 400)
    counted = Counter(order[40:])
    assert 0.70 <= counted["a"] / 360 <= 0.80, counted  # 3 : 1


def test_the_shard_orders_its_own_callers_by_tenant() -> None:
    shard = Shard("q", Terms.checked(1000, fair=True))
    places = [shard.add(tenant="big") for _ in range(4)]
    small = shard.add(tenant="small")
    heavy = shard.add(tenant="heavy", weight=3)
    line = list(shard._line)
    assert line[0] is places[0], "the head stays the head"
    assert line.index(small) < line.index(places[1]), "small comes after big's first, not its fourth"
    assert line.index(heavy) < line.index(places[2])
    unfair = Shard("q", Terms.checked(1000))
    first, second = unfair.add(), unfair.add()
    assert list(unfair._line) == [first, second]


def test_a_fair_record_refuses_malformed_waiters() -> None:
    record = protocol.enqueue(protocol.new_record(1000, fair=True), 0, "acme")[0]
    fields = _stored(record)
    for bad in (
        [[1, "acme", 0, 1, 0]],
        [[1, 5, 1, 1, 0]],
        [[9, "acme", 1, 1, 0]],
        [[1, "acme", 1, 1, 7]],
        "x",
    ):
        with pytest.raises(StateCorrupted, match="waiters"):
            check_record({**fields, "waiters": bad}, where="test")
    with pytest.raises(StateCorrupted, match="fair"):
        check_record({**fields, "fair": 1}, where="test")


def test_bad_input_is_refused_at_the_boundary(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/s.json"
    with pytest.raises(ConfigurationError, match="fair=True"):
        Limiter(url, name="q", interval=0.01).acquire(tenant="acme")
    with pytest.raises(ConfigurationError, match="fair=True"):
        Limiter(url, name="q", interval=0.01, weights={"acme": 2})
    with pytest.raises(ConfigurationError, match="weights"):
        Limiter(url, name="q", interval=0.01, fair=True, weights={"acme": 0})
    with pytest.raises(ConfigurationError, match="tenant"):
        Limiter(url, name="q", interval=0.01, fair=True, weights={3: 1})  # type: ignore[dict-item]
    # (max_late=None: under load a late wake-up gives its ticket up for the next, and the count
    # of tickets below is what shows the refusal changed nothing)
    fair = Limiter(url, name="q2", interval=0.01, fair=True, max_late=None)
    with pytest.raises(ConfigurationError, match="tenant"):
        fair.acquire(tenant=5)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="printable"):
        fair.acquire(tenant="a\nb")
    with pytest.raises(ConfigurationError, match="weight must be"):
        operation("take", "q", Terms.checked(1000, fair=True), tenant="x", weight=0)
    fair.acquire(tenant="acme")
    with pytest.raises(TermsMismatch, match="fair"):
        Limiter(url, name="q2", interval=0.01).acquire()
    assert fair.acquire(tenant="acme").ticket == 2, "the refusal changed nothing"


def test_a_state_without_fair_queues_refuses_a_fair_limiter(backend: Backend) -> None:
    state = backend.open()
    try:
        if state.fair_queues:
            Limiter(state, name=backend.fresh_name(), interval=0.01, fair=True).acquire(tenant="a")
        else:
            with pytest.raises(ConfigurationError, match="does not carry out fair queues"):
                Limiter(state, name=backend.fresh_name(), interval=0.01, fair=True)
            name = backend.fresh_name()
            with pytest.raises(ConfigurationError, match="does not carry out fair queues"):
                state.execute(operation("take", name, Terms.checked(1000, fair=True), tenant="a"))
            assert state.read(name).record is None, "nothing was written"
    finally:
        state.close()


def test_asyncio_limiter_takes_tenants(tmp_path: Path) -> None:
    async def main() -> None:
        limiter = aio.Limiter(f"file://{tmp_path}/s.json", name="q", interval=0.001, fair=True)
        try:
            first = await limiter.acquire(tenant="a")
            second = await limiter.acquire(tenant="b")
            assert second.start_us - first.start_us >= 1000
            with pytest.raises(ConfigurationError, match="printable"):
                await limiter.acquire(tenant="\x00")
        finally:
            await limiter.close()

    asyncio.run(main())


def _big(url: str, name: str, rate: str, fair: bool, ready: Any, stop: Any, starts: Any) -> None:
    shards = [Limiter(url, name=name, rate=rate, fair=fair) for _ in range(8)]
    begun: list[int] = []

    def loop(limiter: Limiter) -> None:
        while not stop.is_set():
            begun.append(limiter.acquire(tenant="big" if fair else None).start_us)
            ready.set()

    threads = [threading.Thread(target=loop, args=(limiter,)) for limiter in shards]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    starts.put(begun)


@pytest.mark.processes
@pytest.mark.parametrize("fair", [True, False])
def test_processes_share_turns_between_tenants(shared_backend: Backend, fair: bool) -> None:
    """A tenant with 8 shards in one process, one with 1 in another: small's turns come every other."""
    if fair and shared_backend.kind == "mongodb":
        pytest.skip(
            "secantusdb, MongoDB's stand-in, answers in more than an interval under CI's load (medians "
            "of 3-4 tickets, not 2, in two CI runs): MongoDB's fair queues are held to the reference "
            "by the contract above and tests/test_fair_mongodb.py"
        )
    if fair and not STATE_CLASSES[shared_backend.kind].fair_queues:
        pytest.skip(f"fair queues are not carried out on {shared_backend.kind} yet (refused: tested above)")
    name = shared_backend.fresh_name()
    url = shared_backend.url + (f"&collection={name}" if shared_backend.kind == "mongodb" else "")
    context = multiprocessing.get_context("spawn")
    ready, stop, reported = context.Event(), context.Event(), context.Queue()
    # (secantusdb, MongoDB's stand-in, answers 9 busy shards in more than 50 ms: 5/s there)
    rate = "5/second" if shared_backend.kind == "mongodb" else "20/second"
    big = context.Process(target=_big, args=(url, name, rate, fair, ready, stop, reported))
    big.start()
    try:
        assert ready.wait(60), "the big tenant's process made no start"
        options = {"fair": True} if fair else {}
        passed: list[Event] = []
        small = Limiter(url, name=name, rate=rate, on_event=passed.append, **options)  # type: ignore[arg-type]
        try:
            turns = [small.acquire(tenant="small" if fair else None) for _ in range(5)]
        finally:
            small.close()
    finally:
        stop.set()
        big_starts = reported.get(timeout=60)
        big.join(60)
    # big's starts between two of small's, on the state's clock (passed tickets are no turns)
    mine = [turn.start_us for turn in turns]
    between = [sum(a < start < b for start in big_starts) for a, b in itertools.pairwise(mine)]
    if fair:
        # each of small's acquires waits behind big's one ticket in line (1 start; 2 allowed for a
        # loaded machine), where arrival order gives about 8. And small's tickets are not passed:
        # before a state's connecting was kept out of its first call's round-trip, big's shards on
        # PostgreSQL took leads of several intervals and passed small's tickets 1-4 times a run
        assert statistics.median(between) <= 2, between
        flush(5.0)
        assert sum(event.kind == "passed" for event in passed) <= 1, passed
    else:
        assert statistics.median(between) >= 4, f"unfair, small waits behind big's 8 shards: {between}"
    assert big.exitcode == 0


@given_for_backend(
    interval=intervals_us,
    epoch=epochs_us,
    weights=st.lists(st.integers(1, 3), min_size=4, max_size=4),
    steps=st.lists(_steps, min_size=1, max_size=30),
)
def test_the_states_carry_out_fair_queues_as_the_reference(
    backend: Backend,
    interval: int,
    epoch: int,
    weights: list[int],
    steps: list[tuple[object, ...]],
) -> None:
    """The states that run fair queues answer, and store, what the reference does (the contract)."""
    state, clock = backend.clocked()
    if not state.fair_queues:
        pytest.skip(f"fair queues are not carried out on {backend.kind} yet (refused: the test above)")
    name = backend.fresh_name()
    clock[0] = epoch
    terms = Terms.checked(interval, fair=True)
    reference = protocol.new_record(interval, fair=True)
    numbers: dict[int, int] = {}
    try:
        for step in steps:
            kind_, now = step[0], clock[0]
            shard = int(step[1]) if kind_ in ("arrive", "ask", "die") else -1  # type: ignore[call-overload]
            if kind_ == "clock":
                clock[0] = now + int(step[1])  # type: ignore[call-overload]
            elif kind_ == "die":
                numbers.pop(shard, None)
            elif kind_ == "arrive" and shard not in numbers:
                which, lead = int(step[2]), int(step[3])  # type: ignore[call-overload]
                tenant, weight = f"t{which}", weights[which]
                reference, expected = protocol.enqueue_and_try(reference, tenant, weight, lead, now)
                got = state.execute(
                    operation("take_and_try", name, terms, lead_us=lead, tenant=tenant, weight=weight)
                )
                assert got == expected
                if isinstance(got, Wait):
                    numbers[shard] = got.ticket
            elif kind_ == "try":
                which, lead = int(step[1]), int(step[2])  # type: ignore[call-overload]
                tenant, weight = f"t{which}", weights[which]
                reference, expected = protocol.try_take(reference, lead, now, tenant=tenant, weight=weight)
                tried = operation("try_take", name, terms, lead_us=lead, tenant=tenant, weight=weight)
                got = state.execute(tried)
                assert got == expected
            elif kind_ == "ask" and shard in numbers:
                lead = int(step[2])  # type: ignore[call-overload]
                reference, expected = protocol.try_turn(reference, numbers[shard], lead, now)
                got = state.execute(operation("try_start", name, terms, ticket=numbers[shard], lead_us=lead))
                assert got == expected
                if not isinstance(got, Wait):
                    del numbers[shard]
            elif kind_ in ("pause", "resume"):
                reference, _ = protocol.set_paused(reference, kind_ == "pause", now)
                state.execute(operation("set_paused", name, terms, paused=kind_ == "pause"))
            elif kind_ == "hold":
                lead = int(step[1])  # type: ignore[call-overload]
                reference, _ = protocol.hold(reference, lead, now)
                state.execute(operation("hold", name, terms, lead_us=lead))
            elif kind_ == "lift":
                reference, _ = protocol.lift(reference, now)
                state.execute(operation("lift", name, terms))
            elif kind_ == "slow":
                lead = int(step[1])  # type: ignore[call-overload]
                reference, _ = protocol.slow(reference, lead, now)
                state.execute(operation("slow", name, terms, lead_us=lead))
        # (an ask is made after an arrive only: every other kind writes the record)
        created = any(step[0] not in ("clock", "die", "ask") for step in steps)
        assert state.read(name).record == (reference if created else None)
    finally:
        state.reset(name)


def test_tenants_that_leave_leave_nothing_in_the_record(tmp_path: Path) -> None:
    limiter = Limiter(f"file://{tmp_path}/s.json", name="q", interval=0.0005, fair=True, max_running=2)
    try:
        for index in range(30):
            with limiter:  # (max_running: a lease, released when the block ends)
                pass
            turn = limiter.acquire(tenant=f"tenant-{index % 10}")
            assert limiter.release(turn)
        record = limiter.state.read("q").record
        assert record is not None
        assert record.fair
        assert record.waiters == ()
        assert limiter.status().tenants == {}
        assert record.number >= 61, "a waiter number per acquire (more for a turn given up and taken again)"
    finally:
        limiter.close()


def test_begins_and_timeouts_carry_the_tenant(tmp_path: Path) -> None:
    from ratequeue.events import flush

    events: list[Event] = []
    url = f"file://{tmp_path}/s.json"
    fair = Limiter(url, name="q", interval=10.0, fair=True, on_event=events.append)
    unfair = Limiter(url, name="u", interval=0.01, on_event=events.append)
    try:
        fair.acquire(tenant="acme")
        with pytest.raises(AcquireTimeout):
            fair.acquire(timeout=0.01, tenant="globex")  # the next turn is 10 s away
        unfair.acquire()
        assert flush(5.0)
    finally:
        fair.close()
        unfair.close()
    seen = [(event.kind, event.queue, event.tenant) for event in events if event.kind in ("begin", "timeout")]
    assert seen == [("begin", "q", "acme"), ("timeout", "q", "globex"), ("begin", "u", None)]


def test_waiters_without_tickets_wait_an_interval_more_each(backend: Backend) -> None:
    """A tenant's k-th waiter without a ticket is told to ask k-1 intervals after the first (every state)."""
    state, clock = backend.clocked()
    if not state.fair_queues:
        pytest.skip(f"fair queues are not carried out on {backend.kind} yet (refused: tested above)")
    name = backend.fresh_name()
    clock[0] = 10**9
    terms = Terms.checked(1000, fair=True)
    reference = protocol.new_record(1000, fair=True)
    answers = []
    try:
        for tenant in ("a", "a", "b", "a", "a", "a"):
            reference, expected = protocol.enqueue_and_try(reference, tenant, 1, 0, clock[0])
            got = state.execute(operation("take_and_try", name, terms, tenant=tenant))
            assert got == expected
            answers.append(got)
        assert isinstance(answers[0], Started)
        waits = [answer.slot for answer in answers[3:]]  # a's waiters without tickets
        assert [later - earlier for earlier, later in itertools.pairwise(waits)] == [1000, 1000]
        assert state.read(name).record == reference
    finally:
        state.reset(name)
