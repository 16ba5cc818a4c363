"""The generalised protocol (bursts and costs: docs/design.md) under shards that come and go.

A hypothesis state machine drives several shards, each with its own FIFO of
jobs of random costs, over the reference protocol with a fake clock: jobs
arrive, heads take and try tickets as a shard does (``take_and_try`` for a
new ticket, ``try_start`` for a held one, a new ticket when passed), shards
die and are replaced, the clock moves (also backwards). After every step:

- any run of consecutive starts of total cost ``C`` spans at least
  ``(C - B)`` intervals, and every window of length ``w`` holds at most
  ``B + w / I`` units of cost (the same statement);
- starts come in ticket order, never earlier on the clock than the one before,
  also when the latest start is moved later (a retime, G7);
- nothing is lost: every job is waiting in its shard, started once, or
  belonged to a shard that died.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from ratequeue.core import protocol
from ratequeue.core.protocol import Passed, Record, Started, Wait


@dataclass
class ShardModel:
    """A shard as the protocol sees it: its jobs' costs, and the ticket it holds with its cost."""

    jobs: deque[int] = field(default_factory=deque)
    ticket: int | None = None
    ticket_cost: int = 0


class BurstMachine(RuleBasedStateMachine):
    @initialize(
        interval=st.sampled_from([1, 7, 1000, 20_000]),
        burst=st.integers(1, 6),
        shards=st.integers(1, 4),
    )
    def setup(self, interval: int, burst: int, shards: int) -> None:
        self.interval, self.burst = interval, burst
        self.record: Record = protocol.new_record(interval, burst)
        self.now = 10**9
        self.shards = [ShardModel() for _ in range(shards)]
        self.added = 0
        self.lost = 0  # jobs of shards that died
        self.starts: list[tuple[int, int, int]] = []  # (ticket, start, cost)

    @rule(shard=st.integers(0, 3), cost=st.integers(0, 5), jobs=st.integers(1, 4))
    def jobs_arrive(self, shard: int, cost: int, jobs: int) -> None:
        model = self.shards[shard % len(self.shards)]
        for _ in range(jobs):
            model.jobs.append(1 + (cost + _) % self.burst)
            self.added += 1

    @rule(shard=st.integers(0, 3), lead=st.sampled_from([0, 0, 1, 500, 30_000]), calls=st.integers(1, 4))
    def heads_call(self, shard: int, lead: int, calls: int) -> None:
        for _ in range(calls):
            model = self.shards[(shard + _) % len(self.shards)]
            if model.jobs:
                self._head_calls(model, lead)

    @rule(lead=st.sampled_from([0, 1, 500, 30_000]))
    def latest_start_moves(self, lead: int) -> None:
        """A shard that woke too late to begin moves its start later (G7's retime)."""
        if not self.starts or self.starts[-1][0] != self.record.pos:
            return  # no start to move: a later ticket has started, or the latest was passed over
        ticket, start, cost = self.starts[-1]
        self.record, outcome = protocol.retime(self.record, ticket, lead, self.now)
        assert isinstance(outcome, Started)
        assert outcome.start >= start
        self.starts[-1] = (ticket, outcome.start, cost)

    def _head_calls(self, model: ShardModel, lead: int) -> None:
        cost = model.jobs[0]
        if model.ticket is not None and cost > model.ticket_cost:
            model.ticket = None  # taken for a cheaper job: dropped, as the shard does
        before = self.record
        if model.ticket is None:
            self.record, outcome = protocol.take_and_try(self.record, lead, self.now, cost)
            called_cost = cost
        else:
            called_cost = model.ticket_cost
            self.record, outcome = protocol.try_start(self.record, model.ticket, lead, self.now, called_cost)
        if isinstance(outcome, Started):
            assert self.now <= outcome.start <= self.now + lead
            if protocol.repeats_start(before, outcome.ticket, self.now):
                return  # asked again for a grant already used: the shard would not do this
            model.jobs.popleft()
            model.ticket = None
            self.starts.append((outcome.ticket, outcome.start, called_cost))
        elif isinstance(outcome, Wait):
            assert outcome.slot > self.now + lead
            if model.ticket is None:
                model.ticket, model.ticket_cost = outcome.ticket, called_cost
        else:
            assert isinstance(outcome, Passed)
            model.ticket = None

    @rule(step=st.one_of(st.integers(0, 5_000), st.integers(0, 50_000), st.integers(-20_000, 0)))
    def clock_moves(self, step: int) -> None:
        self.now = max(0, self.now + step)

    @rule(shard=st.integers(0, 3))
    def shard_dies_and_a_new_one_starts(self, shard: int) -> None:
        index = shard % len(self.shards)
        dead = self.shards[index]
        self.lost += len(dead.jobs)
        self.shards[index] = ShardModel()

    @invariant()
    def any_window_holds_at_most_burst_plus_its_length_in_cost(self) -> None:
        starts = self.starts
        for i in range(len(starts)):
            total = 0
            for j in range(i, len(starts)):
                total += starts[j][2]
                span = starts[j][1] - starts[i][1]
                assert span >= (total - self.burst) * self.interval, (i, j, starts)

    @invariant()
    def starts_come_in_ticket_order(self) -> None:
        for (t1, s1, _), (t2, s2, _) in zip(self.starts, self.starts[1:], strict=False):
            assert t2 > t1
            assert s2 >= s1

    @invariant()
    def nothing_is_lost(self) -> None:
        waiting = sum(len(model.jobs) for model in self.shards)
        assert waiting + len(self.starts) + self.lost == self.added


BurstMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
test_bursts_and_costs_keep_the_window_order_and_every_job = BurstMachine.TestCase


def test_a_waiting_queue_with_a_burst_is_served_in_ticket_order() -> None:
    """Tickets waiting behind each other become free one after another, whatever their costs."""
    record = protocol.new_record(1000, 5)
    now = 0
    record, first = protocol.take_and_try(record, 0, now, 5)  # the whole burst
    assert isinstance(first, Started)
    slots = []
    for cost in (3, 1, 2, 1):
        record, outcome = protocol.take_and_try(record, 0, now, cost)
        assert isinstance(outcome, Wait)
        slots.append(outcome.slot)
    assert slots == sorted(slots)
    assert len(set(slots)) == len(slots)
