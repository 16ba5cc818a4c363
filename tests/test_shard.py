"""The shard state machine, driven with fake clocks over the reference protocol.

A small discrete-event world runs several shards against one protocol record:
each shard has its own local clock (offset from the world's true time), may
wake up late, be paused, resumed or killed, its calls and their answers may
take time on the way (so that each answer bounds the clock offset only
loosely, and other shards act meanwhile), and its jobs may carry deadlines.
The state clock may step backwards (in runs without delayed answers). After
every step the guarantees are checked:

* G1  starts are at least one interval apart on the state clock;
* G7  jobs begin (the true time at which the shard answers ``Begin``) at
      most ``max_late`` after their start, never before it, so begins are at
      least ``interval - max_late`` apart; timers may fire late (``wake_late``),
      which the shard must absorb by moving its start later or giving the
      turn up; with delayed answers a begin may be later, and gaps shorter,
      by at most the longest delay (the offset's uncertainty), never early;
* G2  tickets start in increasing order and ``pos`` never decreases;
* G3  every job of a live shard is waiting, started or expired (its caller
      got ``AcquireTimeout``) -- none vanish;
* G4  see ``isolate``: with one live, unpaused shard left, its j-th waiting
      job starts by ``T0 + (D + j) * interval``, where ``T0`` is the later of
      the state clock and ``at`` at that moment and ``D`` is the number of
      other shards. Each other shard holds at most one ticket, so they delay
      the survivor by one interval each, once; the survivor's own jobs take
      one interval each (each start plus the doubt it was asked with, the
      largest seen, after slow answers).
* G5  a shard with no jobs makes no calls and schedules no wake-up;
* G6  a paused shard makes no calls; on resume it first tries the ticket it
      holds (keeping its place), and its jobs still all start or expire.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ratequeue.core import clock as clock_module
from ratequeue.core import protocol
from ratequeue.core.operation import Operation
from ratequeue.core.protocol import US, Record
from ratequeue.core.shard import (
    DEFAULT_MAX_LATE,
    DOUBT_FREE,
    RECHECK,
    Begin,
    BeginAt,
    Expired,
    Place,
    Shard,
    SleepUntil,
    WaitForTurn,
)

from .ops import Step, is_step, make_shard

#: float tolerance (seconds) when local float times are compared with integer microseconds
EPS = 2e-6


@dataclass
class SimShard:
    """One shard in the simulated world, with the bookkeeping the checks need."""

    index: int
    shard: Shard
    clock_offset: float  # local time = true time + offset
    lateness: float = 0.0  # how late this shard wakes from a sleep
    alive: bool = True
    wake: float | None = None  # true time of the next wake-up, if sleeping
    jobs: list[Place] = field(default_factory=list)  # every job ever added, in order
    expired: list[Place] = field(default_factory=list)
    begun: list[Place] = field(default_factory=list)
    calls: list[tuple[str, int | None]] = field(default_factory=list)
    answer_delay: float = 0.0  # how long (s) after the state reads its clock an answer arrives
    #: a call whose answer is on its way: (job, outcome, local send time, true arrival time)
    pending: tuple[Place, protocol.Outcome, float, float] | None = None


class ShardWorld(RuleBasedStateMachine):
    """Several shards, one reference record, fake clocks."""

    @initialize(
        interval_ms=st.sampled_from([1, 5, 20, 100]),
        shards=st.integers(1, 5),
        offsets=st.lists(st.floats(-3, 3, allow_nan=False), min_size=5, max_size=5),
        fixed_lead_ms=st.one_of(st.none(), st.sampled_from([0, 1, 3])),
        max_late_ms=st.one_of(st.none(), st.sampled_from([0.0, 0.3, 2.0])),
        epoch=st.integers(0, 2 * 10**15),
    )
    def setup(
        self,
        interval_ms: int,
        shards: int,
        offsets: list[float],
        fixed_lead_ms: int | None,
        max_late_ms: float | None,
        epoch: int,
    ) -> None:
        self.interval = interval_ms * 1000  # us
        self.time = 100.0  # true time, seconds
        self.state_offset = epoch  # state clock (us) = true time + this
        self.record: Record = protocol.new_record(self.interval)
        self.max_pos = 0
        self.starts: list[tuple[int, int]] = []  # (ticket, state start us), as the record saw them
        #: true time of each ticket's start: its state time on the state's clock as it was then
        self.true_starts: dict[int, float] = {}
        self.begins: list[tuple[int, float, float]] = []  # (ticket, true start, true begin time)
        #: the longest answer delay set so far: how far a start's conversion may be off (no drift here)
        self.max_answer_delay = 0.0
        #: the largest doubt (us) a start was asked with: each start may move the next by as much
        self.max_doubt_us = 0
        self.clock_stepped = False
        lead = None if fixed_lead_ms is None else fixed_lead_ms / 1000
        max_late = None if max_late_ms is None else max_late_ms / 1000
        self.shards = [
            SimShard(i, make_shard(interval_ms / 1000, lead=lead, max_late=max_late), clock_offset=offsets[i])
            for i in range(shards)
        ]
        self.max_late = self.shards[0].shard.max_late

    # -- the world ------------------------------------------------------------

    def state_now(self) -> int:
        return math.floor(self.time * US) + self.state_offset

    def local_now(self, sim: SimShard) -> float:
        return self.time + sim.clock_offset

    def run_shard(self, sim: SimShard) -> None:
        """Let ``sim``'s drivers act at the current time until they all wait or sleep."""
        if not sim.alive:
            return
        sim.wake = None
        if sim.pending is not None:
            job, outcome, sent, due = sim.pending
            if self.time < due:
                sim.wake = due
            else:
                sim.pending = None
                self.answer(sim, job, outcome, sent, self.local_now(sim))
        for _ in range(10_000):
            now = self.local_now(sim)
            active = [
                job
                for job in sim.jobs
                if (job.queued or (job.turn is not None and job not in sim.begun))
                # the caller whose answer is on its way is blocked in its call
                and (sim.pending is None or job is not sim.pending[0])
            ]
            if not active:
                return
            progressed = False
            for job in active:  # every caller's driver looks at its job
                step = sim.shard.step(job, now)
                if isinstance(step, Expired):
                    sim.shard.cancel(job)
                    sim.expired.append(job)
                    progressed = True
                elif isinstance(step, Operation):
                    self.call(sim, job, step, now)
                    progressed = True
                    if sim.pending is not None:
                        sim.wake = sim.pending[3] if sim.wake is None else min(sim.wake, sim.pending[3])
                elif isinstance(step, (SleepUntil, BeginAt)):
                    assert step.until > now
                    # a busy-wait ends on time; a sleep ends sim.lateness late
                    late = 0.0 if isinstance(step, BeginAt) and step.spin else sim.lateness
                    # in true time; never "now" again, so that float rounding cannot stall the world
                    wake = self.time + max(step.until - now, 1e-9) + late
                    sim.wake = wake if sim.wake is None else min(sim.wake, wake)
                elif isinstance(step, Begin):
                    assert job.turn is not None
                    assert step.turn == job.turn
                    self.begin(sim, job)
                    progressed = True
                else:
                    assert isinstance(step, WaitForTurn)
                    if job.deadline is not None:
                        wake = self.time + max(job.deadline - now, 1e-9)
                        sim.wake = wake if sim.wake is None else min(sim.wake, wake)
                if progressed:
                    break
            if not progressed:
                return
        raise AssertionError("the shard never settles")

    def call(self, sim: SimShard, job: Place, step: Operation, now: float) -> None:
        assert not sim.shard.paused, "G6: a paused shard calls the state"
        self.max_doubt_us = max(self.max_doubt_us, step.doubt_us)
        state_now = self.state_now()
        if is_step(step, "take_and_try"):
            sim.calls.append(("take_and_try", None))
            self.record, outcome = protocol.take_and_try(
                self.record, step.lead_us, state_now, doubt=step.doubt_us
            )
        elif is_step(step, "try_start"):
            sim.calls.append(("try_start", step.ticket))
            self.record, outcome = protocol.try_start(
                self.record, step.ticket, step.lead_us, state_now, doubt=step.doubt_us
            )
        else:
            sim.calls.append(("retime", step.ticket))
            self.record, outcome = protocol.retime(
                self.record, step.ticket, step.lead_us, state_now, step.doubt_us
            )
        assert self.record.pos >= self.max_pos, "G2: pos moved back"
        self.max_pos = self.record.pos
        if isinstance(outcome, protocol.Started):
            self.true_starts[outcome.ticket] = (outcome.start - self.state_offset) / US
            if is_step(step, "retime"):
                assert self.starts[-1][0] == outcome.ticket, "only the latest start moves"
                self.starts[-1] = (outcome.ticket, outcome.start)
            else:
                self.starts.append((outcome.ticket, outcome.start))
        if sim.answer_delay:
            # as if sent that long before the state read its clock (the shard cannot tell)
            sim.pending = (job, outcome, now - sim.answer_delay, self.time + sim.answer_delay)
        else:
            self.answer(sim, job, outcome, now, now)

    def answer(
        self, sim: SimShard, job: Place, outcome: protocol.Outcome, sent: float, received: float
    ) -> None:
        """``outcome`` reaches ``sim`` at local time ``received``."""
        sim.shard.receive(job, outcome, sent, received)
        if isinstance(outcome, protocol.Started):
            started = [
                j
                for j in sim.jobs
                if j.turn is not None and j.turn.ticket == outcome.ticket and j not in sim.begun
            ]
            assert len(started) <= 1, "a STARTED turn goes to one job at most"

    def begin(self, sim: SimShard, job: Place) -> None:
        """``job`` begins now: record its true start and begin times."""
        assert job.turn is not None
        sim.begun.append(job)
        self.begins.append((job.turn.ticket, self.true_starts[job.turn.ticket], self.time))

    def advance_to(self, target: float) -> None:
        """Move true time to ``target``, waking shards on the way, in time order."""
        for _ in range(100_000):
            wakes = [s.wake for s in self.shards if s.alive and s.wake is not None and s.wake <= target]
            if not wakes:
                break
            self.time = max(self.time, min(wakes))
            for sim in self.shards:
                if sim.alive and sim.wake is not None and sim.wake <= self.time:
                    self.run_shard(sim)
        else:  # pragma: no cover
            raise AssertionError("too many wake-ups")
        self.time = max(self.time, target)

    def live(self) -> list[SimShard]:
        return [s for s in self.shards if s.alive]

    # -- rules ----------------------------------------------------------------

    @rule(data=st.data(), count=st.integers(1, 4), timeout_ms=st.one_of(st.none(), st.integers(0, 300)))
    def enqueue(self, data: st.DataObject, count: int, timeout_ms: int | None) -> None:
        live = self.live()
        assume(live)
        sim = data.draw(st.sampled_from(live))
        for _ in range(count):
            deadline = None if timeout_ms is None else self.local_now(sim) + timeout_ms / 1000
            sim.jobs.append(sim.shard.add(deadline))
        self.run_shard(sim)

    @rule(ms=st.one_of(st.integers(0, 50), st.integers(50, 1000)))
    def advance(self, ms: int) -> None:
        self.advance_to(self.time + ms / 1000)

    @rule(data=st.data(), ms=st.sampled_from([0.0, 0.5, 3.0, 30.0]))
    def wake_late(self, data: st.DataObject, ms: float) -> None:
        """A shard's timers fire late by ``ms`` from now on."""
        sim = data.draw(st.sampled_from(self.shards))
        sim.lateness = ms / 1000

    @precondition(lambda self: self.max_answer_delay == 0)
    @rule(ms=st.integers(1, 3000))
    def state_clock_steps_back(self, ms: int) -> None:
        # Not with delayed answers: a step back smaller than a round-trip cannot be told from
        # a slow answer, and older bounds then convert starts early by up to the step.
        self.state_offset -= ms * 1000
        self.clock_stepped = True

    @precondition(lambda self: not self.clock_stepped)
    @rule(data=st.data(), ms=st.sampled_from([0.0, 0.2, 1.0, 5.0]))
    def answers_late(self, data: st.DataObject, ms: float) -> None:
        """A shard's calls reach the state ``ms`` after they are sent, and their answers come back
        ``ms`` after the state read its clock, from its next call on."""
        sim = data.draw(st.sampled_from(self.shards))
        sim.answer_delay = ms / 1000
        self.max_answer_delay = max(self.max_answer_delay, sim.answer_delay)

    @rule(data=st.data())
    def pause(self, data: st.DataObject) -> None:
        live = self.live()
        assume(live)
        sim = data.draw(st.sampled_from(live))
        sim.shard.pause()

    @rule(data=st.data())
    def resume(self, data: st.DataObject) -> None:
        paused = [s for s in self.live() if s.shard.paused]
        assume(paused)
        sim = data.draw(st.sampled_from(paused))
        held = sim.shard.ticket
        calls_before = len(sim.calls)
        slot_not_passed = held is not None and held > self.record.pos
        sim.shard.resume()
        self.run_shard(sim)
        if slot_not_passed and len(sim.calls) > calls_before:
            assert sim.calls[calls_before] == ("try_start", held), "G6: the held ticket keeps its place"

    @precondition(lambda self: len(self.live()) > 1)
    @rule(data=st.data())
    def kill(self, data: st.DataObject) -> None:
        sim = data.draw(st.sampled_from(self.live()))
        sim.alive = False
        sim.wake = None
        sim.pending = None

    @rule(data=st.data(), jobs=st.integers(1, 6), kill_others=st.booleans())
    def isolate(self, data: st.DataObject, jobs: int, kill_others: bool) -> None:
        """G4: leave one live, unpaused shard; its jobs start within the stated bound."""
        live = self.live()
        assume(live)
        survivor = data.draw(st.sampled_from(live))
        # Its late wake-ups and slow answers are not what G4 bounds: none from now on, and the
        # answer on its way arrives first (a start it grants may move, as a slow first one does).
        survivor.lateness = 0.0
        survivor.answer_delay = 0.0
        if survivor.pending is not None:
            self.advance_to(survivor.pending[3])
        others = [s for s in self.shards if s is not survivor]
        for sim in others:
            if kill_others:
                sim.alive, sim.wake = False, None
            else:
                sim.shard.pause()
        for _ in range(jobs):
            survivor.jobs.append(survivor.shard.add(None))
        queued = [job for job in survivor.jobs if job.queued]
        t0 = max(self.state_now(), self.record.at)
        d = len(others)
        survivor.shard.resume()
        self.run_shard(survivor)
        # a state clock stepped back delays every start by the step: wait that out too
        horizon = (t0 - self.state_now()) / US + (d + len(queued) + 2) * self.interval / US + 1.0
        self.advance_to(self.time + horizon)
        for j, job in enumerate(queued, start=1):
            if job in survivor.expired:
                continue
            assert job.turn is not None, "G4: the survivor's job never started"
            # + 2 us a job: with max_late=0, a float rounding of the wake-up may retime a start by 1 us;
            # a start asked for with a doubt (slow answers before) moves the next by as much
            bound = t0 + (d + j) * (self.interval + self.max_doubt_us) + 2 * j
            assert job.turn.start_us <= bound, f"G4: job {j} started {job.turn.start_us - bound} us late"

    # -- invariants -----------------------------------------------------------

    @invariant()
    def spacing_and_order(self) -> None:
        """G1 and G2 over every start so far."""
        for (t1, s1), (t2, s2) in zip(self.starts, self.starts[1:], strict=False):
            assert t2 > t1, "G2: tickets start in increasing order"
            assert s2 - s1 >= self.interval, "G1: starts closer than the interval (state clock)"

    @invariant()
    def begins_where_felt(self) -> None:
        """G7: no job begins before its start, nor more than max_late after; begins keep the spacing.

        Times are true times, the start's on the state's clock as it was when
        the start was granted. An answer delayed by ``d`` bounds a shard's
        clock offset only to within ``d``, so with delayed answers a begin may
        come up to the longest delay later than ``max_late`` (never sooner
        than its start), and begin gaps may shrink by as much.
        """
        slack = self.max_answer_delay + EPS
        for ticket, start, begin in self.begins:
            assert begin >= start - EPS, f"ticket {ticket} began {start - begin} s before its start"
            if self.max_late is not None:
                assert begin - start <= self.max_late + slack, f"ticket {ticket} began {begin - start} s late"
        if self.max_late is not None:
            for (t1, _, b1), (t2, _, b2) in zip(self.begins, self.begins[1:], strict=False):
                assert t2 > t1, "G2: jobs begin in ticket order"
                assert b2 - b1 >= self.interval / US - self.max_late - slack, "G7: begins too close"

    @invariant()
    def nothing_lost(self) -> None:
        """G3: every job of a live shard is queued, started or expired, exactly one of them."""
        for sim in self.live():
            for job in sim.jobs:
                states = [job.queued, job.turn is not None, job in sim.expired]
                assert sum(states) == 1, f"G3: job in states {states}"
                assert job not in sim.begun or job.turn is not None
            assert sim.shard.waiting == sum(job.queued for job in sim.jobs)

    @invariant()
    def idle_means_idle(self) -> None:
        """G5: a live shard with nothing queued has no wake-up and no call in flight."""
        for sim in self.live():
            granted = [job for job in sim.jobs if job.turn is not None and job not in sim.begun]
            if not sim.shard.waiting and not granted:
                assert sim.wake is None

    @invariant()
    def one_ticket_per_shard(self) -> None:
        """Each live shard holds at most one ticket, never one that has started."""
        held = [s.shard.ticket for s in self.live() if s.shard.ticket is not None]
        assert len(held) == len(set(held))
        for ticket in held:
            assert ticket < self.record.ticket


ShardWorld.TestCase.settings = settings(max_examples=200, stateful_step_count=40)
TestShardWorld = ShardWorld.TestCase


def test_idle_shard_asks_for_nothing() -> None:
    """A shard without jobs has nothing to do, and a new job's first step is a single fused call."""
    shard = make_shard(0.01)
    job = shard.add()
    assert shard.step(job, 0.0) == Step("take_and_try", lead_us=2000)
    shard.receive(job, protocol.Started(ticket=1, start=5_000_000, now=5_000_000), 0.0, 0.0)
    assert shard.step(job, 0.0) == Begin(job.turn)  # type: ignore[arg-type]
    assert shard.waiting == 0


def test_a_try_takes_a_ticket_only_if_it_starts() -> None:
    """A try (``try_acquire``) with no ticket held asks with try_take; a wait ends it, holding no ticket."""
    shard = make_shard(0.01)
    tried = shard.add(deadline=0.0, timeout=0.0)
    tried.attempt = True
    assert shard.step(tried, 0.0) == Step("try_take", lead_us=0)
    shard.receive(tried, protocol.Wait(ticket=5, slot=5_010_000, now=5_000_000), 0.0, 0.001)
    assert shard.ticket is None, "the ticket named was not taken"
    assert tried.expected == pytest.approx(0.010, abs=0.002), "when a turn could have come"
    assert isinstance(shard.step(tried, 0.001), Expired)
    shard.abandon(tried)
    again = shard.add(deadline=0.001, timeout=0.0)
    again.attempt = True
    assert shard.step(again, 0.002) == Step("try_take", lead_us=0)
    shard.receive(again, protocol.Started(ticket=5, start=5_010_000, now=5_010_000), 0.002, 0.002)
    assert again.turn is not None
    assert again.turn.ticket == 5


def test_a_try_whose_reply_was_lost_asks_again_with_the_same_token() -> None:
    """A try_take that raised may have started a ticket: the next try names the same token (its lease)."""
    shard = make_shard(0.01)
    first = shard.add(deadline=0.0, timeout=0.0)
    first.attempt = True
    sent = shard.step(first, 0.0)
    assert is_step(sent, "try_take")
    shard.failed(first)  # the reply was lost
    assert shard.ticket is None, "no ticket is known to be held"
    shard.abandon(first)
    again = shard.add(deadline=0.001, timeout=0.0)
    again.attempt = True
    retried = shard.step(again, 0.001)
    assert is_step(retried, "try_take")
    assert retried.token == sent.token, "answered with the lost call's start, if it made one"  # type: ignore[union-attr]
    shard.receive(again, protocol.Wait(ticket=3, slot=2_000_000, now=1_000_000), 0.001, 0.002)
    assert isinstance(shard.step(again, 0.002), Expired)
    shard.abandon(again)
    waiting = shard.add()
    assert shard.step(waiting, 0.003) == Step("take_and_try"), "a caller that waits takes a ticket again"


def test_turn_of_a_job_that_left_goes_to_the_next() -> None:
    """A STARTED answer for a job cancelled meanwhile is given to the next waiting job."""
    shard = make_shard(0.01)
    first, second = shard.add(), shard.add()
    assert is_step(shard.step(first, 0.0), "take_and_try")
    shard.cancel(first)
    shard.receive(first, protocol.Started(ticket=7, start=1000, now=1000), 0.0, 0.0)
    assert second.turn is not None
    assert second.turn.ticket == 7
    assert first.turn is None


def test_expired_job_leaves_its_ticket_to_the_next() -> None:
    """A job whose slot lies past its deadline expires at once; the next job inherits the ticket."""
    shard = make_shard(1.0, lead=0.0)
    first = shard.add(deadline=0.5)
    second = shard.add()
    assert is_step(shard.step(first, 0.0), "take_and_try")
    shard.receive(first, protocol.Wait(ticket=3, slot=800_000, now=0), 0.0, 0.0, offset=0.0)
    assert isinstance(shard.step(first, 0.0), Expired)
    shard.cancel(first)
    assert shard.step(second, 0.0) == SleepUntil(0.8)
    assert shard.step(second, 0.8) == Step("try_start", ticket=3, lead_us=0)


def test_a_late_answer_does_not_delay_the_local_start() -> None:
    """The offset comes from the tightest recent bound, not from each answer's own receive time."""
    shard = make_shard(1.0, lead=0.0)
    first = shard.add()
    assert is_step(shard.step(first, 10.0), "take_and_try")
    shard.receive(first, protocol.Started(ticket=1, start=5_000_000, now=5_000_000), 10.0, 10.0001)
    assert first.turn is not None
    assert isinstance(shard.step(first, first.turn.local_start), Begin)  # a granted turn begins first
    second = shard.add()
    assert is_step(shard.step(second, 10.5), "take_and_try")
    # answered at state time 5.5 s, but received 5 ms later than the first answer's bound implies
    shard.receive(second, protocol.Started(ticket=2, start=6_000_000, now=5_500_000), 10.5, 10.5051)
    assert second.turn is not None
    # the first bound, loosened only by the clocks' possible drift in the 0.5 s since
    expected = 6.0 + 10.0001 - 5.0 + clock_module.DRIFT * (10.5051 - 10.0001)
    assert abs(second.turn.local_start - expected) < 1e-9, "the 5 ms receive delay is not added"


def test_a_state_clock_stepping_back_resets_the_offset() -> None:
    """After the state's clock steps back, starts convert with the clock as it is now, never earlier."""
    shard = make_shard(1.0, lead=0.0)
    first = shard.add()
    assert is_step(shard.step(first, 10.0), "take_and_try")
    shard.receive(first, protocol.Started(ticket=1, start=5_000_000, now=5_000_000), 10.0, 10.0)
    assert isinstance(shard.step(first, 10.0), Begin)
    second = shard.add()
    assert is_step(shard.step(second, 10.5), "take_and_try")
    # the state clock stepped back by 2 s: it reads 3.5 s at local 10.5
    shard.receive(second, protocol.Started(ticket=2, start=3_500_000, now=3_500_000), 10.5, 10.5)
    assert second.turn is not None
    assert second.turn.local_start == 10.5, "a start at the state's now begins now, not 2 s in the past"


def _answer_at(shard: Shard, *, state_now: int, received: float, delay: float) -> float:
    """Tell ``shard`` of one answer read on the state's clock at ``state_now`` (us) and received
    ``delay`` s after that (true offset: local = state + 10 s); the offset it converts with now."""
    offset, _ = shard.estimator.bound(received, state_now / US, 2 * delay)
    return offset


def test_a_young_shard_asks_once_more_halfway_for_another_offset_bound() -> None:
    """While few answers bound the offset, a head told to wait long for a new ticket asks once
    more, halfway; the extra answer tightens the bound its start is converted with."""
    shard = make_shard(1.0, lead=0.0)
    job = shard.add()
    assert is_step(shard.step(job, 10.0), "take_and_try")
    # a fleet's first call: answered 3 ms late (true offset: local = state + 10 s)
    shard.receive(job, protocol.Wait(ticket=2, slot=800_000, now=0), 9.999, 10.003)
    assert shard.step(job, 10.003) == SleepUntil(10.003 + (10.803 - 10.003) / 2)
    assert shard.step(job, 10.403) == Step("try_start", ticket=2, lead_us=0)
    shard.receive(job, protocol.Wait(ticket=2, slot=800_000, now=400_000), 10.4, 10.4001)
    last = shard.step(job, 10.4001)
    assert isinstance(last, SleepUntil)
    # the slot, converted with the 0.1 ms bound just learnt: no second probe for this ticket
    assert last.until == pytest.approx(10.8001, abs=1e-9), "asked more than once"
    assert shard.step(job, last.until) == Step("try_start", ticket=2, lead_us=0)
    shard.receive(job, protocol.Started(ticket=2, start=800_000, now=800_000), last.until, last.until + 0.002)
    assert job.turn is not None
    # with the 0.1 ms bound and the 0.4 s of drift allowed since, not the 2-3 ms of the others
    assert job.turn.local_start == pytest.approx(10.8001 + clock_module.DRIFT * 0.4, abs=1e-5)


def test_a_state_clock_step_makes_a_shard_young_again() -> None:
    """After a step only the newest bound counts: the next wait for a new ticket asks once more."""
    shard = make_shard(1.0, lead=0.0)
    for k in range(3):
        _answer_at(shard, state_now=k * 10_000, received=10.0 + k * 0.01, delay=0.0)
    clock_steps = shard.estimator.steps
    job = shard.add()
    assert is_step(shard.step(job, 10.1), "take_and_try")
    # the state's clock stepped back by 1 s
    shard.receive(job, protocol.Wait(ticket=2, slot=800_000, now=-1_000_000 + 100_000), 10.1, 10.1)
    assert shard.estimator.steps == clock_steps + 1
    step = shard.step(job, 10.1)
    assert isinstance(step, SleepUntil)
    # the slot is at local 11.8 on the stepped clock; halfway to it, one more bound is asked for
    assert step.until == pytest.approx(10.1 + (11.8 - 10.1) / 2), "no probe after the step"


def test_a_shard_reading_the_offset_directly_never_probes() -> None:
    """A state on this host's clock gives the offset itself: one call per wait, as before."""
    shard = make_shard(1.0, lead=0.0)
    job = shard.add()
    assert is_step(shard.step(job, 10.0), "take_and_try")
    shard.receive(job, protocol.Wait(ticket=2, slot=800_000, now=0), 10.0, 10.003, offset=10.0)
    assert shard.step(job, 10.003) == SleepUntil(10.8)


@pytest.mark.parametrize("margin", [0.0, 0.0003, 0.002])
def test_a_loose_first_bound_is_not_kept_but_own_begins_stay_apart(margin: float) -> None:
    """The first turn converted with a 2 ms late answer; later, tighter answers convert later
    turns on time again, while two begins of this shard never come closer than
    interval + margin - max_late (the starts come interval + margin apart, as the margin makes them)."""
    interval, max_late = 0.01, 0.0003
    shard = make_shard(interval, lead=0.0, max_late=max_late, margin=margin)
    spacing = round((interval + margin) * US)
    begins: list[float] = []
    errors: list[float] = []
    for k in range(10):
        start = 5_000_000 + k * spacing  # back to back on the state's clock; local = state + 5 s
        true_local = start / US + 5.0
        delay = 0.002 if k == 0 else 0.0001
        sent = true_local - 0.00006  # the state reads its clock 10 us after the call is sent
        job = shard.add()
        if k == 0:  # a fleet's first answers: a Wait close to its slot, so no probe, 2 ms late
            assert is_step(shard.step(job, sent - 0.003), "take_and_try")
            wait = protocol.Wait(ticket=1, slot=start, now=start - 3_000)
            shard.receive(job, wait, sent - 0.00306, true_local - 0.003 + delay)
            assert job.expected is not None
            sent = job.expected  # the slot, converted 2 ms late
        assert is_step(shard.step(job, sent), "take_and_try", "try_start")
        answer = protocol.Started(ticket=k + 1, start=start, now=start - 50)
        received = max(sent + 0.00001, true_local - 0.00005 + delay)
        shard.receive(job, answer, sent, received)
        assert job.turn is not None
        begin = max(received, job.turn.local_start)
        assert isinstance(shard.step(job, begin), Begin)
        begins.append(begin)
        errors.append(job.turn.local_start - true_local)
    assert errors[0] > 0.0019, errors
    assert all(b <= a for a, b in itertools.pairwise(errors)), errors
    assert errors[-1] < 0.0002, f"the loose first bound was kept: {errors}"
    gaps = [b - a for a, b in itertools.pairwise(begins)]
    assert min(gaps) >= interval + margin - max_late - 1e-9, gaps


def test_a_slow_first_answer_moves_its_start_and_converts_it_with_the_next() -> None:
    """A start granted by the shard's first answer may truly have been a round-trip before the
    answer came: with a 2 ms round-trip the job does not begin but moves its start, and the
    moved start is converted with the tighter bound of the second answer."""
    shard = make_shard(0.01, lead=0.001, max_late=0.0003)  # true offset: local = state + 10 s
    job = shard.add()
    assert is_step(shard.step(job, 10.0), "take_and_try")
    # the state read its clock at once (10.0), the answer came back 2 ms later
    shard.receive(job, protocol.Started(ticket=1, start=0, now=0), 10.0, 10.002)
    assert job.turn is not None
    assert job.turn.local_start == pytest.approx(10.002)
    step = shard.step(job, 10.002)
    assert step == Step("retime", ticket=1, lead_us=1000), "began up to 2 ms late"
    # read at 10.002 (state 2_002), answered 48 us later: the start moves to 10.003002
    shard.receive(job, protocol.Started(ticket=1, start=3_002, now=2_002), 10.002, 10.00205)
    assert job.turn.local_start == pytest.approx(10.003002 + 0.000048, abs=1e-7), (
        "the moved start was converted with the first, loose bound"
    )
    assert shard.step(job, job.turn.local_start) == Begin(job.turn)


@pytest.mark.parametrize(
    ("shard", "rtt", "offset"),
    [
        pytest.param(make_shard(0.01, lead=0.0, max_late=0.0003), 0.0002, None, id="a fast first answer"),
        pytest.param(make_shard(0.01, lead=0.0, max_late=None), 0.002, None, id="no lateness check"),
        pytest.param(make_shard(0.01, lead=0.0, max_late=0.0003, burst=3), 0.002, None, id="a burst"),
        pytest.param(
            make_shard(0.01, lead=0.0, max_late=0.0003), 0.002, 10.0019, id="an offset read directly"
        ),
    ],
)
def test_a_first_answer_begins_at_once_when_its_doubt_does_not_matter(
    shard: Shard, rtt: float, offset: float | None
) -> None:
    """One call for an idle acquire: a first answer within max_late, no lateness check, a queue
    with a burst (whose gaps are not promised), or a state on this host's clock (whose offset,
    read directly, has no doubt: here it read its clock 0.1 ms before the answer came)."""
    job = shard.add()
    assert is_step(shard.step(job, 10.0), "take_and_try")
    shard.receive(job, protocol.Started(ticket=1, start=0, now=0), 10.0, 10.0 + rtt, offset=offset)
    assert job.turn is not None
    assert shard.step(job, max(10.0 + rtt, job.turn.local_start)) == Begin(job.turn)


def _first_begun(shard: Shard, rtt: float) -> None:
    """The shard's first turn, taken at local 10.0 (state time 0) and answered ``rtt`` later, begun."""
    first = shard.add()
    assert is_step(shard.step(first, 10.0), "take_and_try")
    shard.receive(first, protocol.Started(ticket=1, start=0, now=0), 10.0, 10.0 + rtt)
    assert first.turn is not None
    assert shard.step(first, 10.0 + rtt) == Begin(first.turn)


def test_only_the_first_answer_is_doubted() -> None:
    """A later slow answer is converted with the tighter bounds before it: its start begins at once."""
    shard = make_shard(0.01, lead=0.0, max_late=0.0003)
    _first_begun(shard, 0.0001)
    second = shard.add()
    assert is_step(shard.step(second, 10.02), "take_and_try")
    shard.receive(second, protocol.Started(ticket=2, start=20_000, now=20_000), 10.02, 10.022)
    assert second.turn is not None
    assert second.turn.local_start == pytest.approx(10.0201 + clock_module.DRIFT * 0.0219, abs=1e-7)
    assert shard.step(second, 10.022) == Step("retime", ticket=2, lead_us=step_lead(shard)), (
        "1.9 ms late by the tight bound: moved as any late begin"
    )


def test_a_start_whose_bounds_loosened_in_flight_is_doubted_by_the_growth() -> None:
    """The tightest bound ages out while a slow call is in flight: its start is converted with
    looser bounds than the doubt it carried allowed for, so it is moved (carrying the new doubt)
    before it begins. Seen on secantusdb under load: two begins 16 ms apart for 20.5."""
    shard = make_shard(0.05, lead=0.0, max_late=0.0003)
    _first_begun(shard, 0.0002)  # a quick first answer: the offset bounded to 0.2 ms
    second = shard.add()
    call = shard.step(second, 11.95)
    assert is_step(call, "take_and_try")
    assert isinstance(call, Operation)
    carried = 0.0002 + 2 * clock_module.DRIFT * 1.9498  # the bound's 0.2 ms, loosened by its age
    assert call.doubt_us == round((carried - DOUBT_FREE + DEFAULT_MAX_LATE) * US), "still tight"
    # answered 60 ms later, after the tight bound aged out: this answer's own bound is 60 ms wide
    shard.receive(second, protocol.Started(ticket=2, start=1_980_000, now=1_980_000), 11.95, 12.01)
    assert second.turn is not None
    assert second.doubt == pytest.approx(0.06 - carried, abs=1e-6), "the growth past what the call carried"
    moved = shard.step(second, 12.01)
    assert is_step(moved, "retime"), "converted 60 ms loosely, it does not begin unmoved"
    assert isinstance(moved, Operation)
    assert moved.doubt_us >= 59_000, "the move carries the new doubt: the next start comes that much later"


def _idle_acquire(
    shard: Shard, now: float, *, rtt: float, state_behind: float = 10.0
) -> tuple[list[str], float]:
    """Drive one acquire of an idle queue to its begin: each call is answered ``rtt`` after it was
    sent, the state reading its clock (``state_behind`` s behind this host's) as the call arrives,
    and granting a start at once (a Retime: a start moved by its lead). The calls made, and when
    the job began."""
    job = shard.add()
    calls: list[str] = []
    for _ in range(10):
        step = shard.step(job, now)
        if isinstance(step, Begin):
            # (1 us: the state clock reads whole microseconds, rounded)
            assert now >= step.turn.start_us / US + state_behind - 1e-6, "began before its true start"
            return calls, now
        if isinstance(step, BeginAt):
            now = step.until
            continue
        assert isinstance(step, Operation)
        calls.append(step.kind)
        state_now = round((now - state_behind) * US)
        if is_step(step, "take_and_try"):
            answer = protocol.Started(ticket=len(calls), start=state_now, now=state_now)
        else:
            assert is_step(step, "retime"), step
            answer = protocol.Started(ticket=step.ticket, start=state_now + step.lead_us, now=state_now)
        shard.receive(job, answer, now, now + rtt)
        now += rtt
    raise AssertionError(f"no begin after the calls {calls}")


def test_steady_slow_answers_cost_one_call_per_idle_acquire_after_the_first() -> None:
    """A 1 ms round-trip over a max_late of 0.3 ms: only the shard's first start is doubted
    (moved, one more call); every later idle acquire is one call and begins."""
    shard = make_shard(0.01, lead=0.001, max_late=0.0003)
    now, per_acquire = 100.0, []
    for _ in range(5):
        calls, began = _idle_acquire(shard, now, rtt=0.001)
        per_acquire.append(len(calls))
        now = began + 0.05
    assert per_acquire == [2, 1, 1, 1, 1]


@settings(max_examples=300, deadline=None)
@given(
    rtt=st.floats(0.0, 0.01),
    max_late=st.sampled_from([0.0, 0.0003, 0.001, None]),
    behind=st.floats(-1e4, 1e4),
    idle=st.lists(st.floats(0.0, 5.0), min_size=1, max_size=6),
)
def test_idle_acquires_over_steady_slow_answers_begin_in_one_call_after_the_first(
    rtt: float, max_late: float | None, behind: float, idle: list[float]
) -> None:
    """Whatever the round-trip, however long the shard idles: every acquire begins, the first in
    at most two calls (one more when its answer is doubted), every later one in one call."""
    shard = make_shard(0.05, lead=0.001, max_late=max_late)
    calls, now = _idle_acquire(shard, 1000.0, rtt=rtt, state_behind=behind)
    assert len(calls) <= 2
    for spell in idle:
        calls, now = _idle_acquire(shard, now + spell, rtt=rtt, state_behind=behind)
        assert calls == ["take_and_try"]


def test_a_clock_step_makes_the_next_start_doubted() -> None:
    """After the state's clock steps back, the bounds before it are gone: the next answer is a
    first answer again, and a slow one has its start moved."""
    shard = make_shard(0.01, lead=0.001, max_late=0.0003)
    _, began = _idle_acquire(shard, 100.0, rtt=0.001)
    calls, began = _idle_acquire(shard, began + 0.05, rtt=0.0001)
    assert calls == ["take_and_try"]
    calls, _ = _idle_acquire(shard, began + 0.05, rtt=0.001, state_behind=10.005)  # 5 ms back
    assert shard.estimator.steps == 1
    assert calls == ["take_and_try", "retime"]


def test_a_doubted_start_is_checked_at_once_not_after_sleeping_until_it() -> None:
    """A first, slow answer granting a start 5 ms ahead: the shard asks again at once (the start
    stays where it is, the lead being shorter), and the job begins at the start the tighter
    bound converts, not a retime lead after it."""
    shard = make_shard(0.01, lead=0.005, max_late=0.0003)  # true offset: local = state + 10 s
    job = shard.add()
    assert is_step(shard.step(job, 10.0), "take_and_try")
    shard.receive(job, protocol.Started(ticket=1, start=5_000, now=0), 10.0, 10.002)  # 2 ms round-trip
    assert job.turn is not None
    assert job.turn.local_start == pytest.approx(10.007)
    step = shard.step(job, 10.002)
    assert is_step(step, "retime"), f"slept until a start it would have moved anyway: {step}"
    # read at once (state 2_000), answered 50 us later: the start is unchanged, its conversion tighter
    shard.receive(job, protocol.Started(ticket=1, start=5_000, now=2_000), 10.002, 10.00205)
    assert job.turn.local_start == pytest.approx(10.00505, abs=1e-7)
    assert shard.step(job, job.turn.local_start) == Begin(job.turn)


def test_a_paused_shard_sleeps_until_a_doubted_start_and_gives_it_up_there() -> None:
    """A paused shard makes no call, so cannot check a doubted start: it never begins it, and
    gives it up only at the start (where a shard resumed meanwhile would have checked it)."""
    shard = make_shard(0.01, lead=0.005, max_late=0.0003)
    job = shard.add()
    assert is_step(shard.step(job, 10.0), "take_and_try")
    shard.receive(job, protocol.Started(ticket=1, start=5_000, now=0), 10.0, 10.002)
    assert job.turn is not None
    start = job.turn.local_start
    shard.pause()
    assert shard.step(job, 10.002) == BeginAt(start)
    step = shard.step(job, start)
    assert not isinstance(step, (Begin, BeginAt)), step
    assert job.turn is None
    assert job.given_up == job.given_up_paused == 1


def test_a_new_shard_learns_the_state_clock_from_a_working_one() -> None:
    """A group's new key: its shard starts from its sibling's offset bounds, so its first start
    is not doubted and its idle acquire is one call over a slow network."""
    working = make_shard(0.01, lead=0.001, max_late=0.0003)
    _, began = _idle_acquire(working, 100.0, rtt=0.001)
    new = make_shard(0.01, lead=0.001, max_late=0.0003)
    new.learn_clock(working, began + 0.05)
    calls, _ = _idle_acquire(new, began + 0.05, rtt=0.001)
    assert calls == ["take_and_try"]
    stale = make_shard(0.01, lead=0.001, max_late=0.0003)
    stale.learn_clock(working, began + 10.0)  # the working shard's bounds are 10 s old: none learnt
    calls, _ = _idle_acquire(stale, began + 10.0, rtt=0.001)
    assert calls == ["take_and_try", "retime"], "a stale sibling's bounds count as no bounds"
    alone = make_shard(0.01, lead=0.001, max_late=0.0003)
    calls, _ = _idle_acquire(alone, began + 0.05, rtt=0.001)
    assert calls == ["take_and_try", "retime"], "a shard on its own doubts its first start"


def step_lead(shard: Shard) -> int:
    """The lead (us) a late job of ``shard`` moves its start by."""
    return round(shard.retime_lead * US)


def granted(shard: Shard, job: Place, *, start: int, now: float) -> None:
    """Drive ``job`` to a granted turn starting at state time ``start`` (us), received at local ``now``."""
    assert is_step(shard.step(job, now), "take_and_try")
    shard.receive(job, protocol.Started(ticket=1, start=start, now=start - 5_000), now, now)


def test_a_late_wake_up_moves_the_start_instead_of_beginning() -> None:
    """G7: a job that wakes more than max_late after its start asks for a later start; on time, it begins."""
    shard = make_shard(0.01, lead=0.002, max_late=0.0003)
    job = shard.add()
    granted(shard, job, start=10_005_000, now=10.0)  # local start 10.005
    assert shard.step(job, 10.0) == BeginAt(10.005)
    assert shard.step(job, 10.0059) == Step("retime", ticket=1, lead_us=900), (
        "0.9 ms late: no begin; moved by the round-trip (0 here) and the usual wake-up lateness (0.9 ms)"
    )
    shard.receive(job, protocol.Started(ticket=1, start=10_008_000, now=10_006_000), 10.006, 10.006)
    assert job.turn is not None
    assert job.turn.local_start == pytest.approx(10.008)
    assert shard.step(job, 10.0061) == BeginAt(job.turn.local_start, spin=True), "awake: no sleep"
    assert shard.step(job, 10.0081) == Begin(job.turn)


def test_the_sleep_before_a_begin_ends_early_by_the_usual_lateness() -> None:
    """After late wake-ups, the sleep before a begin ends that much early; the rest is busy-waited."""
    shard = make_shard(0.01, lead=0.002, max_late=0.0003)
    first = shard.add()
    granted(shard, first, start=10_005_000, now=10.0)
    assert shard.step(first, 10.0) == BeginAt(10.005)
    assert isinstance(shard.step(first, 10.0052), Begin), "0.2 ms late: within max_late"
    second = shard.add()
    assert is_step(shard.step(second, 10.02), "take_and_try")
    shard.receive(second, protocol.Started(ticket=2, start=10_025_000, now=10_020_000), 10.02, 10.02)
    step = shard.step(second, 10.02)
    assert isinstance(step, BeginAt)
    assert step.until == pytest.approx(10.025 - 0.0002), "wakes 0.2 ms early, the lateness seen"
    assert shard.step(second, 10.0249) == BeginAt(10.025, spin=True)
    assert isinstance(shard.step(second, 10.0250), Begin)


def test_a_late_turn_that_cannot_move_is_given_up_for_a_new_ticket() -> None:
    """G7: once a later ticket has started, the late job gives its turn up and takes a new ticket."""
    shard = make_shard(0.01, lead=0.002, max_late=0.0003)
    job, other = shard.add(), shard.add()
    granted(shard, job, start=10_005_000, now=10.0)
    assert isinstance(shard.step(other, 10.0), WaitForTurn), "one granted, not begun, start per shard"
    assert is_step(shard.step(job, 10.007), "retime")
    shard.receive(job, protocol.Passed(ticket=1, pos=2, now=10_007_000), 10.007, 10.007)
    assert job.turn is None
    assert job.given_up == 1
    assert shard.step(job, 10.007) == Step("take_and_try", lead_us=2000), (
        "back at the head, ahead of the others"
    )
    assert isinstance(shard.step(other, 10.007), WaitForTurn)


def test_a_late_turn_inside_a_burst_that_cannot_move_begins_late_instead() -> None:
    """With a burst, another start may follow at once: a late turn that cannot move is not thrown away."""
    shard = make_shard(0.01, lead=0.002, max_late=0.0003, burst=5)
    job = shard.add()
    granted(shard, job, start=10_005_000, now=10.0)
    assert is_step(shard.step(job, 10.007), "retime")
    shard.receive(job, protocol.Passed(ticket=1, pos=2, now=10_007_000), 10.007, 10.007)
    assert job.turn is not None
    assert job.given_up == 0
    assert shard.step(job, 10.0071) == Begin(job.turn), "begun, late by the wake-up, not given up"


def test_a_paused_shard_gives_a_late_turn_up_without_calling() -> None:
    """G6 with G7: a paused shard whose job wakes late makes no call; the job waits at the head."""
    shard = make_shard(0.01, lead=0.002, max_late=0.0003)
    job = shard.add()
    granted(shard, job, start=10_005_000, now=10.0)
    shard.pause()
    assert isinstance(shard.step(job, 10.007), WaitForTurn)
    assert job.turn is None
    assert job.queued


def test_no_lateness_check_for_short_intervals_or_when_off() -> None:
    """Under four times max_late (or with max_late=None) a late job begins anyway."""
    for shard in (make_shard(0.001, max_late=0.0003), make_shard(0.01, max_late=None)):
        job = shard.add()
        granted(shard, job, start=10_005_000, now=10.0)
        assert isinstance(shard.step(job, 10.5), Begin)


def test_a_head_waiting_for_a_far_slot_re_asks_and_notices_a_reset() -> None:
    """Told to wait 30 s, the head asks again after RECHECK; a reset record answers PASSED: new ticket."""
    shard = make_shard(30.0, lead=0.0)
    job = shard.add()
    assert is_step(shard.step(job, 0.0), "take_and_try")
    shard.receive(job, protocol.Wait(ticket=2, slot=30_000_000, now=0), 0.0, 0.0, offset=0.0)
    assert shard.step(job, 0.0) == SleepUntil(RECHECK)
    assert shard.step(job, RECHECK) == Step("try_start", ticket=2, lead_us=0)
    shard.receive(job, protocol.Wait(ticket=2, slot=30_000_000, now=1_000_000), RECHECK, RECHECK, offset=0.0)
    assert shard.step(job, RECHECK) == SleepUntil(2 * RECHECK), "the bound runs from the latest answer"
    assert shard.step(job, 2 * RECHECK) == Step("try_start", ticket=2, lead_us=0)
    # the record was reset meanwhile: ticket 2 was never handed out by the new one
    reset = protocol.new_record(30_000_000)
    _, answer = protocol.try_start(reset, 2, 0, 2_000_000)
    assert isinstance(answer, protocol.Passed)
    shard.receive(job, answer, 2 * RECHECK, 2 * RECHECK, offset=0.0)
    assert is_step(shard.step(job, 2 * RECHECK), "take_and_try")


def test_a_near_slot_is_slept_for_without_an_extra_call() -> None:
    """A slot within RECHECK is slept for as before: the bound adds no call to short waits."""
    shard = make_shard(0.5, lead=0.01)
    job = shard.add()
    assert is_step(shard.step(job, 0.0), "take_and_try")
    shard.receive(job, protocol.Wait(ticket=2, slot=500_000, now=0), 0.0, 0.0, offset=0.0)
    assert shard.step(job, 0.0) == SleepUntil(0.49)


@pytest.mark.parametrize(
    ("rtt", "burst", "doubt_us"),
    [
        (0.001, 1, 800),  # the round-trip less DOUBT_FREE (0.2 ms)
        (0.0001, 1, 0),  # a round-trip within DOUBT_FREE: nothing moves
        (0.001, 4, 0),  # a burst's begins are not spaced
        (0.3, 1, protocol.MAX_DOUBT_US),  # at most MAX_DOUBT_US
    ],
)
def test_a_start_moves_the_next_by_the_doubt_of_the_clock_offset(
    rtt: float, burst: int, doubt_us: int
) -> None:
    """Each answer bounds the state's clock offset to within its round-trip (the state reads its
    clock as the call arrives): past DOUBT_FREE, a start asks for the next to come that much later."""
    assert DOUBT_FREE == 0.0002
    shard = make_shard(1.0, burst=burst, lead=0.001, max_late=None)
    now = 100.0
    for _ in range(3):
        _, now = _idle_acquire(shard, now, rtt=rtt)
    job = shard.add()
    step = shard.step(job, now)  # (at once: the bounds have not loosened with their age yet)
    assert is_step(step, "take_and_try")
    assert isinstance(step, Operation)
    assert step.doubt_us == doubt_us


def test_begins_of_two_shards_whose_answers_come_late_stay_an_interval_apart() -> None:
    """Two shards, one answered at once and one whose answers take 4 ms back (its offset bound is
    4 ms loose): the loose one begins up to 4 ms after its true start, and its starts move the next
    by its doubt, so that no begin comes less than DOUBT_FREE after the interval from the one before."""
    interval = 0.02
    record = protocol.new_record(round(interval * US))
    fast, slow = make_shard(interval, lead=0.005), make_shard(interval, lead=0.005)
    delays = {id(fast): 0.0, id(slow): 0.004}
    begins: list[float] = []  # true times (local clocks are the true clock here; the state's is 10 s behind)
    now = 50.0
    for k in range(40):
        shard = (fast, slow)[k % 2]
        job = shard.add()
        while True:
            step = shard.step(job, now)
            if isinstance(step, Begin):
                begins.append(now)
                break
            if isinstance(step, (BeginAt, SleepUntil)):
                now = max(now, step.until)
                continue
            assert isinstance(step, Operation)
            state_now = round((now - 10.0) * US)
            if is_step(step, "take_and_try"):
                record, answer = protocol.take_and_try(record, step.lead_us, state_now, doubt=step.doubt_us)
            elif is_step(step, "try_start"):
                record, answer = protocol.try_start(
                    record, step.ticket, step.lead_us, state_now, doubt=step.doubt_us
                )
            else:
                record, answer = protocol.retime(record, step.ticket, step.lead_us, state_now)
            delay = delays[id(shard)]
            shard.receive(job, answer, now, now + delay)
            now += delay
    gaps = [b - a for a, b in itertools.pairwise(begins[4:])]  # (after each has a few bounds)
    assert min(gaps) >= interval - DOUBT_FREE - DEFAULT_MAX_LATE - 1e-6


def test_a_shard_not_doubting_moves_nothing() -> None:
    """Where begins need not be spaced (``max_late=None`` in a limiter), slow answers move no start."""
    shard = make_shard(1.0, lead=0.001, max_late=None, doubting=False)
    now = 100.0
    for _ in range(3):
        _, now = _idle_acquire(shard, now, rtt=0.005)
    step = shard.step(shard.add(), now)
    assert isinstance(step, Operation)
    assert step.doubt_us == 0


def _tight_shard() -> tuple[Shard, float]:
    """A shard (20 ms, lead 45 ms: longer than the interval, as on a slow state) whose bound of the
    state's clock (10 s behind) is tight: read by itself, with a 0.1 ms round-trip."""
    shard = make_shard(0.02, lead=0.045, max_late=DEFAULT_MAX_LATE)
    now = 100.0
    shard.clock_read(now, now + 0.0001, round((now + 0.00005 - 10.0) * US))
    return shard, now + 0.0001


def _started_late(shard: Shard, job: Place, now: float, late: float, ticket: int) -> tuple[object, float]:
    """Answer ``job``'s call (a start made as it arrived) ``late`` s later; the step that follows."""
    step = shard.step(job, now)
    assert is_step(step, "take_and_try")
    state_now = round((now - 10.0) * US)
    shard.receive(job, protocol.Started(ticket=ticket, start=state_now, now=state_now), now, now + late)
    return step, now + late


def test_a_start_answered_late_gives_the_next_starts_an_allowance() -> None:
    """A start made as its call arrives is answered a return trip later. The first such answer is
    retimed (and given up: with a lead over the interval the next ticket has started); from then
    on each start moves the next by as much as answers came late (its doubt), and the turn it
    gives may begin that much after max_late: it begins (G7 keeps its bound)."""
    shard, now = _tight_shard()
    job = shard.add()
    first, now = _started_late(shard, job, now, 0.005, ticket=1)
    assert isinstance(first, Operation)
    assert first.doubt_us == round(DEFAULT_MAX_LATE * US)  # the margin alone: no allowance yet
    retime = shard.step(job, now)
    assert is_step(retime, "retime")
    shard.receive(job, protocol.Passed(ticket=1, pos=2, now=round((now - 10.0) * US)), now, now + 0.0001)
    now += 0.0001
    second, now = _started_late(shard, job, now, 0.004, ticket=3)
    assert isinstance(second, Operation)
    # (late by 5 ms less the read's round-trip at most, as the start converts with its bound)
    allowance_us = round((0.005 - 0.0001 - DEFAULT_MAX_LATE) * US)
    assert second.doubt_us >= round(DEFAULT_MAX_LATE * US) + allowance_us
    assert isinstance(shard.step(job, now), Begin)


def test_the_allowance_fades_once_answers_come_before_their_starts() -> None:
    """Nine starting answers in a row that come before their starts: the next start carries the
    margin alone again, and a late begin is retimed again."""
    shard, now = _tight_shard()
    job = shard.add()
    _started_late(shard, job, now, 0.005, ticket=1)
    now += 0.005
    assert is_step(shard.step(job, now), "retime")
    shard.receive(job, protocol.Passed(ticket=1, pos=2, now=round((now - 10.0) * US)), now, now)
    for ticket in range(3, 12):
        step = shard.step(job, now)
        assert is_step(step, "take_and_try")
        assert isinstance(step, Operation)
        if ticket == 3:  # the late answer's allowance, before the answers that come in time
            assert step.doubt_us >= round((0.005 - 0.0001) * US)
        state_now = round((now - 10.0) * US)
        started = protocol.Started(ticket=ticket, start=state_now + 10_000, now=state_now)  # 10 ms ahead
        shard.receive(job, started, now, now + 0.001)
        now += 0.001
        while not isinstance(step := shard.step(job, now), Begin):
            assert isinstance(step, BeginAt)
            now = step.until
        job = shard.add()
        now += 0.05
    last = shard.step(job, now)
    assert isinstance(last, Operation)
    # the margin and the bounds' width less DOUBT_FREE (they aged), not the 4.7 ms allowance
    assert last.doubt_us < round(DEFAULT_MAX_LATE * US) + 1000


def test_while_late_starts_can_be_moved_no_start_carries_an_allowance() -> None:
    """Where a late answer's turn is still the latest start (a fast state, a lead under the
    interval), its retime succeeds: the start is moved once, and the next starts carry no
    allowance (the allowance is for states where retimes fail)."""
    shard, now = _tight_shard()
    job = shard.add()
    _started_late(shard, job, now, 0.005, ticket=1)
    now += 0.005
    retime = shard.step(job, now)
    assert is_step(retime, "retime")
    assert isinstance(retime, Operation)
    state_now = round((now - 10.0) * US)
    moved = protocol.Started(ticket=1, start=state_now + retime.lead_us, now=state_now)
    shard.receive(job, moved, now, now + 0.0001)
    now += 0.0001
    while not isinstance(step := shard.step(job, now), Begin):
        assert isinstance(step, BeginAt)
        now = step.until
    step = shard.step(shard.add(), now + 0.05)
    assert isinstance(step, Operation)
    assert step.doubt_us < round(DEFAULT_MAX_LATE * US) + 1000  # no 4.7 ms allowance
