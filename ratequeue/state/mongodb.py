"""``mongodb://`` and ``mongodb+srv://``: the protocol run atomically inside MongoDB, on its clock.

Each queue is one document ``{_id: name, ticket, pos, at, interval, answer}``
(integers, microseconds). Every operation is a single ``find_one_and_update``
whose update pipeline reads ``$$NOW`` on the server, applies the protocol and
leaves its answer in ``answer``: no read-then-write from the client and no
transaction. The filter names the expected interval, so an operation on a
record with another interval matches nothing and changes nothing; only then
(and for a queue's first operation) does the client insert the initial
record or report the mismatch. What is sent and how answers are read is in
:mod:`ratequeue.state._mongodb_codec`.

How an operation goes -- update, create the record, retry, read -- is
written once, in :class:`MongoStateBase`, as :mod:`ratequeue._flow`
generators: :class:`MongoState` carries them out with pymongo's client in
the calling thread, :class:`ratequeue.aio.mongodb.AsyncMongoState` with its
asyncio client.

A connection failure is retried (:data:`RETRIES` times, with backoff), so an
operation may reach the server twice when only its reply was lost: a
repeated ``try_start`` of the latest start is answered with the same grant
(:func:`ratequeue.protocol.is_same_grant`), so no turn is lost; a repeated
``take`` leaks one ticket, which costs at most one interval (G4).

``$$NOW`` has millisecond resolution: on this backend every ``now`` is a
whole millisecond (in microseconds), and intervals keep their microseconds.
"""

from __future__ import annotations

import functools
import inspect
from abc import ABC, abstractmethod
from collections.abc import Awaitable
from typing import Any, Generic, TypeVar

from pymongo import AsyncMongoClient, MongoClient, ReturnDocument
from pymongo.asynchronous.collection import AsyncCollection
from pymongo.collection import Collection
from pymongo.errors import ConnectionFailure, DuplicateKeyError, InvalidName, OperationFailure, PyMongoError

from .._flow import Call, Flow, Sleep, run
from .._redact import redact, scrub, secrets_kept_out
from ..errors import ConfigurationError, RateQueueError, StateUnavailable
from ..protocol import Outcome, Taken
from ._mongodb_codec import (
    BAD_URL_ERRORS,
    DEFAULT_COLLECTION,
    DEFAULT_DATABASE,
    Document,
    Op,
    OutcomeOp,
    Pipeline,
    check_document,
    check_well_formed,
    client_options,
    datetime_us,
    initial_document,
    parse_outcome,
    parse_taken,
    pipeline,
    read_now,
    read_pipeline,
    split_url,
    update_filter,
    where_of,
)
from .base import Clock, Snapshot, State, StateBase, check_interval_matches

__all__ = ["MongoState", "MongoStateBase", "split_url"]

#: how often a transient connection failure is retried, the first backoff and the longest (s)
RETRIES = 5
BACKOFF = 0.02
BACKOFF_CAP = 0.5

#: how often an update finding no document creates it and tries again
CREATE_ATTEMPTS = 3

#: the client a state drives: pymongo's synchronous or asyncio one
ClientT = TypeVar("ClientT", MongoClient[Any], AsyncMongoClient[Any])


def retrying(call: Call) -> Flow[Any]:
    """``call`` carried out; after a connection failure, again (with backoff), :data:`RETRIES` times at most.

    Any other error, and the last connection failure, is raised: the state
    maps it (:meth:`MongoStateBase._error_for`).
    """
    delay = BACKOFF
    for _ in range(RETRIES):
        try:
            return (yield call)
        except ConnectionFailure:
            yield Sleep(delay)
            delay = min(delay * 2, BACKOFF_CAP)
    return (yield call)


class MongoStateBase(StateBase, ABC, Generic[ClientT]):
    """What the synchronous and the asyncio MongoDB states share: every operation's flow, errors, setup."""

    #: ``$$NOW`` has whole milliseconds
    clock_resolution = 0.001

    _driver_errors = (PyMongoError,)

    _collection: Collection[Any] | AsyncCollection[Any]

    def __init__(
        self,
        client: ClientT,
        *,
        database: str = DEFAULT_DATABASE,
        collection: str = DEFAULT_COLLECTION,
        url: str | None = None,
        clock: Clock | None = None,
    ) -> None:
        """Use a ready client: ``pymongo.MongoClient``, or ``pymongo.AsyncMongoClient`` for asyncio.

        :param database: the database holding the queues' collection.
        :param collection: the collection, one document per queue name.
        :param url: the URL to pickle limiters as (default: built from the client).
        :param clock: **for tests only**: a function returning ``now`` in whole
            microseconds, used in place of the server's ``$$NOW``.
        """
        self._client: ClientT = client
        self._collection = collection_of(client, database, collection)
        self._clock = clock
        self._where = where_of(client)
        self.url = url or f"mongodb://{self._where}/?database={database}&collection={collection}"

    def _error_for(self, exc: Exception, name: str) -> RateQueueError:
        """:class:`StateUnavailable` naming the server (and the queue); never a password."""
        if isinstance(exc, ConnectionFailure):
            reason = "is unreachable"
        elif isinstance(exc, OperationFailure) and exc.code == 18:  # AuthenticationFailed
            reason = "refused the credentials"
        else:
            reason = f"failed on queue {name!r}"
        return StateUnavailable(
            scrub(f"MongoDB at {self._where} {reason}: {exc}", self.url), where=self._where
        )

    @abstractmethod
    def _aggregate_list(self, steps: Pipeline) -> list[Document] | Awaitable[list[Document]]:
        """The documents the aggregation ``steps`` returns, as a list."""

    def _fixed_now(self) -> int | None:
        """The test clock's ``now`` (us), or ``None`` for the server's."""
        return None if self._clock is None else self._clock()

    def _record_where(self, name: str) -> str:
        return f"{self._collection.full_name}/{name}"

    def _take_flow(self, name: str, interval_us: int) -> Flow[Taken]:
        document = yield from self._update_flow("take", name, interval_us)
        return parse_taken(document, self._record_where(name))

    def _outcome_flow(
        self, op: OutcomeOp, name: str, interval_us: int, ticket: int = 0, lead_us: int = 0
    ) -> Flow[Outcome]:
        document = yield from self._update_flow(op, name, interval_us, ticket, lead_us)
        return parse_outcome(document, self._record_where(name))

    def _update_flow(
        self, op: Op, name: str, interval_us: int, ticket: int = 0, lead_us: int = 0
    ) -> Flow[Document]:
        """Run ``op`` on ``name``'s document and return the document after it (with the answer).

        When the update matches nothing, the record is missing (it is then
        inserted), or has another interval or is malformed (:meth:`_create_flow`
        raises), and the update is sent again.
        """
        steps = pipeline(op, interval_us, self._fixed_now(), ticket=ticket, lead_us=lead_us)
        update = functools.partial(self._collection.find_one_and_update, return_document=ReturnDocument.AFTER)
        for _ in range(CREATE_ATTEMPTS):
            document: Document | None = yield from retrying(
                Call(update, (update_filter(name, interval_us), steps))
            )
            if document is not None:
                return document
            yield from self._create_flow(name, interval_us)
        raise StateUnavailable(  # pragma: no cover - only if the document vanishes again and again
            f"MongoDB at {self._where}: queue {name!r} disappeared while being created", where=self._where
        )

    def _create_flow(self, name: str, interval_us: int) -> Flow[None]:
        """Create the record of ``name`` if it is missing; raise if it has another interval or is malformed.

        Not an upsert: under concurrent creation some MongoDB-compatible servers apply an
        upserting ``find_one_and_update`` yet return no document, and retrying it would apply
        the operation twice. Inserting the initial record first is correct everywhere.
        """
        try:
            yield from retrying(Call(self._collection.insert_one, (initial_document(name, interval_us),)))
        except DuplicateKeyError:  # another shard created it (or our insert's reply was lost)
            stored: Document | None = yield from retrying(Call(self._collection.find_one, ({"_id": name},)))
            if stored is not None:
                record = check_document(stored, self._record_where(name))
                check_interval_matches(name, record.interval, interval_us)
                check_well_formed(stored, self._record_where(name))

    def _read_flow(self, name: str) -> Flow[Snapshot]:
        fixed_us = self._fixed_now()
        rows: list[Document] = yield from retrying(
            Call(self._aggregate_list, (read_pipeline(name, fixed_us),))
        )
        if rows:
            where = self._record_where(name)
            return Snapshot(record=check_document(rows[0], where), now=read_now(rows[0], where))
        if fixed_us is not None:
            return Snapshot(record=None, now=fixed_us)
        hello: Document = yield from retrying(Call(self._client.admin.command, ("hello",)))
        return Snapshot(record=None, now=datetime_us(hello["localTime"]))

    def _reset_flow(self, name: str) -> Flow[bool]:
        result = yield from retrying(Call(self._collection.delete_one, ({"_id": name},)))
        return bool(result.deleted_count)


def open_client(url: str, client_class: type[ClientT]) -> tuple[ClientT, str, str]:
    """A ``client_class`` for ``url`` less ratequeue's options, and the database and collection they name.

    :raises ConfigurationError: for a URL the driver refuses, a TLS file it
        names that cannot be read, or a database or collection name MongoDB
        does not allow (the client is then closed again).
    """
    client_url, database, collection = split_url(url)
    with secrets_kept_out(url):
        try:
            client = client_class(client_url, **client_options(client_url))
        except (*BAD_URL_ERRORS, OSError) as exc:  # OSError: a TLS file named by the URL cannot be read
            raise ConfigurationError(f"bad MongoDB URL {redact(url)!r}: {scrub(str(exc), url)}") from exc
        try:
            collection_of(client, database, collection)
        except ConfigurationError:
            closing: object = client.close()  # type: ignore[func-returns-value]
            if inspect.iscoroutine(closing):  # the asyncio client: it opens nothing before its first call
                closing.close()
            raise
    return client, database, collection


def collection_of(client: ClientT, database: str, collection: str) -> Any:
    """``client[database][collection]``; :class:`ConfigurationError` for a name MongoDB does not allow."""
    try:
        return client[database][collection]
    except (InvalidName, TypeError) as exc:
        raise ConfigurationError(
            f"bad MongoDB database or collection name (database={database!r}, collection={collection!r}): "
            f"{exc}; choose them with ?database=D&collection=C"
        ) from exc


class MongoState(MongoStateBase[MongoClient[Any]], State):
    """Records kept in a MongoDB collection, changed only by server-side update pipelines."""

    _collection: Collection[Any]

    @classmethod
    def from_url(cls, url: str) -> MongoState:
        """Open ``mongodb://[user:password@]host[:port][/authdb][?database=D&collection=C&...]``.

        ``database`` (default ``ratequeue``) and ``collection`` (default
        ``queues``) choose where the documents live; other options go to
        ``MongoClient``. ``mongodb+srv://`` needs the ``dnspython`` package.
        """
        client, database, collection = open_client(url, MongoClient)
        return cls(client, database=database, collection=collection, url=url)

    @property
    def collection(self) -> Collection[Any]:
        """The collection holding one document per queue."""
        return self._collection

    def close(self) -> None:
        self._client.close()

    def _aggregate_list(self, steps: Pipeline) -> list[Document]:
        return list(self._collection.aggregate(steps))

    def _take(self, name: str, interval_us: int) -> Taken:
        return run(self._take_flow(name, interval_us))

    def _try_start(self, name: str, interval_us: int, ticket: int, lead_us: int) -> Outcome:
        return run(self._outcome_flow("try_start", name, interval_us, ticket, lead_us))

    def _take_and_try(self, name: str, interval_us: int, lead_us: int) -> Outcome:
        return run(self._outcome_flow("take_and_try", name, interval_us, lead_us=lead_us))

    def _retime(self, name: str, interval_us: int, ticket: int, lead_us: int) -> Outcome:
        return run(self._outcome_flow("retime", name, interval_us, ticket, lead_us))

    def _read(self, name: str) -> Snapshot:
        return run(self._read_flow(name))

    def _reset(self, name: str) -> bool:
        return run(self._reset_flow(name))
