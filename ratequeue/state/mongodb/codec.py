"""What the MongoDB state sends and what it makes of the answers: pure functions, no I/O.

The update pipelines that run the protocol on the server (:func:`pipeline`),
the documents and filters around them, the parsing of the answer an
operation leaves in its document (:data:`PARSERS`: anything unexpected
raises :class:`StateCorrupted` naming where it is), and the URL handling.

A queue's document is ``{_id: name, ticket, pos, at, interval, due, burst,
paused, max_running, leases, held, not_before, pace, paced_at, settled,
answer, expires}``, and ``paused_at`` while it is paused: every field of
its record (integers, microseconds; ``leases`` an array of ``[ticket,
expiry, token]`` arrays in start order; no cap is
``max_running`` 0; no hold is ``not_before`` ``NEVER``, as in a document
written before holds existed, which lacks ``not_before``; no slow-down is
``pace`` 0 and ``paced_at`` ``NEVER``, as in a document written before
slow-downs existed, which lacks both; no settlement is ``settled`` 0, as in
a document written before settlements existed, which lacks it; when the
pause began is ``paused_at``, stored only while ``paused``: a record not paused
stores it not at all, as before pauses were noted, and a paused one that
lacks it was paused by a version that did not note it, ``NEVER``; one left on
a record that is not paused, by an older version's resume, means nothing: it is
read as ``NEVER``, whatever it holds, and the next write drops it). A fair
queue's document also holds ``fair`` (true), ``number``, ``begun`` and
``waiters``, an array of ``[number, tenant, weight, cost, ticket]`` arrays
(:data:`~ratequeue.core.protocol.Waiter`); any other document holds none of
them, and is not fair (one created after fair queues came to the
reference but before this backend ran them holds ``fair`` false and the
others' defaults, and is read as not fair). ``expires`` (a
``Date``; on a test clock, whole microseconds on it) is there while the
record is kept for a while only (``Terms.keep_us``): the collection's TTL
index, and :func:`sweep_filter`, delete the document once it has passed.
``$$NOW`` has millisecond resolution: every ``now`` is a whole millisecond
(in microseconds); intervals keep their microseconds.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Callable, Mapping
from typing import Any, TypeGuard
from urllib.parse import parse_qsl

from pymongo.errors import ConfigurationError as MongoConfigurationError
from pymongo.errors import InvalidURI

from ...core import protocol
from ...core.operation import MAX_WEIGHT, Operation, Terms
from ...core.protocol import (
    FULL_GRACE_US,
    FULL_RECHECK_US,
    MAX_DOUBT_US,
    MAX_HOLD_US,
    MAX_LEAD_US,
    MAX_LEASE_US,
    MAX_SLOW,
    MAX_US,
    NEVER,
    PAUSED_RECHECK_US,
    RECOVER_US,
    Answer,
    Outcome,
    Passed,
    Record,
    Started,
    Taken,
    Unwritten,
    Wait,
)
from ...errors import StateCorrupted
from ..base import Snapshot, split_options
from ..records import FIELDS, check_record, unwritten

DEFAULT_DATABASE = "ratequeue"
DEFAULT_COLLECTION = "queues"

#: a document as the server stores and returns it
Document = Mapping[str, Any]

#: an aggregation or update pipeline
Pipeline = list[dict[str, Any]]

#: the field holding when a record kept for a while may be deleted, and the TTL index on it
EXPIRES = "expires"
TTL_INDEX = "ratequeue_expires"

#: the fields a pipeline works in, gone from the document it leaves
_SCRATCH = ["_was", "_now", "_t", "_bad", "_s", "_e", "_until", "_live", "_mine", "_p", "_n"]

_WHOLE = ["int", "long"]


def _now_expression(fixed_us: int | None) -> Any:
    """The server clock in microseconds, or a fixed value (tests only)."""
    if fixed_us is not None:
        return {"$literal": fixed_us}
    return {"$multiply": [{"$toLong": "$$NOW"}, 1000]}


def _due(step: Any) -> Any:
    """Where slots count from (``protocol._due``): ``due``, or ``step`` before a hold's end if later."""
    return {"$max": ["$due", {"$subtract": ["$not_before", step]}]}


def _slot(ticket: Any, step: Any) -> Any:
    """The strict slot of ``ticket`` with slots ``step`` apart, in fields.

    ``max(due, not_before - step) + (ticket - pos) * step``: from a hold's
    end if that is later than ``due`` (:func:`_due`). With ``step``
    :data:`_SLOWEST` it is :meth:`~ratequeue.core.protocol.Record.slot`; with
    ``$_p`` (:data:`_EFFECTIVE`), the slot
    :func:`~ratequeue.core.protocol.try_start` counts at ``_now``.
    """
    return {"$add": [_due(step), {"$multiply": [{"$subtract": [ticket, "$pos"]}, step]}]}


#: the slowest interval the record's slots count at (:meth:`~ratequeue.core.protocol.Record.slot`):
#: the last slow-down's ``pace`` if it is slower than the interval
_SLOWEST = {"$max": ["$pace", "$interval"]}


def _effective() -> Any:
    """:func:`~ratequeue.core.protocol.effective_interval` at ``_now``, in fields (a long).

    The interval, or more while a slow-down recovers: ``pace``'s excess over
    the interval halved once for every whole :data:`RECOVER_US` since
    ``paced_at`` (none while ``_now`` is not past it), down to none after 53
    halvings. Halving is a division by a power of two, exact in a double for
    the excess (under ``MAX_US``); it is rounded down, as ``>>`` rounds.
    """
    since = {"$subtract": ["$_now", "$paced_at"]}
    halvings = {"$cond": [{"$gt": ["$_now", "$paced_at"]}, {"$floor": {"$divide": [since, RECOVER_US]}}, 0]}
    excess = {"$subtract": ["$pace", "$interval"]}
    halved = {"$toLong": {"$floor": {"$divide": [excess, {"$pow": [2, halvings]}]}}}
    recovering = {"$cond": [{"$lt": [halvings, 53]}, {"$add": ["$interval", halved]}, "$interval"]}
    return {"$toLong": {"$cond": [{"$lte": ["$pace", "$interval"]}, "$interval", recovering]}}


#: ``_p``, the interval slots count at now (:func:`_effective`): before any stage that uses it
_EFFECTIVE: Pipeline = [{"$set": {"_p": _effective()}}]


def _told(kind: str, value: Any, ticket: Any = "$_t") -> dict[str, Any]:
    """An answer: ``kind``, for ``ticket``, with ``value``, at ``_now``."""
    return {"kind": kind, "ticket": ticket, "value": value, "now": "$_now"}


def _where(cond: Any, values: dict[str, Any]) -> dict[str, Any]:
    """Fields of a ``$set``: each of ``values`` where ``cond`` holds, and the field as it was elsewhere."""
    return {field: {"$cond": [cond, value, f"${field}"]} for field, value in values.items()}


def _check_stages(op: Operation) -> Pipeline:
    """Name in ``_bad`` what the protocol refuses (:func:`ratequeue.core.protocol.check`, the last ticket).

    ``_bad`` is ``{kind: "unwritten", field, value, now}`` or ``""``; the
    document as read (``_was``) is put back after the operation's stages
    (in :func:`pipeline`) if it names something.
    """
    horizon = {"$add": ["$_now", {"$literal": MAX_LEAD_US}]}
    latest_expiry = {"$max": {"$map": {"input": "$leases", "as": "l", "in": _expiry("$$l")}}}
    cases: list[tuple[Any, str, Any]] = [
        ({"$gt": ["$at", horizon]}, "at", "$at"),
        ({"$gt": ["$held", horizon]}, "held", "$held"),
        (
            {"$gt": ["$not_before", {"$add": [horizon, {"$literal": MAX_HOLD_US}]}]},
            "not_before",
            "$not_before",
        ),
        ({"$gt": ["$paced_at", horizon]}, "paced_at", "$paced_at"),
        ({"$gt": [_PAUSED_AT, horizon]}, "paused_at", "$paused_at"),
        ({"$gt": [latest_expiry, {"$add": [horizon, {"$literal": MAX_LEASE_US}]}]}, "leases", latest_expiry),
    ]
    taking = op.kind in ("take", "take_and_try", "try_take")
    if taking and not op.terms.fair:  # (a fair take seats, and checks, later)
        cases.append(({"$gte": [{"$add": ["$ticket", {"$literal": op.cost}]}, MAX_US]}, "ticket", "$ticket"))
    branches = [
        {"case": case, "then": {"kind": "unwritten", "field": field, "value": value, "now": "$_now"}}
        for case, field, value in cases
    ]
    return [{"$set": {"_bad": {"$switch": {"branches": branches, "default": ""}}}}]


def _take_stages(op: Operation, unless: Any = False) -> Pipeline:
    """``take`` of ``op.cost``: jump ``pos`` over stale tickets, hand out ``ticket`` into ``_t``.

    Stale: the last ticket is a step past its slot, both counted at ``_p``
    (:data:`_EFFECTIVE`), as :func:`~ratequeue.core.protocol.take` counts
    them. Not while a full queue's grace runs (``held``): the tickets'
    holders wait for a place. Nothing is taken where ``unless`` holds (a
    retried ``take_and_try`` whose first call started a ticket: ``_t`` is
    that one).
    """
    last = {"$subtract": ["$ticket", 1]}
    stale = {
        "$and": [
            {"$not": [unless]},
            {"$gt": [last, "$pos"]},
            {"$lte": [{"$add": [_slot(last, "$_p"), "$_p"]}, "$_now"]},
            {"$lte": [_GRACE_END, "$_now"]},
        ]
    }
    taken = {"_t": "$ticket", "ticket": {"$add": ["$ticket", {"$literal": op.cost}]}}
    return [
        {"$set": _where(stale, {"pos": last})},
        {
            "$set": {
                **_where({"$not": [unless]}, taken),
                "_t": {"$cond": [unless, _holder("$_mine"), "$ticket"]},
            }
        },
    ]


def _lease_stages(op: Operation) -> Pipeline:
    """With ``max_running``: the live leases into ``_live``, the one ``op.token`` names into ``_mine``."""
    if not op.terms.max_running:
        return []
    named = _leases_where("$_live", {"$eq": [_token("$$l"), {"$literal": op.token}]})
    mine = {"$arrayElemAt": [named, 0]} if op.token else "$$REMOVE"
    return [{"$set": {"_live": _LIVE}}, {"$set": {"_mine": mine}}]


#: whether ``_mine`` holds a lease (:func:`_lease_stages`): the operation was carried out before
_ADOPTED = {"$eq": [{"$type": "$_mine"}, "array"]}


def _try_stages(op: Operation, gate: Any = None) -> Pipeline:
    """``try_start`` of ticket ``_t``, of ``op.cost``: set ``answer``; if it starts, ``pos``, ``at``, ``due``.

    A start's ``due`` is the later of its slot and its start, plus
    ``op.doubt_us`` (the starter's doubt of the state's clock). ``_s`` is
    the ticket's strict slot (counted from a hold's end if that is later,
    at ``_p``, the interval slots count at now: :data:`_EFFECTIVE`)
    and ``_e`` its earliest start
    (:meth:`~ratequeue.core.protocol.Record.earliest`: never before a hold
    ends; not before a full queue's grace ends if it would pass an earlier
    ticket). The branches are those of
    :func:`ratequeue.core.protocol.try_start`, in its order. The first,
    :func:`~ratequeue.core.protocol.repeats_start`, answers a repeated call for
    the latest start with that start and changes nothing, so a call re-sent
    after a lost reply keeps its turn. After ``take`` (``take_and_try``)
    ``_t`` is above ``pos``, and that branch never applies.

    With ``max_running``, ``_live`` holds the leases live at ``_now``: a
    ticket that could start while ``max_running`` of them are live waits
    (the answer's kind is ``full`` until the last stage, which makes it
    ``wait``, sets ``held`` to ``_now`` and lets the expired leases go); a
    start appends its lease to the live ones.

    With ``gate`` (a fair queue's turn, :func:`_turn_stages`), all of this
    only where ``gate`` holds: elsewhere ``answer`` and the record stay.
    """
    same_start = {
        "$and": [
            {"$eq": ["$pos", "$_t"]},
            {"$lt": ["$_t", "$ticket"]},
            {"$lt": ["$_now", {"$add": ["$at", "$interval"]}]},
        ]
    }
    passed = {"$or": [{"$gte": ["$pos", "$_t"]}, {"$gte": ["$_t", "$ticket"]}]}
    paused_wait = {"$max": ["$_e", {"$add": ["$_now", {"$literal": PAUSED_RECHECK_US}]}]}
    can_start = {"$gte": [{"$add": ["$_now", {"$literal": op.lead_us}]}, "$_e"]}
    # asked again with its lease's token (the reply to the first call lost): that start again
    repeated = {"$and": [_ADOPTED, {"$eq": [_holder("$_mine"), "$_t"]}]}
    repeated_start = {"$subtract": [_expiry("$_mine"), {"$literal": op.terms.lease_us}]}
    # a start, but not the same start again
    started = {"$and": [{"$eq": ["$answer.kind", "started"]}, {"$ne": ["$pos", "$_t"]}, {"$not": [repeated]}]}
    early = {"$multiply": [{"$subtract": ["$burst", {"$literal": op.cost}]}, "$interval"]}
    passing = {"$gt": ["$_t", {"$add": ["$pos", 1]}]}  # it would pass the tickets between
    grace = {"$cond": [passing, _GRACE_END, "$at"]}
    earliest = {"$max": [{"$subtract": ["$_s", early]}, "$at", "$not_before", grace]}
    stages: Pipeline = [{"$set": {"_s": _slot("$_t", "$_p")}}, {"$set": {"_e": earliest}}]
    due = {"$add": [{"$max": ["$_s", "$answer.value"]}, {"$literal": op.doubt_us}]}
    start = {"pos": "$_t", "at": "$answer.value", "due": due}
    full_branches: list[dict[str, Any]] = []
    after: Pipeline = []
    if op.terms.max_running:
        full = {"$gte": [{"$size": "$_live"}, {"$literal": op.terms.max_running}]}
        first_expiry = {"$min": {"$map": {"input": "$_live", "as": "l", "in": _expiry("$$l")}}}
        recheck = {"$min": [first_expiry, {"$add": ["$_now", {"$literal": FULL_RECHECK_US}]}]}
        full_branches = [
            {"case": {"$and": [can_start, full]}, "then": _told("full", {"$max": ["$_e", recheck]})}
        ]
        expiry = {"$toLong": {"$add": ["$answer.value", {"$literal": op.terms.lease_us}]}}
        lease = [{"$toLong": "$_t"}, expiry, {"$literal": op.token}]
        start["leases"] = {"$concatArrays": ["$_live", [lease]]}
        when_full = {"answer.kind": "wait", "leases": "$_live", "held": {"$toLong": "$_now"}}
        after = [{"$set": _where({"$eq": ["$answer.kind", "full"]}, when_full)}]
    branches = [
        {"case": same_start, "then": _told("started", "$at")},
        *([{"case": repeated, "then": _told("started", repeated_start)}] if op.terms.max_running else []),
        {"case": passed, "then": _told("passed", "$pos")},
        {"case": "$paused", "then": _told("wait", paused_wait)},
        *full_branches,
        {"case": can_start, "then": _told("started", {"$max": ["$_e", "$_now"]})},
    ]
    answer: Any = {"$switch": {"branches": branches, "default": _told("wait", "$_e")}}
    if gate is not None:
        answer = {"$cond": [gate, answer, "$answer"]}
        started = {"$and": [gate, started]}
    return [*stages, {"$set": {"answer": answer}}, {"$set": _where(started, start)}, *after]


def _expiry(lease: str) -> Any:
    """The expiry of ``lease``, a ``[ticket, expiry, token]`` array."""
    return {"$arrayElemAt": [lease, 1]}


def _holder(lease: str) -> Any:
    """The ticket of ``lease``, a ``[ticket, expiry, token]`` array."""
    return {"$arrayElemAt": [lease, 0]}


def _token(lease: str) -> Any:
    """The token of ``lease``, a ``[ticket, expiry, token]`` array."""
    return {"$arrayElemAt": [lease, 2]}


def _own(ticket: int, token: int) -> Any:
    """Whether the lease ``$$l`` is ``ticket``'s, named by ``token``."""
    return {
        "$and": [
            {"$eq": [_holder("$$l"), {"$literal": ticket}]},
            {"$eq": [_token("$$l"), {"$literal": token}]},
        ]
    }


def _leases_where(leases: str, cond: Any) -> Any:
    """The leases (each ``$$l`` in ``cond``) of the array ``leases`` for which ``cond`` holds."""
    return {"$filter": {"input": leases, "as": "l", "cond": cond}}


def _moved(leases: str, own: Any, expiry: Callable[[Any], Any]) -> Any:
    """The array ``leases`` with the expiry ``e`` of each lease ``$$l`` that is ``own`` made ``expiry(e)``."""
    moved = {"$cond": [own, expiry(_expiry("$$l")), _expiry("$$l")]}
    return {"$map": {"input": leases, "as": "l", "in": [_holder("$$l"), moved, _token("$$l")]}}


#: the leases live at ``_now`` (:func:`ratequeue.core.protocol.live_leases`)
_LIVE = _leases_where("$leases", {"$gt": [_expiry("$$l"), "$_now"]})


def _release_stages(op: Operation) -> Pipeline:
    """``release`` of ``op.ticket``'s lease: keep the other live ones; ``value`` 1 if its lease was live.

    When nothing is dropped the leases are written back unchanged, as the
    reference returns the record itself.
    """
    released = {"$cond": [{"$lt": [{"$size": "$leases"}, {"$size": "$_live"}]}, 1, 0]}  # leases: kept
    return [
        {"$set": {"_live": _LIVE}},
        {"$set": {"leases": _leases_where("$_live", {"$not": [_own(op.ticket, op.token)]})}},
        {"$set": {"answer": _told("set", released, {"$literal": op.ticket})}},
    ]


def _renew_stages(op: Operation) -> Pipeline:
    """``renew`` of ``op.ticket``'s lease, if live, to ``_now + lease_us`` at least; drop expired leases.

    The answer's ``value`` is 1 if the lease was live (and renewed), else 0.
    """
    until = {"$toLong": {"$add": ["$_now", {"$literal": op.terms.lease_us}]}}
    own = _own(op.ticket, op.token)
    live = {"$cond": [{"$gt": [{"$size": _leases_where("$_live", own)}, 0]}, 1, 0]}
    renewed = _moved("$_live", own, lambda expiry: {"$max": [expiry, until]})
    return [
        {"$set": {"_live": _LIVE}},
        {"$set": {"answer": _told("set", live, {"$literal": op.ticket}), "leases": renewed}},
    ]


#: when a full queue's grace ends (:data:`~ratequeue.core.protocol.FULL_GRACE_US` after ``held``)
_GRACE_END = {"$add": ["$held", {"$literal": FULL_GRACE_US}]}


def _set_paused_stages(op: Operation) -> Pipeline:
    """``set_paused``: set the flag; the answer's ``value`` is 1 if that changed it, else 0.

    A pause that begins sets ``paused_at`` to ``_now``; a resume removes it.
    A pause asked again keeps the first one's (or its absence, a pause not
    noted by an older version); a resume of a queue not paused leaves it
    missing (:func:`pipeline` dropped one an older version's resume left).
    """
    changed = {"$ne": ["$paused", {"$literal": op.paused}]}
    since = {"$toLong": "$_now"} if op.paused else "$$REMOVE"
    return [
        {
            "$set": {
                "answer": _told("set", {"$cond": [changed, 1, 0]}, 0),
                "paused": {"$literal": op.paused},
                "paused_at": {"$cond": [changed, since, "$paused_at"]},
            }
        }
    ]


def _hold_stages(op: Operation) -> Pipeline:
    """``hold``: ``not_before`` to ``_now + lead_us`` if that is later; ``value`` 1 if it moved, else 0."""
    until = {"$toLong": {"$add": ["$_now", {"$literal": op.lead_us}]}}
    moved = {"$cond": [{"$gt": [until, "$not_before"]}, 1, 0]}
    return [{"$set": {"answer": _told("set", moved, 0), "not_before": {"$max": ["$not_before", until]}}}]


def _lift_stages(op: Operation) -> Pipeline:
    """``lift``: ``not_before`` to ``NEVER``; ``value`` 1 if a hold was on at ``_now``, else 0.

    A hold that has ended is cleared as well (answering 0); a record without
    one is written back unchanged.
    """
    on_now = {"$and": [{"$ne": ["$not_before", {"$literal": NEVER}]}, {"$gt": ["$not_before", "$_now"]}]}
    on = {"$cond": [on_now, 1, 0]}
    return [{"$set": {"answer": _told("set", on, 0), "not_before": {"$literal": NEVER}}}]


def _slow_stages(op: Operation) -> Pipeline:
    """``slow``: ``pace`` to ``lead_us`` (0: twice ``_p``), at most the cap, if slower than ``_p``.

    ``_p`` is the interval slots count at now (:data:`_EFFECTIVE`); the cap
    is :data:`MAX_SLOW` intervals, and so that ``burst`` slots stay under
    ``MAX_US`` (the terms' interval and burst: the filter matched them).
    Slowing sets ``paced_at`` to ``_now``; the answer's ``value`` is 1 if it
    slowed the queue, else 0 (the record unchanged).
    """
    cap = min(MAX_SLOW * op.terms.interval_us, (MAX_US - 1) // op.terms.burst)
    wanted = {"$literal": op.lead_us} if op.lead_us > 0 else {"$multiply": ["$_p", 2]}
    slowed = {"$gt": ["$_n", "$_p"]}
    paced = {"pace": "$_n", "paced_at": {"$toLong": "$_now"}}
    return [
        {"$set": {"_n": {"$toLong": {"$min": [wanted, {"$literal": cap}]}}}},
        {"$set": {"answer": _told("set", {"$cond": [slowed, 1, 0]}, 0), **_where(slowed, paced)}},
    ]


def _retime_stages(op: Operation) -> Pipeline:
    """``retime`` of ``op.ticket``: while it is the latest start, move ``at`` to ``_now + lead_us``.

    ``due`` and the ticket's lease, if it holds one, move on by as much as
    its start (``due`` to the start plus ``op.doubt_us`` at least), so that
    what the start added to ``due`` (a doubt, an overrun) stays.
    """
    ticket = op.ticket
    latest = {"$and": [{"$eq": ["$pos", ticket]}, {"$lt": [ticket, "$ticket"]}]}
    start = {"$max": ["$at", {"$add": ["$_now", {"$literal": op.lead_us}]}]}
    moved = {"$subtract": [start, "$at"]}
    own = {"$eq": [_holder("$$l"), {"$literal": ticket}]}
    shifted = _moved("$leases", own, lambda expiry: {"$toLong": {"$add": [expiry, moved]}})
    told = {"$literal": ticket}
    answer = {"$cond": [latest, _told("started", start, told), _told("passed", "$pos", told)]}
    after = {"$toLong": {"$add": [start, {"$literal": op.doubt_us}]}}
    retimed = {"at": start, "due": {"$max": [{"$add": ["$due", moved]}, after]}, "leases": shifted}
    return [{"$set": {"answer": answer, **_where(latest, retimed)}}]


def _ceil_ms(us: Any) -> Any:
    """``us`` (whole microseconds, an integer) in whole milliseconds, rounded up, as an integer.

    In integers throughout (``$divide`` of an exact multiple of 1000), so
    that no double rounds a keep time down.
    """
    rest = {"$mod": [us, 1000]}
    whole = {"$toLong": {"$divide": [{"$subtract": [us, rest]}, 1000]}}
    return {"$add": [whole, {"$cond": [{"$gt": [rest, 0]}, 1, 0]}]}


def _keep_stages(keep_us: int, fixed: bool) -> Pipeline:
    """Set ``expires`` to when the record written may be deleted; remove it when ``keep_us`` is 0.

    That is ``keep_us`` after the later of ``_now`` and
    :func:`ratequeue.core.protocol.expires` (``slot(ticket) + interval``, so
    no sooner than an interval after a hold ends, both counted at the
    slowest pace a slow-down left (:data:`_SLOWEST`), the
    grace after ``held`` and every lease's expiry), as a
    ``Date`` rounded up to the millisecond. A test clock's (``fixed``) is
    kept as whole microseconds on that clock instead: an integer, which the
    server's TTL monitor (reading its real clock) leaves alone, and which
    only :func:`sweep_filter` of a test clock deletes. A keep time past
    ``MAX_US`` (about 2112) is none: the record is kept. So is a paused
    record (:func:`ratequeue.core.protocol.set_paused`), until it is resumed.
    """
    if not keep_us:
        return [{"$unset": EXPIRES}]
    ends = {"$max": [{"$add": [_slot("$ticket", _SLOWEST), _SLOWEST]}, _GRACE_END]}
    expires = {
        "$reduce": {"input": "$leases", "initialValue": ends, "in": {"$max": ["$$value", _expiry("$$this")]}}
    }
    until = {"$add": [{"$max": [expires, "$_now"]}, {"$literal": keep_us}]}
    stored = "$_until" if fixed else {"$toDate": _ceil_ms("$_until")}
    kept = {"$and": [{"$lt": ["$_until", MAX_US]}, {"$not": ["$paused"]}]}
    return [
        {"$set": {"_until": until}},
        {"$set": {EXPIRES: {"$cond": [kept, stored, "$$REMOVE"]}}},
    ]


def _settle_stages(op: Operation) -> Pipeline:
    """``settle`` of ``op.ticket``, started for ``op.cost``, whose actual cost is ``op.lead_us``.

    As :func:`ratequeue.core.protocol.settle`: nothing moves for a ticket
    above ``pos``, on a record that never started one, for the ticket
    ``settled`` last, or for an actual cost equal to the estimate. An
    overrun moves ``due`` on by the excess at ``_p`` (:data:`_EFFECTIVE`),
    to ``at + (burst - 1)`` slowest paces at most, and never back (a
    doubt may have put ``due`` past that cap already: then nothing moves,
    as ``moved`` compares with ``due``); a refund moves it back by the
    saving at the interval, never below ``at + (pos - ticket - cost) *
    interval``. A move sets ``settled`` to the ticket; the answer's
    ``value`` is 1 if ``due`` moved, else 0 (the record unchanged).

    The floor's multiplier is clamped to ``-burst`` (no lower while it
    applies: the ticket is at most ``pos``) and to the first count of
    intervals reaching ``MAX_US`` (a floor past every ``due`` the filter
    lets through, which moves nothing, as a higher one would): the
    product stays exact in an int64.
    """
    terms, ticket, estimate, actual = op.terms, op.ticket, op.cost, op.lead_us
    told = {"$literal": ticket}
    if actual == estimate:
        return [{"$set": {"answer": _told("set", 0, told)}}]
    counts = {
        "$and": [
            {"$lte": [told, "$pos"]},
            {"$ne": ["$at", {"$literal": NEVER}]},
            {"$ne": ["$settled", told]},
        ]
    }
    interval = terms.interval_us
    if actual > estimate:
        slowest = min(MAX_SLOW * interval, (MAX_US - 1) // terms.burst)
        most = {"$add": ["$at", {"$literal": (terms.burst - 1) * slowest}]}
        later = {"$add": ["$due", {"$multiply": [{"$literal": actual - estimate}, "$_p"]}]}
        wanted: Any = {"$min": [later, most]}
        moved = {"$gt": ["$_n", "$due"]}
        stages: Pipeline = [*_EFFECTIVE]
    else:
        reach = -(-MAX_US // interval)  # intervals enough to reach MAX_US
        behind: Any = {"$toLong": {"$subtract": ["$pos", {"$literal": ticket + estimate}]}}
        behind = {"$max": [{"$min": [behind, {"$literal": reach}]}, {"$literal": -terms.burst}]}
        floor = {"$add": ["$at", {"$multiply": [behind, {"$literal": interval}]}]}
        earlier = {"$subtract": ["$due", {"$literal": (estimate - actual) * interval}]}
        wanted = {"$max": [earlier, floor]}
        moved = {"$lt": ["$_n", "$due"]}
        stages = []
    settled = {"due": "$_n", "settled": told}
    return [
        *stages,
        {"$set": {"_n": {"$cond": [counts, {"$toLong": wanted}, "$due"]}}},
        {"$set": {"answer": _told("set", {"$cond": [moved, 1, 0]}, told), **_where(moved, settled)}},
    ]


def _of(waiter: Any, index: int) -> Any:
    """Field ``index`` of ``waiter``, a fair queue's ``[number, tenant, weight, cost, ticket]`` array."""
    return {"$arrayElemAt": [waiter, index]}


def _waiters_where(cond: Any, name: str = "w", waiters: Any = "$waiters") -> Any:
    """The waiters (each ``$$name`` in ``cond``) of ``waiters`` for which ``cond`` holds."""
    return {"$filter": {"input": waiters, "as": name, "cond": cond}}


def _unwritten_unless_bad(cond: Any, field: str, value: Any) -> dict[str, Any]:
    """``_bad`` (for a ``$set``): ``field`` (``value``) refused where ``cond`` holds, unless already."""
    refused = {"kind": "unwritten", "field": field, "value": value, "now": "$_now"}
    return {"_bad": {"$cond": [{"$and": [{"$eq": ["$_bad", ""]}, cond]}, refused, "$_bad"]}}


def _seat(cond: Any, waiters: Any) -> Any:
    """``_seat``: :func:`ratequeue.core.protocol._seated` of ``waiters`` where ``cond`` holds, else missing.

    The waiters whose tickets were passed (at or below ``pos``) are dropped;
    then, in order, each waiter without a ticket whose tenant holds fewer
    than its weight gets the next one (``cost`` numbers). ``held`` lists
    the tenant of every ticket held so far (of the waiters kept, then of
    those seated). The result is ``{out, ticket, bad}``: the waiters, the
    next ticket, and the ticket at which the first seat would pass the last
    one a record holds (0: none), which refuses the operation
    (:func:`_seated_stages`). (Few stages, each doing much: a stage costs
    more than an expression on some servers.)
    """
    passed = {"$and": [{"$gt": [_of("$$w", 4), 0]}, {"$lte": [_of("$$w", 4), "$pos"]}]}
    kept = _waiters_where({"$not": [passed]}, waiters=waiters)
    holders = {
        "$map": {
            "input": _waiters_where({"$gt": [_of("$$w", 4), 0]}, waiters="$$kept"),
            "as": "w",
            "in": _of("$$w", 1),
        }
    }
    holding = {"$size": {"$filter": {"input": "$$value.held", "as": "h", "cond": {"$eq": ["$$h", "$$t"]}}}}
    overflows = {"$gte": [{"$add": ["$$value.ticket", "$$c"]}, {"$literal": MAX_US}]}
    waiter = [_of("$$this", 0), "$$t", _of("$$this", 2), "$$c", "$$value.ticket"]
    seated = {
        "out": {"$concatArrays": ["$$value.out", [waiter]]},
        "ticket": {"$add": ["$$value.ticket", "$$c"]},
        "held": {"$concatArrays": ["$$value.held", ["$$t"]]},
        "bad": "$$value.bad",
    }
    kept_as_is = {
        "out": {"$concatArrays": ["$$value.out", ["$$this"]]},
        "ticket": "$$value.ticket",
        "held": "$$value.held",
        "bad": "$$value.bad",
    }
    first_bad = {"$cond": [{"$eq": ["$$value.bad", 0]}, "$$value.ticket", "$$value.bad"]}
    refused = {**kept_as_is, "bad": first_bad}  # (the operation is refused: the rest does not matter)
    free = {"$cond": [{"$eq": [_of("$$this", 4), 0]}, {"$lt": [holding, _of("$$this", 2)]}, False]}
    step = {
        "$let": {
            "vars": {"t": _of("$$this", 1), "c": _of("$$this", 3)},
            "in": {"$cond": [free, {"$cond": [overflows, refused, seated]}, kept_as_is]},
        }
    }
    start = {"out": [], "ticket": "$ticket", "held": holders, "bad": 0}
    seat = {"$reduce": {"input": "$$kept", "initialValue": start, "in": step}}
    return {"$cond": [cond, {"$let": {"vars": {"kept": kept}, "in": seat}}, "$$REMOVE"]}


def _seated_stages() -> Pipeline:
    """The waiters and next ticket :func:`_seat` left in ``_seat``, if any; a ticket past the last refuses."""
    seated = {"$eq": [{"$type": "$_seat"}, "object"]}
    return [
        {
            "$set": {
                **_where(seated, {"waiters": "$_seat.out", "ticket": "$_seat.ticket"}),
                **_unwritten_unless_bad(
                    {"$and": [seated, {"$gt": ["$_seat.bad", 0]}]}, "ticket", "$_seat.bad"
                ),
            }
        }
    ]


def _enqueue_stages(op: Operation, unless: Any = False) -> Pipeline:
    """:func:`ratequeue.core.protocol.enqueue`: G4's jump (as ``take`` of cost 0), a waiter, seated.

    The new waiter's number goes into ``_n``. Nothing is done where
    ``unless`` holds (a retried fair ``take_and_try`` whose first call
    started a ticket: it is answered again).
    """
    last = {"$subtract": ["$ticket", 1]}
    stale = {
        "$and": [
            {"$not": [unless]},
            {"$gt": [last, "$pos"]},
            {"$lte": [{"$add": [_slot(last, "$_p"), "$_p"]}, "$_now"]},
            {"$lte": [_GRACE_END, "$_now"]},
        ]
    }
    waiter = ["$number", {"$literal": op.tenant}, {"$literal": op.weight}, {"$literal": op.cost}, 0]
    queued = {"$concatArrays": ["$waiters", [waiter]]}
    last_number = {"$and": [{"$not": [unless]}, {"$gte": [{"$add": ["$number", 1]}, {"$literal": MAX_US}]}]}
    return [
        {"$set": _where(stale, {"pos": last})},
        {
            "$set": {
                **_unwritten_unless_bad(last_number, "number", "$number"),
                "_n": "$number",
                **_where({"$not": [unless]}, {"number": {"$add": ["$number", 1]}}),
                "_seat": _seat({"$not": [unless]}, queued),
            }
        },
        *_seated_stages(),
    ]


def _turn_stages(op: Operation, number: Any, adopted_first: bool) -> Pipeline:
    """:func:`ratequeue.core.protocol.try_turn` of waiter ``number``: set ``answer``, start, reseat.

    ``_f`` names the case, in the reference's order: ``begun`` (the latest
    start asked for again), ``repeat`` (a live lease's token: that start
    again), ``passed`` (no such waiter, ``_w``), ``unseated`` (a waiter
    without a ticket waits for its tenant's first ticket's earliest start,
    an interval from now at least), ``try`` (the waiter's ticket ``_t`` is
    tried as ``try_start`` tries it, :func:`_try_stages`: started, the
    waiter leaves and ``begun`` names it; a wait or a pass names the waiter;
    a start or a pass reseats, :func:`_seat`). ``adopted_first``: the
    lease's repeat comes first (a fair ``take_and_try``: its waiter was not added).
    """
    lease_repeat = [{"case": _ADOPTED, "then": "repeat"}] if op.terms.max_running and op.token else []
    begun = {
        "$and": [
            {"$eq": [number, "$begun"]},
            {"$lt": ["$pos", "$ticket"]},
            {"$lt": ["$_now", {"$add": ["$at", "$interval"]}]},
        ]
    }
    found = _waiters_where({"$eq": [_of("$$w", 0), number]})
    mine = {"$arrayElemAt": [found, 0]}
    branches = [
        *(lease_repeat if adopted_first else []),
        {"case": begun, "then": "begun"},
        *([] if adopted_first else lease_repeat),
        {"case": {"$eq": [{"$size": "$$found"}, 0]}, "then": "passed"},
        {
            "case": {"$in": [0, {"$map": {"input": "$$found", "as": "w", "in": _of("$$w", 4)}}]},
            "then": "unseated",
        },
    ]
    case = {"$let": {"vars": {"found": found}, "in": {"$switch": {"branches": branches, "default": "try"}}}}
    of_tenant = {"$and": [{"$eq": [_of("$$w", 1), _of("$_w", 1)]}, {"$gt": [_of("$$w", 4), 0]}]}
    tickets = {"$map": {"input": _waiters_where(of_tenant), "as": "w", "in": _of("$$w", 4)}}
    early = {"$multiply": [{"$subtract": ["$burst", {"$literal": op.cost}]}, "$interval"]}
    earliest = {"$max": [{"$subtract": [_slot("$$first", _SLOWEST), early]}, "$at", "$not_before"]}
    soonest = {"$add": ["$_now", "$_p"]}
    after = {"$cond": [{"$gt": ["$$first", "$pos"]}, earliest, soonest]}
    # without a burst, an interval more for each waiter of its tenant without a ticket before it
    before_me = {
        "$and": [
            {"$eq": [_of("$$w", 1), _of("$_w", 1)]},
            {"$eq": [_of("$$w", 4), 0]},
            {"$lt": [_of("$$w", 0), number]},
        ]
    }
    ahead = {"$multiply": [{"$size": _waiters_where(before_me)}, "$interval"]}
    later = {"$add": [after, {"$cond": [{"$eq": ["$burst", 1]}, ahead, 0]}]}
    unseated_wait = {
        "$let": {"vars": {"first": {"$ifNull": [{"$min": tickets}, 0]}}, "in": {"$max": [later, soonest]}}
    }
    repeated_start = {"$subtract": [_expiry("$_mine"), {"$literal": op.terms.lease_us}]}
    answers = {
        "begun": _told("started", "$at", "$pos"),
        "repeat": _told("started", repeated_start, _holder("$_mine")),
        "passed": _told("passed", "$pos", number),
        "unseated": _told("wait", unseated_wait, number),
    }
    cases = [{"case": {"$eq": ["$_f", name]}, "then": then} for name, then in answers.items()]
    told = {"$switch": {"branches": cases, "default": "$answer"}}
    trying = {"$eq": ["$_f", "try"]}
    started = {"$and": [trying, {"$eq": ["$answer.kind", "started"]}]}
    renamed = {"$and": [trying, {"$ne": ["$answer.kind", "started"]}]}
    named = {"$mergeObjects": ["$answer", {"ticket": number}]}
    left = {"$cond": [started, _waiters_where({"$ne": [_of("$$w", 0), number]}), "$waiters"]}
    return [
        {"$set": {"_w": mine, "_f": case}},
        {"$set": {"answer": told, "_t": {"$cond": [trying, _of("$_w", 4), 0]}}},
        *_try_stages(op, trying),
        {
            "$set": {
                "answer": {"$cond": [renamed, named, "$answer"]},
                **_where(started, {"begun": number}),
                "_seat": _seat({"$and": [trying, {"$ne": ["$answer.kind", "wait"]}]}, left),
            }
        },
        *_seated_stages(),
    ]


def _fair_take_and_try(op: Operation) -> Pipeline:
    """A fair queue's ``take_and_try`` and ``try_take``: :func:`~ratequeue.core.protocol.enqueue_and_try`."""
    return [
        *_EFFECTIVE,
        *_lease_stages(op),
        *_enqueue_stages(op, _ADOPTED if op.terms.max_running and op.token else False),
        *_turn_stages(op, "$_n", adopted_first=True),
    ]


#: the stages of a fair queue's take, try_start, take_and_try and try_take (the other kinds run as on
#: any queue)
_FAIR_STAGES: dict[str, Callable[[Operation], Pipeline]] = {
    "take": lambda op: [
        *_EFFECTIVE,
        *_enqueue_stages(op),
        {"$set": {"answer": _told("taken", "$pos", "$_n")}},
    ],
    "try_start": lambda op: [
        *_EFFECTIVE,
        *_lease_stages(op),
        *_turn_stages(op, {"$literal": op.ticket}, adopted_first=False),
    ],
    "take_and_try": _fair_take_and_try,
    "try_take": _fair_take_and_try,
}

#: the fields a fair queue's pipeline works in besides :data:`_SCRATCH`
_FAIR_SCRATCH = ["_seat", "_w", "_f"]


def _take_and_try(op: Operation) -> Pipeline:
    """``take_and_try`` (and ``try_take``): ``take``, then ``try_start`` of the ticket taken."""
    return [
        *_EFFECTIVE,
        *_lease_stages(op),
        *_take_stages(op, _ADOPTED if op.terms.max_running and op.token else False),
        *_try_stages(op),
    ]


#: the stages of each kind of operation, between the checks and the keep time (``try_take`` runs
#: ``take_and_try``'s; :func:`pipeline` puts the document back unless it started)
_STAGES: dict[str, Callable[[Operation], Pipeline]] = {
    "take": lambda op: [*_EFFECTIVE, *_take_stages(op), {"$set": {"answer": _told("taken", "$pos")}}],
    "try_start": lambda op: [
        {"$set": {"_t": {"$literal": op.ticket}}},
        *_EFFECTIVE,
        *_lease_stages(op),
        *_try_stages(op),
    ],
    "take_and_try": _take_and_try,
    "try_take": _take_and_try,
    "retime": _retime_stages,
    "set_paused": _set_paused_stages,
    "release": _release_stages,
    "renew": _renew_stages,
    "hold": _hold_stages,
    "lift": _lift_stages,
    "slow": lambda op: [*_EFFECTIVE, *_slow_stages(op)],
    "settle": _settle_stages,
}


def pipeline(op: Operation, now_us: int | None) -> Pipeline:
    """The update pipeline of ``op``; it leaves its answer in the document's ``answer``.

    ``try_take`` runs the stages of ``take_and_try`` (on a fair queue too);
    unless it starts, the document is put back as it was read (its
    ``expires`` too), answering ``take_and_try``'s answer
    (:func:`ratequeue.core.protocol.try_take`).

    :param now_us: a fixed ``now`` (tests only), or ``None`` for the server's ``$$NOW``.
    """
    refused = {"$mergeObjects": ["$_was", {"answer": "$_bad"}]}
    written: Any = "$$ROOT"
    if op.kind == "try_take":  # no start: nothing written but the answer
        untaken = {"$mergeObjects": ["$_was", {"answer": "$answer"}]}
        written = {"$cond": [{"$eq": ["$answer.kind", "started"]}, "$$ROOT", untaken]}
    fair = op.terms.fair and op.kind in _FAIR_STAGES
    # a document written before holds existed has no ``not_before``: no hold (``NEVER``); one
    # written before slow-downs has no ``pace`` and ``paced_at``: none (0, ``NEVER``); one written
    # before settlements has no ``settled``: none (0); a ``paused_at`` on a record that is not
    # paused (left by an older version's resume) means nothing: dropped, so the write leaves none
    read = {
        "_was": "$$ROOT",
        "_now": _now_expression(now_us),
        "not_before": _NOT_BEFORE,
        "pace": _PACE,
        "paced_at": _PACED_AT,
        "settled": _SETTLED,
        "paused_at": {"$cond": ["$paused", "$paused_at", "$$REMOVE"]},
    }
    if fair:  # a fair record's waiters (none where the document lacks them)
        read["waiters"] = {"$ifNull": ["$waiters", []]}
    return [
        {"$set": read},  # the document as read, the clock, the hold, the slow-down, the settlement, the pause
        *_check_stages(op),
        *(_FAIR_STAGES if fair else _STAGES)[op.kind](op),
        *_keep_stages(op.terms.keep_us, now_us is not None),
        # a refusal named in ``_bad`` puts the document back as it was read, answering ``_bad`` (as
        # does a try_take that did not start, answering its wait: ``written``)
        {"$replaceWith": {"$cond": [{"$ne": ["$_bad", ""]}, refused, written]}},
        {"$unset": _SCRATCH + _FAIR_SCRATCH if fair else _SCRATCH},
    ]


#: the stored ``not_before``, or ``NEVER`` where it is missing (a document older than holds)
_NOT_BEFORE = {"$ifNull": ["$not_before", {"$literal": NEVER}]}

#: the stored ``pace``, or 0 where it is missing (a document older than slow-downs)
_PACE = {"$ifNull": ["$pace", 0]}

#: the stored ``paced_at``, or ``NEVER`` where it is missing (a document older than slow-downs)
_PACED_AT = {"$ifNull": ["$paced_at", {"$literal": NEVER}]}

#: the stored ``settled``, or 0 where it is missing (a document older than settlements)
_SETTLED = {"$ifNull": ["$settled", 0]}

#: the stored ``paused_at``, or ``NEVER`` where it is missing (not paused, or paused by an older
#: version); after :func:`pipeline`'s first stage, which drops one on a record that is not paused
_PAUSED_AT = {"$ifNull": ["$paused_at", {"$literal": NEVER}]}


def read_pipeline(name: str, now_us: int | None) -> Pipeline:
    """An aggregation returning ``name``'s document with the server clock in ``_now``; changes nothing."""
    return [{"$match": {"_id": name}}, {"$set": {"_now": _now_expression(now_us)}}]


def names_pipeline(prefix: str) -> Pipeline:
    """An aggregation returning every ``_id`` that is a string beginning with ``prefix``."""
    match: dict[str, Any] = {"$type": "string"}
    if prefix:
        match["$regex"] = "^" + re.escape(prefix)
    return [{"$match": {"_id": match}}, {"$project": {"_id": 1}}]


def sweep_filter(now_us: int | None) -> dict[str, Any]:
    """The documents whose keep time has passed on the server's clock (or on a fixed ``now_us``, tests only).

    The comparison is of whole milliseconds (``$toLong`` of both dates):
    secantusdb 0.7 compares a stored ``Date`` with ``$$NOW`` wrongly (every
    one is found equal, and none older or newer), MongoDB either way.
    """
    if now_us is not None:  # a test clock keeps integers (see _keep_stages), never Dates
        return {EXPIRES: {"$type": _WHOLE, "$lte": now_us}}
    due = {"$lte": [{"$toLong": f"${EXPIRES}"}, {"$toLong": "$$NOW"}]}
    return {
        EXPIRES: {"$type": "date"},
        "$expr": {"$cond": [{"$eq": [{"$type": f"${EXPIRES}"}, "date"]}, due, False]},
    }


def initial_document(name: str, terms: Terms) -> dict[str, Any]:
    """The record of a queue that has handed out no ticket yet, as :func:`~ratequeue.core.protocol.new_record`
    makes it (no cap: ``max_running`` 0).
    """
    record = protocol.new_record(terms.interval_us, terms.burst, terms.max_running, terms.fair)
    fields = dict(zip(_UNFAIR, record, strict=False))  # (a queue that is not fair stores no fair fields)
    document: dict[str, Any] = {"_id": name, **fields, "max_running": terms.max_running or 0, "leases": []}
    if terms.fair:
        document.update(fair=True, number=record.number, begun=record.begun, waiters=[])
    return document


#: the fields of a record that is not fair, as stored before fair queues existed
_UNFAIR = Record._fields[: Record._fields.index("fair")]


def update_filter(name: str, terms: Terms) -> dict[str, Any]:
    """The filter of every update: ``name``'s document, with these terms, well formed.

    A record whose fields are not whole numbers in range matches nothing, so
    it is reported as corrupted (by the creation path) and never changed.
    What depends on the server clock (an ``at`` too far ahead of ``$$NOW``)
    is checked inside the pipeline instead (:func:`_check_stages`), where
    ``now`` is known and a test clock applies. The ranges are those of
    :func:`~ratequeue.state.records.check_record`.
    """
    # a slow-down's pace: at most MAX_SLOW intervals, and ``burst`` of it under MAX_US
    slowest = min(MAX_SLOW * terms.interval_us, (MAX_US - 1) // terms.burst)
    # ``due`` at most ``burst - 1`` slots after ``at``, at the slowest pace a slow-down may set (a due
    # written then outlives a later, faster pace), and a starter's doubt (MAX_DOUBT_US) more, and at
    # most a burst of intervals before it (as far back as a settlement's refund moves it)
    late = {"$literal": (terms.burst - 1) * slowest + MAX_DOUBT_US}
    early = {"$literal": terms.burst * terms.interval_us}
    holder, expiry, token = _holder("$$this"), _expiry("$$this"), _token("$$this")
    whole = [{"$in": [{"$type": value}, _WHOLE]} for value in (holder, expiry, token)]
    lease = {
        "$and": [
            {"$isArray": "$$this"},
            {"$eq": [{"$size": "$$this"}, 3]},
            *whole,
            {"$gt": [holder, "$$value"]},  # tickets rising: leases are taken in start order
            *_within(NEVER, expiry, MAX_US),
            *_within(0, token, MAX_US),
        ]
    }
    # the last lease's ticket if every lease is well formed (at most pos: a started ticket), else MAX_US
    last_holder = {
        "$reduce": {"input": "$leases", "initialValue": 0, "in": {"$cond": [lease, holder, MAX_US]}}
    }
    return {
        "_id": name,
        "interval": terms.interval_us,
        "burst": {"$eq": terms.burst, "$type": _WHOLE},
        "max_running": {"$eq": terms.max_running or 0, "$type": _WHOLE},
        "paused": {"$type": "bool"},
        "leases": {"$type": "array"},
        **{field: {"$type": _WHOLE} for field in ("ticket", "pos", "at", "due", "held")},
        "$expr": {
            "$and": [
                # ``not_before`` whole (or missing: a document older than holds), as ``held`` is
                {"$in": [{"$type": "$not_before"}, ["missing", *_WHOLE]]},
                *_within(NEVER, _NOT_BEFORE, MAX_US),
                # ``pace`` and ``paced_at`` whole or missing (a document older than slow-downs)
                *({"$in": [{"$type": f"${field}"}, ["missing", *_WHOLE]]} for field in ("pace", "paced_at")),
                {"$lte": [0, _PACE]},
                {"$lte": [_PACE, {"$literal": slowest}]},
                *_within(NEVER, _PACED_AT, MAX_US),
                # ``settled`` whole or missing (a document older than settlements), a started ticket
                {"$in": [{"$type": "$settled"}, ["missing", *_WHOLE]]},
                {"$lte": [0, _SETTLED]},
                {"$lte": [_SETTLED, "$pos"]},
                # while paused, ``paused_at`` whole or missing (paused by an older version); on a
                # record that is not paused, anything (left by an older version's resume: ignored)
                {
                    "$or": [
                        {"$not": ["$paused"]},
                        {
                            "$and": [
                                {"$in": [{"$type": "$paused_at"}, ["missing", *_WHOLE]]},
                                *_within(NEVER, _PAUSED_AT, MAX_US),
                            ]
                        },
                    ]
                },
                *_within(0, "$pos", "$ticket"),
                {"$lt": ["$ticket", MAX_US]},
                *_within(NEVER, "$at", MAX_US),
                {"$lte": [{"$subtract": ["$at", early]}, "$due"]},
                {"$lte": ["$due", {"$add": ["$at", late]}]},
                *_within(NEVER, "$held", MAX_US),
                {"$lte": [{"$size": "$leases"}, {"$literal": terms.max_running or 0}]},
                {"$lte": [last_holder, "$pos"]},
                *(_fair_filter() if terms.fair else _unfair_filter()),
            ]
        },
    }


def _unfair_filter() -> list[Any]:
    """A record that is not fair: no ``fair`` (a document older than fair queues), or ``false``."""
    return [{"$or": [{"$eq": [{"$type": "$fair"}, "missing"]}, {"$eq": ["$fair", False]}]}]


def _fair_filter() -> list[Any]:
    """A fair record, its fields as :func:`~ratequeue.state.records.check_record` takes them.

    ``fair`` true, ``number`` from 1, ``begun`` below it, and ``waiters``
    (missing: none) an array of ``[number, tenant, weight, cost, ticket]``
    arrays, numbers rising below ``number``, each ticket 0 or one not yet
    started (above ``pos``, below ``ticket``).
    """
    mine, tenant, weight, cost, held = (_of("$$this", index) for index in range(5))
    waiter = {
        "$and": [
            {"$isArray": "$$this"},
            {"$eq": [{"$size": "$$this"}, 5]},
            *({"$in": [{"$type": value}, _WHOLE]} for value in (mine, weight, cost, held)),
            {"$eq": [{"$type": tenant}, "string"]},
            {"$gt": [mine, "$$value"]},  # numbers rising
            {"$lte": [1, weight]},
            {"$lte": [weight, {"$literal": MAX_WEIGHT}]},
            {"$lte": [1, cost]},
            {"$or": [{"$eq": [held, 0]}, {"$and": [{"$lt": ["$pos", held]}, {"$lt": [held, "$ticket"]}]}]},
        ]
    }
    # the last waiter's number if every waiter is well formed, else MAX_US (never below ``number``)
    last = {"$reduce": {"input": "$waiters", "initialValue": 0, "in": {"$cond": [waiter, mine, MAX_US]}}}
    return [
        {"$eq": ["$fair", True]},
        *({"$in": [{"$type": f"${field}"}, _WHOLE]} for field in ("number", "begun")),
        *_within(1, "$number", MAX_US),
        *_within(0, "$begun", "$number"),
        {"$in": [{"$type": "$waiters"}, ["missing", "array"]]},
        {"$lt": [{"$ifNull": [last, 0]}, "$number"]},
    ]


def _within(low: Any, value: Any, high: Any) -> list[Any]:
    """``low <= value < high``, as two conditions."""
    return [{"$lte": [low, value]}, {"$lt": [value, high]}]


#: the fields of a stored record: :data:`~ratequeue.state.records.FIELDS`, and ``not_before``, ``pace``,
#: ``paced_at``, ``settled`` and ``paused_at`` where present, and a fair queue's ``fair``, ``number``,
#: ``begun``, ``waiters``
_STORED = (
    *FIELDS,
    *("not_before", "pace", "paced_at", "settled", "paused_at"),
    *("fair", "number", "begun", "waiters"),
)


def check_document(document: Document, where: str) -> Record:
    """The record in ``document``, or :class:`StateCorrupted` naming ``where`` it is.

    A document without ``not_before`` (written before holds existed) holds no
    hold; one without ``pace`` and ``paced_at`` (written before slow-downs) no
    slow-down; one without ``settled`` (written before settlements) no settlement;
    one without ``paused_at`` (not paused, or paused by an older version) ``NEVER``,
    as one that is not paused, whatever its ``paused_at`` (an older version's
    resume leaves it).
    """
    return check_record({key: document[key] for key in _STORED if key in document}, where=where)


def read_snapshot(row: Document, where: str) -> Snapshot:
    """The record of a :func:`read_pipeline` row and the server clock it carries, both checked.

    The record is checked against that clock too (:func:`ratequeue.core.protocol.check`).
    """
    record = check_document(row, where)
    now = row.get("_now")
    if not _whole(now):
        raise StateCorrupted(f"the clock read with {where} is {now!r}; want whole microseconds", where=where)
    try:
        protocol.check(record, now)
    except Unwritten as exc:
        raise unwritten(exc, f"record at {where}", where) from None
    return Snapshot(record=record, now=now)


def check_well_formed(document: Document, where: str) -> None:
    """Raise :class:`StateCorrupted` if ``document`` would not match :func:`update_filter` (terms aside).

    Its record is one :func:`check_document` takes: only a null time (``NEVER``
    to a record, not a whole number to the filter) is left to refuse (and a
    ``pace`` :func:`check_document` reads as 0: null, false, 0.0); a missing
    ``not_before``, ``pace``, ``paced_at`` or ``paused_at`` (a document older
    than holds or slow-downs, or not paused) is none, and the ``paused_at`` of
    a document that is not paused is ignored.
    """
    for field in ("at", "due", "held", "not_before", "pace", "paced_at", "paused_at"):
        if field == "paused_at" and document.get("paused") is not True:
            continue
        if field in document and not _whole(document[field]):
            raise StateCorrupted(
                f"record at {where} has {field}={document[field]!r}; want a whole number", where=where
            )


def parse_taken(document: Document, where: str) -> Taken:
    """The :class:`Taken` a ``take`` left in ``document``; :class:`StateCorrupted` if it holds none."""
    record, _, ticket, pos, now = _answer(document, where, "taken")
    return Taken(ticket=ticket, pos=pos, at=record.at, now=now)


def parse_changed(document: Document, where: str) -> bool:
    """The yes or no ``set_paused``, ``release``, ``renew``, ``hold``, ``lift``, ``slow`` or ``settle`` left.

    Whether ``set_paused`` changed the flag; whether the lease ``release``
    gave back, or ``renew`` renewed, was live; whether ``hold`` moved the
    hold; whether a hold ``lift`` cleared was on; whether ``slow`` slowed
    the queue; whether ``settle`` moved the schedule.
    """
    _, _, _, value, _ = _answer(document, where, "set")
    if value not in (0, 1):
        raise StateCorrupted(f"record at {where} answered 'set' {value!r}; want 0 or 1", where=where)
    return value == 1


#: the outcomes of try_start, take_and_try, try_take and retime, by their answer's kind
_OUTCOMES: dict[str, Callable[[int, int, int], Outcome]] = {
    "started": Started,
    "wait": Wait,
    "passed": Passed,
}


def parse_outcome(document: Document, where: str) -> Outcome:
    """The outcome an operation left in ``document``; :class:`StateCorrupted` if it holds none."""
    _, kind, ticket, value, now = _answer(document, where, *_OUTCOMES)
    return _OUTCOMES[kind](ticket, value, now)


def _answer(document: Document, where: str, *kinds: str) -> tuple[Record, str, int, int, int]:
    """``document``'s record, and its answer's ``kind`` (one of ``kinds``), ``ticket``, ``value``, ``now``.

    Both are checked (the record by :func:`check_document`). An ``unwritten``
    answer (the operation refused the record, changing nothing) raises
    :class:`StateCorrupted` naming the field and its value.
    """
    record = check_document(document, where)
    answer = document.get("answer")
    if not isinstance(answer, Mapping):
        raise StateCorrupted(f"record at {where} holds no answer, but answer={answer!r}", where=where)
    kind, ticket, value, now = (answer.get(key) for key in ("kind", "ticket", "value", "now"))
    if kind == "unwritten" and isinstance(answer.get("field"), str) and _whole(value) and _whole(now):
        raise unwritten(Unwritten(answer["field"], value, now), f"record at {where}", where)
    if not (_whole(ticket) and _whole(value) and _whole(now)):
        raise StateCorrupted(
            f"record at {where} has answer={dict(answer)!r}; want whole numbers ticket, value and now",
            where=where,
        )
    if kind not in kinds:
        want = " or ".join(map(repr, kinds))
        raise StateCorrupted(f"record at {where} answered with kind {kind!r}; want {want}", where=where)
    return record, kind, ticket, value, now


def _whole(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def datetime_us(moment: datetime.datetime) -> int:
    """A server ``Date`` (milliseconds) in whole microseconds."""
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.timezone.utc)
    return round(moment.timestamp() * 1000) * 1000


def split_url(url: str) -> tuple[str, str, str]:
    """``url`` without ratequeue's options, and the database and collection they name."""
    client_url, ours = split_options(url, "database", "collection")
    return client_url, ours.get("database", DEFAULT_DATABASE), ours.get("collection", DEFAULT_COLLECTION)


#: settings of the clients ratequeue creates, unless the URL sets them
CLIENT_OPTIONS: dict[str, Any] = {"serverSelectionTimeoutMS": 5000, "connectTimeoutMS": 5000}


def client_options(client_url: str) -> dict[str, Any]:
    """:data:`CLIENT_OPTIONS` less those the URL gives itself (URL options win)."""
    given = {key.lower() for key, _ in parse_qsl(client_url.partition("?")[2])}
    return {key: value for key, value in CLIENT_OPTIONS.items() if key.lower() not in given}


#: errors in creating a client that mean the URL is wrong
BAD_URL_ERRORS = (InvalidURI, MongoConfigurationError, ValueError, TypeError)


def where_of(client: Any) -> str:
    """The seed list of a client, ``host:port,...``."""
    return ",".join(f"{h}:{p}" for h, p in client.topology_description.server_descriptions())


#: how each operation's answer is read from the document it leaves
PARSERS: dict[str, Callable[[Document, str], Answer]] = {
    "take": parse_taken,
    "try_start": parse_outcome,
    "take_and_try": parse_outcome,
    "try_take": parse_outcome,
    "retime": parse_outcome,
    "set_paused": parse_changed,
    "release": parse_changed,
    "renew": parse_changed,
    "hold": parse_changed,
    "lift": parse_changed,
    "slow": parse_changed,
    "settle": parse_changed,
}
