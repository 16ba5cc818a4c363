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

Times and intervals are whole **microseconds**: integer arithmetic keeps
guarantee G1 exact (no start closer than ``interval`` by a rounding error)
and gives every backend -- Python, Lua, MongoDB's int64 -- the same answers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Union

__all__ = [
    "MAX_LEAD_US",
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
    "new_record",
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


def new_record(interval: Micros, burst: int = 1) -> Record:
    """The record of a queue that has handed out no ticket yet."""
    return Record(ticket=1, pos=0, at=NEVER, interval=interval, burst=burst, due=NEVER)


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
    if last > record.pos and record.slot(last) + record.interval <= now:
        record = replace(record, pos=last)
    taken = Taken(ticket=record.ticket, pos=record.pos, at=record.at, now=now)
    return replace(record, ticket=record.ticket + cost), taken


def try_start(
    record: Record, ticket: int, lead: Micros, now: Micros, cost: int = 1
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
    """
    check(record, now)
    if is_same_grant(record, ticket, now):
        return record, Started(ticket=ticket, start=record.at, now=now)
    if record.pos >= ticket or ticket >= record.ticket:
        return record, Passed(ticket=ticket, pos=record.pos, now=now)
    earliest = record.earliest(ticket, cost)
    if record.paused:
        return record, Wait(ticket=ticket, slot=max(earliest, now + PAUSED_RECHECK_US), now=now)
    if now + lead >= earliest:
        start = max(earliest, now)
        due = max(record.slot(ticket), start)
        return replace(record, pos=ticket, at=start, due=due), Started(ticket=ticket, start=start, now=now)
    return record, Wait(ticket=ticket, slot=earliest, now=now)


def is_same_grant(record: Record, ticket: int, now: Micros) -> bool:
    """Whether ``try_start(ticket)`` at ``now`` repeats the grant already given (see :func:`try_start`)."""
    return record.pos == ticket < record.ticket and now < record.at + record.interval


def take_and_try(record: Record, lead: Micros, now: Micros, cost: int = 1) -> tuple[Record, Outcome]:
    """:func:`take` a ticket and :func:`try_start` it, as one atomic step."""
    record, taken = take(record, now, cost)
    return try_start(record, taken.ticket, lead, now, cost)


def retime(record: Record, ticket: int, lead: Micros, now: Micros) -> tuple[Record, Outcome]:
    """Move the start of ``ticket``, the latest started, to ``now + lead`` at the earliest.

    A shard whose job could not begin on time (its wake-up came too late)
    calls this instead of beginning late, since a late begin would shorten
    the gap to the next one as a third party sees it (guarantee G7). While
    ``ticket`` is still the latest start (``pos == ticket``) its start moves
    forward, never back, to ``max(at, now + lead)``, and ``due`` with it
    (to the later of the two): the gap before it only grows and every later
    slot is computed from the new ``due``, so G1-G6 hold.
    Once a later ticket has started the turn cannot move: the answer is
    :class:`Passed`, and the job must give its turn up and take a new ticket.
    """
    check(record, now)
    if record.pos != ticket or ticket >= record.ticket:
        return record, Passed(ticket=ticket, pos=record.pos, now=now)
    start = max(record.at, now + lead)
    return replace(record, at=start, due=max(record.due, start)), Started(ticket=ticket, start=start, now=now)


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
    states keep it, whatever the keep time, until it is resumed.
    """
    return record.slot(record.ticket) + record.interval
