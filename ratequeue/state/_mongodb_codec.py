"""What the MongoDB states send and what they make of the answers: pure functions, no I/O.

Shared by :class:`ratequeue.state.mongodb.MongoState` and
:class:`ratequeue.aio.mongodb.AsyncMongoState`: the update pipelines that run
the protocol on the server (:func:`pipeline`), the documents and filters
around them, the parsing of the answer an operation leaves in its document
(:func:`parse_taken`, :func:`parse_outcome`: anything unexpected raises
:class:`StateCorrupted` naming where it is), and the URL handling.

A queue's document is ``{_id: name, ticket, pos, at, interval, answer}``
(integers, microseconds). ``$$NOW`` has millisecond resolution: every ``now``
is a whole millisecond (in microseconds); intervals keep their microseconds.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any, Literal, TypeGuard
from urllib.parse import parse_qsl

from pymongo.errors import ConfigurationError as MongoConfigurationError
from pymongo.errors import InvalidURI

from .. import protocol
from ..errors import StateCorrupted
from ..protocol import MAX_LEAD_US, NEVER, Outcome, Passed, Record, Started, Taken, Unwritten, Wait
from .base import MAX_US, check_record, split_options, unwritten

DEFAULT_DATABASE = "ratequeue"
DEFAULT_COLLECTION = "queues"

#: an operation run by an update pipeline
Op = Literal["take", "try_start", "take_and_try", "retime"]

#: the operations that answer an :data:`~ratequeue.protocol.Outcome`
OutcomeOp = Literal["try_start", "take_and_try", "retime"]

#: a document as the server stores and returns it
Document = Mapping[str, Any]

#: an aggregation or update pipeline
Pipeline = list[dict[str, Any]]


def _now_expression(fixed_us: int | None) -> Any:
    """The server clock in microseconds, or a fixed value (tests only)."""
    if fixed_us is not None:
        return {"$literal": fixed_us}
    return {"$multiply": [{"$toLong": "$$NOW"}, 1000]}


def _slot(ticket: Any) -> Any:
    """``at + (ticket - pos) * interval`` over the document's fields."""
    return {"$add": ["$at", {"$multiply": [{"$subtract": [ticket, "$pos"]}, "$interval"]}]}


def _open_stages(interval_us: int, now_us: int | None) -> Pipeline:
    """Fill a new document's fields and read the clock into ``_now``."""
    return [
        {
            "$set": {
                "_now": _now_expression(now_us),
                "ticket": {"$ifNull": ["$ticket", 1]},
                "pos": {"$ifNull": ["$pos", 0]},
                "at": {"$ifNull": ["$at", {"$literal": NEVER}]},
                "interval": {"$ifNull": ["$interval", {"$literal": interval_us}]},
            }
        }
    ]


def _check_stages(op: Op) -> Pipeline:
    """Name in ``_bad`` what the protocol refuses (:func:`ratequeue.protocol.check`, the last ticket).

    ``_bad`` is ``{kind: "unwritten", field, value, now}`` or ``""``; the
    record's fields as read are kept in ``_was``, so :func:`_refuse_stages`
    can put them back after the operation's stages.
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
                "case": {"$gte": [{"$add": ["$ticket", 1]}, MAX_US]},
                "then": {"kind": "unwritten", "field": "ticket", "value": "$ticket", "now": "$_now"},
            }
        )
    return [
        {
            "$set": {
                "_bad": {"$switch": {"branches": branches, "default": ""}},
                "_was": {"ticket": "$ticket", "pos": "$pos", "at": "$at"},
            }
        }
    ]


def _refuse_stages() -> Pipeline:
    """If ``_bad`` names a refusal, restore the record as it was read and answer ``_bad``."""
    bad = {"$ne": ["$_bad", ""]}
    return [
        {
            "$set": {
                **{
                    field: {"$cond": [bad, f"$_was.{field}", f"${field}"]}
                    for field in ("ticket", "pos", "at")
                },
                "answer": {"$cond": [bad, "$_bad", "$answer"]},
            }
        }
    ]


def _take_stages() -> Pipeline:
    """``take``: jump ``pos`` over stale tickets, hand out ``ticket`` into ``_t``."""
    last = {"$subtract": ["$ticket", 1]}
    stale = {
        "$and": [
            {"$gt": [last, "$pos"]},
            {"$lte": [{"$add": [_slot(last), "$interval"]}, "$_now"]},
        ]
    }
    return [
        {"$set": {"pos": {"$cond": [stale, last, "$pos"]}}},
        {"$set": {"_t": "$ticket", "ticket": {"$add": ["$ticket", 1]}}},
    ]


def _try_stages(lead_us: int) -> Pipeline:
    """``try_start`` of ticket ``_t``: set ``answer`` and, if it starts now, ``pos`` and ``at``.

    The branches are those of :func:`ratequeue.protocol.try_start`, in its
    order. The first, :func:`~ratequeue.protocol.is_same_grant`, answers a
    repeated call for the latest start with that start and changes nothing
    (``pos`` is ``_t`` and ``at`` the answer already), so a call re-sent
    after a lost reply keeps its turn. After ``take`` (``take_and_try``)
    ``_t`` is above ``pos``, and that branch never applies.
    """
    same_grant = {
        "$and": [
            {"$eq": ["$pos", "$_t"]},
            {"$lt": ["$_t", "$ticket"]},
            {"$lt": ["$_now", {"$add": ["$at", "$interval"]}]},
        ]
    }
    passed = {"$or": [{"$gte": ["$pos", "$_t"]}, {"$gte": ["$_t", "$ticket"]}]}
    can_start = {"$gte": [{"$add": ["$_now", {"$literal": lead_us}]}, _slot("$_t")]}
    start = {"$max": [_slot("$_t"), "$_now"]}
    return [
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
                            {"case": can_start, "then": {"kind": "started", "ticket": "$_t", "value": start}},
                        ],
                        "default": {"kind": "wait", "ticket": "$_t", "value": _slot("$_t")},
                    }
                }
            }
        },
        {
            "$set": {
                "answer.now": "$_now",
                "pos": {"$cond": [{"$eq": ["$answer.kind", "started"]}, "$_t", "$pos"]},
                "at": {"$cond": [{"$eq": ["$answer.kind", "started"]}, "$answer.value", "$at"]},
            }
        },
    ]


def _retime_stages(ticket: int, lead_us: int) -> Pipeline:
    """``retime`` of ``ticket``: while it is the latest start, move ``at`` to ``_now + lead_us`` or later."""
    latest = {"$and": [{"$eq": ["$pos", ticket]}, {"$lt": [ticket, "$ticket"]}]}
    start = {"$max": ["$at", {"$add": ["$_now", {"$literal": lead_us}]}]}
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
            }
        },
    ]


def pipeline(op: Op, interval_us: int, now_us: int | None, *, ticket: int = 0, lead_us: int = 0) -> Pipeline:
    """The update pipeline of ``op``; it leaves its answer in the document's ``answer``.

    :param now_us: a fixed ``now`` (tests only), or ``None`` for the server's ``$$NOW``.
    :param ticket: the ticket of ``try_start`` and ``retime``.
    """
    if op == "take":
        answer = {"kind": "taken", "ticket": "$_t", "value": "$pos", "now": "$_now"}
        stages = [*_take_stages(), {"$set": {"answer": answer}}]
    elif op == "retime":
        stages = _retime_stages(ticket, lead_us)
    elif op == "try_start":
        stages = [{"$set": {"_t": {"$literal": ticket}}}, *_try_stages(lead_us)]
    else:
        stages = [*_take_stages(), *_try_stages(lead_us)]
    return [
        *_open_stages(interval_us, now_us),
        *_check_stages(op),
        *stages,
        *_refuse_stages(),
        {"$unset": ["_now", "_t", "_bad", "_was"]},
    ]


def read_pipeline(name: str, now_us: int | None) -> Pipeline:
    """An aggregation returning ``name``'s document with the server clock in ``_now``; changes nothing."""
    return [{"$match": {"_id": name}}, {"$set": {"_now": _now_expression(now_us)}}]


def initial_document(name: str, interval_us: int) -> dict[str, Any]:
    """The record of a queue that has handed out no ticket yet."""
    return {"_id": name, "ticket": 1, "pos": 0, "at": NEVER, "interval": interval_us}


#: the filter every update adds: a record whose fields are not whole numbers in range matches
#: nothing, so it is reported as corrupted (by the creation path) and never changed. What
#: depends on the server clock (an ``at`` too far ahead of ``$$NOW``) is checked inside the
#: pipeline instead (:func:`_check_stages`), where ``now`` is known and a test clock applies
WELL_FORMED: dict[str, Any] = {
    **{field: {"$type": ["int", "long"]} for field in ("ticket", "pos", "at")},
    "$expr": {
        "$and": [
            {"$lte": [0, "$pos"]},
            {"$lt": ["$pos", "$ticket"]},
            {"$lt": ["$ticket", MAX_US]},
            {"$lte": [NEVER, "$at"]},
            {"$lt": ["$at", MAX_US]},
        ]
    },
}


def update_filter(name: str, interval_us: int) -> dict[str, Any]:
    """The filter of every update: ``name``'s document, with that interval, well formed."""
    return {"_id": name, "interval": interval_us, **WELL_FORMED}


def check_document(document: Document, where: str) -> Record:
    """The record in ``document``, or :class:`StateCorrupted` naming ``where`` it is.

    A document read with the server's clock (a :func:`read_pipeline` row,
    ``_now``) is also checked against it (:func:`ratequeue.protocol.check`).
    """
    fields = {key: document.get(key) for key in ("ticket", "pos", "at", "interval") if key in document}
    record = check_record(fields, where=where)
    now = document.get("_now")
    if _whole(now):
        try:
            protocol.check(record, now)
        except Unwritten as exc:
            raise unwritten(exc, f"record at {where}", where) from None
    return record


def check_well_formed(document: Document, where: str) -> None:
    """Raise :class:`StateCorrupted` if ``document`` would not match :data:`WELL_FORMED`."""
    for field in ("ticket", "pos", "at"):
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
