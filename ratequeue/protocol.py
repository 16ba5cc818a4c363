"""The ticket protocol: the shared record and its two atomic operations.

This module is the reference every state backend is held to (DESIGN.md §3).
It is pure: each operation takes a :class:`Record` and the state clock's
``now`` and returns the new record with the answer. Backends run the same
steps atomically, reading ``now`` from their own clock.

``slot(T) = due + (T - pos) * interval`` is the strict slot of ticket ``T``
(DESIGN.md §7a): the earliest state-clock time at which it may start when the
queue allows no burst. A queue with a burst ``B`` lets a ticket of cost ``c``
start up to ``(B - c) * interval`` before that (:meth:`Record.earliest`): the
generic cell rate algorithm, with tickets counted in units of cost, so that a
job of cost ``c`` holds ``c`` ticket numbers and moves every later slot on by
``c`` intervals. Any run of consecutive starts of total cost ``C`` then spans
at least ``(C - B) * interval``; with ``B = 1`` and ``c = 1`` that is one
interval between any two starts (G1), and this is the protocol of DESIGN.md §3.
A record whose ``at`` is :data:`NEVER` has never started a job, so every
ticket's slot lies far in the past and it may start at once.

A record can be **paused** for every shard at once (:func:`set_paused`,
DESIGN.md §7b): while it is, no ticket starts (:func:`try_start` answers
:class:`Wait`, at least :data:`PAUSED_RECHECK_US` ahead), while tickets are
still handed out and earlier grants still repeated. See :func:`set_paused`
for what becomes of the tickets held meanwhile.

A record can cap how many of its jobs **run** at once, across every shard
(``max_running``, DESIGN.md §7b): every start then also takes a **lease**
on the ticket that started, which lasts until a state-clock expiry. The
holder renews it while its job runs (:func:`renew`) and releases it when the
job ends (:func:`release`); a holder that dies simply stops renewing, and
its place comes back when the lease expires. While ``max_running`` leases
are live no ticket starts: :func:`try_start` answers :class:`Wait`, at most
:data:`FULL_RECHECK_US` ahead, and notes when it last found the queue full
(``held``), so that for :data:`FULL_GRACE_US` after that no ticket may pass
an earlier one that is still waiting for a place: places go in ticket order.

Times and intervals are whole **microseconds**: integer arithmetic keeps
guarantee G1 exact (no start closer than ``interval`` by a rounding error)
and gives every backend -- Python, Lua, MongoDB's int64 -- the same answers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Union

__all__ = [
    "FULL_GRACE_US",
    "FULL_RECHECK_US",
    "MAX_LEAD_US",
    "MAX_RUNNING",
    "NEVER",
    "PAUSED_RECHECK_US",
    "TICKET_LIMIT",
    "US",
    "Micros",
    "Outcome",
    "Passed",
    "Record",
    "Started",
    "Taken",
    "Unwritten",
    "Wait",
    "check",
    "expires",
    "is_same_grant",
    "live_leases",
    "new_record",
    "release",
    "renew",
    "retime",
    "set_paused",
    "take",
    "take_and_try",
    "try_start",
]

#: the ``at`` of a record that has never started a job: -2**52 us, about 142
#: years before the epoch, so that slots stay exact in a double (Lua)
NEVER = -(2**52)

#: microseconds per second
US = 1_000_000

#: the largest lead a shard asks for (an hour): every start the protocol grants lies at most
#: this far ahead of the state clock, so a record whose ``at`` lies further ahead was not
#: written by it (a poisoned record, or a clock that stepped back by more than this)
MAX_LEAD_US = 3600 * US

#: tickets stay below this (2**52, as every time and interval does): a record holding the last
#: ticket, ``TICKET_LIMIT - 1``, hands out no more (:func:`take` raises :class:`Unwritten`)
TICKET_LIMIT = 2**52

#: how far ahead (us) a paused record answers :class:`Wait` at the least: a shard whose head
#: job waits asks again once a second while the queue is paused (an idle shard asks nothing)
PAUSED_RECHECK_US = US

#: how far ahead (us) a full queue answers :class:`Wait` at most (its first lease's expiry
#: if that is sooner): a shard whose head waits for a place asks again ten times a second,
#: and is woken at once by a place freed in its own process (an idle shard asks nothing)
FULL_RECHECK_US = 100_000

#: for how long (us) after a full queue was last found full a ticket may not pass an
#: earlier one: three rechecks, so that every holder still waiting for a place has asked
#: again (and the first of them started) before a later ticket may go first
FULL_GRACE_US = 3 * FULL_RECHECK_US

#: the largest ``max_running``: its leases are kept in the record itself
MAX_RUNNING = 1000

#: a time or a duration in whole microseconds: every time, interval and lead in this
#: module and in the states is one (a name ending in ``_us`` says so where seconds are near)
Micros = int


#: stands for "the same as ``at``" in :class:`Record`'s ``due`` (a record from before bursts)
_AS_AT = -(2**63)


@dataclass(frozen=True)
class Record:
    """The state one queue name shares between all of its shards."""

    #: the next ticket number to hand out (the first is 1); a job of cost ``c`` takes ``c`` numbers
    ticket: int
    #: the highest ticket that has started (0: none yet)
    pos: int
    #: state-clock time (us) at which ticket ``pos`` starts; ``NEVER`` if none has
    at: Micros
    #: microseconds between two starts (of cost 1), fixed when the record is created
    interval: Micros
    #: how many starts (of cost 1) may come at once after an idle spell, fixed when the record is created
    burst: int = 1
    #: the strict slot ticket ``pos`` took: ``at`` or later, by at most ``(burst - 1)`` intervals
    #: (by how much the start came early, using the burst); every later slot counts from it.
    #: Left out, it is ``at`` (always so when ``burst`` is 1).
    due: Micros = _AS_AT
    #: whether the queue is paused for every shard (:func:`set_paused`): no ticket starts meanwhile.
    #: A record written before pauses has none: it is not paused.
    paused: bool = False
    #: how many jobs may run at once across every shard (0: no cap), fixed when the record is created
    max_running: int = 0
    #: the leases of running jobs: ``(ticket, expiry)`` pairs in start order, expiry on the state
    #: clock (us); one past its expiry no longer counts (and is dropped at the next start)
    leases: tuple[tuple[int, Micros], ...] = ()
    #: when (state clock, us) a start was last refused because ``max_running`` leases were
    #: live, or ``NEVER``; for :data:`FULL_GRACE_US` after it, no ticket passes an earlier one
    held: Micros = NEVER

    def __post_init__(self) -> None:
        if self.due == _AS_AT:
            object.__setattr__(self, "due", self.at)

    def slot(self, ticket: int) -> Micros:
        """The strict slot of ``ticket`` (> ``pos``): its earliest start if the queue allowed no burst."""
        return self.due + (ticket - self.pos) * self.interval

    def earliest(self, ticket: int, cost: int) -> Micros:
        """The earliest state-clock time at which ``ticket`` (> ``pos``), of ``cost``, may start.

        Its strict slot less what the burst allows, and never before the latest
        start (``at``, which a lead may have put ahead of the clock): starts
        follow each other in ticket order. With ``burst`` 1 the slot is always
        the later of the two.
        """
        return max(self.slot(ticket) - (self.burst - cost) * self.interval, self.at)


def new_record(interval: Micros, burst: int = 1, max_running: int = 0) -> Record:
    """The record of a queue that has handed out no ticket yet."""
    return Record(
        ticket=1, pos=0, at=NEVER, interval=interval, burst=burst, due=NEVER, max_running=max_running
    )


def live_leases(record: Record, now: Micros) -> tuple[tuple[int, Micros], ...]:
    """``record``'s leases that have not expired at state-clock time ``now``."""
    return tuple(lease for lease in record.leases if lease[1] > now)


class Unwritten(ValueError):
    """A record the protocol could not have written, or an operation that would write one.

    ``field`` holds ``value``; ``now`` is the state clock's time. States
    raise it as :class:`~ratequeue.errors.StateCorrupted`, changing nothing.
    """

    def __init__(self, field: str, value: int, now: Micros) -> None:
        self.field, self.value, self.now = field, value, now
        super().__init__(f"{field}={value} at now={now}")


def check(record: Record, now: Micros) -> Record:
    """``record``, if the protocol could have written it by state-clock time ``now``; else :class:`Unwritten`.

    Every start lies at most :data:`MAX_LEAD_US` past the ``now`` it was
    granted at, so an ``at`` further ahead of ``now`` was written by
    something else (or the state clock stepped back by more than that). Such
    a record would stall every shard until its ``at``: it is refused, not
    used. Every operation below checks its record first.
    """
    if record.at > now + MAX_LEAD_US:
        raise Unwritten("at", record.at, now)
    return record


@dataclass(frozen=True)
class Taken:
    """A ticket handed out by :func:`take`, with the record as it stood."""

    ticket: int
    pos: int
    at: Micros
    now: Micros


@dataclass(frozen=True)
class Started:
    """``ticket`` started; its job begins at state-clock time ``start`` (``>= now``)."""

    ticket: int
    start: Micros
    now: Micros


@dataclass(frozen=True)
class Wait:
    """``ticket`` may not start before state-clock time ``slot``; ask again then."""

    ticket: int
    slot: Micros
    now: Micros


@dataclass(frozen=True)
class Passed:
    """A later ticket (``pos``) has started: ``ticket`` will never start; take a new one."""

    ticket: int
    pos: int
    now: Micros


#: what :func:`try_start` and :func:`take_and_try` answer
Outcome = Union[Started, Wait, Passed]


def take(record: Record, now: Micros, cost: int = 1) -> tuple[Record, Taken]:
    """Hand out the next ticket, for a job of ``cost`` (``1 <= cost <= burst``): it holds ``cost`` numbers.

    When every ticket already handed out is at least one interval past its
    slot, ``pos`` jumps forward to the last of them first, so a new ticket
    never waits behind tickets whose holders are gone (guarantee G4). ``at``
    is left alone: slots stay computed from the last real start.

    A record holding the last ticket (``TICKET_LIMIT - 1``) hands out no
    more: :class:`Unwritten` names it (a later record would be refused by
    every reader, so none is written).
    """
    check(record, now)
    if record.ticket + cost >= TICKET_LIMIT:
        raise Unwritten("ticket", record.ticket, now)
    last = record.ticket - 1
    waited = record.slot(last) + record.interval <= now and record.held + FULL_GRACE_US <= now
    if last > record.pos and waited:
        record = replace(record, pos=last)
    taken = Taken(ticket=record.ticket, pos=record.pos, at=record.at, now=now)
    return replace(record, ticket=record.ticket + cost), taken


def try_start(
    record: Record, ticket: int, lead: Micros, now: Micros, cost: int = 1, lease: Micros = 0
) -> tuple[Record, Outcome]:
    """Start ``ticket``, taken for a job of ``cost``, if its earliest start is at most ``lead`` us away.

    A started ticket's job begins at ``max(earliest, now)`` (see
    :meth:`Record.earliest`), which may lie up to ``lead`` in the future;
    the record's ``pos`` moves to it, ``at`` to the start, and ``due`` to the
    later of the start and the ticket's strict slot. ``cost`` must be the
    cost ``ticket`` was taken with (the record does not keep it): a smaller
    one only starts it later. A ticket below
    ``pos`` has been passed and can never start; so has a ticket the record
    never handed out (it was reset since).

    Asking again for the latest start (``pos == ticket``) is answered with
    the same grant, unchanged, while its interval has not run out: a client
    that re-sends the call after losing the answer (a timeout, a dropped
    connection) keeps its turn instead of being told it was passed
    (DESIGN.md §3). After that, or when ``take`` jumped ``pos`` to a ticket
    that never started (its ``at`` is then at least two intervals old), the
    answer is :class:`Passed`: a begin that late would shorten the next gap.

    ``lead`` is at most :data:`MAX_LEAD_US` (the states refuse more), so
    every start written lies at most that far past ``now``.

    While the record is paused (:func:`set_paused`) a ticket that would
    start, or wait, is answered :class:`Wait` with its earliest start or
    ``now + PAUSED_RECHECK_US``, whichever is later, and nothing changes;
    the same grant and :class:`Passed` are answered as ever.

    With ``max_running`` set, a start also takes a lease on ``ticket`` that
    expires ``lease`` us (> 0) after the start. When ``max_running`` leases
    are live at ``now``, nothing starts: the answer is :class:`Wait` with
    the earliest start or the first lease's expiry or
    ``now + FULL_RECHECK_US``, whichever is later of the first and sooner of
    the other two, and the record notes ``held = now`` (dropping the expired
    leases). For :data:`FULL_GRACE_US` after ``held`` a ticket may not pass
    an earlier one (start while a ticket between ``pos`` and it waits).
    """
    check(record, now)
    if is_same_grant(record, ticket, now):
        return record, Started(ticket=ticket, start=record.at, now=now)
    if record.pos >= ticket or ticket >= record.ticket:
        return record, Passed(ticket=ticket, pos=record.pos, now=now)
    earliest = record.earliest(ticket, cost)
    if ticket > record.pos + 1:  # it would pass the tickets between: not while they wait for a place
        earliest = max(earliest, record.held + FULL_GRACE_US)
    if record.paused:
        return record, Wait(ticket=ticket, slot=max(earliest, now + PAUSED_RECHECK_US), now=now)
    if now + lead < earliest:
        return record, Wait(ticket=ticket, slot=earliest, now=now)
    leases = record.leases
    if record.max_running:
        leases = live_leases(record, now)
        if len(leases) >= record.max_running:
            recheck = min(min(expiry for _, expiry in leases), now + FULL_RECHECK_US)
            full = replace(record, leases=leases, held=now)
            return full, Wait(ticket=ticket, slot=max(earliest, recheck), now=now)
    start = max(earliest, now)
    if record.max_running:
        leases += ((ticket, start + lease),)
    due = max(record.slot(ticket), start)
    started = replace(record, pos=ticket, at=start, due=due, leases=leases)
    return started, Started(ticket=ticket, start=start, now=now)


def is_same_grant(record: Record, ticket: int, now: Micros) -> bool:
    """Whether ``try_start(ticket)`` at ``now`` repeats the grant already given (see :func:`try_start`)."""
    return record.pos == ticket < record.ticket and now < record.at + record.interval


def take_and_try(
    record: Record, lead: Micros, now: Micros, cost: int = 1, lease: Micros = 0
) -> tuple[Record, Outcome]:
    """:func:`take` a ticket and :func:`try_start` it, as one atomic step."""
    record, taken = take(record, now, cost)
    return try_start(record, taken.ticket, lead, now, cost, lease)


def retime(record: Record, ticket: int, lead: Micros, now: Micros) -> tuple[Record, Outcome]:
    """Move the start of ``ticket``, the latest started, to ``now + lead`` at the earliest.

    A shard whose job could not begin on time (its wake-up came too late)
    calls this instead of beginning late, since a late begin would shorten
    the gap to the next one as a third party sees it (guarantee G7). While
    ``ticket`` is still the latest start (``pos == ticket``) its start moves
    forward, never back, to ``max(at, now + lead)``, and ``due`` with it
    (to the later of the two): the gap before it only grows and every later
    slot is computed from the new ``due``, so G1-G6 hold. The ticket's lease,
    if it has one, moves on by as much as its start.
    Once a later ticket has started the turn cannot move: the answer is
    :class:`Passed`, and the job must give its turn up and take a new ticket.
    """
    check(record, now)
    if record.pos != ticket or ticket >= record.ticket:
        return record, Passed(ticket=ticket, pos=record.pos, now=now)
    start = max(record.at, now + lead)
    moved = start - record.at
    leases = tuple((held, expiry + moved if held == ticket else expiry) for held, expiry in record.leases)
    retimed = replace(record, at=start, due=max(record.due, start), leases=leases)
    return retimed, Started(ticket=ticket, start=start, now=now)


def release(record: Record, ticket: int, now: Micros) -> tuple[Record, bool]:
    """``record`` without ``ticket``'s lease (its job has ended), and whether that lease was live.

    Expired leases are dropped as well. Releasing a lease that has expired,
    or was never taken, changes nothing else: a job that outlived its lease
    has already lost its place (see :func:`renew`).
    """
    check(record, now)
    leases = live_leases(record, now)
    kept = tuple(lease for lease in leases if lease[0] != ticket)
    if kept == record.leases:
        return record, False
    return replace(record, leases=kept), len(kept) < len(leases)


def renew(record: Record, ticket: int, lease: Micros, now: Micros) -> tuple[Record, bool]:
    """``record`` with ``ticket``'s lease lasting until ``now + lease`` at least, and whether it was live.

    A job whose lease has expired cannot renew it: its place may have gone
    to another job meanwhile (the answer is ``False``, and the job runs on
    uncounted). Expired leases are dropped as well.
    """
    check(record, now)
    leases = live_leases(record, now)
    if not any(held == ticket for held, _ in leases):
        return (record, False) if leases == record.leases else (replace(record, leases=leases), False)
    renewed = tuple((held, max(expiry, now + lease) if held == ticket else expiry) for held, expiry in leases)
    return replace(record, leases=renewed), True


def set_paused(record: Record, paused: bool, now: Micros) -> tuple[Record, bool]:
    """``record`` paused (or resumed) for every shard, and whether that changed it.

    Only the flag changes. While it is set no ticket starts
    (:func:`try_start`); tickets are still handed out (:func:`take`, and the
    take of :func:`take_and_try`: a ticket costs nothing) and a start
    granted before the pause is still granted again to a client that lost
    the reply (:func:`is_same_grant`). :func:`retime` is unchanged: it only
    moves an already granted start later.

    The tickets held during a pause are kept. On resume each starts at its
    earliest start, which lies in the past after a long pause, so their
    holders start one after another at the rate (as the burst allows), in
    ticket order; a holder that left meanwhile costs nothing once every
    ticket is an interval past its slot, since :func:`take` then passes them
    all (G4). A paused record never expires (:func:`expires`): forgetting it
    would forget the pause.
    """
    check(record, now)
    if record.paused == paused:
        return record, False
    return replace(record, paused=paused), True


def expires(record: Record) -> Micros:
    """The state-clock time from which a fresh record would do what ``record`` does.

    From then on every ticket handed out lies at least one interval past its
    slot (:func:`take` would pass them all) and the whole burst is free
    again, so deleting the record loses nothing: an idle queue's record may
    be dropped (a per-key limiter's keys expire so). A holder of an old
    ticket is then answered :class:`Passed` and takes a new one.

    A paused record is not such a record (a fresh one is not paused): the
    states keep it, whatever the keep time, until it is resumed. Nor is one
    with a live lease (a fresh one would let one more job run), or one found
    full less than :data:`FULL_GRACE_US` ago.
    """
    ends = [record.slot(record.ticket) + record.interval, record.held + FULL_GRACE_US]
    return max(ends + [expiry for _, expiry in record.leases])
