"""The shard: one process's local queue of waiting jobs, free of I/O.

A :class:`Shard` decides, for each waiting job, what its driver must do next
(DESIGN.md §4): wait for its turn in the local FIFO, take a ticket, try to
start the ticket it holds, sleep until its slot comes near, sleep until its
granted start, and begin -- or, when it wakes too late to begin on time,
move its start later or give the turn up (G7). It never calls the state,
reads a clock or sleeps itself; the thread driver (:mod:`ratequeue.limiter`)
and the asyncio driver run the I/O and report the answers back. The
property tests drive it with a fake clock.

Only the head job talks to the state, and the shard holds at most one ticket
and at most one granted start that has not begun: while a job sleeps until
its start, the next one does not call. So a shard that dies wastes at most
one slot, whatever the lead (G4). The ticket belongs to the shard, not to a
job: when the head gives up (timeout, cancel) the next job inherits the
ticket, and a turn granted to a job that has just left goes to the next one.

Local times are seconds on the local clock (``time.monotonic`` in the
drivers); the protocol's answers carry state-clock times in microseconds.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Union

from .protocol import MAX_LEAD_US, US, Outcome, Passed, Started, Wait

__all__ = [
    "DEFAULT_JITTER",
    "DEFAULT_MAX_LATE",
    "RECHECK",
    "Begin",
    "BeginAt",
    "Expired",
    "Job",
    "Retime",
    "Shard",
    "SleepUntil",
    "Step",
    "TakeAndTry",
    "Turn",
    "TryStart",
    "WaitForTurn",
]

#: wake-up lateness allowed for when reserving a slot early (adaptive lead)
DEFAULT_JITTER = 0.002

#: how late (s) a job may begin after its granted start (G7's epsilon)
DEFAULT_MAX_LATE = 0.0003

#: the longest (s) a head sleeps toward its slot without asking the state again. A record
#: reset (or any change that passes the held ticket) is noticed within this, plus a
#: round-trip: the next ``try_start`` answers PASSED and the head takes a new ticket. It
#: costs a waiting head at most one call a second more (only while it waits for a slot
#: more than a second away); a shard with no jobs still makes no call (G5).
RECHECK = 1.0

#: the lateness check is on for intervals of at least this many ``max_late``: below,
#: a busy host's wake-up jitter is a large part of the interval, and giving turns up
#: would cost more rate than the check is worth
_CHECKED_FROM = 4

#: how many times a turn's start may be moved later before the turn is given up
_MAX_RETIMES = 2

#: the protocol's resolution (s): lateness within it is a rounding error, not late
_RESOLUTION = 1e-6

#: what a moved start allows (s) beyond a round-trip and the usual wake-up lateness
_RETIME_MARGIN = 0.0005

#: how many recent wake-up lateness samples the early wake-up is the median of
_WAKE_SAMPLES = 9
#: the most (s) a job busy-waits before its start
_MAX_EARLY = 0.002

#: how many calls a head may make once its deadline has passed
_LATE_CALLS = 2

#: how fast (s per s) a state's clock may drift from this host's: an offset bound learnt ``t`` s
#: ago still bounds the offset now once ``_DRIFT * t`` is added to it. 500 ppm: the fastest
#: rate at which the kernel slews a clock that NTP corrects (two undisciplined quartz clocks
#: differ by at most about 200 ppm)
_DRIFT = 500e-6
#: how old (s) an answer's offset bound may be and still be used (with its drift added)
_OFFSET_WINDOW = 2.0
#: how far (s) an answer's offset bound may exceed the best before a clock step is assumed
_OFFSET_SLACK = 0.0005
#: how far (s) an offset read directly (a state on this host's clock) may move between two answers
#: before it may be a clock step: more than a thread preempted between two clock reads, less
#: than the steps NTP makes (it slews smaller differences). A move counts as a step only once
#: the next answer's offset agrees with the moved one within this too: a stall between the
#: two reads (a preempted thread, a garbage collection) moves one answer's offset, not the next
_DIRECT_STEP = 0.01

#: while fewer answers than this in the last _OFFSET_WINDOW bound the clock offset (a shard
#: just started, or idle for a while), a head told to wait for a new ticket asks once more,
#: halfway to its wake-up: one more bound, likely from a quieter moment than a fleet's first
#: calls, before its start is converted to local time with it (measured: first turns
#: converted up to 1.5 ms late)
_FEW_BOUNDS = 3
#: ...but only when its wake-up is at least this far (s) away
_PROBE_FROM = 0.004

#: weight of the newest round-trip in the smoothed round-trip time
_RTT_WEIGHT = 0.25


@dataclass(frozen=True)
class Turn:
    """A job's granted turn."""

    #: the ticket that started
    ticket: int
    #: when the job starts, on the state's clock, in microseconds
    start_us: int
    #: the same instant on this process's local clock, in seconds
    local_start: float

    @property
    def start(self) -> float:
        """When the job starts, on the state's clock, in seconds."""
        return self.start_us / US


@dataclass(eq=False)
class Job:
    """One caller waiting in a shard for its turn."""

    #: local time by which the job must have begun, or ``None``
    deadline: float | None = None
    #: the timeout (s) the deadline was set from, for messages
    timeout: float | None = None
    #: how many starts of the queue's rate the job uses (1 to the queue's burst)
    cost: int = 1
    #: set once the job's turn has been granted
    turn: Turn | None = field(default=None, init=False)
    #: whether the job is in its shard's queue
    queued: bool = field(default=False, init=False)
    #: calls made for the job at or after its deadline
    late_calls: int = field(default=0, init=False)
    #: how often the granted turn's start has been moved later
    retimes: int = field(default=0, init=False)
    #: turns given up because the job woke too late to begin them
    given_up: int = field(default=0, init=False)
    #: those of them given up at once because the shard was paused (a paused shard makes no
    #: call, so cannot move the start): a pause, not a host too busy to begin on time
    given_up_paused: int = field(default=0, init=False)
    #: set when a late turn of a queue with a burst could not be moved: it begins late
    begins_late: bool = field(default=False, init=False)
    #: local time the job's driver was told to wake at before its start, while it sleeps
    wake: float | None = field(default=None, init=False)
    #: set when the job was withdrawn (its reservation cancelled): its driver stops, turnless
    withdrawn: bool = field(default=False, init=False)
    #: the local time of the slot the state last told this job to wait for, if it did
    expected: float | None = field(default=None, init=False)
    #: how much earlier (s) than ``turn.local_start`` the granted start may truly have been:
    #: the round-trip of the answer that granted it, when that was the shard's first bound
    #: on the clock offset (see :meth:`Shard._turn`); 0 otherwise
    doubt: float = field(default=0.0, init=False)


@dataclass(frozen=True)
class WaitForTurn:
    """Not this job's turn to act (another job is ahead, or the shard is paused).

    Wait until the shard changes, or until ``deadline`` (if not ``None``).
    """

    deadline: float | None


@dataclass(frozen=True)
class SleepUntil:
    """Sleep until local time ``until`` (or a change of the shard), then ask again."""

    until: float


@dataclass(frozen=True)
class TakeAndTry:
    """Call ``state.take_and_try(name, interval_us, lead_us, cost=cost)`` and report the answer."""

    lead_us: int
    cost: int = 1


@dataclass(frozen=True)
class TryStart:
    """Call ``state.try_start(name, interval_us, ticket, lead_us, cost=cost)`` and report the answer.

    ``cost`` is the cost the ticket was taken for, which may exceed the
    head job's (the ticket was taken for a job that has left since).
    """

    ticket: int
    lead_us: int
    cost: int = 1


@dataclass(frozen=True)
class Retime:
    """The job woke too late to begin: call ``state.retime(name, interval_us, ticket, lead_us)``."""

    ticket: int
    lead_us: int


@dataclass(frozen=True)
class BeginAt:
    """The job's turn is granted: wait until local time ``until``, then ask again.

    Without ``spin``, sleep as precisely as the driver can (the shard sets
    ``until`` a little before the start, by the wake-up lateness it has
    seen); with ``spin``, the start is a short moment away: busy-wait for it.
    The answer is then :class:`Begin`, or :class:`Retime` if the wake-up came
    too late.
    """

    until: float
    spin: bool = False


@dataclass(frozen=True)
class Begin:
    """Begin the job now: its turn has come, and it is at most ``max_late`` late."""

    turn: Turn


@dataclass(frozen=True)
class Expired:
    """The job's deadline passes before its turn can come: give up."""


#: what :meth:`Shard.step` tells a driver to do
Step = Union[WaitForTurn, SleepUntil, TakeAndTry, TryStart, Retime, BeginAt, Begin, Expired]


class Shard:
    """The scheduling logic of one process's share of a queue."""

    def __init__(
        self,
        interval: float,
        *,
        lead: float | None = None,
        jitter: float = DEFAULT_JITTER,
        max_late: float | None = DEFAULT_MAX_LATE,
        burst: int = 1,
        same_clock: bool = False,
    ) -> None:
        """
        :param interval: the queue's interval in seconds.
        :param lead: how long before its slot the head may reserve it; ``None``
            adapts it to twice the smoothed round-trip time plus ``jitter``.
        :param jitter: the wake-up lateness the adaptive lead allows for.
        :param max_late: how late (s) after its granted start a job may still
            begin; a later wake-up moves the start (or gives the turn up)
            instead. ``None``, or an interval under four times this, turns
            the check off.
        :param burst: the queue's burst. With a burst, a late turn whose start
            cannot be moved (another start followed it, inside the burst) is
            begun late rather than given up: giving it up would hand its place
            in the burst to nobody, and churn every burst after an idle spell
            (each start granted "now" arrives a round-trip late). The state's
            window bound holds all the same; as the service sees it, by the
            wake-up lateness.
        :param same_clock: the state's clock is the driver's own (a memory state read on
            ``time.monotonic``): the offsets read directly can differ only by a stall
            between two reads, never by a clock step, so no step is looked for.
        """
        self.burst = burst
        self.same_clock = same_clock
        self.interval = interval
        self._fixed_lead = lead
        self._jitter = jitter
        self.max_late = max_late if max_late is not None and interval >= _CHECKED_FROM * max_late else None
        self._jobs: deque[Job] = deque()
        self._granted: Job | None = None
        #: how late recent sleeps before a begin woke up (s)
        self._wake_lateness: deque[float] = deque(maxlen=_WAKE_SAMPLES)
        self._paused = False
        #: the ticket this shard holds, the cost it was taken for, and the local time of its slot if known
        self._ticket: int | None = None
        self._ticket_cost = 1
        #: the cost of the ticket the call in flight takes or tries, and the lead (us) it asks with
        self._call_cost = 1
        self._call_lead_us = 0
        #: whether the held ticket's slot is a time to ask again (a paused or full queue's
        #: answer, within the lead), not a time to start: the head then wakes at it, not a lead early
        self._recheck = False
        self._slot: float | None = None
        #: local time of the answer that gave the held ticket's slot
        self._asked: float | None = None
        #: when to ask about the held ticket again for another offset bound (see _FEW_BOUNDS)
        self._probe_at: float | None = None
        #: local receive times of the latest answers that bounded the offset
        self._bounded_at: deque[float] = deque(maxlen=_FEW_BOUNDS)
        #: whether an answer has bounded the offset since this shard began (or its clock stepped)
        self._ever_bounded = False
        self._in_flight: Job | None = None
        #: whether the call in flight is a Retime
        self._retiming = False
        self._rtt: float | None = None
        #: (local receive time, offset bound) of recent answers, each bound with its drift
        #: since added rising from front to back: the front is the tightest (see _offset)
        self._offsets: deque[tuple[float, float]] = deque()
        #: the latest turn this shard began, and how late (s) it began (see _turn)
        self._last_turn: Turn | None = None
        self._last_lateness = 0.0
        #: the latest offset read directly that agreed with the one before, for telling clock steps
        self._direct_offset: float | None = None
        #: an offset read directly that moved from it, until the next answer confirms or denies the move
        self._direct_moved: float | None = None
        #: how many clock steps this shard has noticed: answers whose local-minus-state offset
        #: jumped (see :meth:`_offset` and :meth:`_direct`); the driver reports them
        self.clock_steps = 0
        #: the latest step (s): how far the offset moved; positive when the state's clock went
        #: back against this host's (or this host's went forward)
        self.clock_step = 0.0
        #: tickets granted a start that no job began (dropped, given up, or nobody left to take
        #: it): on a queue with ``max_running`` their leases are released. The driver empties it.
        self.unused: list[int] = []

    @property
    def waiting(self) -> int:
        """How many jobs wait here for their turn."""
        return len(self._jobs)

    @property
    def rtt(self) -> float:
        """The smoothed round-trip time (s) of this shard's calls to the state (0 before the first)."""
        return self._rtt if self._rtt is not None else 0.0

    @property
    def idle(self) -> bool:
        """Whether no job waits or holds an unbegun turn, no call is in flight, and it is not paused."""
        return not self._jobs and self._granted is None and self._in_flight is None and not self._paused

    @property
    def paused(self) -> bool:
        """Whether the shard is paused."""
        return self._paused

    @property
    def ticket(self) -> int | None:
        """The ticket this shard holds, if any."""
        return self._ticket

    @property
    def lead(self) -> float:
        """How long before its slot the head reserves it (at most the protocol's ``MAX_LEAD_US``)."""
        if self._fixed_lead is not None:
            lead = self._fixed_lead
        else:
            rtt = self._rtt if self._rtt is not None else 0.0
            lead = self._jitter + 2 * rtt
        return min(lead, MAX_LEAD_US / US)

    @property
    def _retime_lead(self) -> float:
        """How far ahead a late job moves its start: its answer's way back, its wake-up, a margin.

        The job is awake and ready, so less than the lead, which also covers
        sleeping until the slot: every microsecond of it is a microsecond the
        queue stands still.
        """
        rtt = self._rtt if self._rtt is not None else 0.0
        return min(self.lead, rtt + self.early + _RETIME_MARGIN)

    @property
    def early(self) -> float:
        """How long before its start a job wakes up, to busy-wait the rest: the median recent lateness."""
        if not self._wake_lateness:
            return 0.0
        ordered = sorted(self._wake_lateness)
        return min(ordered[len(ordered) // 2], self.interval, _MAX_EARLY)

    def add(self, deadline: float | None = None, timeout: float | None = None, cost: int = 1) -> Job:
        """Queue a new job of ``cost`` at the back; ``deadline`` is local time (set from ``timeout`` s)."""
        job = Job(deadline=deadline, timeout=timeout, cost=cost)
        job.queued = True
        self._jobs.append(job)
        return job

    def cancel(self, job: Job) -> None:
        """Take ``job`` out of the queue (it timed out or was cancelled).

        The shard keeps its ticket for the next job. Cancelling a job that has
        its turn already, or has left, does nothing.
        """
        if job.queued:
            job.queued = False
            self._jobs.remove(job)

    def abandon(self, job: Job) -> None:
        """``job``'s caller is gone (it raised): cancel it, and drop its turn if granted and not begun.

        The dropped turn's slot goes unused; the next job may call at once.
        """
        self.cancel(job)
        if self._granted is job:
            self._granted = None
            if job.turn is not None:
                self.unused.append(job.turn.ticket)

    def withdraw(self, job: Job) -> None:
        """Withdraw ``job`` for good, from any point (its reservation was cancelled).

        A waiting job leaves the queue (the shard keeps its ticket for the
        next one); a granted turn not yet begun is dropped, its slot unused.
        Its driver, at its next step, stops and returns no turn (see
        :attr:`Job.withdrawn`). A job that has begun is not affected.
        """
        if job.turn is not None and self._granted is not job:
            return  # begun already
        job.withdrawn = True
        self.abandon(job)

    def ask_again(self) -> None:
        """Forget when the held ticket's slot comes: the head asks the state at its next step.

        For a record known to have changed (the queue resumed everywhere):
        the slot last answered may be a paused queue's "a second from now".
        """
        self._slot = None

    def pause(self) -> None:
        """Stop calling the state; waiting jobs keep their places."""
        self._paused = True

    def resume(self) -> None:
        """Continue after :meth:`pause`; the held ticket is tried first."""
        self._paused = False

    def step(self, job: Job, now: float) -> Step:
        """What the driver of ``job`` must do at local time ``now``."""
        if job.turn is not None:
            step = self._granted_step(job, job.turn, now)
            if step is not None:
                return step
        if not job.queued:
            raise ValueError("the job is not waiting in this shard")
        deadline = job.deadline
        busy = self._in_flight is not None or self._granted is not None
        if self._jobs[0] is not job or self._paused or busy:
            if deadline is not None and now >= deadline:
                return Expired()
            return WaitForTurn(deadline)
        # The head gets its attempt (with a lead cut to the time left) even at or past its
        # deadline, so a zero timeout takes a turn that is free now: a held ticket tried, and
        # if passed, a new one taken. It expires once its slot is known to lie beyond the
        # deadline, or after those two calls.
        if deadline is not None and now >= deadline:
            if job.late_calls >= _LATE_CALLS:
                return Expired()
            job.late_calls += 1
        lead = self.lead if deadline is None else max(0.0, min(self.lead, deadline - now))
        lead_us = round(lead * US)  # not truncated: 0.000999999 s is the 1000 us it stands for
        if self._ticket is not None and job.cost > self._ticket_cost:
            # taken for a cheaper job that has left: starting it at this cost would overlap the
            # next ticket's units, so it is dropped (it is passed, as a dead shard's ticket is)
            self._ticket = self._slot = None
        self._call_lead_us = lead_us
        if self._ticket is None:
            self._in_flight = job
            self._call_cost = job.cost
            return TakeAndTry(lead_us, job.cost)
        if self._slot is not None:
            if deadline is not None and self._slot > deadline:
                job.expected = self._slot  # when the turn would come, for a caller that asks (all_of)
                return Expired()
            wake = self._slot if self._recheck else self._slot - self.lead
            if self._asked is not None:
                wake = min(wake, self._asked + RECHECK)  # re-ask: the record may have been reset
            if self._probe_at is not None:
                wake = min(wake, self._probe_at)
            if now < wake:
                return SleepUntil(wake)
        self._in_flight = job
        self._call_cost = self._ticket_cost
        self._probe_at = None
        return TryStart(self._ticket, lead_us, self._ticket_cost)

    def _granted_step(self, job: Job, turn: Turn, now: float) -> Step | None:
        """The step of a job holding a granted turn; ``None`` once it has given the turn up."""
        if self._granted is not job:
            return Begin(turn)  # begun already (or cancelled): nothing more to decide
        if job.wake is not None:  # the driver has slept until job.wake: learn how late it woke
            self._wake_lateness.append(max(0.0, now - job.wake))
            job.wake = None
        # A start converted with a first, slow answer counts late by that answer's round-trip
        # whenever it begins: it is moved (or its conversion checked by a second answer) now,
        # rather than after sleeping until it, when the queue would have waited for nothing.
        # (A paused shard makes no call: it sleeps until the start, as a shard that could not
        # check would, and gives the turn up then unless resumed meanwhile.)
        doubted = self.max_late is not None and job.doubt > self.max_late + _RESOLUTION
        if now < turn.local_start and (not doubted or self._paused):
            wake = turn.local_start - self.early
            if job.retimes and turn.local_start - now <= _MAX_EARLY:
                # a moved start is a round-trip away and the job is awake: a sleep would risk
                # another late wake-up (and another stall of the queue), so busy-wait instead
                wake = now
            if now < wake:
                job.wake = wake
                return BeginAt(wake)
            return BeginAt(turn.local_start, spin=True)
        lateness = now - turn.local_start + job.doubt  # at worst
        on_time = not doubted and lateness <= (self.max_late or 0.0) + _RESOLUTION
        if self.max_late is None or job.begins_late or on_time:
            return self._begin(turn, now)
        # Too late: a late begin shortens the gap to the next one (G7). Move the start
        # later while it is still the latest; a paused shard makes no call, so gives up.
        if job.retimes < _MAX_RETIMES and not self._paused:
            job.retimes += 1
            self._in_flight = job
            self._retiming = True
            return Retime(turn.ticket, round(self._retime_lead * US))
        if self.burst > 1:
            return self._begin(turn, now)
        if job.retimes < _MAX_RETIMES:  # not out of moves: paused, so none was tried
            job.given_up_paused += 1
        self._give_up(job)
        return None

    def _begin(self, turn: Turn, now: float) -> Begin:
        """Begin ``turn`` at local time ``now``; remember it, and how late it began, for :meth:`_turn`."""
        self._granted = None
        self._last_turn = turn
        self._last_lateness = now - turn.local_start
        return Begin(turn)

    def _give_up(self, job: Job) -> None:
        """Return a granted job to the head of the queue, to take a new ticket."""
        if job.turn is not None:
            self.unused.append(job.turn.ticket)
        job.turn = None
        job.retimes = 0
        job.given_up += 1
        job.queued = True
        self._jobs.appendleft(job)
        self._granted = None

    def receive(
        self, job: Job, outcome: Outcome, sent: float, received: float, *, offset: float | None = None
    ) -> None:
        """Report the state's answer to the call made for ``job``.

        ``sent`` and ``received`` are the local times just before the call and
        just after its answer. ``offset`` is the local-minus-state clock offset
        if the driver could read it directly (a state on this host's clock);
        otherwise each answer bounds it.
        """
        self._finish_call(job)
        rtt = max(0.0, received - sent)
        self._rtt = rtt if self._rtt is None else self._rtt + _RTT_WEIGHT * (rtt - self._rtt)
        self._probe_at = None
        bounded = offset is None
        first = False
        if offset is None:
            offset = self._offset(received - outcome.now / US, received, rtt)
            self._bounded_at.append(received)
            first, self._ever_bounded = not self._ever_bounded, True
        elif not self.same_clock:
            self._direct(offset)
        # A start converted with the shard's first bound may truly have been up to the
        # answer's round-trip earlier (the answer may have been delayed all the way back):
        # the begin is checked as that much later, so a slow first answer has its start
        # moved (one more call) rather than shortening the gap to the next begin. Later
        # bounds are the tightest of several answers; with a burst, gaps are not promised.
        doubt = rtt if first and self.burst == 1 else 0.0
        if self._retiming:
            self._retiming = False
            if self._granted is not job or job.turn is None:
                return  # the turn was abandoned meanwhile
            if isinstance(outcome, Started):
                job.turn = self._turn(outcome, offset, sent)
                job.doubt = doubt
            elif self.burst > 1:
                job.begins_late = True
            else:
                self._give_up(job)
        elif isinstance(outcome, Started):
            self._ticket = self._slot = None
            if not self._jobs or self._jobs[0].cost > self._call_cost:
                # the job left meanwhile and nobody else waits, or the next job costs more than
                # the turn was granted for: the turn is unused
                self.unused.append(outcome.ticket)
                return
            head = self._jobs.popleft()  # the job itself, or the next one if it left meanwhile
            head.queued = False
            head.turn = self._turn(outcome, offset, sent)
            head.doubt = doubt
            self._granted = head
        elif isinstance(outcome, Wait):
            new_ticket = outcome.ticket != self._ticket
            if new_ticket:  # from TakeAndTry
                self._ticket_cost = self._call_cost
            self._ticket = outcome.ticket
            slot = _to_local(outcome.slot, outcome.now, offset, sent)
            self._slot = job.expected = slot
            self._asked = received
            # a slot within the lead asked with would have been granted, were only the rate in
            # the way: the queue is paused or full, and the slot is when to ask again
            self._recheck = outcome.slot - outcome.now <= self._call_lead_us
            few = len(self._bounded_at) < _FEW_BOUNDS or received - self._bounded_at[0] > _OFFSET_WINDOW
            wake = slot if self._recheck else slot - self.lead
            if bounded and few and new_ticket and wake - received >= _PROBE_FROM:  # once per ticket
                self._probe_at = received + (wake - received) / 2
        elif isinstance(outcome, Passed):
            self._ticket = self._slot = None
        else:  # pragma: no cover - the protocol has three answers
            raise TypeError(f"not a protocol answer: {outcome!r}")

    def _turn(self, outcome: Started, offset: float, sent: float) -> Turn:
        """The turn ``outcome`` grants, its start converted to local time with ``offset``.

        A tighter offset bound learnt since this shard's previous begun turn
        moves the conversion earlier, shortening the gap between the two
        begins of this process (seen with the first turns of a run, when the
        bound is still loose). So a turn is converted earlier than the two
        starts' gap on the state's clock allows only as far as the two begins
        stay ``interval - max_late`` apart (G7) after the previous begin's own
        lateness: a loose first bound is not kept for good. A turn granted
        but not begun (moved, given up, dropped) sets no such limit.
        """
        local = _to_local(outcome.start, outcome.now, offset, sent)
        last = self._last_turn
        if last is not None and outcome.start > last.start_us:
            gap = (outcome.start - last.start_us) / US
            room = gap - self.interval + (self.max_late or 0.0) - self._last_lateness
            local = max(local, last.local_start + gap - max(0.0, room))
        return Turn(outcome.ticket, outcome.start, local)

    def learn_clock_from(self, other: Shard, now: float) -> None:
        """Start from what ``other`` (a shard on the same state) knows of the state's clock, at local ``now``.

        A clock-offset bound holds for every queue of a state, so a shard made
        for a new queue beside a working one (a group's new key) need not
        count its first answer as a first answer: its first start is not
        doubted, and an idle acquire stays one call over a slow network. Only
        bounds of the last :data:`_OFFSET_WINDOW` seconds are taken: with none
        that recent, nothing is learnt, and the first answer is doubted as a
        lone shard's is. Called before this shard makes any call; ``other``
        may be in use by another thread (each copy is taken in one step).
        """
        if self._ever_bounded or other.same_clock != self.same_clock:
            return
        offsets = [bound for bound in list(other._offsets) if now - bound[0] <= _OFFSET_WINDOW]
        if not offsets:
            return
        self._offsets = deque(offsets)
        recent = [at for at in list(other._bounded_at) if now - at <= _OFFSET_WINDOW]
        self._bounded_at = deque(recent, maxlen=_FEW_BOUNDS)
        self._ever_bounded = True
        if self._rtt is None:
            self._rtt = other._rtt

    def _offset(self, sample: float, received: float, rtt: float) -> float:
        """The local-minus-state clock offset to convert state times with.

        Each answer bounds it from above: the state read its clock before the
        answer was received, so ``received - now`` is the true offset plus a
        delay in ``[0, rtt]``. An older bound still holds once the two clocks'
        possible drift since (:data:`_DRIFT`) is added, so the tightest of the
        last :data:`_OFFSET_WINDOW` seconds' bounds, each with its drift
        added, is used: it never converts a start to a local time before it
        happens, and one answer delayed by a busy host does not loosen it. An
        answer whose bound exceeds that by more than its round-trip means the
        state's clock stepped back: older bounds are then dropped, so that
        every shard converts with the clock as it is now.
        """
        offsets = self._offsets
        while offsets and received - offsets[0][0] > _OFFSET_WINDOW:
            offsets.popleft()
        if offsets:
            best = offsets[0][1] + _DRIFT * (received - offsets[0][0])
            if sample - best > rtt + _OFFSET_SLACK:
                offsets.clear()
                self._bounded_at.clear()  # the bounds before the step count no more
                self._ever_bounded = False
                self._stepped(sample - best)
        # a bound no tighter than this one is never the tightest again (both loosen alike)
        while offsets and offsets[-1][1] + _DRIFT * (received - offsets[-1][0]) >= sample:
            offsets.pop()
        offsets.append((received, sample))
        first_received, first = offsets[0]
        return first + _DRIFT * (received - first_received)

    def _direct(self, offset: float) -> None:
        """Look for a clock step in ``offset``, read directly (a state on this host's clock).

        The driver reads its clock, then the state's: a stall between the two
        reads (a preempted thread, a garbage collection) moves that one
        answer's offset, and the next answer's offset is back where it was.
        So a move beyond :data:`_DIRECT_STEP` counts as a step only once the
        next answer agrees with it (within the same tolerance), and then by
        how far it moved from the offset before it.
        """
        known, moved = self._direct_offset, self._direct_moved
        if known is None or abs(offset - known) <= _DIRECT_STEP:
            self._direct_offset, self._direct_moved = offset, None
        elif moved is not None and abs(offset - moved) <= _DIRECT_STEP:
            self._stepped(offset - known)
            self._direct_offset, self._direct_moved = offset, None
        else:
            self._direct_moved = offset  # confirmed, or denied, by the next answer

    def _stepped(self, by: float) -> None:
        """Count a clock step that moved the offset by ``by`` seconds."""
        self.clock_steps += 1
        self.clock_step = by

    def failed(self, job: Job) -> None:
        """Report that the call made for ``job`` raised or was abandoned.

        Its answer is unknown: a ticket it may have taken is lost (costing the
        others at most one interval), and the held ticket is kept. A failed
        :class:`Retime` leaves the turn as it was (the next step retries it or gives it up).
        """
        self._finish_call(job)
        self._retiming = False

    def _finish_call(self, job: Job) -> None:
        if self._in_flight is not job:
            raise ValueError("no call is in flight for this job")
        self._in_flight = None


def _to_local(state_time: int, state_now: int, offset: float, sent: float) -> float:
    """``state_time`` (us) as local time: with ``offset``, but never sooner than the answer allows.

    The state read its clock (``state_now``) after the call was ``sent``, so
    ``state_time`` is at least ``state_time - state_now`` after ``sent``; this
    also keeps float rounding of a large state time from making it sooner.
    """
    return max(state_time / US + offset, sent + (state_time - state_now) / US)
