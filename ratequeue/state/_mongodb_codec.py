"""What the MongoDB states send and what they make of the answers: pure functions, no I/O.

Shared by :class:`ratequeue.state.mongodb.MongoState` and
:class:`ratequeue.aio.mongodb.AsyncMongoState`: the update pipelines that run
the protocol on the server (:func:`pipeline`), the documents and filters
around them, the parsing of the answer an operation leaves in its document
(:func:`parse_taken`, :func:`parse_outcome`: anything unexpected raises
:class:`StateCorrupted` naming where it is), and the URL handling.

A queue's document is ``{_id: name, ticket, pos, at, interval, burst, due,
paused, max_running, leases, held, answer, expires}`` (integers,
microseconds; ``paused`` is ``true`` while the queue is paused for every
shard, and absent otherwise). A queue of burst 1 keeps no ``burst`` and no
``due`` (``due`` is then ``at``): its document, unless paused, is the one
written before bursts, which every version reads and writes alike. Only a
queue with a cap on running jobs keeps ``max_running``, ``leases`` (an array
of ``[ticket, expiry]`` arrays of int64, in start order) and ``held`` (int64,
``NEVER`` until the queue is first found full); a queue without one keeps
none of them, as before leases.
``expires`` (a ``Date``; on a test clock, whole microseconds on it) is
there while the record is kept for a while only
(:class:`~ratequeue.state.base.Terms`' ``keep_us``): the collection's TTL
index, and :func:`sweep_filter`, delete the document once it has passed.
``$$NOW`` has millisecond resolution: every ``now`` is a whole millisecond
(in microseconds); intervals keep their microseconds.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Mapping
from typing import Any, Literal, TypeGuard
from urllib.parse import parse_qsl

from bson.int64 import Int64
from pymongo.errors import ConfigurationError as MongoConfigurationError
from pymongo.errors import InvalidURI

from .. import protocol
from ..errors import StateCorrupted
from ..protocol import (
    FULL_GRACE_US,
    FULL_RECHECK_US,
    MAX_LEAD_US,
    NEVER,
    PAUSED_RECHECK_US,
    Outcome,
    Passed,
    Record,
    Started,
    Taken,
    Unwritten,
    Wait,
)
from .base import MAX_US, Terms, check_record, split_options, unwritten

DEFAULT_DATABASE = "ratequeue"
DEFAULT_COLLECTION = "queues"

#: an operation run by an update pipeline
Op = Literal["take", "try_start", "take_and_try", "retime", "set_paused", "release", "renew"]

#: the operations that answer whether they changed something (``parse_changed``)
ChangeOp = Literal["set_paused", "release", "renew"]

#: the operations that answer an :data:`~ratequeue.protocol.Outcome`
OutcomeOp = Literal["try_start", "take_and_try", "retime"]

#: a document as the server stores and returns it
Document = Mapping[str, Any]

#: an aggregation or update pipeline
Pipeline = list[dict[str, Any]]

#: the field holding when a record kept for a while may be deleted, and the TTL index on it
EXPIRES = "expires"
TTL_INDEX = "ratequeue_expires"

#: the fields of a record, as :func:`~ratequeue.state.base.check_record` reads them
RECORD_FIELDS = ("ticket", "pos", "at", "interval", "burst", "due", "paused", "max_running", "leases", "held")

#: the fields a pipeline works in, gone from the document it leaves
_SCRATCH = ["_was", "_now", "_t", "_bad", "_s", "_e", "_until", "_live", "_full"]

_WHOLE = ["int", "long"]


def _now_expression(fixed_us: int | None) -> Any:
    """The server clock in microseconds, or a fixed value (tests only)."""
    if fixed_us is not None:
        return {"$literal": fixed_us}
    return {"$multiply": [{"$toLong": "$$NOW"}, 1000]}


def _slot(ticket: Any) -> Any:
    """:meth:`~ratequeue.protocol.Record.slot`: ``due + (ticket - pos) * interval`` in fields."""
    return {"$add": ["$due", {"$multiply": [{"$subtract": [ticket, "$pos"]}, "$interval"]}]}


def _open_stages(terms: Terms, now_us: int | None) -> Pipeline:
    """Keep the document as read in ``_was``, fill a new document's fields and read the clock into ``_now``.

    A record written before bursts has no ``burst`` (it is 1) and no ``due``
    (it is ``at``); one without a cap on running jobs has no ``leases``
    (none) and no ``held`` (``NEVER``).
    """
    return [
        {"$set": {"_was": "$$ROOT"}},
        {
            "$set": {
                "_now": _now_expression(now_us),
                "ticket": {"$ifNull": ["$ticket", 1]},
                "pos": {"$ifNull": ["$pos", 0]},
                "at": {"$ifNull": ["$at", {"$literal": NEVER}]},
                "interval": {"$ifNull": ["$interval", {"$literal": terms.interval_us}]},
                "burst": {"$ifNull": ["$burst", 1]},
                "due": {"$ifNull": ["$due", "$at"]},
                "leases": {"$ifNull": ["$leases", []]},
                "held": {"$ifNull": ["$held", {"$literal": NEVER}]},
            }
        },
    ]


def _check_stages(op: Op, cost: int) -> Pipeline:
    """Name in ``_bad`` what the protocol refuses (:func:`ratequeue.protocol.check`, the last ticket).

    ``_bad`` is ``{kind: "unwritten", field, value, now}`` or ``""``; the
    document as read (``_was``) is put back after the operation's stages
    (:func:`_refuse_stages`) if it names something.
    """
    branches = [
        {
            "case": {"$gt": ["$at", {"$add": ["$_now", {"$literal": MAX_LEAD_US}]}]},
            "then": {"kind": "unwritten", "field": "at", "value": "$at", "now": "$_now"},
        }
    ]
    if op in ("take", "take_and_try"):
        branches.append(
            {
                "case": {"$gte": [{"$add": ["$ticket", {"$literal": cost}]}, MAX_US]},
                "then": {"kind": "unwritten", "field": "ticket", "value": "$ticket", "now": "$_now"},
            }
        )
    return [{"$set": {"_bad": {"$switch": {"branches": branches, "default": ""}}}}]


def _refuse_stages() -> Pipeline:
    """If ``_bad`` names a refusal, put the document back as it was read, answering ``_bad``."""
    refused = {"$mergeObjects": ["$_was", {"answer": "$_bad"}]}
    return [{"$replaceWith": {"$cond": [{"$ne": ["$_bad", ""]}, refused, "$$ROOT"]}}]


def _take_stages(cost: int) -> Pipeline:
    """``take`` of ``cost``: jump ``pos`` over stale tickets, hand out ``ticket`` into ``_t``.

    Not while a full queue's grace runs (``held``): the tickets' holders wait for a place.
    """
    last = {"$subtract": ["$ticket", 1]}
    stale = {
        "$and": [
            {"$gt": [last, "$pos"]},
            {"$lte": [{"$add": [_slot(last), "$interval"]}, "$_now"]},
            {"$lte": [_GRACE_END, "$_now"]},
        ]
    }
    return [
        {"$set": {"pos": {"$cond": [stale, last, "$pos"]}}},
        {"$set": {"_t": "$ticket", "ticket": {"$add": ["$ticket", {"$literal": cost}]}}},
    ]


def _try_stages(lead_us: int, cost: int, terms: Terms) -> Pipeline:
    """``try_start`` of ticket ``_t`` (of ``cost``): set ``answer``; if it starts, ``pos``, ``at``, ``due``.

    ``_s`` is the ticket's strict slot and ``_e`` its earliest start
    (:meth:`~ratequeue.protocol.Record.earliest`; not before a full queue's
    grace ends if it would pass an earlier ticket). The branches are those of
    :func:`ratequeue.protocol.try_start`, in its order. The first,
    :func:`~ratequeue.protocol.is_same_grant`, answers a repeated call for
    the latest start with that start and changes nothing, so a call re-sent
    after a lost reply keeps its turn. After ``take`` (``take_and_try``)
    ``_t`` is above ``pos``, and that branch never applies.

    With ``max_running``, ``_live`` holds the leases live at ``_now`` and
    ``_full`` whether there are ``max_running`` of them: a ticket that could
    start then waits (the answer's kind is ``full`` until the last stage,
    which makes it ``wait``), ``held`` becomes ``_now`` and the expired
    leases go; a start appends its lease to the live ones.
    """
    same_grant = {
        "$and": [
            {"$eq": ["$pos", "$_t"]},
            {"$lt": ["$_t", "$ticket"]},
            {"$lt": ["$_now", {"$add": ["$at", "$interval"]}]},
        ]
    }
    passed = {"$or": [{"$gte": ["$pos", "$_t"]}, {"$gte": ["$_t", "$ticket"]}]}
    paused_wait = {"$max": ["$_e", {"$add": ["$_now", {"$literal": PAUSED_RECHECK_US}]}]}
    can_start = {"$gte": [{"$add": ["$_now", {"$literal": lead_us}]}, "$_e"]}
    started = {"$and": [{"$eq": ["$answer.kind", "started"]}, {"$ne": ["$pos", "$_t"]}]}  # not the same grant
    early = {"$multiply": [{"$subtract": ["$burst", {"$literal": cost}]}, "$interval"]}
    passing = {"$gt": ["$_t", {"$add": ["$pos", 1]}]}  # it would pass the tickets between
    earliest = {"$max": [{"$subtract": ["$_s", early]}, "$at"]}
    capped = bool(terms.max_running)
    full_branches: list[dict[str, Any]] = []
    lease_stages: Pipeline = []
    if capped:
        lease_stages = [
            {"$set": {"_live": _LIVE}},
            {"$set": {"_full": {"$gte": [{"$size": "$_live"}, {"$literal": terms.max_running}]}}},
        ]
        first_expiry = {"$min": {"$map": {"input": "$_live", "as": "l", "in": _expiry("$$l")}}}
        recheck = {"$min": [first_expiry, {"$add": ["$_now", {"$literal": FULL_RECHECK_US}]}]}
        full_branches = [
            {
                "case": {"$and": [can_start, "$_full"]},
                "then": {"kind": "full", "ticket": "$_t", "value": {"$max": ["$_e", recheck]}},
            }
        ]
    return [
        {"$set": {"_s": _slot("$_t")}},
        {"$set": {"_e": earliest}},
        {"$set": {"_e": {"$cond": [passing, {"$max": ["$_e", _GRACE_END]}, "$_e"]}}},
        *lease_stages,
        {
            "$set": {
                "answer": {
                    "$switch": {
                        "branches": [
                            {
                                "case": same_grant,
                                "then": {"kind": "started", "ticket": "$_t", "value": "$at"},
                            },
                            {"case": passed, "then": {"kind": "passed", "ticket": "$_t", "value": "$pos"}},
                            {
                                "case": _PAUSED,
                                "then": {"kind": "wait", "ticket": "$_t", "value": paused_wait},
                            },
                            *full_branches,
                            {
                                "case": can_start,
                                "then": {
                                    "kind": "started",
                                    "ticket": "$_t",
                                    "value": {"$max": ["$_e", "$_now"]},
                                },
                            },
                        ],
                        "default": {"kind": "wait", "ticket": "$_t", "value": "$_e"},
                    }
                }
            }
        },
        {
            "$set": {
                "answer.now": "$_now",
                "pos": {"$cond": [started, "$_t", "$pos"]},
                "at": {"$cond": [started, "$answer.value", "$at"]},
                "due": {"$cond": [started, {"$max": ["$_s", "$answer.value"]}, "$due"]},
                **(_lease_fields(started, terms) if capped else {}),
            }
        },
    ]


def _lease_fields(started: Any, terms: Terms) -> dict[str, Any]:
    """The fields a try that started (a new lease) or found the queue full (``held``) changes.

    ``answer.kind`` ``full`` (set by the try's branches) becomes ``wait``.
    """
    full = {"$eq": ["$answer.kind", "full"]}
    expiry = {"$toLong": {"$add": ["$answer.value", {"$literal": terms.lease_us}]}}
    lease = [{"$toLong": "$_t"}, expiry]
    return {
        "answer.kind": {"$cond": [full, "wait", "$answer.kind"]},
        "leases": {
            "$switch": {
                "branches": [
                    {"case": started, "then": {"$concatArrays": ["$_live", [lease]]}},
                    {"case": full, "then": "$_live"},
                ],
                "default": "$leases",
            }
        },
        "held": {"$cond": [full, {"$toLong": "$_now"}, "$held"]},
    }


def _expiry(lease: str) -> Any:
    """The expiry of ``lease``, a ``[ticket, expiry]`` array."""
    return {"$arrayElemAt": [lease, 1]}


def _holder(lease: str) -> Any:
    """The ticket of ``lease``, a ``[ticket, expiry]`` array."""
    return {"$arrayElemAt": [lease, 0]}


#: the leases live at ``_now`` (:func:`ratequeue.protocol.live_leases`)
_LIVE = {"$filter": {"input": "$leases", "as": "l", "cond": {"$gt": [_expiry("$$l"), "$_now"]}}}


def _release_stages(ticket: int) -> Pipeline:
    """``release`` of ``ticket``'s lease: keep the other live ones; ``value`` 1 if its lease was live.

    When nothing is dropped the leases are written back unchanged, as the
    reference returns the record itself.
    """
    kept = {
        "$filter": {"input": "$_live", "as": "l", "cond": {"$ne": [_holder("$$l"), {"$literal": ticket}]}}
    }
    released = {"$cond": [{"$lt": [{"$size": "$leases"}, {"$size": "$_live"}]}, 1, 0]}  # leases: kept
    answer = {"kind": "set", "ticket": {"$literal": ticket}, "value": released, "now": "$_now"}
    return [{"$set": {"_live": _LIVE}}, {"$set": {"leases": kept}}, {"$set": {"answer": answer}}]


def _renew_stages(ticket: int, lease_us: int) -> Pipeline:
    """``renew`` of ``ticket``'s lease, if live, to ``_now + lease_us`` at least; drop expired leases.

    The answer's ``value`` is 1 if the lease was live (and renewed), else 0.
    """
    own = {"$eq": [_holder("$$l"), {"$literal": ticket}]}
    until = {"$toLong": {"$add": ["$_now", {"$literal": lease_us}]}}
    renewed = [_holder("$$l"), {"$cond": [own, {"$max": [_expiry("$$l"), until]}, _expiry("$$l")]}]
    held = {"$filter": {"input": "$_live", "as": "l", "cond": own}}
    answer = {
        "kind": "set",
        "ticket": {"$literal": ticket},
        "value": {"$cond": [{"$gt": [{"$size": held}, 0]}, 1, 0]},
        "now": "$_now",
    }
    return [
        {"$set": {"_live": _LIVE}},
        {"$set": {"answer": answer, "leases": {"$map": {"input": "$_live", "as": "l", "in": renewed}}}},
    ]


#: when a full queue's grace ends (:data:`~ratequeue.protocol.FULL_GRACE_US` after ``held``)
_GRACE_END = {"$add": ["$held", {"$literal": FULL_GRACE_US}]}


#: whether the record is paused for every shard (``paused`` is ``true``; missing: not paused)
_PAUSED = {"$eq": ["$paused", True]}


def _set_paused_stages(paused: bool) -> Pipeline:
    """``set_paused``: set the flag; the answer's ``value`` is 1 if that changed it, else 0."""
    changed = {"$cond": [{"$eq": [_PAUSED, {"$literal": paused}]}, 0, 1]}
    answer = {"kind": "set", "ticket": 0, "value": changed, "now": "$_now"}
    return [{"$set": {"answer": answer, "paused": {"$literal": paused}}}]


def _retime_stages(ticket: int, lead_us: int) -> Pipeline:
    """``retime`` of ``ticket``: while it is the latest start, move ``at``, ``due`` to ``_now + lead_us``.

    The ticket's lease, if it holds one, moves on by as much as its start.
    """
    latest = {"$and": [{"$eq": ["$pos", ticket]}, {"$lt": [ticket, "$ticket"]}]}
    start = {"$max": ["$at", {"$add": ["$_now", {"$literal": lead_us}]}]}
    moved = {"$subtract": ["$answer.value", "$at"]}
    own = {"$eq": [_holder("$$l"), {"$literal": ticket}]}
    shifted = [
        _holder("$$l"),
        {"$cond": [own, {"$toLong": {"$add": [_expiry("$$l"), moved]}}, _expiry("$$l")]},
    ]
    return [
        {
            "$set": {
                "answer": {
                    "$cond": [
                        latest,
                        {"kind": "started", "ticket": {"$literal": ticket}, "value": start},
                        {"kind": "passed", "ticket": {"$literal": ticket}, "value": "$pos"},
                    ]
                }
            }
        },
        {
            "$set": {
                "answer.now": "$_now",
                "at": {"$cond": [{"$eq": ["$answer.kind", "started"]}, "$answer.value", "$at"]},
                "leases": {
                    "$cond": [
                        {"$eq": ["$answer.kind", "started"]},
                        {"$map": {"input": "$leases", "as": "l", "in": shifted}},
                        "$leases",
                    ]
                },
                "due": {
                    "$cond": [
                        {"$eq": ["$answer.kind", "started"]},
                        {"$max": ["$due", "$answer.value"]},
                        "$due",
                    ]
                },
            }
        },
    ]


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
    :func:`ratequeue.protocol.expires` (``slot(ticket) + interval``, the
    grace after ``held`` and every lease's expiry), as a
    ``Date`` rounded up to the millisecond. A test clock's (``fixed``) is
    kept as whole microseconds on that clock instead: an integer, which the
    server's TTL monitor (reading its real clock) leaves alone, and which
    only :func:`sweep_filter` of a test clock deletes. A keep time past
    ``MAX_US`` (about 2112) is none: the record is kept. So is a paused
    record (:func:`ratequeue.protocol.set_paused`), until it is resumed.
    """
    if not keep_us:
        return [{"$unset": EXPIRES}]
    ends = {"$max": [{"$add": [_slot("$ticket"), "$interval"]}, _GRACE_END]}
    expires = {
        "$reduce": {"input": "$leases", "initialValue": ends, "in": {"$max": ["$$value", _expiry("$$this")]}}
    }
    until = {"$add": [{"$max": [expires, "$_now"]}, {"$literal": keep_us}]}
    stored = "$_until" if fixed else {"$toDate": _ceil_ms("$_until")}
    kept = {"$and": [{"$lt": ["$_until", MAX_US]}, {"$not": [_PAUSED]}]}
    return [
        {"$set": {"_until": until}},
        {"$set": {EXPIRES: {"$cond": [kept, stored, "$$REMOVE"]}}},
    ]


def _burst_one_stages(terms: Terms) -> Pipeline:
    """A record of burst 1 is stored without ``burst`` and ``due`` (it is ``at``), as before bursts.

    ``paused`` is stored only while it is ``true``; ``max_running``,
    ``leases`` and ``held`` only with a cap on running jobs (a ``held``
    written otherwise, by something else, is kept).
    """
    one = {"$eq": ["$burst", 1]}
    capped: dict[str, Any] = {
        "max_running": {"$literal": terms.max_running},
        "leases": "$leases",
        "held": "$held",
    }
    uncapped: dict[str, Any] = {
        "max_running": "$$REMOVE",
        "leases": "$$REMOVE",
        "held": {"$cond": [{"$eq": ["$held", {"$literal": NEVER}]}, "$$REMOVE", "$held"]},
    }
    return [
        {
            "$set": {
                "burst": {"$cond": [one, "$$REMOVE", "$burst"]},
                "due": {"$cond": [one, "$$REMOVE", "$due"]},
                "paused": {"$cond": [_PAUSED, True, "$$REMOVE"]},
                **(capped if terms.max_running else uncapped),
            }
        }
    ]


def pipeline(
    op: Op,
    terms: Terms,
    now_us: int | None,
    *,
    ticket: int = 0,
    lead_us: int = 0,
    cost: int = 1,
    paused: bool = False,
) -> Pipeline:
    """The update pipeline of ``op``; it leaves its answer in the document's ``answer``.

    :param now_us: a fixed ``now`` (tests only), or ``None`` for the server's ``$$NOW``.
    :param ticket: the ticket of ``try_start``, ``retime``, ``release`` and ``renew``.
    :param cost: the cost of the ticket taken (``take``, ``take_and_try``) or started (``try_start``).
    :param paused: the flag ``set_paused`` sets.
    """
    if op == "set_paused":
        stages = _set_paused_stages(paused)
    elif op == "release":
        stages = _release_stages(ticket)
    elif op == "renew":
        stages = _renew_stages(ticket, terms.lease_us)
    elif op == "take":
        answer = {"kind": "taken", "ticket": "$_t", "value": "$pos", "now": "$_now"}
        stages = [*_take_stages(cost), {"$set": {"answer": answer}}]
    elif op == "retime":
        stages = _retime_stages(ticket, lead_us)
    elif op == "try_start":
        stages = [{"$set": {"_t": {"$literal": ticket}}}, *_try_stages(lead_us, cost, terms)]
    else:
        stages = [*_take_stages(cost), *_try_stages(lead_us, cost, terms)]
    return [
        *_open_stages(terms, now_us),
        *_check_stages(op, cost),
        *stages,
        *_keep_stages(terms.keep_us, now_us is not None),
        *_burst_one_stages(terms),
        *_refuse_stages(),
        {"$unset": _SCRATCH},
    ]


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
    """The record of a queue that has handed out no ticket yet.

    Of burst 1: without ``burst`` and ``due``; without a cap on running
    jobs, without ``max_running``, ``leases`` and ``held``.
    """
    document: dict[str, Any] = {
        "_id": name,
        "ticket": 1,
        "pos": 0,
        "at": NEVER,
        "interval": terms.interval_us,
    }
    if terms.burst != 1:
        document.update(burst=terms.burst, due=NEVER)
    if terms.max_running:
        document.update(max_running=terms.max_running, leases=[], held=Int64(NEVER))
    return document


def update_filter(name: str, terms: Terms) -> dict[str, Any]:
    """The filter of every update: ``name``'s document, with that interval and burst, well formed.

    A record whose fields are not whole numbers in range matches nothing, so
    it is reported as corrupted (by the creation path) and never changed.
    What depends on the server clock (an ``at`` too far ahead of ``$$NOW``)
    is checked inside the pipeline instead (:func:`_check_stages`), where
    ``now`` is known and a test clock applies. A record without ``burst``
    (written before bursts) has burst 1, and one without ``due`` has ``due``
    equal to ``at``; ``paused`` is missing (not paused) or a boolean.
    ``max_running`` is the terms' (missing: 0), ``leases`` at most that many
    ``[ticket, expiry]`` pairs of whole numbers (``1 <= ticket <`` the
    record's, ``NEVER <= expiry < MAX_US``; missing: none) and ``held``
    whole microseconds in range (missing: ``NEVER``), as
    :func:`~ratequeue.state.base.check_record` wants them.
    """
    burst: dict[str, Any] = {"$eq": terms.burst, "$type": _WHOLE}
    late = {"$literal": (terms.burst - 1) * terms.interval_us}
    due_ok = {
        "$or": [
            {"$eq": [{"$type": "$due"}, "missing"]},
            {
                "$and": [
                    {"$in": [{"$type": "$due"}, _WHOLE]},
                    {"$lte": ["$at", "$due"]},
                    {"$lte": ["$due", {"$add": ["$at", late]}]},
                ]
            },
        ]
    }
    return {
        "_id": name,
        "interval": terms.interval_us,
        **(
            {"$or": [{"burst": {"$exists": False}}, {"burst": burst}]}
            if terms.burst == 1
            else {"burst": burst}
        ),
        **{field: {"$type": _WHOLE} for field in ("ticket", "pos", "at")},
        "$expr": {
            "$and": [
                {"$lte": [0, "$pos"]},
                {"$lt": ["$pos", "$ticket"]},
                {"$lt": ["$ticket", MAX_US]},
                {"$lte": [NEVER, "$at"]},
                {"$lt": ["$at", MAX_US]},
                due_ok,
                {"$in": [{"$type": "$paused"}, ["missing", "bool"]]},
                *_lease_checks(terms),
            ]
        },
    }


def _lease_checks(terms: Terms) -> list[Any]:
    """The ``$expr`` conditions of :func:`update_filter` on ``max_running``, ``leases`` and ``held``."""
    pair = {
        "$and": [
            {"$eq": [{"$size": "$$l"}, 2]},
            {"$in": [{"$type": _holder("$$l")}, _WHOLE]},
            {"$in": [{"$type": _expiry("$$l")}, _WHOLE]},
            {"$lte": [1, _holder("$$l")]},
            {"$lt": [_holder("$$l"), "$ticket"]},
            {"$lte": [NEVER, _expiry("$$l")]},
            {"$lt": [_expiry("$$l"), MAX_US]},
        ]
    }
    pairs = {"$map": {"input": "$leases", "as": "l", "in": {"$cond": [{"$isArray": "$$l"}, pair, False]}}}
    leases_ok = {
        "$cond": [
            {"$isArray": "$leases"},
            {
                "$and": [
                    {"$lte": [{"$size": "$leases"}, {"$literal": terms.max_running}]},
                    {"$allElementsTrue": [pairs]},
                ]
            },
            {"$eq": [{"$type": "$leases"}, "missing"]},
        ]
    }
    held = {"$ifNull": ["$held", {"$literal": NEVER}]}
    return [
        {"$in": [{"$type": "$max_running"}, ["missing", *_WHOLE]]},
        {"$eq": [{"$ifNull": ["$max_running", 0]}, {"$literal": terms.max_running}]},
        leases_ok,
        {"$in": [{"$type": "$held"}, ["missing", *_WHOLE]]},
        {"$lte": [NEVER, held]},
        {"$lt": [held, MAX_US]},
    ]


def check_document(document: Document, where: str) -> Record:
    """The record in ``document``, or :class:`StateCorrupted` naming ``where`` it is.

    A document read with the server's clock (a :func:`read_pipeline` row,
    ``_now``) is also checked against it (:func:`ratequeue.protocol.check`).
    """
    record = check_record({key: document[key] for key in RECORD_FIELDS if key in document}, where=where)
    now = document.get("_now")
    if _whole(now):
        try:
            protocol.check(record, now)
        except Unwritten as exc:
            raise unwritten(exc, f"record at {where}", where) from None
    return record


def check_well_formed(document: Document, where: str) -> None:
    """Raise :class:`StateCorrupted` if ``document`` would not match :func:`update_filter` (terms aside)."""
    optional = ("burst", "due", "max_running", "held")
    for field in ("ticket", "pos", "at", *(field for field in optional if field in document)):
        value = document.get(field)
        if not _whole(value):
            raise StateCorrupted(f"record at {where} has {field}={value!r}; want a whole number", where=where)
    check_record(dict(document), where=where)  # the ranges


def parse_taken(document: Document, where: str) -> Taken:
    """The :class:`Taken` a ``take`` left in ``document``; :class:`StateCorrupted` if it holds none."""
    record = check_document(document, where)
    kind, ticket, value, now = _answer(document, where)
    if kind != "taken":
        raise StateCorrupted(f"record at {where} answered a take with kind {kind!r}", where=where)
    return Taken(ticket=ticket, pos=value, at=record.at, now=now)


def parse_changed(document: Document, where: str, op: ChangeOp = "set_paused") -> bool:
    """The yes or no an ``op`` left in ``document``.

    Whether ``set_paused`` changed the flag; whether the lease ``release``
    gave back, or ``renew`` renewed, was live.
    """
    check_document(document, where)
    kind, _, value, _ = _answer(document, where)
    if kind != "set" or value not in (0, 1):
        raise StateCorrupted(f"record at {where} answered a {op} with {kind!r} {value!r}", where=where)
    return value == 1


def parse_outcome(document: Document, where: str) -> Outcome:
    """The outcome an operation left in ``document``; :class:`StateCorrupted` if it holds none."""
    check_document(document, where)
    kind, ticket, value, now = _answer(document, where)
    if kind == "started":
        return Started(ticket=ticket, start=value, now=now)
    if kind == "wait":
        return Wait(ticket=ticket, slot=value, now=now)
    if kind == "passed":
        return Passed(ticket=ticket, pos=value, now=now)
    raise StateCorrupted(
        f"record at {where} answered with kind {kind!r}; want 'started', 'wait' or 'passed'", where=where
    )


def _answer(document: Document, where: str) -> tuple[object, int, int, int]:
    """The ``kind``, ``ticket``, ``value`` and ``now`` of ``document``'s answer, the numbers checked.

    An ``unwritten`` answer (the operation refused the record, changing
    nothing) raises :class:`StateCorrupted` naming the field and its value.
    """
    answer = document.get("answer")
    if not isinstance(answer, Mapping):
        raise StateCorrupted(f"record at {where} holds no answer, but answer={answer!r}", where=where)
    if answer.get("kind") == "unwritten":
        field, value, now = answer.get("field"), answer.get("value"), answer.get("now")
        if isinstance(field, str) and _whole(value) and _whole(now):
            raise unwritten(Unwritten(field, value, now), f"record at {where}", where)
    ticket, value, now = answer.get("ticket"), answer.get("value"), answer.get("now")
    if not (_whole(ticket) and _whole(value) and _whole(now)):
        raise StateCorrupted(
            f"record at {where} has answer={dict(answer)!r}; want whole numbers ticket, value and now",
            where=where,
        )
    return answer.get("kind"), ticket, value, now


def _whole(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def read_now(row: Document, where: str) -> int:
    """The server clock (us) a :func:`read_pipeline` row carries."""
    now = row.get("_now")
    if not _whole(now):
        raise StateCorrupted(f"the clock read with {where} is {now!r}; want whole microseconds", where=where)
    return now


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
