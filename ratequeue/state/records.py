"""What a stored record may hold, and the errors for one that does not fit what is asked of it.

Every state stores the fields of :class:`~ratequeue.core.protocol.Record`
(numbers in whole microseconds; ``NEVER`` may be stored as null; "no cap"
as ``max_running`` 0; ``not_before``, ``pace``, ``paced_at`` and ``settled``, which
older records lack, as missing). :func:`check_record` turns stored fields into a record or raises
:class:`~ratequeue.errors.StateCorrupted`: a record is never silently reset.
:func:`check_terms` raises :class:`~ratequeue.errors.TermsMismatch` for a
record created with other terms.
"""

from __future__ import annotations

from typing import Any

from ..core.operation import MAX_WEIGHT, Terms
from ..core.protocol import (
    MAX_BURST,
    MAX_DOUBT_US,
    MAX_HOLD_US,
    MAX_LEAD_US,
    MAX_LEASE_US,
    MAX_RUNNING,
    MAX_SLOW,
    MAX_US,
    NEVER,
    US,
    Lease,
    Record,
    Unwritten,
    Waiter,
)
from ..errors import StateCorrupted, TermsMismatch

__all__ = ["FIELDS", "check_record", "check_terms", "mismatch", "unwritten"]

#: the fields every stored record has
FIELDS = ("ticket", "pos", "at", "interval", "due", "burst", "paused", "max_running", "leases", "held")


def check_terms(name: str, record: Record, wanted: Terms) -> None:
    """Raise :class:`TermsMismatch` unless ``record``'s interval, burst and max_running are ``wanted``'s."""
    stored = (record.interval, record.burst, record.max_running, record.fair)
    asked = (wanted.interval_us, wanted.burst, wanted.max_running, wanted.fair)
    if stored == asked:  # (the usual case, at a glance: this runs on every operation)
        return
    for field, have, want in zip(("interval", "burst", "max_running", "fair"), stored, asked, strict=True):
        if have != want:
            raise mismatch(name, field, have, want)


def mismatch(name: str, field: str, stored: int | None, wanted: int | None) -> TermsMismatch:
    """The :class:`TermsMismatch` for queue ``name`` whose stored ``field`` is not ``wanted`` (in us)."""

    def said(value: int | None) -> str:
        if field == "fair":
            return f"fair={bool(value)}"
        if field == "interval":
            return f"{(value or 0) / US:g} s"
        return "no cap" if value is None else str(value)

    scale = US if field == "interval" else 1
    told = (
        f"queue {name!r} has {field} {said(stored)} in this state, not {said(wanted)}; "
        f"use the stored {field} or another name"
        if field != "fair"
        else f"queue {name!r} is {'' if stored else 'not '}fair in this state ({said(stored)}), not "
        f"{said(wanted)}; give every limiter of it the same fair= or use another name"
    )
    return TermsMismatch(
        told,
        name=name,
        field=field,
        stored=stored if stored is None or scale == 1 else stored / scale,
        wanted=wanted if wanted is None or scale == 1 else wanted / scale,
    )


def check_record(fields: Any, *, where: str) -> Record:
    """Turn stored fields into a :class:`Record`, or raise :class:`StateCorrupted` naming the bad one."""
    if not isinstance(fields, dict):
        raise StateCorrupted(f"record at {where} is {type(fields).__name__}, not an object", where=where)
    missing = set(FIELDS) - fields.keys()
    if missing:
        raise StateCorrupted(f"record at {where} lacks {', '.join(sorted(missing))}", where=where)
    ticket, pos, interval, burst = fields["ticket"], fields["pos"], fields["interval"], fields["burst"]
    at, due, held = (NEVER if fields[key] is None else fields[key] for key in ("at", "due", "held"))

    def refuse(field: str, want: str) -> StateCorrupted:
        return StateCorrupted(f"record at {where} has {field}={fields[field]!r}; want {want}", where=where)

    if not (_is_int(ticket) and _is_int(pos) and 0 <= pos < ticket < MAX_US):
        raise StateCorrupted(
            f"record at {where} has ticket={ticket!r}, pos={pos!r}; want integers 0 <= pos < ticket < 2**52",
            where=where,
        )
    if not (_is_int(at) and NEVER <= at < MAX_US):
        raise refuse("at", "whole microseconds or null")
    if not (_is_int(interval) and 0 < interval < MAX_US):
        raise refuse("interval", "whole microseconds > 0")
    if not (_is_int(burst) and 1 <= burst <= MAX_BURST and burst * interval < MAX_US):
        raise refuse("burst", "a whole number >= 1, burst * interval < 2**52")
    pace = fields.get("pace")
    pace = 0 if pace is None else pace
    if not (_is_int(pace) and 0 <= pace <= MAX_SLOW * interval and burst * pace < MAX_US):
        raise StateCorrupted(
            f"record at {where} has pace={pace!r}; want 0 (none) or whole microseconds up to "
            f"{MAX_SLOW} intervals",
            where=where,
        )
    # (the slowest pace any slow-down may have set: a due written then outlives a later, faster pace)
    slowest = min(MAX_SLOW * interval, (MAX_US - 1) // burst)
    # (and as far behind as a refund moves it: a burst of intervals, protocol.settle; and as far
    # ahead as a starter's doubt moves it, MAX_DOUBT_US)
    if not (_is_int(due) and at - burst * interval <= due <= at + (burst - 1) * slowest + MAX_DOUBT_US):
        raise refuse(
            "due",
            "whole microseconds, at - burst * interval to at + (burst - 1) * the slowest pace allowed "
            "+ MAX_DOUBT_US",
        )
    if not isinstance(fields["paused"], bool):
        raise refuse("paused", "true or false")
    max_running = fields["max_running"]
    if not (_is_int(max_running) and 0 <= max_running <= MAX_RUNNING):
        raise refuse("max_running", f"a whole number from 0 (no cap) to {MAX_RUNNING}")
    leases = _leases(fields["leases"], max_running, pos)
    if leases is None:
        raise refuse("leases", "at most max_running [ticket, expiry, token], tickets rising to pos at most")
    if not (_is_int(held) and NEVER <= held < MAX_US):
        raise refuse("held", "whole microseconds or null")
    not_before, paced_at = (
        NEVER if fields.get(key) is None else fields[key] for key in ("not_before", "paced_at")
    )
    if not (_is_int(not_before) and NEVER <= not_before < MAX_US):
        raise refuse("not_before", "whole microseconds or null")
    if not (_is_int(paced_at) and NEVER <= paced_at < MAX_US):
        raise refuse("paced_at", "whole microseconds or null")
    # (paused_at means something only while paused: an older version's resume leaves it behind)
    paused_at = fields.get("paused_at") if fields["paused"] is True else None
    paused_at = NEVER if paused_at is None else paused_at
    if not (_is_int(paused_at) and NEVER <= paused_at < MAX_US):
        raise refuse("paused_at", "whole microseconds (when the pause began) or null")
    settled = fields.get("settled", 0)
    if not (_is_int(settled) and 0 <= settled <= pos):
        raise refuse("settled", "a ticket from 0 (none) to pos")
    fair, number, begun = fields.get("fair", False), fields.get("number", 1), fields.get("begun", 0)
    waiters: tuple[Waiter, ...] | None = ()
    if fair is not False:
        if fair is not True:
            raise refuse("fair", "true or false")
        if not (_is_int(number) and 1 <= number < MAX_US):
            raise refuse("number", "a whole number >= 1")
        if not (_is_int(begun) and 0 <= begun < number):
            raise refuse("begun", "a waiter's number from 0 (none) to below number")
        waiters = _waiters(fields.get("waiters", ()), number, pos, ticket)
        if waiters is None:
            raise refuse(
                "waiters",
                "[number, tenant, weight, cost, ticket] lists, numbers rising below number, "
                "tickets 0 or above pos and below ticket",
            )
    return Record(
        ticket,
        pos,
        at,
        interval,
        due,
        burst,
        fields["paused"],
        max_running or None,
        leases,
        held,
        not_before,
        pace,
        paced_at,
        settled,
        fair,
        number if fair else 1,
        begun if fair else 0,
        waiters or (),
        paused_at,
    )


def _waiters(value: object, number: int, pos: int, ticket: int) -> tuple[Waiter, ...] | None:
    """The waiters in ``value``, if each is well formed, numbered in order below ``number``."""
    if not isinstance(value, (list, tuple)):
        return None
    waiters: list[Waiter] = []
    for waiter in value:
        if not (isinstance(waiter, (list, tuple)) and len(waiter) == 5):
            return None
        mine, tenant, weight, cost, held = waiter
        after = waiters[-1][0] if waiters else 0
        if not (_is_int(mine) and after < mine < number and isinstance(tenant, str)):
            return None
        if not (_is_int(weight) and 1 <= weight <= MAX_WEIGHT and _is_int(cost) and cost >= 1):
            return None
        if not (_is_int(held) and (held == 0 or pos < held < ticket)):
            return None
        waiters.append((mine, tenant, weight, cost, held))
    return tuple(waiters)


def _leases(value: object, max_running: int, pos: int) -> tuple[Lease, ...] | None:
    """The leases in ``value``, if they are at most ``max_running`` of started tickets in start order."""
    if not isinstance(value, (list, tuple)) or len(value) > max_running:
        return None
    leases: list[Lease] = []
    for lease in value:
        if not (isinstance(lease, (list, tuple)) and len(lease) == 3):
            return None
        held, expiry, token = lease
        after = leases[-1][0] if leases else 0
        if not (_is_int(held) and after < held <= pos and _is_int(expiry) and NEVER <= expiry < MAX_US):
            return None
        if not (_is_int(token) and 0 <= token < MAX_US):
            return None
        leases.append((held, expiry, token))
    return tuple(leases)


def unwritten(exc: Unwritten, place: str, where: str) -> StateCorrupted:
    """The :class:`StateCorrupted` for :class:`~ratequeue.core.protocol.Unwritten` ``exc``.

    ``place`` names the record in the message, ``where`` is the error's
    ``where``; the message names the field, its value, the clock's ``now``
    and the way out (a reset).
    """
    if exc.field in ("ticket", "number"):
        why = f"the last {exc.field} a record can hold: taking another would overflow it"
    else:  # at, held, a hold's end or a lease's expiry, further ahead than the protocol writes
        ahead = MAX_LEAD_US + {"leases": MAX_LEASE_US, "not_before": MAX_HOLD_US}.get(exc.field, 0)
        why = (
            f"more than {ahead // US} s ahead of the state clock (now={exc.now}): "
            f"not a record ratequeue wrote"
        )
    return StateCorrupted(f"{place} has {exc.field}={exc.value}, {why}; reset the queue", where=where)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
