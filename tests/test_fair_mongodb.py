"""MongoDB's fair queues beside the reference, beyond the shared contract (tests/test_fairness.py).

The shared contract drives a fair queue of cost 1, no burst and no cap on
running jobs. Here the update pipelines (ratequeue/state/mongodb/codec.py,
``_FAIR_STAGES``) meet costs, bursts, ``max_running`` with leases and
tokens (a repeated start answered again), plain ``try_start`` asks for any
number, and the operations on the started ticket (retime, release, renew,
settle), each answer and the stored record checked against the reference.
Also: the document of a queue that is not fair holds no fair field, a fair
queue and a plain one of the same name refuse each other, and a corrupt
waiter is reported, never changed.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pymongo import MongoClient

from ratequeue.core import protocol
from ratequeue.core.operation import Terms, apply, operation
from ratequeue.core.protocol import Started, Wait
from ratequeue.errors import StateCorrupted, TermsMismatch
from ratequeue.state.mongodb import MongoState

from .servers import Server
from .strategies import epochs_us

SHARDS = 5

_steps = st.one_of(
    st.tuples(st.just("arrive"), st.integers(0, SHARDS - 1), st.integers(0, 2), st.integers(0, 200_000)),
    st.tuples(st.just("take"), st.integers(0, SHARDS - 1), st.integers(0, 2)),
    st.tuples(st.just("ask"), st.integers(0, SHARDS - 1), st.integers(0, 200_000)),
    st.tuples(st.just("ask_any"), st.integers(0, 12), st.integers(0, 200_000)),
    st.tuples(st.just("again"), st.integers(0, SHARDS - 1)),
    st.tuples(st.just("end"), st.sampled_from(["release", "renew", "retime", "settle"])),
    st.tuples(st.just("clock"), st.integers(0, 150_000)),
    st.tuples(st.just("pause"), st.booleans()),
    st.tuples(st.just("hold"), st.integers(0, 100_000)),
    st.tuples(st.just("slow"), st.integers(0, 400_000)),
)


@pytest.fixture(scope="module")
def mongo(mongodb_server: Server) -> Any:
    client: MongoClient[Any] = MongoClient(f"mongodb://127.0.0.1:{mongodb_server.port}")
    clock = [0]
    state = MongoState(client, database="ratequeue_fair", clock=lambda: clock[0])
    yield state, clock
    state.close()


_names = iter(range(10**9))

#: each example makes up to 25 round-trips to secantusdb, and under CI's load the two tests took 144 s
#: at 300 examples: a third keeps the property without the minutes (the contract suite runs its own)
_examples = settings(max_examples=max(1, settings.default.max_examples // 3))


@_examples
@given(
    interval=st.integers(1_000, 100_000),
    burst=st.integers(1, 3),
    max_running=st.sampled_from([None, 1, 2]),
    keep=st.sampled_from([0, 5_000_000]),
    epoch=epochs_us,
    steps=st.lists(_steps, min_size=1, max_size=25),
)
def test_fair_pipelines_answer_and_store_as_the_reference(
    mongo: Any,
    interval: int,
    burst: int,
    max_running: int | None,
    keep: int,
    epoch: int,
    steps: list[tuple[Any, ...]],
) -> None:
    state, clock = mongo
    name = f"fair-{next(_names)}"
    epoch -= epoch % 1000  # (the server's clock has whole milliseconds; the test clock need not)
    clock[0] = epoch
    lease = 300_000 if max_running else 0
    terms = Terms.checked(interval, burst, keep_us=keep, max_running=max_running, lease_us=lease, fair=True)
    reference = protocol.new_record(interval, burst, max_running, fair=True)
    numbers: dict[int, tuple[int, int, int]] = {}  # shard -> (number, cost, token)
    last: tuple[Any, ...] | None = None  # the last op (to repeat it) and the last start
    started: tuple[int, int, int] | None = None  # (ticket, cost, token)
    tokens = iter(range(1, 10**6))
    created = False

    def run(kind: Any, **args: Any) -> Any:
        nonlocal reference, created
        op = operation(kind, name, terms, **args)
        reference, expected = apply(reference, op, clock[0])
        got = state.execute(op)
        assert got == expected, (kind, args)
        created = True
        return got

    try:
        for step in steps:
            kind = step[0]
            if kind == "clock":
                clock[0] += step[1]
                continue
            if kind == "arrive" and step[1] not in numbers:
                cost, token = min(step[2] + 1, burst), next(tokens)
                args = {"lead_us": step[3], "cost": cost, "token": token, "tenant": f"t{step[2]}"}
                args["weight"] = step[2] + 1
                got = run("take_and_try", **args)
                last = ("take_and_try", args)
                if isinstance(got, Started):
                    started = (got.ticket, cost, token)
                elif isinstance(got, Wait):
                    numbers[step[1]] = (got.ticket, cost, token)
            elif kind == "take" and step[1] not in numbers:
                cost = min(step[2] + 1, burst)
                got = run("take", cost=cost, tenant=f"t{step[2]}", weight=2)
                numbers[step[1]] = (got.ticket, cost, next(tokens))
            elif kind == "ask" and step[1] in numbers:
                number, cost, token = numbers[step[1]]
                args = {"ticket": number, "lead_us": step[2], "cost": cost, "token": token}
                got = run("try_start", **args)
                last = ("try_start", args)
                if not isinstance(got, Wait):
                    del numbers[step[1]]
                if isinstance(got, Started):
                    started = (got.ticket, cost, token)
            elif kind == "ask_any":
                run("try_start", ticket=step[1] + 1, lead_us=step[2])
            elif kind == "again" and last is not None:
                run(last[0], **last[1])  # a call re-sent after a lost reply
            elif kind == "end" and started is not None:
                ticket, cost, token = started
                if step[1] == "release":
                    run("release", ticket=ticket, token=token)
                elif step[1] == "renew" and max_running:
                    run("renew", ticket=ticket, token=token)
                elif step[1] == "retime":
                    run("retime", ticket=ticket, lead_us=50_000)
                elif step[1] == "settle":
                    run("settle", ticket=ticket, cost=cost, lead_us=burst)
            elif kind == "pause":
                run("set_paused", paused=step[1])
            elif kind == "hold":
                run("hold", lead_us=step[1])
            elif kind == "slow":
                run("slow", lead_us=step[1])
        snapshot = state.read(name)
        assert snapshot.record == (reference if created else None)
    finally:
        state.reset(name)


def test_only_a_fair_queue_stores_fair_fields(mongo: Any) -> None:
    state, clock = mongo
    clock[0] = 10**12
    collection = state.collection
    state.execute(operation("take", "plain", Terms.checked(1000)))
    state.execute(operation("take", "fair", Terms.checked(1000, fair=True), tenant="a"))
    try:
        plain = collection.find_one({"_id": "plain"})
        assert not {"fair", "number", "begun", "waiters"} & plain.keys()
        fair = collection.find_one({"_id": "fair"})
        assert (fair["fair"], fair["number"], fair["begun"], fair["waiters"]) == (
            True,
            2,
            0,
            [[1, "a", 1, 1, 1]],
        )
        with pytest.raises(TermsMismatch, match="fair"):
            state.execute(operation("take", "plain", Terms.checked(1000, fair=True), tenant="a"))
        with pytest.raises(TermsMismatch, match="fair"):
            state.execute(operation("take", "fair", Terms.checked(1000)))
        # a document written between fair queues and this backend's learning them: fair false
        collection.update_one(
            {"_id": "plain"}, {"$set": {"fair": False, "number": 1, "begun": 0, "waiters": []}}
        )
        assert state.execute(operation("take", "plain", Terms.checked(1000))).ticket == 2
    finally:
        state.reset("plain")
        state.reset("fair")


@pytest.mark.parametrize(
    "bad",
    [
        {"waiters": [[1, "a", 0, 1, 0]]},
        {"waiters": [[1, 5, 1, 1, 0]]},
        {"waiters": [[9, "a", 1, 1, 0]]},
        {"waiters": [[1, "a", 1, 1, 7]]},
        {"waiters": "x"},
        {"number": 0},
        {"begun": 5},
        {"fair": 1},
    ],
)
def test_a_corrupt_fair_record_is_reported_and_left_alone(mongo: Any, bad: dict[str, Any]) -> None:
    state, clock = mongo
    clock[0] = 10**12
    terms = Terms.checked(1000, fair=True)
    state.execute(operation("take", "corrupt", terms, tenant="a"))
    try:
        state.collection.update_one({"_id": "corrupt"}, {"$set": bad})
        before = state.collection.find_one({"_id": "corrupt"})
        with pytest.raises(StateCorrupted):
            state.execute(operation("take_and_try", "corrupt", terms, tenant="a"))
        assert state.collection.find_one({"_id": "corrupt"}) == before
    finally:
        state.reset("corrupt")


def test_a_fair_start_asked_again_is_answered_again(mongo: Any) -> None:
    """A lost reply: the re-sent take_and_try (its lease's token) or try_start gets the same start."""
    state, clock = mongo
    clock[0] = 10**12
    terms = Terms.checked(10_000, burst=2, max_running=2, lease_us=1_000_000, fair=True)
    reference = protocol.new_record(10_000, 2, 2, fair=True)
    ops = [
        operation("take_and_try", "again", terms, lead_us=0, token=7, tenant="a"),
        operation("take_and_try", "again", terms, lead_us=0, token=7, tenant="a"),  # re-sent
        operation("take_and_try", "again", terms, lead_us=0, cost=2, token=8, tenant="b", weight=2),
        operation("take_and_try", "again", terms, lead_us=0, token=9, tenant="a"),
        operation("take_and_try", "again", terms, lead_us=0, token=10, tenant="a"),
        operation("try_start", "again", terms, ticket=3, lead_us=20_000, cost=2, token=8),
        operation("try_start", "again", terms, ticket=3, lead_us=20_000, cost=2, token=8),  # re-sent
        operation("release", "again", terms, ticket=1, token=7),
        operation("try_start", "again", terms, ticket=4, lead_us=50_000, token=9),
        operation("try_start", "again", terms, ticket=5, lead_us=50_000, token=10),
        operation("try_start", "again", terms, ticket=5, lead_us=50_000, token=10),
    ]
    answers = []
    try:
        for op in ops:
            reference, expected = apply(reference, op, clock[0])
            got = state.execute(op)
            assert got == expected, (op, got, expected)
            answers.append(type(got).__name__)
            clock[0] += 4_000
        assert state.read("again").record == reference
        assert answers.count("Started") >= 4, answers
    finally:
        state.reset("again")


_try_steps = st.one_of(
    st.tuples(st.just("try"), st.integers(0, 2), st.integers(0, 200_000)),
    st.tuples(st.just("take_and_try"), st.integers(0, 2), st.integers(0, 200_000)),
    st.tuples(st.just("again"), st.just(0)),
    st.tuples(st.just("release"), st.just(0)),
    st.tuples(st.just("clock"), st.integers(0, 150_000)),
    st.tuples(st.just("pause"), st.booleans()),
    st.tuples(st.just("hold"), st.integers(0, 100_000)),
)


@_examples
@given(
    fair=st.booleans(),
    interval=st.integers(1_000, 100_000),
    burst=st.integers(1, 3),
    max_running=st.sampled_from([None, 1, 2]),
    keep=st.sampled_from([0, 5_000_000]),
    epoch=epochs_us,
    steps=st.lists(_try_steps, min_size=1, max_size=20),
)
def test_try_take_answers_as_the_reference_and_writes_only_a_start(
    mongo: Any,
    fair: bool,
    interval: int,
    burst: int,
    max_running: int | None,
    keep: int,
    epoch: int,
    steps: list[tuple[Any, ...]],
) -> None:
    """try_take beside take_and_try, fair or not: each answer and the record as the reference's.

    One that does not start leaves the stored document as it was, ``expires`` included (answer aside).
    """
    state, clock = mongo
    name = f"try-{next(_names)}"
    clock[0] = epoch - epoch % 1000
    lease = 300_000 if max_running else 0
    terms = Terms.checked(interval, burst, keep_us=keep, max_running=max_running, lease_us=lease, fair=fair)
    reference = protocol.new_record(interval, burst, max_running, fair=fair)
    tokens = iter(range(1, 10**6))
    started: list[tuple[int, int]] = []  # (ticket, token)
    last: tuple[Any, dict[str, Any]] | None = None
    created = False

    def stored() -> dict[str, Any] | None:
        document = state.collection.find_one({"_id": name})
        return None if document is None else {k: v for k, v in document.items() if k != "answer"}

    def run(kind: Any, **args: Any) -> Any:
        nonlocal reference, created
        op = operation(kind, name, terms, **args)
        reference, expected = apply(reference, op, clock[0])
        before = stored()
        got = state.execute(op)
        assert got == expected, (kind, args)
        if kind == "try_take" and not isinstance(got, Started) and before is not None:
            assert stored() == before, "a try_take that did not start changed the document"
        created = True
        return got

    try:
        for step in steps:
            kind = step[0]
            if kind == "clock":
                clock[0] += step[1]
            elif kind in ("try", "take_and_try"):
                cost, token = min(step[1] + 1, burst), next(tokens)
                args = {"lead_us": step[2], "cost": cost, "token": token}
                if fair:
                    args.update(tenant=f"t{step[1]}", weight=step[1] + 1)
                op_kind = "try_take" if kind == "try" else "take_and_try"
                got = run(op_kind, **args)
                last = (op_kind, args)
                if isinstance(got, Started):
                    started.append((got.ticket, token))
            elif kind == "again" and last is not None:
                run(last[0], **last[1])  # a call re-sent after a lost reply (a lease's token: answered again)
            elif kind == "release" and started and max_running:
                ticket, token = started.pop(0)
                run("release", ticket=ticket, token=token)
            elif kind == "pause":
                run("set_paused", paused=step[1])
            elif kind == "hold":
                run("hold", lead_us=step[1])
        assert state.read(name).record == (reference if created else None)
    finally:
        state.reset(name)


@pytest.mark.parametrize("fair", [False, True], ids=["unfair", "fair"])
def test_a_try_take_that_waits_leaves_the_document_unchanged(mongo: Any, fair: bool) -> None:
    """Busy, full (max_running: ``held`` not noted) or paused: a try_take's Wait writes nothing.

    Not the ticket, the waiters, G4's jump, ``held``, the expired leases nor ``expires``; it names
    the ticket (a fair queue: the waiter's number) take_and_try would have taken. A start is written.
    """
    state, clock = mongo
    clock[0] = 10**12
    name = f"try-wait-{fair}"
    terms = Terms.checked(100_000, max_running=1, lease_us=150_000, keep_us=5_000_000, fair=fair)
    reference = protocol.new_record(100_000, 1, 1, fair=fair)
    tenant = {"tenant": "a"} if fair else {}

    def run(kind: Any, **args: Any) -> Any:
        nonlocal reference
        op = operation(kind, name, terms, **args)
        reference, expected = apply(reference, op, clock[0])
        got = state.execute(op)
        assert got == expected, (kind, args, got, expected)
        return got

    def document() -> dict[str, Any]:
        found = state.collection.find_one({"_id": name})
        assert found is not None
        return {key: value for key, value in found.items() if key != "answer"}

    try:
        first = run("try_take", lead_us=0, token=1, **tenant)
        assert isinstance(first, Started)  # a missing record is created, and started: written
        assert document()["expires"] > clock[0]
        assert document()["pos"] == first.ticket
        clock[0] += 50_000
        before = document()
        busy = run("try_take", lead_us=0, token=2, **tenant)  # the interval runs: wait
        assert isinstance(busy, Wait)
        assert busy.ticket == 2
        assert document() == before
        clock[0] += 60_000  # the interval is over, the lease (till 150 ms) still runs: full
        taken = run("take_and_try", lead_us=0, token=3, **tenant)  # noted: held, ticket 2 taken
        assert isinstance(taken, Wait)
        before = document()
        full = run("try_take", lead_us=0, token=4, **tenant)
        assert isinstance(full, Wait)
        assert full.ticket == 3
        assert document() == before
        clock[0] += 10**6  # every lease expired: G4 would jump the late ticket 2, and the leases go
        run("set_paused", paused=True)
        before = document()
        assert before["paused_at"] == clock[0]  # when the pause began
        clock[0] += 1000
        assert isinstance(run("try_take", lead_us=0, token=5, **tenant), Wait)  # paused
        assert document() == before
        run("set_paused", paused=False)
        assert "paused_at" not in document()  # resumed: as if never paused
        assert isinstance(run("try_take", lead_us=0, token=6, **tenant), Started)  # written
        assert document() != before
        assert state.read(name).record == reference
    finally:
        state.reset(name)


def test_a_try_take_asked_again_with_its_token_is_answered_again(mongo: Any) -> None:
    """A lost reply: the re-sent try_take (its lease's token) gets the same start and changes nothing."""
    state, clock = mongo
    clock[0] = 10**12
    for fair in (False, True):
        name = f"try-again-{fair}"
        terms = Terms.checked(10_000, max_running=2, lease_us=1_000_000, keep_us=5_000_000, fair=fair)
        tenant = {"tenant": "a"} if fair else {}
        reference = protocol.new_record(10_000, 1, 2, fair=fair)
        try:
            op = operation("try_take", name, terms, lead_us=0, token=7, **tenant)
            reference, expected = apply(reference, op, clock[0])
            first = state.execute(op)
            assert isinstance(first, Started)
            assert first == expected
            before = state.collection.find_one({"_id": name})
            clock[0] += 4_000
            reference, expected = apply(reference, op, clock[0])
            again = state.execute(op)
            assert again == expected == Started(first.ticket, first.start, clock[0])
            after = state.collection.find_one({"_id": name})
            assert {k: v for k, v in after.items() if k != "answer"} == {
                k: v for k, v in before.items() if k != "answer"
            }
            assert state.read(name).record == reference
        finally:
            state.reset(name)
