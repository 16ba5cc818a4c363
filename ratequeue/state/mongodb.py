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
from urllib.parse import parse_qs, urlsplit

from pymongo import MongoClient, ReturnDocument
from pymongo.collection import Collection
from pymongo.errors import ConfigurationError as MongoConfigurationError
from pymongo.errors import ConnectionFailure, DuplicateKeyError, InvalidURI, OperationFailure, PyMongoError

from ..errors import ConfigurationError, StateUnavailable
from ..protocol import NEVER, Outcome, Passed, Record, Started, Taken, Wait
from .base import Clock, Snapshot, State, check_interval_matches, check_record

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


class MongoState(State):
    """Records kept in a MongoDB collection, changed only by server-side update pipelines."""

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
        seeds = ",".join(f"{h}:{p}" for h, p in client.topology_description.server_descriptions())
        self._where = seeds
        self.url = url or f"mongodb://{seeds}/?database={database}&collection={collection}"

    @classmethod
    def from_url(cls, url: str) -> MongoState:
        """Open ``mongodb://[user:password@]host[:port][/authdb][?database=D&collection=C&...]``.

        ``database`` (default ``ratequeue``) and ``collection`` (default
        ``queues``) choose where the documents live; other options go to
        ``MongoClient``. ``mongodb+srv://`` needs the ``dnspython`` package.
        """
        parts = urlsplit(url)
        query = parse_qs(parts.query)
        database = query.pop("database", [DEFAULT_DATABASE])[-1]
        collection = query.pop("collection", [DEFAULT_COLLECTION])[-1]
        rest = "&".join(f"{key}={value}" for key, values in query.items() for value in values)
        try:
            client: MongoClient[Any] = MongoClient(
                parts._replace(query=rest).geturl(),
                serverSelectionTimeoutMS=5000,
                connectTimeoutMS=5000,
            )
        except (InvalidURI, MongoConfigurationError, ValueError, TypeError) as exc:
            raise ConfigurationError(f"bad MongoDB URL {url!r}: {exc}") from exc
        return cls(client, database=database, collection=collection, url=url)

    @property
    def collection(self) -> Collection[Any]:
        """The collection holding one document per queue."""
        return self._collection

    def close(self) -> None:
        self._client.close()

    def _update(self, name: str, interval: int, stages: list[dict[str, Any]]) -> dict[str, Any]:
        now = None if self._clock is None else self._clock()
        pipeline = [*_open_stages(interval, now), *stages, {"$unset": ["_now", "_t"]}]
        for _ in range(3):
            document = self._retrying(
                lambda: self._collection.find_one_and_update(
                    {"_id": name, "interval": interval}, pipeline, return_document=ReturnDocument.AFTER
                )
            )
            if document is not None:
                self._check(name, document)
                return dict(document)
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
        initial = {"_id": name, "ticket": 1, "pos": 0, "at": NEVER, "interval": interval}
        try:
            self._retrying(lambda: self._collection.insert_one(initial))
        except DuplicateKeyError:
            stored = self._retrying(lambda: self._collection.find_one({"_id": name}))
            if stored is not None:
                check_interval_matches(name, self._check(name, stored).interval, interval)

    def _check(self, name: str, document: dict[str, Any]) -> Record:
        fields = {key: document.get(key) for key in ("ticket", "pos", "at", "interval") if key in document}
        return check_record(fields, where=self._document_where(name))

    def _document_where(self, name: str) -> str:
        return f"{self._collection.full_name}/{name}"

    def _retrying(self, call: Any) -> Any:
        delay = BACKOFF
        for attempt in range(RETRIES + 1):
            try:
                return call()
            except DuplicateKeyError:
                raise
            except ConnectionFailure as exc:
                if attempt == RETRIES:
                    raise StateUnavailable(
                        f"MongoDB at {self._where} is unreachable: {exc}", where=self._where
                    ) from exc
                time.sleep(delay)
                delay = min(delay * 2, 0.5)
            except (OperationFailure, PyMongoError) as exc:
                raise StateUnavailable(f"MongoDB at {self._where} failed: {exc}", where=self._where) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    def _take(self, name: str, interval: int) -> Taken:
        document = self._update(
            name,
            interval,
            [
                *_take_stages(),
                {"$set": {"answer": {"kind": "taken", "ticket": "$_t", "value": "$pos", "now": "$_now"}}},
            ],
        )
        answer = document["answer"]
        return Taken(ticket=answer["ticket"], pos=answer["value"], at=document["at"], now=answer["now"])

    def _try_start(self, name: str, interval: int, ticket: int, lead: int) -> Outcome:
        document = self._update(name, interval, [{"$set": {"_t": {"$literal": ticket}}}, *_try_stages(lead)])
        return _outcome(document["answer"])

    def _take_and_try(self, name: str, interval: int, lead: int) -> Outcome:
        document = self._update(name, interval, [*_take_stages(), *_try_stages(lead)])
        return _outcome(document["answer"])

    def _read(self, name: str) -> Snapshot:
        # One round-trip that changes nothing: the document with the server's clock beside it.
        now = _now_expression(None if self._clock is None else self._clock())
        rows = self._retrying(
            lambda: list(self._collection.aggregate([{"$match": {"_id": name}}, {"$set": {"_now": now}}]))
        )
        if rows:
            return Snapshot(record=self._check(name, rows[0]), now=int(rows[0]["_now"]))
        if self._clock is not None:
            return Snapshot(record=None, now=self._clock())
        hello = self._retrying(lambda: self._client.admin.command("hello"))
        return Snapshot(record=None, now=_datetime_us(hello["localTime"]))

    def _reset(self, name: str) -> bool:
        result = self._retrying(lambda: self._collection.delete_one({"_id": name}))
        return bool(result.deleted_count)


def _outcome(answer: dict[str, Any]) -> Outcome:
    kind, ticket, value, now = answer["kind"], answer["ticket"], answer["value"], answer["now"]
    if kind == "started":
        return Started(ticket=ticket, start=value, now=now)
    if kind == "wait":
        return Wait(ticket=ticket, slot=value, now=now)
    return Passed(ticket=ticket, pos=value, now=now)


def _datetime_us(moment: datetime.datetime) -> int:
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.timezone.utc)
    return round(moment.timestamp() * 1000) * 1000
