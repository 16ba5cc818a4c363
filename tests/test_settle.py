"""Costs settled after the call: an overrun moves later starts, a refund gives back what the burst holds.

The guarantee (G8, docs/design.md) is checked under random sequences of
starts, settlements, slow-downs, holds and clock moves on the protocol; the
contract suite (``test_contract.py``) runs ``settle`` on every backend
against the same reference. Here too: examples of each rule, the API on
both drivers and every backend, processes settling against each other, and
bad input.
"""

from __future__ import annotations

import asyncio
from contextlib import closing

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ratequeue import ConfigurationError, Limiter, StateUnavailable, aio
from ratequeue.core import protocol
from ratequeue.core.operation import Operation
from ratequeue.core.protocol import NEVER, Answer, Started, Wait
from ratequeue.state import State
from ratequeue.state import open_state as ratequeue_state

from .backends import Backend
from .test_wakeups import Counting

INTERVAL = 10_000  # 10 ms


def _started(record: protocol.Record, now: int, cost: int) -> tuple[protocol.Record, Started]:
    record, outcome = protocol.take_and_try(record, 0, now, cost)
    assert isinstance(outcome, Started), outcome
    return record, outcome


def test_a_refund_on_an_idle_queue_gives_the_saving_back() -> None:
    now = 1_000_000
    record, first = _started(protocol.new_record(INTERVAL, burst=10), now, 10)
    record, _ = protocol.take(record, now, 10)  # ticket 11, of cost 10: the burst is spent
    assert protocol.try_start(record, 11, 0, now, 10)[1] == Wait(11, now + 10 * INTERVAL, now)
    record, moved = protocol.settle(record, first.ticket, 10, 1, now)
    assert moved
    assert record.settled == 1
    assert protocol.try_start(record, 11, 0, now, 10)[1] == Wait(11, now + INTERVAL, now), (
        "as if the first call had cost 1: the next of cost 10 waits one interval"
    )


def test_an_overrun_moves_every_later_start() -> None:
    now = 1_000_000
    record, first = _started(protocol.new_record(INTERVAL, burst=4), now, 1)
    record, moved = protocol.settle(record, first.ticket, 1, 4, now)
    assert moved
    record, _ = protocol.take(record, now, 1)
    assert protocol.try_start(record, 2, 0, now)[1] == Wait(2, now + 1 * INTERVAL, now), (
        "the overrun of 3 used the burst's 3 spare starts: the next one waits an interval"
    )
    record, second = protocol.try_start(record, 2, 0, now + INTERVAL)
    assert second == Started(2, now + INTERVAL, now + INTERVAL)


def test_a_settlement_sent_again_counts_once() -> None:
    now = 1_000_000
    record, first = _started(protocol.new_record(INTERVAL, burst=10), now, 8)
    refunded, moved = protocol.settle(record, first.ticket, 8, 2, now)
    assert moved
    assert protocol.settle(refunded, first.ticket, 8, 2, now) == (refunded, False)
    assert protocol.settle(refunded, first.ticket, 8, 0, now) == (refunded, False), "a turn settles once"


def test_no_credit_comes_back_that_the_burst_had_dropped() -> None:
    """A refund after the queue went idle, and others used the full burst, gives nothing back."""
    now = 1_000_000
    record, first = _started(protocol.new_record(INTERVAL, burst=4), now, 4)
    later = now + 100 * INTERVAL  # idle: the burst is whole again
    for _ in range(4):
        record, _ = _started(record, later, 1)
    refunded, moved = protocol.settle(record, first.ticket, 4, 0, later)
    assert not moved, "the burst was refilled and spent since: the saving is gone"
    assert refunded is record


def test_nothing_settles_for_a_ticket_not_started() -> None:
    now = 1_000_000
    record, _ = _started(protocol.new_record(INTERVAL, burst=4), now, 1)
    record, taken = protocol.take(record, now, 2)
    assert protocol.settle(record, taken.ticket, 2, 0, now) == (record, False)
    assert protocol.settle(protocol.new_record(INTERVAL, burst=4), 1, 2, 0, now)[1] is False
    assert protocol.settle(record, 1, 1, 1, now) == (record, False), "the estimate itself: nothing moves"


#: one step of a random run: a start of cost seed ``c``, a settlement of the start ``n`` picks at
#: cost seed ``a``, a slow-down, a hold, or the clock moving on
_steps = st.one_of(
    st.tuples(st.just("start"), st.integers(0, 200), st.integers(0, 30_000)),
    st.tuples(st.just("settle"), st.integers(0, 40), st.integers(0, 200)),
    st.tuples(st.just("slow"), st.integers(0, 3 * INTERVAL)),
    st.tuples(st.just("hold"), st.integers(0, 5 * INTERVAL)),
    st.tuples(st.just("clock"), st.integers(0, 40_000)),
)


@given(burst=st.one_of(st.integers(1, 6), st.sampled_from([20, 100])), steps=st.lists(_steps, max_size=60))
def test_any_run_of_starts_costs_at_most_the_burst_plus_its_length(
    burst: int, steps: list[tuple[int | str, ...]]
) -> None:
    """G8: starts ``i`` to ``k`` cost, as known when ``k`` started, at most ``B + (s_k - s_i) / I``.

    A settlement is known from the moment it is made, whatever it moved;
    each start settles once at most (a turn settles once).
    """
    now = 1_000_000
    record = protocol.new_record(INTERVAL, burst)
    starts: list[tuple[int, int]] = []  # (ticket, start) in ticket order
    costs: dict[int, int] = {}  # ticket -> its cost as known now: the estimate, or the settled cost
    estimates: dict[int, int] = {}
    settled: set[int] = set()
    for step in steps:
        kind = step[0]
        if kind == "clock":
            now += int(step[1])
        elif kind == "slow":
            record, _ = protocol.slow(record, int(step[1]), now)
        elif kind == "hold":
            record, _ = protocol.hold(record, int(step[1]), now)
        elif kind == "settle":
            unsettled = [ticket for ticket, _ in starts if ticket not in settled]
            if not unsettled:
                continue
            ticket = unsettled[int(step[1]) % len(unsettled)]
            actual = int(step[2]) % (burst + 1)
            before = record
            record, _ = protocol.settle(record, ticket, estimates[ticket], actual, now)
            if actual > estimates[ticket]:  # (these runs are too short to reach the cap on debt)
                step_us = protocol.effective_interval(before, now)
                assert record.due == before.due + (actual - estimates[ticket]) * step_us
            costs[ticket] = actual
            settled.add(ticket)
        else:
            cost = 1 + int(step[1]) % burst
            record, outcome = protocol.take_and_try(record, int(step[2]), now, cost)
            if isinstance(outcome, Wait):  # a waiting ticket: start it at its slot, as its shard would
                now = max(now, outcome.slot)
                record, outcome = protocol.try_start(record, outcome.ticket, 0, now, cost)
            assert isinstance(outcome, Started), outcome
            estimates[outcome.ticket] = costs[outcome.ticket] = cost
            starts.append((outcome.ticket, outcome.start))
            _check_runs(starts, costs, burst)


def _check_runs(starts: list[tuple[int, int]], costs: dict[int, int], burst: int) -> None:
    """G8 for every run of starts ending with the latest one."""
    last_ticket, last_start = starts[-1]
    total = 0
    for ticket, start in reversed(starts):
        total += costs[ticket]
        assert total * INTERVAL <= last_start - start + burst * INTERVAL, (
            f"starts from ticket {ticket} (at {start}) to {last_ticket} (at {last_start}) cost {total}"
        )


def test_the_limiter_settles_on_every_backend(backend: Backend) -> None:
    with closing(Limiter(backend.open(), name=backend.fresh_name(), interval=1.0, burst=10)) as limiter:
        turn = limiter.acquire(cost=10)
        assert turn.cost == 10
        assert limiter.settle(turn, 10) is False, "nothing to move: the estimate itself, no call"
        assert limiter.settle(turn, 1) is True
        assert limiter.settle(turn, 1) is False, "a turn settles once"
        assert limiter.try_acquire(cost=9) is not None, "the refund of 9 gave the burst back"
        assert limiter.try_acquire() is None, "and no more: 1 + 9 is the burst"


def test_an_overrun_makes_the_next_caller_wait(backend: Backend) -> None:
    # (intervals of 0.2 s: the spare burst comes back within 3 of them, longer than a slow state's calls)
    with closing(Limiter(backend.open(), name=backend.fresh_name(), interval=0.2, burst=4)) as limiter:
        turn = limiter.acquire()
        assert limiter.settle(turn, 4) is True
        assert limiter.try_acquire() is None, "the overrun of 3 used the spare burst"
        late = limiter.acquire()
        assert late.start_us - turn.start_us >= 200_000


def test_the_asyncio_limiter_settles() -> None:
    async def main() -> None:
        limiter = aio.Limiter("memory://", name="settle", interval=1.0, burst=5)
        try:
            turn = await limiter.acquire(cost=5)
            assert await limiter.settle(turn, 0) is True
            assert await limiter.try_acquire(cost=5) is not None
            assert await limiter.try_acquire() is None
        finally:
            await limiter.close()

    asyncio.run(main())


@pytest.mark.parametrize("cost", [-1, 6, 1.5, "2", None, True])
def test_a_bad_settled_cost_is_refused_and_changes_nothing(cost: object) -> None:
    name = f"settle-bad-{cost!r}"  # (a name each: the memory store is the process's, and a used burst waits)
    with closing(Limiter("memory://", name=name, interval=1.0, burst=5)) as limiter:
        turn = limiter.acquire(cost=5)
        before = limiter.state.read(name).record
        with pytest.raises(ConfigurationError, match="settled cost must be a whole number from 0 to"):
            limiter.settle(turn, cost)  # type: ignore[arg-type]
        assert limiter.state.read(name).record == before


def test_settle_takes_a_turn() -> None:
    limiter = Limiter("memory://", name="settle-turn", interval=1.0, burst=5)
    with closing(limiter), pytest.raises(ConfigurationError, match="takes the Turn acquire"):
        limiter.settle(3, 1)  # type: ignore[arg-type]


def test_a_record_that_never_started_reads_as_unsettled() -> None:
    assert protocol.new_record(INTERVAL).settled == 0
    assert protocol.new_record(INTERVAL).at == NEVER


def test_settling_costs_an_idle_acquire_nothing(backend: Backend) -> None:
    """No cost when unused: on a queue that was settled, an idle acquire still asks for its turn once.

    (A start the shard would begin late is moved by a ``retime``, G7's own
    call, whatever was settled: it is not counted here.)
    """
    state = _Kinds(backend.open())
    with closing(Limiter(state, name=backend.fresh_name(), interval=0.01, burst=10)) as limiter:
        turn = limiter.acquire(cost=5)
        assert limiter.settle(turn, 5) is False
        state.kinds.clear()
        assert limiter.settle(turn, 2) is True
        assert state.kinds == ["settle"], "a settlement is one call, and none at the estimate"
        state.kinds.clear()
        limiter.acquire()
        assert [kind for kind in state.kinds if kind != "retime"] == ["take_and_try"]


class _Kinds(Counting):
    """A state that notes the kind of each operation made through it."""

    def __init__(self, inner: State) -> None:
        super().__init__(inner)
        self.kinds: list[str] = []

    def execute(self, op: Operation) -> Answer:
        self.kinds.append(op.kind)
        return super().execute(op)


class _FailingSettle(_Kinds):
    """A state whose settlements fail, as a state that went down would; every other call goes through."""

    def execute(self, op: Operation) -> Answer:
        if op.kind == "settle":
            raise StateUnavailable("the state is down (injected)", where="test")
        return super().execute(op)


def test_a_settlement_the_state_fails_raises_and_leaves_the_limiter_working() -> None:
    inner = ratequeue_state("memory://settle-down")
    state = _FailingSettle(inner)
    with closing(Limiter(state, name="settle-down", interval=0.01, burst=5)) as limiter:
        turn = limiter.acquire(cost=5)
        before = inner.read("settle-down").record
        with pytest.raises(StateUnavailable, match="injected"):
            limiter.settle(turn, 1)
        assert inner.read("settle-down").record == before, "no schedule moved"
        assert limiter.acquire(timeout=5).ticket > turn.ticket, "the next caller still gets its turn"


def test_a_cancelled_settlement_leaves_the_asyncio_limiter_working() -> None:
    async def main() -> None:
        limiter = aio.Limiter("memory://", name="settle-cancel", interval=0.01, burst=5)
        try:
            turn = await limiter.acquire(cost=5)
            task = asyncio.ensure_future(limiter.settle(turn, 1))
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert (await limiter.acquire(timeout=5)).ticket > turn.ticket
        finally:
            await limiter.close()

    asyncio.run(main())
