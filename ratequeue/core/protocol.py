"""The ticket protocol: the shared record and the operations on it, as pure functions.

This module is the reference every state is held to (docs/design.md, "The
protocol"). Each operation takes a :class:`Record` and the state clock's
``now`` and returns the new record with the answer; a state runs the same
steps atomically, reading ``now`` from its own clock.
:func:`ratequeue.core.operation.apply` carries out any operation with them.

Times and intervals are whole **microseconds**: integer arithmetic keeps
every start at least an interval after the one before (G1) without a
rounding error, and gives Python, Lua, SQL and MongoDB the same answers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Union

__all__ = [
    "FULL_GRACE_US",
    "FULL_RECHECK_US",
    "MAX_BURST",
    "MAX_DOUBT_US",
    "MAX_HOLD_US",
    "MAX_LEASE_US",
    "MAX_LEAD_US",
    "MAX_RUNNING",
    "MAX_SLOW",
    "MAX_US",
    "NEVER",
    "PAUSED_RECHECK_US",
    "RECOVER_US",
    "US",
    "Answer",
    "Lease",
    "Micros",
    "Outcome",
    "Passed",
    "Record",
    "Started",
    "Taken",
    "Unwritten",
    "Wait",
    "Waiter",
    "check",
    "enqueue",
    "enqueue_and_try",
    "expires",
    "effective_interval",
    "hold",
    "lift",
    "live_leases",
    "new_record",
    "release",
    "renew",
    "repeats_start",
    "retime",
    "set_paused",
    "settle",
    "slow",
    "take",
    "take_and_try",
    "try_start",
    "try_turn",
    "waiting_tenants",
]

#: a time or a duration in whole microseconds (a name ending in ``_us`` says so where seconds are near)
Micros = int

#: microseconds per second
US = 1_000_000

#: times, intervals and tickets stay below this (2**52, about 142 years in us): every one is exact
#: in a double (Lua) and in an int64 (MongoDB, PostgreSQL)
MAX_US = 2**52

#: the ``at`` of a record that has never started a job: so far in the past that every slot is free
NEVER = -(2**52)

#: the largest lead a shard asks for (an hour): every start lies at most this far past the ``now``
#: it was made at, so a record whose ``at`` lies further ahead was not written by the protocol
MAX_LEAD_US = 3600 * US

#: the largest burst (``burst * interval`` must stay under ``MAX_US`` as well)
MAX_BURST = 2**31

#: the largest ``max_running``: its leases are kept in the record itself
MAX_RUNNING = 1000

#: the longest lease (a day): a lease expires at most this long after the start or renewal that
#: took it, so one expiring further past ``now`` than this and :data:`MAX_LEAD_US` was not written
MAX_LEASE_US = 86_400 * US

#: the longest hold (a day): :func:`hold` sets ``not_before`` at most this far past its ``now``
MAX_HOLD_US = 86_400 * US
#: the most (us) a start may move the next by for its starter's doubt (:func:`try_start`'s ``doubt``):
#: a state whose answers bound its clock's offset no closer than this is too slow to pace begins
MAX_DOUBT_US = 100_000

#: an adaptive slow-down (:func:`slow`) makes the interval at most this many times the queue's own
MAX_SLOW = 64

#: a slow-down's excess over the queue's interval halves every this many us without another one
RECOVER_US = 5 * US

#: how far past ``now`` a hold's end may lie in a record the protocol wrote (a step back of the clock
#: allowed for, as for a start)
_HOLD_HORIZON = MAX_LEAD_US + MAX_HOLD_US

#: how far ahead (us) a paused record answers :class:`Wait` at the least: a waiting shard asks
#: again once a second while the queue is paused
PAUSED_RECHECK_US = US

#: how far ahead (us) a full record answers :class:`Wait` at most (its first lease's expiry if sooner)
FULL_RECHECK_US = 100_000

#: for how long (us) after a record was last found full no ticket may pass an earlier one: three
#: rechecks, so that every holder waiting for a place has asked again before a later ticket goes
FULL_GRACE_US = 3 * FULL_RECHECK_US


#: a running job's lease: ``(ticket, expiry, token)``; the job holds one of ``max_running`` places
#: until ``expiry`` (us, state clock). ``token`` is the number the ticket's shard gave the ticket
#: (1 to ``MAX_US - 1``): only an operation naming it renews or releases the lease, and a start
#: asked for again with it (its reply lost) is answered with this start (:func:`try_start`)
Lease = tuple[int, Micros, int]


#: a fair queue's waiter: ``(number, tenant, weight, cost, ticket)``. ``number`` names it (from
#: :func:`enqueue`); ``ticket`` is the ticket it holds, 0 until its tenant's turn gives it one
#: (at most ``weight`` of a tenant's waiters hold tickets at once, :func:`enqueue`)
Waiter = tuple[int, str, int, int, int]


class Record(NamedTuple):
    """What the shards of one queue share: its tickets, its latest start, its terms, pause and leases."""

    #: the next ticket number to hand out (the first is 1); a job of cost ``c`` takes ``c`` numbers
    ticket: int
    #: the highest ticket that has started (0: none yet)
    pos: int
    #: state-clock time (us) at which ticket ``pos`` starts; ``NEVER`` if none has
    at: Micros
    #: microseconds between two starts (of cost 1), fixed when the record is created
    interval: Micros
    #: the strict slot ticket ``pos`` took: ``at`` or up to ``burst - 1`` intervals later (how much
    #: of the burst its start used); every later slot counts from it
    due: Micros
    #: how many starts (of cost 1) may come at once after an idle spell, fixed when created
    burst: int = 1
    #: whether no ticket may start, in any shard (:func:`set_paused`)
    paused: bool = False
    #: how many jobs may run at once across every shard (``None``: no cap), fixed when created
    max_running: int | None = None
    #: the leases of running jobs (:data:`Lease`), in start order (so in ticket order)
    leases: tuple[Lease, ...] = ()
    #: when (state clock) a start was last refused for a full record; ``NEVER`` if never
    held: Micros = NEVER
    #: no ticket starts before this state-clock time (a fleet-wide hold, :func:`hold`); ``NEVER``: none
    not_before: Micros = NEVER
    #: the interval (us) the last slow-down set (:func:`slow`), recovering since ``paced_at``; 0: none
    pace: Micros = 0
    #: when (state clock) the last slow-down was made; ``NEVER`` if none
    paced_at: Micros = NEVER
    #: the ticket of the latest settlement that moved ``due`` (:func:`settle`); 0: none
    settled: int = 0
    #: whether tickets go to tenants in turn (a fair queue, :func:`enqueue`), fixed when created
    fair: bool = False
    #: a fair queue's next waiter number to hand out (the first is 1)
    number: int = 1
    #: the number of the waiter whose ticket started last (0: none): asked again, it is answered so
    begun: int = 0
    #: a fair queue's waiters, in the order they came (:data:`Waiter`)
    waiters: tuple[Waiter, ...] = ()
    #: when (state clock) the queue was paused everywhere (:func:`set_paused`); ``NEVER`` while it
    #: is not, or if it was paused by a version that did not note it
    paused_at: Micros = NEVER

    def slot(self, ticket: int) -> Micros:
        """The strict slot of ``ticket`` (> ``pos``): its earliest start if the queue allowed no burst.

        Slots count from ``due``, or from the end of a hold if that is later:
        the first ticket after ``pos`` may start when the hold ends, the next
        an interval later, and so on, in ticket order. A slowed record counts
        at its slowest pace (``pace``), an upper bound of what
        :func:`try_start` counts at any ``now`` (:func:`effective_interval`).
        """
        step = self.pace if self.pace > self.interval else self.interval
        return _due(self.due, self.not_before, step) + (ticket - self.pos) * step

    def earliest(self, ticket: int, cost: int) -> Micros:
        """The earliest state-clock time at which ``ticket`` (> ``pos``), of ``cost``, may start.

        A slowed record counts at its slowest pace (as :meth:`slot`): a bound
        :func:`try_start` may beat as the queue recovers.

        Its strict slot less what the burst allows (at the queue's own
        interval, so that a slow-down never lets a start come sooner), and
        never before the latest start: starts follow each other in ticket
        order (the generic cell rate algorithm, with tickets counted in
        units of cost).
        """
        return max(self.slot(ticket) - (self.burst - cost) * self.interval, self.at, self.not_before)


def effective_interval(record: Record, now: Micros) -> Micros:
    """The interval ``record``'s slots count at state-clock time ``now``: its own, or more after :func:`slow`.

    The excess of the last slow-down's ``pace`` over the interval halves every
    :data:`RECOVER_US` since ``paced_at`` (whole halvings, rounded down), so a
    slowed queue recovers by itself while no refusal comes, and never goes
    faster than its own interval.
    """
    return _effective(record.interval, record.pace, record.paced_at, now)


def _effective(interval: Micros, pace: Micros, paced_at: Micros, now: Micros) -> Micros:
    if pace <= interval:
        return interval
    halvings = (now - paced_at) // RECOVER_US if now > paced_at else 0
    return interval + ((pace - interval) >> halvings) if halvings < 53 else interval


def _due(due: Micros, not_before: Micros, interval: Micros) -> Micros:
    """Where the slots after ``pos`` count from: ``due``, or an interval before a hold's end if later."""
    after_hold = not_before - interval
    return due if due >= after_hold else after_hold


def new_record(
    interval: Micros, burst: int = 1, max_running: int | None = None, fair: bool = False
) -> Record:
    """The record of a queue that has handed out no ticket yet."""
    return Record(1, 0, NEVER, interval, NEVER, burst, False, max_running, fair=fair)


@dataclass(slots=True)
class Taken:
    """A ticket handed out by :func:`take`, with the record as it stood."""

    ticket: int
    pos: int
    at: Micros
    now: Micros


@dataclass(slots=True)
class Started:
    """``ticket`` started; its job begins at state-clock time ``start`` (``>= now``)."""

    ticket: int
    start: Micros
    now: Micros


@dataclass(slots=True)
class Wait:
    """``ticket`` may not start before state-clock time ``slot``; ask again then."""

    ticket: int
    slot: Micros
    now: Micros


@dataclass(slots=True)
class Passed:
    """A later ticket (``pos``) has started: ``ticket`` will never start; take a new one."""

    ticket: int
    pos: int
    now: Micros


#: what :func:`try_start`, :func:`take_and_try` and :func:`retime` answer
Outcome = Union[Started, Wait, Passed]

#: what any operation answers: a ticket, an outcome, or whether it changed something
#: (``set_paused``: the flag changed; ``release``, ``renew``: the lease was live)
Answer = Union[Taken, Started, Wait, Passed, bool]


class Unwritten(ValueError):
    """A record the protocol could not have written, or an operation that would write one.

    ``field`` holds ``value``; ``now`` is the state clock's time. States
    raise it as :class:`~ratequeue.errors.StateCorrupted`, changing nothing.
    """

    def __init__(self, field: str, value: int, now: Micros) -> None:
        self.field, self.value, self.now = field, value, now
        super().__init__(f"{field}={value} at now={now}")


def live_leases(record: Record, now: Micros) -> tuple[Lease, ...]:
    """``record``'s leases that have not expired at state-clock time ``now``."""
    return tuple(lease for lease in record.leases if lease[1] > now)


def check(record: Record, now: Micros) -> Record:
    """``record``, if the protocol could have written it by ``now``; else :class:`Unwritten`.

    Every start lies at most :data:`MAX_LEAD_US` past the ``now`` it was
    made at, ``held`` and ``paused_at`` are each a ``now``, a hold ends at
    most :data:`MAX_HOLD_US` after a ``now``, and a lease expires at most
    :data:`MAX_LEASE_US` after a start or a ``now``: a record whose ``at``,
    ``held``, ``paused_at``, hold or lease lies further ahead would stall
    every shard until then (an hour of the state's clock stepping back is
    allowed for), so it is refused. Every operation checks its record first.
    """
    horizon = now + MAX_LEAD_US
    if record.at > horizon:
        raise Unwritten("at", record.at, now)
    if record.held > horizon:
        raise Unwritten("held", record.held, now)
    if record.not_before > now + _HOLD_HORIZON:
        raise Unwritten("not_before", record.not_before, now)
    if record.paced_at > horizon:
        raise Unwritten("paced_at", record.paced_at, now)
    if record.paused_at > horizon:
        raise Unwritten("paused_at", record.paused_at, now)
    for lease in record.leases:
        if lease[1] > horizon + MAX_LEASE_US:
            raise Unwritten("leases", lease[1], now)
    return record


def take(record: Record, now: Micros, cost: int = 1) -> tuple[Record, Taken]:
    """Hand out the next ticket, for a job of ``cost`` (``1 <= cost <= burst``): it holds ``cost`` numbers.

    When every ticket handed out is at least one interval past its slot (and
    the record was not found full within :data:`FULL_GRACE_US`; a hold moves
    the slots to its end, :meth:`Record.slot`), ``pos``
    jumps to the last of them first, so a new ticket never waits behind
    tickets whose holders are gone (G4); ``at`` and ``due`` stay, so slots
    are still computed from the last real start. A record holding the last
    ticket hands out no more (:class:`Unwritten`).
    """
    taken = _taken(record, now, cost)
    return taken, Taken(record.ticket, taken.pos, record.at, now)


def _taken(record: Record, now: Micros, cost: int) -> Record:
    """The record after :func:`take` (the ticket handed out is ``record.ticket``)."""
    (
        ticket,
        pos,
        at,
        interval,
        due,
        burst,
        paused,
        max_running,
        leases,
        held,
        not_before,
        pace,
        paced_at,
        settled,
        fair,
        number,
        begun,
        waiters,
        paused_at,
    ) = record
    if (
        at > now + MAX_LEAD_US
        or held > now + MAX_LEAD_US
        or paced_at > now + MAX_LEAD_US
        or paused_at > now + MAX_LEAD_US
        or not_before > now + _HOLD_HORIZON
        or leases
    ):
        check(record, now)
    if ticket + cost >= MAX_US:
        raise Unwritten("ticket", ticket, now)
    last = ticket - 1
    step = _effective(interval, pace, paced_at, now) if pace else interval
    if (
        last > pos
        and _due(due, not_before, step) + (last - pos + 1) * step <= now
        and held + FULL_GRACE_US <= now
    ):
        pos = last
    return tuple.__new__(
        Record,
        (
            ticket + cost,
            pos,
            at,
            interval,
            due,
            burst,
            paused,
            max_running,
            leases,
            held,
            not_before,
            pace,
            paced_at,
            settled,
            fair,
            number,
            begun,
            waiters,
            paused_at,
        ),
    )


def try_start(
    record: Record,
    ticket: int,
    lead: Micros,
    now: Micros,
    cost: int = 1,
    lease: Micros = 0,
    token: int = 0,
    doubt: Micros = 0,
) -> tuple[Record, Outcome]:
    """Start ``ticket``, taken for a job of ``cost``, if its earliest start is at most ``lead`` us away.

    A started ticket begins at ``max(earliest, now)`` (:meth:`Record.earliest`),
    up to ``lead`` in the future; ``pos`` moves to it, ``at`` to the start,
    ``due`` to the later of the start and the ticket's strict slot, plus
    ``doubt``: how late the starter may begin against its start because it
    knows the state's clock only that closely (0 to :data:`MAX_DOUBT_US`),
    so that the next start comes that much later and the two begins are an
    interval apart however late this one comes (G7, docs/design.md "Doubt").

    * The latest start asked for again is started again, unchanged, while
      its interval has not run out (:func:`repeats_start`): a client that
      re-sends a call whose reply was lost keeps its turn. With
      ``max_running``, a start asked for again with its lease's ``token``
      is answered the same for as long as the lease lives (its start is
      the expiry less ``lease``).
    * A ticket at or below ``pos``, or one never handed out (the record was
      reset), is :class:`Passed`.
    * Slowed (:func:`slow`): slots count at :func:`effective_interval`
      instead of the interval (at least the interval: G1 holds).
    * Held (:func:`hold`): nothing starts before ``not_before``; a ticket
      asking earlier is answered :class:`Wait` until its earliest start,
      which the hold moved to its end or later (:meth:`Record.slot`).
    * Paused: nothing starts; :class:`Wait` until the earliest start or
      :data:`PAUSED_RECHECK_US` from now, whichever is later.
    * With ``max_running``: a start takes a lease on ``ticket`` until
      ``start + lease``, naming ``token``; while ``max_running`` leases are live nothing starts
      (:class:`Wait` until the earliest start, or the first expiry or
      :data:`FULL_RECHECK_US`, whichever is sooner of those two) and the
      record notes ``held = now``. For :data:`FULL_GRACE_US` after ``held`` a
      ticket may not pass an earlier one.
    """
    (
        ticket_next,
        pos,
        at,
        interval,
        due,
        burst,
        paused,
        max_running,
        leases,
        held,
        not_before,
        pace,
        paced_at,
        settled,
        fair,
        number,
        begun,
        waiters,
        paused_at,
    ) = record
    if (
        at > now + MAX_LEAD_US
        or held > now + MAX_LEAD_US
        or paced_at > now + MAX_LEAD_US
        or paused_at > now + MAX_LEAD_US
        or not_before > now + _HOLD_HORIZON
        or leases
    ):
        check(record, now)  # (in full only where it can fail)
    if pos == ticket < ticket_next and now < at + interval:
        return record, Started(ticket, at, now)
    if token and leases:
        repeated = _repeated(leases, token, now, lease)
        if repeated is not None and repeated.ticket == ticket:
            return record, repeated
    if pos >= ticket or ticket >= ticket_next:
        return record, Passed(ticket, pos, now)
    # (conditional expressions rather than max(): this runs on every acquire)
    step = _effective(interval, pace, paced_at, now) if pace else interval
    slot = (due if due >= not_before - step else not_before - step) + (ticket - pos) * step
    earliest = slot - (burst - cost) * interval  # (the burst at the interval: a slow-down never speeds up)
    earliest = earliest if earliest > at else at
    earliest = earliest if earliest > not_before else not_before
    if ticket > pos + 1 and held + FULL_GRACE_US > earliest:  # it would pass the tickets between:
        earliest = held + FULL_GRACE_US  # not while they wait for a place
    if paused:
        return record, Wait(ticket, max(earliest, now + PAUSED_RECHECK_US), now)
    if now + lead < earliest:
        return record, Wait(ticket, earliest, now)
    start = earliest if earliest > now else now
    if max_running:
        leases = live_leases(record, now)
        if len(leases) >= max_running:
            recheck = min(min(lease[1] for lease in leases), now + FULL_RECHECK_US)
            full = record._replace(leases=leases, held=now)
            return full, Wait(ticket, max(earliest, recheck), now)
        leases += ((ticket, start + lease, token),)
    due = (slot if slot > start else start) + doubt
    # (tuple.__new__: a NamedTuple's own __new__ is a Python function, and this runs on every start)
    started = tuple.__new__(
        Record,
        (
            ticket_next,
            ticket,
            start,
            interval,
            due,
            burst,
            False,
            max_running,
            leases,
            held,
            not_before,
            pace,
            paced_at,
            settled,
            fair,
            number,
            begun,
            waiters,
            paused_at,
        ),
    )
    return started, Started(ticket, start, now)


def repeats_start(record: Record, ticket: int, now: Micros) -> bool:
    """Whether ``try_start(ticket)`` at ``now`` repeats the latest start (see :func:`try_start`)."""
    return record.pos == ticket < record.ticket and now < record.at + record.interval


def take_and_try(
    record: Record,
    lead: Micros,
    now: Micros,
    cost: int = 1,
    lease: Micros = 0,
    token: int = 0,
    doubt: Micros = 0,
) -> tuple[Record, Outcome]:
    """:func:`take` a ticket and :func:`try_start` it, as one atomic step.

    With ``max_running``: asked again with the ``token`` of a live lease (the
    reply to the first call was lost, and it started a ticket), it answers
    that start again and changes nothing, so a lost reply never holds a
    place that nobody uses.
    """
    if token and record.leases:
        repeated = _repeated(check(record, now).leases, token, now, lease)
        if repeated is not None:
            return record, repeated
    return try_start(_taken(record, now, cost), record.ticket, lead, now, cost, lease, token, doubt)


def try_take(
    record: Record,
    lead: Micros,
    now: Micros,
    cost: int = 1,
    lease: Micros = 0,
    token: int = 0,
    doubt: Micros = 0,
    tenant: str = "",
    weight: int = 1,
) -> tuple[Record, Outcome]:
    """:func:`take_and_try` (:func:`enqueue_and_try` on a fair record) that changes nothing unless it starts.

    For a caller that will not wait (``try_acquire``). Started, the record
    is as :func:`take_and_try` leaves it. Otherwise the record is returned
    unchanged: no ticket handed out, no waiter added, no jump made (G4), no
    full record noted; the answer is :func:`take_and_try`'s :class:`Wait`,
    naming the ticket (on a fair record, the waiter's number) that was *not*
    taken and when it could have started. So a try that gets no turn leaves
    nothing behind that another caller waits for.
    """
    if record.fair:
        tried, outcome = enqueue_and_try(record, tenant, weight, lead, now, cost, lease, token, doubt)
    else:
        tried, outcome = take_and_try(record, lead, now, cost, lease, token, doubt)
    return (tried, outcome) if isinstance(outcome, Started) else (record, outcome)


def enqueue(record: Record, now: Micros, tenant: str, weight: int = 1, cost: int = 1) -> tuple[Record, Taken]:
    """A fair queue's :func:`take`: a new waiter of ``tenant``, of ``cost``, at the back of its tenant's line.

    The answer's ``ticket`` is the waiter's number, which :func:`try_turn`
    names. A waiter holds no ticket until its tenant's turn: at most
    ``weight`` of a tenant's waiters hold tickets at once, and a ticket is
    handed out (the next, as :func:`take` does) to the first waiter without
    one as soon as its tenant holds fewer (:func:`_seated`). So the tickets
    not yet started belong to ``weight`` waiters of each tenant at most, in
    the order their tenants' turns came: a tenant's first waiter starts
    after at most the sum of the other waiting tenants' weights of tickets
    (docs/design.md, "Fair queues"). G4's jump (:func:`take`) is made
    first; waiters whose tickets it passed are dropped.
    """
    jumped = _taken(record, now, 0)
    number = jumped.number
    if number + 1 >= MAX_US:
        raise Unwritten("number", number, now)
    waiters = (*jumped.waiters, (number, tenant, weight, cost, 0))
    seated = _seated(jumped._replace(number=number + 1, waiters=waiters), now)
    return seated, Taken(number, seated.pos, seated.at, now)


def _seated(record: Record, now: Micros) -> Record:
    """``record`` without waiters whose tickets were passed, and with tickets for those whose turns came."""
    pos, ticket = record.pos, record.ticket
    holding: dict[str, int] = {}
    waiters: list[Waiter] = []
    changed = False
    for waiter in record.waiters:
        number, tenant, weight, cost, held = waiter
        if held:
            if held <= pos:  # passed: its holder is gone or late, and takes a new number
                changed = True
                continue
            holding[tenant] = holding.get(tenant, 0) + 1
        waiters.append(waiter)
    for index, waiter in enumerate(waiters):
        number, tenant, weight, cost, held = waiter
        if held == 0 and holding.get(tenant, 0) < weight:
            if ticket + cost >= MAX_US:
                raise Unwritten("ticket", ticket, now)
            waiters[index] = (number, tenant, weight, cost, ticket)
            holding[tenant] = holding.get(tenant, 0) + 1
            ticket += cost
            changed = True
    if not changed:
        return record
    return record._replace(ticket=ticket, waiters=tuple(waiters))


def try_turn(
    record: Record,
    number: int,
    lead: Micros,
    now: Micros,
    cost: int = 1,
    lease: Micros = 0,
    token: int = 0,
    doubt: Micros = 0,
) -> tuple[Record, Outcome]:
    """A fair queue's :func:`try_start`: start waiter ``number``'s ticket, as :func:`try_start` would.

    * A waiter that holds a ticket is tried as :func:`try_start` tries it;
      started, it leaves the line, the tickets below its own are passed and
      their waiters dropped, and its tenant's next waiter gets a ticket at
      the back (:func:`_seated`). The :class:`Started` answer names the
      ticket, which the turn's re-time, release and settlement then name.
    * A waiter without a ticket yet is told to :class:`Wait` until its
      tenant's first ticket may start (or an interval from ``now``, if
      later): its own ticket comes no sooner.
    * The latest start asked for again is answered again while its interval
      has not run out (:func:`repeats_start`), as is a lease's start asked for
      with its token; a number not in the line is :class:`Passed`.
    """
    check(record, now)
    if number == record.begun and record.pos < record.ticket and now < record.at + record.interval:
        return record, Started(record.pos, record.at, now)
    if token and record.leases:
        repeated = _repeated(record.leases, token, now, lease)
        if repeated is not None:
            return record, repeated
    mine: Waiter | None = None
    for waiter in record.waiters:
        if waiter[0] == number:
            mine = waiter
            break
    if mine is None:
        return record, Passed(number, record.pos, now)
    _, tenant, _, _, held = mine
    if not held:
        first = min((w[4] for w in record.waiters if w[1] == tenant and w[4]), default=0)
        step = effective_interval(record, now)
        after = record.earliest(first, cost) if first > record.pos else now + step
        if record.burst == 1:
            # it is seated once as many of its tenant's tickets have started as it has waiters
            # without one before it, plus one: each of those starts an interval after the one before
            ahead = sum(1 for w in record.waiters if w[1] == tenant and not w[4] and w[0] < number)
            after += ahead * record.interval
        return record, Wait(number, max(after, now + step), now)
    tried, outcome = try_start(record, held, lead, now, cost, lease, token, doubt)
    if isinstance(outcome, Started):
        left = tuple(w for w in tried.waiters if w[0] != number)
        return _seated(tried._replace(begun=number, waiters=left), now), outcome
    if isinstance(outcome, Wait):
        return tried, Wait(number, outcome.slot, now)
    return _seated(tried, now), Passed(number, outcome.pos, now)


def enqueue_and_try(
    record: Record,
    tenant: str,
    weight: int,
    lead: Micros,
    now: Micros,
    cost: int = 1,
    lease: Micros = 0,
    token: int = 0,
    doubt: Micros = 0,
) -> tuple[Record, Outcome]:
    """:func:`enqueue` a waiter and :func:`try_turn` it, as one atomic step (a fair :func:`take_and_try`)."""
    if token and record.leases:
        repeated = _repeated(check(record, now).leases, token, now, lease)
        if repeated is not None:
            return record, repeated
    check(record, now)
    queued, taken = enqueue(record, now, tenant, weight, cost)
    return try_turn(queued, taken.ticket, lead, now, cost, lease, token, doubt)


def _repeated(leases: tuple[Lease, ...], token: int, now: Micros, lease: Micros) -> Started | None:
    """The start of the live lease named ``token``, answered again; ``None`` if there is none."""
    for held, expiry, named in leases:
        if named == token and expiry > now:
            return Started(held, expiry - lease, now)
    return None


def retime(
    record: Record, ticket: int, lead: Micros, now: Micros, doubt: Micros = 0
) -> tuple[Record, Outcome]:
    """Move the start of ``ticket``, the latest, to ``now + lead`` at the earliest (never back).

    A shard that woke too late to begin on time calls this instead of
    beginning late (G7): while ``pos == ticket`` its start, ``due`` and lease
    move forward together (``due`` by as much as the start, so that what the
    start added to it, a doubt or an overrun, stays; and to ``doubt`` after
    the new start at least, the starter's doubt now, :func:`try_start`),
    and every gap only grows. Once a later ticket has started the turn cannot move: :class:`Passed`.
    """
    check(record, now)
    if record.pos != ticket or ticket >= record.ticket:
        return record, Passed(ticket, record.pos, now)
    start = max(record.at, now + lead)
    moved = start - record.at
    leases = tuple(
        (held, expiry + moved if held == ticket else expiry, named) for held, expiry, named in record.leases
    )
    retimed = record._replace(at=start, due=max(record.due + moved, start + doubt), leases=leases)
    return retimed, Started(ticket, start, now)


def release(record: Record, ticket: int, now: Micros, token: int = 0) -> tuple[Record, bool]:
    """``record`` without ``ticket``'s lease named ``token`` (its job has ended), and whether it was live.

    Expired leases are dropped as well; a lease that expired, was never
    taken, or is named by another token changes nothing else: only the
    shard that started a ticket can give its place back.
    """
    check(record, now)
    leases = live_leases(record, now)
    kept = tuple(lease for lease in leases if lease[0] != ticket or lease[2] != token)
    if kept == record.leases:
        return record, False
    return record._replace(leases=kept), len(kept) < len(leases)


def renew(record: Record, ticket: int, lease: Micros, now: Micros, token: int = 0) -> tuple[Record, bool]:
    """``record`` with ``ticket``'s lease named ``token`` lasting until ``now + lease`` at least.

    Answers whether that lease was live. An expired lease cannot be
    renewed: its place may have gone to another job meanwhile. Expired
    leases are dropped as well.
    """
    check(record, now)
    leases = live_leases(record, now)
    mine = (ticket, token)
    if not any((held, named) == mine for held, _, named in leases):
        return (record, False) if leases == record.leases else (record._replace(leases=leases), False)
    renewed = tuple(
        (held, max(expiry, now + lease), named) if (held, named) == mine else (held, expiry, named)
        for held, expiry, named in leases
    )
    return record._replace(leases=renewed), True


def set_paused(record: Record, paused: bool, now: Micros) -> tuple[Record, bool]:
    """``record`` paused (or resumed) for every shard, and whether that changed it.

    Only the flag changes, and ``paused_at``: ``now`` when a pause begins (a
    pause asked again keeps the first one's), ``NEVER`` on resume. Tickets
    are still handed out and the latest start still repeated. On resume the
    tickets held keep their order and start at the rate; a paused record
    never expires (:func:`expires`).
    """
    check(record, now)
    if record.paused == paused:
        return record, False
    return record._replace(paused=paused, paused_at=now if paused else NEVER), True


def hold(record: Record, lead: Micros, now: Micros) -> tuple[Record, bool]:
    """``record`` held: no ticket starts, in any shard, before ``now + lead``; whether the hold moved.

    A hold only grows: one ending later than ``now + lead`` is kept as it
    is. A start granted before the hold (up to its lead ahead) stays
    granted, and is answered again as such (:func:`repeats_start`).
    Tickets keep their order and their holders keep waiting; once the hold
    ends the first ticket may start, the next an interval later (or as the
    burst allows), as after any idle spell (:meth:`Record.slot`).
    """
    check(record, now)
    until = now + lead
    if until <= record.not_before:
        return record, False
    return record._replace(not_before=until), True


def lift(record: Record, now: Micros) -> tuple[Record, bool]:
    """``record`` without its hold, and whether a hold was on at ``now`` (:func:`hold`)."""
    check(record, now)
    if record.not_before == NEVER:
        return record, False
    return record._replace(not_before=NEVER), record.not_before > now


def slow(record: Record, interval: Micros, now: Micros) -> tuple[Record, bool]:
    """``record`` slowed: its slots count at ``interval`` at least from ``now`` (0: twice the effective one).

    The new pace is the larger of ``interval`` (or twice
    :func:`effective_interval` for 0) and the effective interval now, at
    most :data:`MAX_SLOW` times the queue's own interval (and so that
    ``burst`` slots of it stay under :data:`MAX_US`); it then recovers by
    itself (:func:`effective_interval`). Answers whether it slowed the queue
    (a pace no slower than the effective one changes nothing).
    """
    check(record, now)
    current = effective_interval(record, now)
    wanted = interval if interval > 0 else 2 * current
    pace = min(wanted, MAX_SLOW * record.interval, (MAX_US - 1) // record.burst)
    if pace <= current:
        return record, False
    return record._replace(pace=pace, paced_at=now), True


def settle(record: Record, ticket: int, estimate: int, actual: int, now: Micros) -> tuple[Record, bool]:
    """``record`` once the job of ``ticket``, started for ``estimate``, is known to have cost ``actual``.

    Answers whether the schedule moved. ``actual`` is from 0 to the burst.

    * An overrun (``actual > estimate``) moves every later slot by the
      excess, at the effective interval (:func:`effective_interval`): the
      fleet pays it back. ``due`` moves at most to ``at + (burst - 1)``
      slowest paces (:data:`MAX_SLOW` intervals): 64 bursts of debt at
      least, beyond which an overrun is not counted.
    * A refund (``actual < estimate``) moves ``due`` back by the saving, at
      the queue's own interval, but never below
      ``at + (pos - ticket - estimate) * interval``: a bound on what the
      starts after ``ticket`` took, so that no credit returns that the
      burst's cap had already dropped (the queue idle meanwhile). The
      starts then follow the cell rate algorithm run with ``actual`` for
      this job (never looser): any stretch of starts ``i`` to ``k`` has
      costs, as known when ``k`` started, of at most ``burst`` plus the
      stretch's length in intervals (docs/design.md, G8).
    * Nothing moves for a ticket that has not started (above ``pos``), on a
      record that never started one, or for ``ticket`` again right after
      it settled (``settled``): a settlement re-sent after a lost reply
      counts once.
    """
    check(record, now)
    if not (0 < ticket <= record.pos) or record.at == NEVER or ticket == record.settled or actual == estimate:
        return record, False
    if actual > estimate:
        step = effective_interval(record, now)
        slowest = min(MAX_SLOW * record.interval, (MAX_US - 1) // record.burst)
        most = record.at + (record.burst - 1) * slowest
        due = min(record.due + (actual - estimate) * step, most)
        moved = due > record.due
    else:
        floor = record.at + (record.pos - ticket - estimate) * record.interval
        due = max(record.due - (estimate - actual) * record.interval, floor)
        moved = due < record.due
    if not moved:
        return record, False
    return record._replace(due=due, settled=ticket), True


def waiting_tenants(record: Record) -> dict[str, tuple[int, int, int]]:
    """A fair queue's tenants with waiters: each one's waiters, how many hold tickets, and its weight.

    In the order their first waiters came. A tenant's share of the turns
    while every tenant named here keeps waiting is its weight over their sum.
    """
    tenants: dict[str, tuple[int, int, int]] = {}
    for _, tenant, weight, _, ticket in record.waiters:
        waiting, holding, _ = tenants.get(tenant, (0, 0, weight))
        tenants[tenant] = (waiting + 1, holding + (ticket > 0), weight)
    return tenants


def expires(record: Record) -> Micros:
    """The state-clock time from which a fresh record would do what ``record`` does.

    From then on every ticket handed out is an interval past its slot and
    the whole burst is free again, so deleting the record loses nothing (an
    idle per-key limiter's record is deleted so). A paused record, one with
    a live lease or one found full within :data:`FULL_GRACE_US` does not
    expire before those end (the states keep a paused one for ever).
    """
    step = record.pace if record.pace > record.interval else record.interval
    ends = [record.slot(record.ticket) + step, record.held + FULL_GRACE_US]
    return max(ends + [lease[1] for lease in record.leases])
