"""``mongodb://`` and ``mongodb+srv://``: the protocol run atomically inside MongoDB, on its clock.

Each queue is one document ``{_id: name, ticket, pos, at, interval, answer}``
(integers, microseconds). Every operation is a single ``find_one_and_update``
whose update pipeline reads ``$$NOW`` on the server, applies the protocol and
leaves its answer in ``answer``: no read-then-write from the client and no
transaction. The filter names the expected interval, so an operation on a
record with another interval matches nothing and changes nothing; only then
(and for a queue's first operation) does the client insert the initial
record or report the mismatch.

``$$NOW`` has millisecond resolution: on this backend every ``now`` is a
whole millisecond (in microseconds), and intervals keep their microseconds.
"""

from __future__ import annotations

import datetime
import time
from typing import Any
from urllib.parse import parse_qsl

from pymongo import MongoClient, ReturnDocument
from pymongo.collection import Collection
from pymongo.errors import ConfigurationError as MongoConfigurationError
from pymongo.errors import ConnectionFailure, DuplicateKeyError, InvalidURI, PyMongoError

from ..errors import ConfigurationError, StateCorrupted, StateUnavailable
from ..protocol import NEVER, Outcome, Passed, Record, Started, Taken, Wait
from .base import MAX_US, Clock, Snapshot, State, check_interval_matches, check_record, split_options

__all__ = ["MongoState"]

DEFAULT_DATABASE = "ratequeue"
DEFAULT_COLLECTION = "queues"

#: how often a transient connection failure is retried, and the first backoff
RETRIES = 5
BACKOFF = 0.02


def _now_expression(fixed: int | None) -> Any:
    """The server clock in microseconds, or a fixed value (tests only)."""
    if fixed is not None:
        return {"$literal": fixed}
    return {"$multiply": [{"$toLong": "$$NOW"}, 1000]}


def _slot(ticket: Any) -> Any:
    """``at + (ticket - pos) * interval`` over the document's fields."""
    return {"$add": ["$at", {"$multiply": [{"$subtract": [ticket, "$pos"]}, "$interval"]}]}


def _open_stages(interval: int, now: int | None) -> list[dict[str, Any]]:
    """Fill a new document's fields and read the clock into ``_now``."""
    return [
        {
            "$set": {
                "_now": _now_expression(now),
                "ticket": {"$ifNull": ["$ticket", 1]},
                "pos": {"$ifNull": ["$pos", 0]},
                "at": {"$ifNull": ["$at", {"$literal": NEVER}]},
                "interval": {"$ifNull": ["$interval", {"$literal": interval}]},
            }
        }
    ]


def _take_stages() -> list[dict[str, Any]]:
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


def _try_stages(lead: int) -> list[dict[str, Any]]:
    """``try_start`` of ticket ``_t``: set ``answer`` and, if started, ``pos`` and ``at``."""
    passed = {"$or": [{"$gte": ["$pos", "$_t"]}, {"$gte": ["$_t", "$ticket"]}]}
    can_start = {"$gte": [{"$add": ["$_now", {"$literal": lead}]}, _slot("$_t")]}
    start = {"$max": [_slot("$_t"), "$_now"]}
    return [
        {
            "$set": {
                "answer": {
                    "$switch": {
                        "branches": [
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


def _retime_stages(ticket: int, lead: int) -> list[dict[str, Any]]:
    """``retime`` of ``ticket``: while it is the latest start, move ``at`` to ``_now + lead`` or later."""
    latest = {"$and": [{"$eq": ["$pos", ticket]}, {"$lt": [ticket, "$ticket"]}]}
    start = {"$max": ["$at", {"$add": ["$_now", {"$literal": lead}]}]}
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


def pipeline(
    op: str, interval: int, now: int | None, *, ticket: int = 0, lead: int = 0
) -> list[dict[str, Any]]:
    """The update pipeline of ``op`` (``take``, ``try_start``, ``take_and_try``, ``retime``)."""
    if op == "take":
        answer = {"kind": "taken", "ticket": "$_t", "value": "$pos", "now": "$_now"}
        stages = [*_take_stages(), {"$set": {"answer": answer}}]
    elif op == "retime":
        stages = _retime_stages(ticket, lead)
    elif op == "try_start":
        stages = [{"$set": {"_t": {"$literal": ticket}}}, *_try_stages(lead)]
    else:
        stages = [*_take_stages(), *_try_stages(lead)]
    return [*_open_stages(interval, now), *stages, {"$unset": ["_now", "_t"]}]


def read_pipeline(name: str, now: int | None) -> list[dict[str, Any]]:
    """An aggregation returning ``name``'s document with the server clock in ``_now``; changes nothing."""
    return [{"$match": {"_id": name}}, {"$set": {"_now": _now_expression(now)}}]


def initial_document(name: str, interval: int) -> dict[str, Any]:
    """The record of a queue that has handed out no ticket yet."""
    return {"_id": name, "ticket": 1, "pos": 0, "at": NEVER, "interval": interval}


def check_document(collection: str, name: str, document: Any) -> Record:
    """The record in ``document``, or :class:`StateCorrupted` naming where it is."""
    fields = {key: document.get(key) for key in ("ticket", "pos", "at", "interval") if key in document}
    return check_record(fields, where=f"{collection}/{name}")


def check_well_formed(collection: str, name: str, document: Any) -> None:
    """Raise :class:`StateCorrupted` if ``document`` would not match :data:`WELL_FORMED`."""
    where = f"{collection}/{name}"
    for field in ("ticket", "pos", "at"):
        value = document.get(field)
        if isinstance(value, bool) or not isinstance(value, int):
            raise StateCorrupted(f"record at {where} has {field}={value!r}; want a whole number", where=where)
    check_record(document, where=where)  # the ranges


def parse(op: str, document: dict[str, Any]) -> Taken | Outcome:
    """The answer an operation left in its document."""
    answer = document["answer"]
    kind, ticket, value, now = answer["kind"], answer["ticket"], answer["value"], answer["now"]
    if op == "take":
        return Taken(ticket=ticket, pos=value, at=document["at"], now=now)
    if kind == "started":
        return Started(ticket=ticket, start=value, now=now)
    if kind == "wait":
        return Wait(ticket=ticket, slot=value, now=now)
    return Passed(ticket=ticket, pos=value, now=now)


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


#: the filter every update adds: a record whose fields are not whole numbers in range matches
#: nothing, so it is reported as corrupted (by the creation path) and never changed
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

#: errors in creating a client that mean the URL is wrong
BAD_URL_ERRORS = (InvalidURI, MongoConfigurationError, ValueError, TypeError)


def unavailable(where: str, exc: Exception) -> StateUnavailable:
    """The error raised when MongoDB at ``where`` fails with ``exc``."""
    if isinstance(exc, ConnectionFailure):
        return StateUnavailable(f"MongoDB at {where} is unreachable: {exc}", where=where)
    return StateUnavailable(f"MongoDB at {where} failed: {exc}", where=where)


def where_of(client: Any) -> str:
    """The seed list of a client, ``host:port,...``."""
    return ",".join(f"{h}:{p}" for h, p in client.topology_description.server_descriptions())


def datetime_us(moment: datetime.datetime) -> int:
    """A server ``Date`` (milliseconds) in whole microseconds."""
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.timezone.utc)
    return round(moment.timestamp() * 1000) * 1000


class MongoState(State):
    """Records kept in a MongoDB collection, changed only by server-side update pipelines."""

    #: ``$$NOW`` has whole milliseconds
    clock_resolution = 0.001

    def __init__(
        self,
        client: MongoClient[Any],
        *,
        database: str = DEFAULT_DATABASE,
        collection: str = DEFAULT_COLLECTION,
        url: str | None = None,
        clock: Clock | None = None,
    ) -> None:
        """Use a ready ``pymongo.MongoClient``.

        :param database: the database holding the queues' collection.
        :param collection: the collection, one document per queue name.
        :param url: the URL to pickle limiters as (default: built from the client).
        :param clock: **for tests only**: a function returning ``now`` in whole
            microseconds, used in place of the server's ``$$NOW``.
        """
        self._client = client
        self._collection: Collection[Any] = client[database][collection]
        self._clock = clock
        self._where = where_of(client)
        self.url = url or f"mongodb://{self._where}/?database={database}&collection={collection}"

    @classmethod
    def from_url(cls, url: str) -> MongoState:
        """Open ``mongodb://[user:password@]host[:port][/authdb][?database=D&collection=C&...]``.

        ``database`` (default ``ratequeue``) and ``collection`` (default
        ``queues``) choose where the documents live; other options go to
        ``MongoClient``. ``mongodb+srv://`` needs the ``dnspython`` package.
        """
        client_url, database, collection = split_url(url)
        try:
            client: MongoClient[Any] = MongoClient(client_url, **client_options(client_url))
        except BAD_URL_ERRORS as exc:
            raise ConfigurationError(f"bad MongoDB URL {url!r}: {exc}") from exc
        return cls(client, database=database, collection=collection, url=url)

    @property
    def collection(self) -> Collection[Any]:
        """The collection holding one document per queue."""
        return self._collection

    def close(self) -> None:
        self._client.close()

    def _update(self, op: str, name: str, interval: int, **args: int) -> Taken | Outcome:
        steps = pipeline(op, interval, None if self._clock is None else self._clock(), **args)
        for _ in range(3):
            document = self._retrying(
                lambda: self._collection.find_one_and_update(
                    {"_id": name, "interval": interval, **WELL_FORMED},
                    steps,
                    return_document=ReturnDocument.AFTER,
                )
            )
            if document is not None:
                check_document(self._collection.full_name, name, document)
                return parse(op, document)
            self._create(name, interval)
        raise StateUnavailable(  # pragma: no cover - only if the document vanishes again and again
            f"MongoDB at {self._where}: queue {name!r} disappeared while being created", where=self._where
        )

    def _create(self, name: str, interval: int) -> None:
        """Create the record of ``name`` if it is missing; raise if it has another interval.

        Not an upsert: under concurrent creation some MongoDB-compatible servers apply an
        upserting ``find_one_and_update`` yet return no document, and retrying it would apply
        the operation twice. Inserting the initial record first is correct everywhere.
        """
        try:
            self._retrying(lambda: self._collection.insert_one(initial_document(name, interval)))
        except DuplicateKeyError:
            stored = self._retrying(lambda: self._collection.find_one({"_id": name}))
            if stored is not None:
                record = check_document(self._collection.full_name, name, stored)
                check_interval_matches(name, record.interval, interval)
                check_well_formed(self._collection.full_name, name, stored)

    def _retrying(self, call: Any) -> Any:
        delay = BACKOFF
        for attempt in range(RETRIES + 1):
            try:
                return call()
            except DuplicateKeyError:
                raise
            except ConnectionFailure as exc:
                if attempt == RETRIES:
                    raise unavailable(self._where, exc) from exc
                time.sleep(delay)
                delay = min(delay * 2, 0.5)
            except PyMongoError as exc:
                raise unavailable(self._where, exc) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    def _take(self, name: str, interval: int) -> Taken:
        return self._update("take", name, interval)  # type: ignore[return-value]

    def _try_start(self, name: str, interval: int, ticket: int, lead: int) -> Outcome:
        return self._update("try_start", name, interval, ticket=ticket, lead=lead)  # type: ignore[return-value]

    def _take_and_try(self, name: str, interval: int, lead: int) -> Outcome:
        return self._update("take_and_try", name, interval, lead=lead)  # type: ignore[return-value]

    def _retime(self, name: str, interval: int, ticket: int, lead: int) -> Outcome:
        return self._update("retime", name, interval, ticket=ticket, lead=lead)  # type: ignore[return-value]

    def _read(self, name: str) -> Snapshot:
        fixed = None if self._clock is None else self._clock()
        rows = self._retrying(lambda: list(self._collection.aggregate(read_pipeline(name, fixed))))
        if rows:
            record = check_document(self._collection.full_name, name, rows[0])
            return Snapshot(record=record, now=int(rows[0]["_now"]))
        if fixed is not None:
            return Snapshot(record=None, now=fixed)
        hello = self._retrying(lambda: self._client.admin.command("hello"))
        return Snapshot(record=None, now=datetime_us(hello["localTime"]))

    def _reset(self, name: str) -> bool:
        result = self._retrying(lambda: self._collection.delete_one({"_id": name}))
        return bool(result.deleted_count)
