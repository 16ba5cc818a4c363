"""The shard: one process's line of callers waiting for their turns, free of I/O.

A :class:`Shard` decides, for each :class:`Place` in its line, what its
driver does next (docs/design.md, "A shard"): wait for its turn in the line,
carry out an :class:`~ratequeue.core.operation.Operation` on the state
(take and try a ticket, try the held one, re-time a late start), sleep until
a slot comes near or until a started turn's start, and begin -- or, woken too late
to begin on time, move its start later or give the turn up (G7). It never
calls the state, reads a clock or sleeps itself: the drivers do, and report
the answers back. The property tests drive it with fake clocks.

Only the head of the line talks to the state, and the shard holds at most
one ticket and one started turn not yet begun, so a shard that dies wastes
at most one slot (G4). The ticket belongs to the shard, not to a place:
when the head gives up (timeout, cancel) the next place inherits it, and a
turn started for a place that has just left goes to the next one.

Local times are seconds on the driver's clock (``time.monotonic``); the
state's answers carry state-clock times in microseconds, converted with the
:class:`~ratequeue.core.clock.OffsetEstimator`.
"""

from __future__ import annotations

import math
import secrets
from collections import deque
from typing import NamedTuple, Union

from .clock import OffsetEstimator
from .fair_order import FairOrder
from .leases import Held
from .operation import Operation, Terms
from .protocol import FULL_GRACE_US, MAX_DOUBT_US, MAX_LEAD_US, MAX_US, US, Answer, Passed, Started, Wait

__all__ = [
    "DEFAULT_JITTER",
    "DEFAULT_MAX_LATE",
    "DOUBT_FREE",
    "RECHECK",
    "Begin",
    "BeginAt",
    "Expired",
    "Place",
    "Shard",
    "SleepUntil",
    "Step",
    "Turn",
    "WaitForTurn",
]

#: wake-up lateness allowed for when reserving a slot early (adaptive lead)
DEFAULT_JITTER = 0.002

#: how late (s) a job may begin after its start (G7's epsilon)
DEFAULT_MAX_LATE = 0.0003

#: how far apart (s) the bounds of a shard's clock offset may be before its starts move the next
#: ones by the excess (:meth:`Shard._doubt_us`): with ``max_late``, a begin gap may be this much
#: shorter than the interval (0.5 ms by default)
DOUBT_FREE = 0.0002

#: the longest (s) a head sleeps toward its slot without asking again: a reset record is noticed
#: within this (its next try answers Passed); a shard with no callers still makes no call (G5)
RECHECK = 1.0

#: the lateness check is on for intervals of at least this many ``max_late``: below, giving turns
#: up for a busy host's wake-up jitter would cost more rate than the check is worth
_CHECKED_FROM = 4
#: how many times a turn's start may be moved later before the turn is given up
_MAX_RETIMES = 2
#: the protocol's resolution (s): lateness within it is rounding, not late
_RESOLUTION = 1e-6
#: how many recent wake-up latenesses the early wake-up is the median of, and its cap (s)
_WAKE_SAMPLES = 9
_MAX_EARLY = 0.002
#: how many calls a head may make once its deadline has passed
_LATE_CALLS = 2
#: a new ticket told to wait while few answers bound the offset asks once more, halfway to its
#: wake-up, if that is at least this far (s) away: one more bound before its start is converted
_PROBE_FROM = 0.004
#: a shard on a state that :attr:`~ratequeue.state.StateBase.reads_clock` reads it while it sleeps
#: at least this long (s) beside the round-trip, and at most this often (s), if its offset's
#: bounds lie further apart than the clock's grain and :data:`DOUBT_FREE`
_CLOCK_READ_FROM = 0.004
_CLOCK_READ_EVERY = 0.025
#: the round-trip (s) of a read of the clock deemed slow: a slower one does not stop the next
_CLOCK_READ_RTT = 0.001
#: how many recent started answers the allowance for late answers looks back over
_LATE_ANSWERS = 9
#: weight of the newest round-trip in the smoothed round-trip time
_RTT_WEIGHT = 0.25


class Turn(NamedTuple):
    """A caller's turn: a ticket that started, and when, on the state's clock and on this host's."""

    #: the ticket that started
    ticket: int
    #: when the job starts, on the state's clock, in microseconds
    start_us: int
    #: the same instant on this process's clock, in seconds
    local_start: float
    #: the number this turn's shard gave its ticket (0 without ``max_running`` or
    #: ``tenant_max_running``): releasing the turn names it, so a turn releases its own places only
    token: int = 0
    #: the cost its ticket was taken for (the estimate a settlement corrects, ``Limiter.settle``)
    cost: int = 1

    @property
    def start(self) -> float:
        """When the job starts, on the state's clock, in seconds."""
        return self.start_us / US


class Place:
    """One caller's place in a shard's line, until its turn begins.

    (A plain class whose rarely-set fields default on the class: a place is
    made on every acquire, and only three of its fields are set then.)
    """

    #: the started turn, once there is one
    turn: Turn | None = None
    #: whether the place is in its shard's line
    queued = True
    #: a caller that will not wait (``try_acquire``): a new ticket is taken for it only if it
    #: starts at once (``try_take``), so that a try without a turn leaves no ticket behind
    attempt = False
    #: calls made at or after the deadline; moves of the started turn's start
    late_calls = 0
    retimes = 0
    #: turns given up for late wake-ups; those of them given up because the shard was paused
    given_up = 0
    given_up_paused = 0
    #: set when a late turn of a bursty queue could not be moved: it begins late
    begins_late = False
    #: local time the driver was told to wake at before the start, while it sleeps
    wake: float | None = None
    #: set when the place was withdrawn (its reservation cancelled): its driver stops, turnless
    withdrawn = False
    #: the local time of the slot the state last told this place to wait for
    expected: float | None = None
    #: how much earlier (s) than ``turn.local_start`` the start may truly have been: the
    #: round-trip of the answer that started it, when that was the first offset bound; else 0
    doubt = 0.0
    #: how much later (s) than ``max_late`` the started turn may begin: what its start moved the
    #: next one by for answers that come after their start (:meth:`Shard._allowance_us`)
    allowance = 0.0
    #: set on the turn that rejoins a state that was down (``ratequeue.fallback``): from the state only
    rejoin = False
    #: a fair queue's tenant of the caller, its weight, and its place in the shard's fair order
    tenant = ""
    weight = 1
    tag = 0.0

    def __init__(self, deadline: float | None = None, timeout: float | None = None, cost: int = 1) -> None:
        #: local time by which the turn must have begun, or ``None``; the timeout (s) it came from
        self.deadline, self.timeout = deadline, timeout
        #: how many units of the rate the caller uses (1 to the burst)
        self.cost = cost


class WaitForTurn(NamedTuple):
    """Not this place's turn to act: wait until the shard changes, or until ``deadline``."""

    deadline: float | None


class SleepUntil(NamedTuple):
    """Sleep until local time ``until`` (or a change of the shard), then ask again."""

    until: float


class BeginAt(NamedTuple):
    """The turn has started: wait until local time ``until`` (busy-wait if ``spin``), then ask again."""

    until: float
    spin: bool = False


class Begin(NamedTuple):
    """Begin now: the turn has come, at most ``max_late`` late."""

    turn: Turn


class Expired(NamedTuple):
    """The deadline passes before the turn can come: give up."""


#: what :meth:`Shard.step` tells a driver to do
Step = Union[WaitForTurn, SleepUntil, Operation, BeginAt, Begin, Expired]


class Shard:
    """The scheduling logic of one process's share of a queue."""

    def __init__(
        self,
        name: str,
        terms: Terms,
        *,
        lead: float | None = None,
        jitter: float = DEFAULT_JITTER,
        max_late: float | None = DEFAULT_MAX_LATE,
        estimator: OffsetEstimator | None = None,
        doubting: bool = True,
        margin: float | None = None,
        tokens: bool = False,
    ) -> None:
        """
        :param name: the queue's name, and ``terms`` its terms: the operations carry them.
        :param lead: how long before its slot the head may reserve it; ``None`` adapts it
            to twice the smoothed round-trip time plus ``jitter``.
        :param max_late: how late (s) after its start a turn may still begin; a later
            wake-up moves the start (or gives the turn up). ``None``, or an interval under
            four times this, turns the check off. With a burst, a late turn whose start
            cannot be moved is begun late rather than given up (giving it up would churn
            every burst after an idle spell).
        :param estimator: converts the state's clock to this host's (a new one by default).
        :param doubting: whether a start moves the next by this shard's doubt of the state's
            clock (:meth:`_doubt_us`); off where begins need not be spaced (``max_late=None``).
        :param margin: how much (s) each start moves the next beyond the interval, so that
            begins up to ``max_late`` late still come an interval apart (docs/design.md, "The
            margin"). ``None``: the lateness checked (``max_late``, once the rules below
            have applied), none with a burst, whose begins are not spaced.
        :param tokens: whether tickets get tokens without ``max_running`` as well: a turn's
            ``(ticket, token)`` then names it across records (tenants' caps map turns so).
        """
        self.name, self.terms = name, terms
        self._tokens = tokens or bool(terms.max_running)
        self.interval = interval = terms.interval_us / US
        self.burst = terms.burst
        self._fixed_lead, self._jitter = lead, jitter
        self.max_late = max_late if max_late is not None and interval >= _CHECKED_FROM * max_late else None
        self.estimator = estimator or OffsetEstimator()
        #: whether starts carry a doubt (never with a burst, whose begins are not spaced)
        self.doubting = doubting and terms.burst == 1
        if margin is None:
            margin = (self.max_late or 0.0) if terms.burst == 1 else 0.0
        #: how much (us) each start moves the next beyond the interval
        self.margin_us = min(round(margin * US), MAX_DOUBT_US)
        self._margin = self.margin_us / US
        self._line: deque[Place] = deque()
        #: the place holding a started turn not yet begun
        self._holder: Place | None = None
        self._in_flight: Place | None = None
        self._retiming = False
        self._paused = False
        #: how late recent sleeps before a begin woke up (s)
        self._wake_lateness: deque[float] = deque(maxlen=_WAKE_SAMPLES)
        #: how long (s) after their converted start recent starting answers came (0: before it)
        self._late_answers: deque[float] = deque(maxlen=_LATE_ANSWERS)
        #: whether each of the recent retimes failed (the turn was not the latest start any more)
        self._retimes_failed: deque[bool] = deque(maxlen=_LATE_ANSWERS)
        #: the late-answer allowance (us) the call in flight carries in its doubt
        self._call_allowance_us = 0
        #: the width of the offset's bounds (s) the call in flight's doubt allowed for
        self._call_width = 0.0
        #: the ticket held, the cost it was taken for, the local time of its slot if known, and
        #: whether that slot is a time to ask again (a paused or full record's answer) rather than a start
        self._ticket: int | None = None
        self._ticket_cost = 1
        #: a fair queue's tenant the held ticket was taken for, and the tenant of a take in flight
        self._ticket_tenant = self._call_tenant = ""
        #: a fair queue's local order: start-time fair queuing over this shard's callers
        self._fair_order = FairOrder()
        self._slot: float | None = None
        self._recheck = self._full = False
        #: local time of the answer that gave the slot; when to ask again for another offset bound
        self._asked: float | None = None
        self._probe_at: float | None = None
        #: local time this shard last read the state's clock (:meth:`wants_clock`)
        self._clock_read_at = -math.inf
        #: the round-trip (s) of the latest read of the state's clock
        self._clock_read_rtt = 0.0
        #: the cost and lead (us) of the call in flight
        self._call_cost = 1
        self._call_lead_us = 0
        self._new_rtt(None)
        #: the latest turn begun here, and how late (s) it began (see :meth:`_turn`)
        self._last_turn: Turn | None = None
        self._last_lateness = 0.0
        #: the held ticket's token, and the token the next ticket is taken with: a new one once a
        #: take is answered, the same one again after a take whose answer was lost (its retry is
        #: then answered with the start the lost one made, if it made one)
        self._token = 0
        self._next_token = self._new_token()
        self._taking = False
        #: the call in flight is a try_take (:attr:`Place.attempt`): unless it starts, no ticket comes of it
        self._trying = False
        #: tickets started that no caller began (dropped, given up, nobody left), with their
        #: tokens: on a record with ``max_running`` their leases are released. The driver empties it.
        self.unused: list[Held] = []

    def _new_token(self) -> int:
        """A fresh token for a ticket (0 without ``max_running`` or ``tokens``: only they need one)."""
        return 1 + secrets.randbelow(MAX_US - 1) if self._tokens else 0

    @property
    def waiting(self) -> int:
        """How many callers wait here for their turn."""
        return len(self._line)

    @property
    def rtt(self) -> float:
        """The smoothed round-trip time (s) of this shard's calls to the state (0 before the first)."""
        return self._rtt if self._rtt is not None else 0.0

    @property
    def idle(self) -> bool:
        """Whether nobody waits or holds an unbegun turn, no call is in flight, and it is not paused."""
        return not self._line and self._holder is None and self._in_flight is None and not self._paused

    @property
    def full(self) -> bool:
        """Whether the held ticket may wait for a place: told to wait at most ``FULL_GRACE_US``, with a cap.

        A full record answers so, and so does one whose earlier tickets wait
        for places (a wait for a slot as near looks the same).

        A place freed in another process reaches it only when it asks again
        (within :data:`~ratequeue.core.protocol.FULL_RECHECK_US`), unless the
        state tells of freed places (:meth:`ratequeue.state.State.watch`).
        """
        return self._full and self._slot is not None and bool(self._line)

    @property
    def paused(self) -> bool:
        """Whether the shard is paused."""
        return self._paused

    @property
    def ticket(self) -> int | None:
        """The ticket this shard holds, if any."""
        return self._ticket

    @property
    def holding(self) -> bool:
        """Whether a started turn waits here for its begin."""
        return self._holder is not None

    def _new_rtt(self, rtt: float | None) -> None:
        """Take ``rtt`` as the smoothed round-trip time, and the :attr:`lead` that follows from it."""
        self._rtt = rtt
        lead = self._fixed_lead if self._fixed_lead is not None else self._jitter + 2 * (rtt or 0.0)
        #: how long before its slot the head reserves it (at most ``MAX_LEAD_US``)
        self.lead = min(lead, MAX_LEAD_US / US)

    def wants_clock(self, now: float, until: float) -> bool:
        """Whether to read the state's clock now, before sleeping until ``until``: its bounds are loose.

        Loose bounds convert starts late and move the next start by as much
        (the doubt); a read of the clock alone (a MongoDB ``hello``) is answered
        at once and bounds the offset from above as tightly as its round-trip,
        where an operation's answer comes after its work. Only for a
        :attr:`doubting` shard with time to spare, at most every
        :data:`_CLOCK_READ_EVERY`.
        """
        if not self.doubting or now - self._clock_read_at < _CLOCK_READ_EVERY:
            return False
        if until - now < _CLOCK_READ_FROM + (self._rtt or 0.0):
            return False
        # (at best, a read bounds the offset within the clock's grain and the read's round-trip)
        best = self.estimator.resolution + min(self._clock_read_rtt, _CLOCK_READ_RTT)
        return self.estimator.width(now) > best + DOUBT_FREE

    def clock_read(self, sent: float, received: float, state_now_us: int | None) -> None:
        """Take the state clock's ``state_now_us``, read by a call sent at ``sent``, answered at ``received``.

        ``None``: the read failed (it is not tried again for :data:`_CLOCK_READ_EVERY`).
        """
        self._clock_read_at = received
        if state_now_us is not None:
            self._clock_read_rtt = rtt = max(0.0, received - sent)
            self.estimator.bound(received, state_now_us / US, rtt)

    @property
    def retime_lead(self) -> float:
        """How far ahead a late turn's start is moved: its answer's way back and a wake-up.

        The caller is awake: less than the lead, which also covers sleeping
        until the slot (every microsecond of it the queue stands still). No
        margin beyond: a begin is allowed ``max_late`` after the moved start,
        and one later still is moved again. (A 0.5 ms margin cost each move
        that much, and spared no second move beside two busy loops.)
        """
        return min(self.lead, self.rtt + self.early)

    @property
    def early(self) -> float:
        """How long before its start a caller wakes, to busy-wait the rest: the median recent lateness."""
        if not self._wake_lateness:
            return 0.0
        ordered = sorted(self._wake_lateness)
        return min(ordered[len(ordered) // 2], self.interval, _MAX_EARLY)

    def add(
        self,
        deadline: float | None = None,
        timeout: float | None = None,
        cost: int = 1,
        tenant: str = "",
        weight: int = 1,
    ) -> Place:
        """A new place of ``cost`` at the back of the line; ``deadline``: local time (from ``timeout`` s).

        On a fair queue the back of ``tenant``'s share of the line: places
        are ordered by start-time fair queuing over their tenants (a
        tenant's ``k``-th place waiting here comes after the others'
        ``k * weight / their weight``-th), first come first served inside
        a tenant, and never before the head, which may hold the ticket.
        """
        place = Place(deadline, timeout, cost)
        line = self._line
        if not self.terms.fair:
            line.append(place)
            return place
        place.tenant, place.weight = tenant, weight
        place.tag = tag = self._fair_order.tag(tenant, weight, len(line))
        index = len(line)
        while index > 1 and line[index - 1].tag > tag:
            index -= 1
        line.insert(index, place)
        return place

    def cancel(self, place: Place) -> None:
        """Take ``place`` out of the line (it timed out or was cancelled); the ticket stays with the shard."""
        if place.queued:
            place.queued = False
            self._line.remove(place)

    def abandon(self, place: Place) -> None:
        """``place``'s caller is gone (it raised): cancel it, and drop its turn if started and not begun."""
        self.cancel(place)
        if self._holder is place:
            self._holder = None
            if place.turn is not None:
                self.unused.append((place.turn.ticket, place.turn.token))

    def withdraw(self, place: Place) -> None:
        """Withdraw ``place`` for good (its reservation was cancelled), unless its turn has begun.

        Its driver, at its next step, stops and returns no turn.
        """
        if place.turn is not None and self._holder is not place:
            return  # begun already
        place.withdrawn = True
        self.abandon(place)

    def ask_again(self) -> None:
        """Forget when the held ticket's slot comes (the record changed): the head asks at its next step."""
        self._slot = None

    def pause(self) -> None:
        """Stop calling the state; the places keep their order."""
        self._paused = True

    def resume(self) -> None:
        """Continue after :meth:`pause`; the held ticket is tried first."""
        self._paused = False

    def step(self, place: Place, now: float) -> Step:
        """What the driver of ``place`` must do at local time ``now``."""
        turn = place.turn
        if turn is not None:
            begun = self._started_step(place, turn, now)
            if begun is not None:
                return begun
        if not place.queued:
            raise ValueError("the place is not in this shard's line")
        deadline = place.deadline
        if (
            self._line[0] is not place
            or self._paused
            or self._in_flight is not None
            or self._holder is not None
        ):
            if deadline is not None and now >= deadline:
                return Expired()
            return WaitForTurn(deadline)
        # The head gets its attempt (with a lead cut to the time left) even at or past its
        # deadline, so a zero timeout takes a turn that is free now; it expires once its slot is
        # known to lie beyond the deadline, or after _LATE_CALLS calls.
        lead = self.lead
        if deadline is not None:
            if now >= deadline:
                if place.late_calls >= _LATE_CALLS:
                    return Expired()
                place.late_calls += 1
            lead = max(0.0, min(lead, deadline - now))
        lead_us = round(lead * US)  # 0.000999999 s is the 1000 us it stands for
        if self._ticket is not None and (
            place.cost > self._ticket_cost or (place.tenant != self._ticket_tenant and self.terms.fair)
        ):
            # taken for a cheaper caller (or another tenant's) that has left: started at this cost
            # it would overlap the next ticket's units (or count against another tenant), so it is
            # dropped (passed, as a dead shard's ticket is)
            self._ticket = self._slot = None
        self._call_lead_us = lead_us
        if self._ticket is None:
            self._in_flight = place
            self._call_cost = place.cost
            self._call_tenant = place.tenant
            self._taking = True
            self._trying = place.attempt
            # (tuple.__new__: every field, without the NamedTuple's __new__, a Python function)
            return tuple.__new__(
                Operation,
                (
                    "try_take" if place.attempt else "take_and_try",
                    self.name,
                    self.terms,
                    0,
                    lead_us,
                    place.cost,
                    False,
                    self._next_token,
                    self._call_move_us(now) if self.doubting else self.margin_us,
                    place.tenant,
                    place.weight,
                ),
            )
        if self._slot is not None:
            if deadline is not None and self._slot > deadline:
                place.expected = self._slot  # when the turn would come, for a caller that asks (all_of)
                return Expired()
            wake = self._slot if self._recheck else self._slot - self.lead
            if self._asked is not None:
                wake = min(wake, self._asked + RECHECK)  # ask again: the record may have been reset
            if self._probe_at is not None:
                wake = min(wake, self._probe_at)
            if now < wake:
                return SleepUntil(wake)
        self._in_flight = place
        self._call_cost = self._ticket_cost
        self._probe_at = None
        return tuple.__new__(
            Operation,
            (
                "try_start",
                self.name,
                self.terms,
                self._ticket,
                lead_us,
                self._ticket_cost,
                False,
                self._token,
                self._call_move_us(now) if self.doubting else self.margin_us,
                "",
                1,
            ),
        )

    def _call_move_us(self, now: float) -> int:
        """How much (us) a start asked now moves the next one; notes the allowance it carries.

        Its doubt and margin (:meth:`_doubt_us`), plus the late-answer
        allowance (:meth:`_allowance_us`), which :meth:`_answered` reads back
        as the started place's. Only the :attr:`margin_us` where not :attr:`doubting`.
        """
        if not self.doubting:
            return self.margin_us
        # as wide as the bounds will be when the answer comes, should the tightest age out meanwhile
        self._call_width = width = self.estimator.width(now, kept_until=now + 2 * self.rtt)
        doubt = self._doubt_us(width)
        self._call_allowance_us = min(self._allowance_us(), MAX_DOUBT_US - doubt)
        return doubt + self._call_allowance_us

    def _doubt_us(self, width: float) -> int:
        """How much (us) a start moves the next one, for this shard's doubt of the state's clock.

        Its begin may come as much later than its start as the offset's
        bounds are apart (``width``, :meth:`OffsetEstimator.width` when the
        answer comes); past
        :data:`DOUBT_FREE`, the next start waits that much longer, so that
        the next begin, in any process, comes an interval after this one
        (G7, docs/design.md "Doubt"); plus the :attr:`margin_us` every start
        adds. A :attr:`doubting` shard's only (there is no doubt with a
        burst, whose begins are not spaced).
        """
        excess = width - DOUBT_FREE
        return self.margin_us if excess <= 0 else min(round(excess * US) + self.margin_us, MAX_DOUBT_US)

    def _allowance_us(self) -> int:
        """How much later (us) than ``max_late`` recent starting answers came after their start.

        A start made as the call arrives (its slot had come) is answered a
        return trip later: on a slow state (MongoDB) later than ``max_late``.
        Moving the start is then no help where leads exceed the interval (the
        next ticket has started already), and giving turns up feeds itself
        (each freed slot is started as the next call arrives). So a start
        also moves the next one by as much as recent answers came late, and
        its turn may begin that much later (G7 holds: ``Place.allowance``).
        0 where answers come before their starts; 0 too while none of the
        last 9 retimes failed and the round-trip is under a quarter of the
        interval: where a late turn's start can still be moved (a fast
        state), it is moved once rather than every start moving the next.
        """
        if not self._late_answers or self.max_late is None:
            return 0
        if not any(self._retimes_failed) and 4 * (self._rtt or 0.0) < self.interval:
            return 0
        late = max(self._late_answers) - self.max_late
        return round(late * US) if late > _RESOLUTION else 0

    def _answered(self, place: Place, turn: Turn, received: float) -> None:
        """Note how late after ``turn``'s start its answer came, and the allowance its start carried."""
        place.allowance = self._call_allowance_us / US
        if self.doubting:
            late = received - turn.local_start
            self._late_answers.append(late if late > 0.0 else 0.0)

    def _started_step(self, place: Place, turn: Turn, now: float) -> Step | None:
        """The step of a place holding a started turn; ``None`` once it has given the turn up."""
        if self._holder is not place:
            return Begin(turn)  # begun already (or cancelled): nothing more to decide
        if place.wake is not None:  # the driver slept until place.wake: learn how late it woke
            self._wake_lateness.append(max(0.0, now - place.wake))
            place.wake = None
        # A start converted with a first, slow answer counts late by that answer's round-trip
        # whenever it begins: it is moved now rather than after sleeping until it. (A paused
        # shard makes no call: it sleeps until the start, and gives the turn up then.)
        doubted = self.max_late is not None and place.doubt > self.max_late + _RESOLUTION
        if now < turn.local_start and (not doubted or self._paused):
            wake = turn.local_start - self.early
            if place.retimes and turn.local_start - now <= _MAX_EARLY:
                wake = now  # a moved start, a round-trip away: busy-wait rather than risk a late wake
            if now < wake:
                place.wake = wake
                return BeginAt(wake)
            return BeginAt(turn.local_start, spin=True)
        lateness = now - turn.local_start + place.doubt  # at worst
        if (
            self.max_late is None
            or place.begins_late
            or (not doubted and lateness <= self.max_late + place.allowance + _RESOLUTION)
        ):
            return self._begin(turn, now)
        # Too late: a late begin shortens the gap to the next one (G7). Move the start later
        # while it is still the latest; a paused shard makes no call, so it gives up.
        if place.retimes < _MAX_RETIMES and not self._paused:
            place.retimes += 1
            self._in_flight = place
            self._retiming = True
            return Operation(
                "retime",
                self.name,
                self.terms,
                turn.ticket,
                round(self.retime_lead * US),
                doubt_us=self._call_move_us(now),
            )
        if self.burst > 1:
            return self._begin(turn, now)
        if place.retimes < _MAX_RETIMES:  # not out of moves: paused, so none was tried
            place.given_up_paused += 1
        self._give_up(place)
        return None

    def _begin(self, turn: Turn, now: float) -> Begin:
        """Begin ``turn`` at local time ``now``; remember it, and how late it began, for :meth:`_turn`."""
        self._holder = None
        self._last_turn = turn
        self._last_lateness = now - turn.local_start
        return Begin(turn)

    def _give_up(self, place: Place) -> None:
        """Put a place whose turn started back at the head of the line, to take a new ticket."""
        if place.turn is not None:
            self.unused.append((place.turn.ticket, place.turn.token))
        place.turn = None
        place.retimes = 0
        place.given_up += 1
        place.queued = True
        self._line.appendleft(place)
        self._holder = None

    def receive(
        self, place: Place, answer: Answer, sent: float, received: float, *, offset: float | None = None
    ) -> None:
        """Report the state's answer to the operation carried out for ``place``.

        ``sent`` and ``received`` are the local times just before the call
        and just after its answer. ``offset`` is the local-minus-state clock
        offset if the driver read it directly (a state on this host's
        clock); otherwise the answer bounds it (:class:`OffsetEstimator`).
        """
        if not isinstance(answer, (Started, Wait, Passed)):
            raise TypeError(f"not an answer the shard asked for: {answer!r}")
        if self._in_flight is not place:
            raise ValueError("no call is in flight for this place")
        self._in_flight = None
        trying, self._trying = self._trying, False
        if self._taking:  # a take was answered: its token is the ticket's, and the next take gets a new one
            self._taking = False
            self._token, self._next_token = self._next_token, self._new_token()
        rtt = received - sent if received > sent else 0.0
        smoothed = self._rtt
        self._new_rtt(rtt if smoothed is None else smoothed + _RTT_WEIGHT * (rtt - smoothed))
        self._probe_at = None
        bounded = offset is None
        first = False
        if offset is None:
            offset, first = self.estimator.bound(received, answer.now / US, rtt)
        elif not self.estimator.same_clock:  # (a state on this process's own clock never steps)
            self.estimator.direct(offset)
        # A start converted with the first bound may truly have been up to the answer's
        # round-trip earlier: the begin is checked as that much later (with a burst, gaps are not
        # promised). Later bounds are the tightest of several answers.
        doubt = rtt if first and self.burst == 1 else 0.0
        if self.doubting and not first and self._call_width > 0.0:
            # The bounds may have loosened since the call carried its doubt (the tightest ones
            # aged out of the window while it was in flight, on a slow state under load): the
            # start is converted later than the doubt moved the next one, by up to the growth.
            grown = self.estimator.width(received) - max(self._call_width, DOUBT_FREE)
            doubt = grown if grown > doubt else doubt
        if self._retiming:
            self._retiming = False
            if self._holder is not place or place.turn is None:
                return  # the turn was abandoned meanwhile
            self._retimes_failed.append(not isinstance(answer, Started))
            if isinstance(answer, Started):
                place.turn = self._turn(answer, offset, sent, place.turn.token, place.turn.cost)
                place.doubt = doubt
                self._answered(place, place.turn, received)
            elif self.burst > 1:
                place.begins_late = True
            else:
                self._give_up(place)
        elif isinstance(answer, Started):
            self._ticket = self._slot = None
            line = self._line
            if not line or line[0].cost > self._call_cost:
                # the caller left and nobody else waits, or the next one costs more than the turn
                self.unused.append((answer.ticket, self._token))
                return
            head = line.popleft()  # the caller itself, or the next one if it left meanwhile
            head.queued = False
            if head.tag:
                self._fair_order.serve(head.tag)
            head.turn = self._turn(answer, offset, sent, self._token, self._call_cost)
            head.doubt = doubt
            self._answered(head, head.turn, received)
            self._holder = head
        elif trying:  # a try_take that did not start took no ticket: the try is over
            if isinstance(answer, Wait):
                place.expected = _to_local(answer.slot, answer.now, offset, sent)
            place.late_calls = _LATE_CALLS
        elif isinstance(answer, Wait):
            new_ticket = answer.ticket != self._ticket
            if new_ticket:  # from take_and_try
                self._ticket_cost = self._call_cost
                self._ticket_tenant = self._call_tenant
            self._ticket = answer.ticket
            slot = _to_local(answer.slot, answer.now, offset, sent)
            self._slot = place.expected = slot
            self._asked = received
            # a slot within the lead asked with would have started, were only the rate in the
            # way: the record is paused or full, and the slot is when to ask again
            self._recheck = answer.slot - answer.now <= self._call_lead_us
            # On a capped queue, a wait of at most FULL_GRACE_US may be for a place: the record is
            # full (a wait of FULL_RECHECK_US at most), or tickets before this one wait for places
            # (FULL_GRACE_US after it was last found full). A paused record's is a second or more;
            # a wait for a slot as near looks the same, and is watched too.
            self._full = bool(self.terms.max_running) and answer.slot - answer.now <= FULL_GRACE_US
            wake = slot if self._recheck else slot - self.lead
            if bounded and new_ticket and wake - received >= _PROBE_FROM and self.estimator.few(received):
                self._probe_at = received + (wake - received) / 2  # once per ticket
        else:
            self._ticket = self._slot = None

    def _turn(self, started: Started, offset: float, sent: float, token: int, cost: int) -> Turn:
        """The turn ``started`` gives, its start converted to local time with ``offset``.

        A tighter offset bound learnt since this shard's previous begun turn
        would convert it earlier than the two starts' gap allows: it is kept
        no earlier than ``interval + margin - max_late`` after the previous
        begin (after that begin's own lateness), so that the two begins of
        this process keep G7, and a loose first bound is not kept for good.
        """
        local = _to_local(started.start, started.now, offset, sent)
        last = self._last_turn
        if last is not None and started.start > last.start_us:
            gap = (started.start - last.start_us) / US
            room = gap - self.interval - self._margin + (self.max_late or 0.0) - self._last_lateness
            local = max(local, last.local_start + gap - max(0.0, room))
        return tuple.__new__(Turn, (started.ticket, started.start, local, token, cost))

    def convert(
        self,
        started: Started,
        sent: float,
        received: float,
        *,
        offset: float | None = None,
        token: int = 0,
        cost: int = 1,
    ) -> Turn:
        """The turn ``started`` gives (with ``token``), converted to local time as :meth:`receive` would.

        For a start moved outside the line (``all_of``); the answer bounds the offset too.
        """
        if offset is None:
            offset, _ = self.estimator.bound(received, started.now / US, max(0.0, received - sent))
        else:
            self.estimator.direct(offset)
        local = _to_local(started.start, started.now, offset, sent)
        return Turn(started.ticket, started.start, local, token, cost)

    def learn_clock(self, other: Shard, now: float) -> None:
        """Start from what ``other``, a shard of the same state, knows of its clock (a group's new key)."""
        self.estimator.learn_from(other.estimator, now)
        if self._rtt is None:
            self._new_rtt(other._rtt)

    def failed(self, place: Place, *, answered_elsewhere: bool = False) -> None:
        """Report that the call made for ``place`` raised or was abandoned.

        Its answer is unknown: a ticket it may have taken is lost (costing
        the others at most one interval), and the held ticket is kept, with
        its token, as is a take's token: retried, the call is answered with
        the start the lost one made, if it made one. With
        ``answered_elsewhere`` (an asyncio call cancelled on its way, whose
        answer gives its start's lease back) the call's ticket or token is
        dropped instead. A failed re-time leaves the turn as it was.
        """
        self._finish_call(place)
        self._trying = False
        if answered_elsewhere and not self._retiming:
            if self._taking:
                self._next_token = self._new_token()
            else:
                self._ticket = self._slot = None
        self._retiming = self._taking = False

    def _finish_call(self, place: Place) -> None:
        if self._in_flight is not place:
            raise ValueError("no call is in flight for this place")
        self._in_flight = None


def _to_local(state_time: int, state_now: int, offset: float, sent: float) -> float:
    """``state_time`` (us) as local time: with ``offset``, but never sooner than the answer allows.

    The state read its clock (``state_now``) after the call was ``sent``, so
    ``state_time`` is at least ``state_time - state_now`` after ``sent``.
    """
    return max(state_time / US + offset, sent + (state_time - state_now) / US)
