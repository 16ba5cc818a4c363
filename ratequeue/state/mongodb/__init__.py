"""``mongodb://`` and ``mongodb+srv://``: the protocol run atomically inside MongoDB, on its clock.

Each queue is one document holding every field of its record (see
:mod:`.codec`). Every operation is a single
``find_one_and_update`` whose update pipeline reads ``$$NOW`` on the server,
applies the protocol and leaves its answer in ``answer``: no
read-then-write from the client and no transaction. The filter names the
expected interval, burst, max_running and fairness, so an operation on a record with others
matches nothing and changes nothing; only then (and for a queue's first
operation) does the client insert the initial record or report the
mismatch. What is sent and how answers are read is in :mod:`.codec`.

A write with a keep time (``keep_us``) sets the ``Date`` ``expires`` in the
same pipeline, from the same ``$$NOW``; one without removes it. A TTL index
on ``expires`` (created before a state's first write with a keep time) lets
the server delete idle records; :meth:`MongoBackend._sweep_flow` deletes
them itself too, and runs now and then (:attr:`~MongoBackend.sweep_every_us`)
when an operation creates a record, for servers whose TTL monitor is slow
or missing. A record past its keep time but not yet deleted behaves as a
fresh one would (:func:`ratequeue.core.protocol.expires`), so reads show it.

How an operation goes -- update, create the record, retry, read -- is
written once, in :class:`MongoBackend`, as :mod:`ratequeue.core.flow`
generators: :class:`MongoState` carries them out with pymongo's client in
the calling thread, :class:`AsyncMongoState` with its asyncio client.

A connection failure is retried (:meth:`RetryLog.retried
<ratequeue.state._retries.RetryLog.retried>`, with backoff), so an
operation may reach the server twice when only its reply was lost: a
repeated ``try_start`` of the latest start is answered with the same start
(:func:`ratequeue.core.protocol.repeats_start`), so no turn is lost; a repeated
``take`` leaks one ticket, which costs at most one interval (G4).

A fair queue's ``take``, ``try_start`` and ``take_and_try`` are
:func:`~ratequeue.core.protocol.enqueue`, :func:`~ratequeue.core.protocol.try_turn`
and :func:`~ratequeue.core.protocol.enqueue_and_try`, in the same single
pipeline (the waiters seated by a ``$reduce``): still one round trip.

``try_take`` (:func:`~ratequeue.core.protocol.try_take`) runs
``take_and_try``'s stages (a fair queue's too) in its one pipeline, whose
last stage puts the document back as it was read, answer aside, unless the
ticket started: a try that waits leaves no ticket, waiter or keep time behind.

``$$NOW`` has millisecond resolution: on this backend every ``now`` is a
whole millisecond (in microseconds), and intervals keep their microseconds.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any, ClassVar, Generic, TypeVar

from pymongo import AsyncMongoClient, MongoClient, ReturnDocument
from pymongo.errors import ConnectionFailure, DuplicateKeyError, InvalidName, OperationFailure, PyMongoError

from ..._redact import redact, scrub, secrets_kept_out
from ...core.flow import Call, Flow
from ...core.operation import Operation, Terms
from ...core.protocol import Answer
from ...errors import ConfigurationError, RateQueueError, StateUnavailable
from .._retries import RetryLog
from ..base import AsyncState, Clock, Snapshot, State, StateBase
from ..records import check_terms
from .codec import (
    BAD_URL_ERRORS,
    DEFAULT_COLLECTION,
    DEFAULT_DATABASE,
    EXPIRES,
    PARSERS,
    TTL_INDEX,
    Document,
    Pipeline,
    check_document,
    check_well_formed,
    client_options,
    datetime_us,
    initial_document,
    names_pipeline,
    pipeline,
    read_pipeline,
    read_snapshot,
    split_url,
    sweep_filter,
    update_filter,
    where_of,
)

__all__ = ["AsyncMongoState", "MongoBackend", "MongoState", "split_url"]

#: calls retried after a connection failure (see :mod:`ratequeue.state._retries`)
_log = logging.getLogger("ratequeue.state.mongodb")

#: how often an update finding no document creates it and tries again
CREATE_ATTEMPTS = 3

#: the client a state drives: pymongo's synchronous or asyncio one
ClientT = TypeVar("ClientT", MongoClient[Any], AsyncMongoClient[Any])

S = TypeVar("S", bound="MongoBackend[Any]")


class MongoBackend(StateBase, Generic[ClientT]):
    """The MongoDB state, for both APIs: every entry point as a flow, errors, setup."""

    #: the client :meth:`from_url` makes: pymongo's synchronous or asyncio one
    _client_class: ClassVar[Any]

    #: ``$$NOW`` has whole milliseconds
    clock_resolution = 0.001

    #: a ``hello`` answers with the server's ``localTime`` (the clock ``$$NOW`` reads), at once
    reads_clock = True

    #: fair queues run in the update pipelines too (:mod:`.codec`, ``_FAIR_STAGES``)
    fair_queues = True

    _client_errors = (PyMongoError,)

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
        try:
            self._collection: Any = client[database][collection]
        except (InvalidName, TypeError) as exc:
            raise ConfigurationError(
                f"bad MongoDB database or collection name (database={database!r}, "
                f"collection={collection!r}): {exc}; choose them with ?database=D&collection=C"
            ) from exc
        self._clock = clock
        self._where = where_of(client)
        self.url = url or f"mongodb://{self._where}/?database={database}&collection={collection}"
        #: the calls retried after a connection failure, and their log
        self._retries = RetryLog(_log, "MongoDB", self._where, url=self.url, transient=(ConnectionFailure,))
        self._ttl_ready = False

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

    @classmethod
    def from_url(cls: type[S], url: str) -> S:
        """Open ``mongodb://[user:password@]host[:port][/authdb][?database=D&collection=C&...]``.

        ``database`` (default ``ratequeue``) and ``collection`` (default
        ``queues``) choose where the documents live; other options go to the
        client. ``mongodb+srv://`` needs the ``dnspython`` package.

        :raises ConfigurationError: for a URL the client refuses, a TLS file it
            names that cannot be read, or a database or collection name MongoDB
            does not allow (the client is then closed again).
        """
        client_url, database, collection = split_url(url)
        with secrets_kept_out(url):
            try:
                client = cls._client_class(client_url, **client_options(client_url))
            except (*BAD_URL_ERRORS, OSError) as exc:  # OSError: a TLS file named by the URL cannot be read
                raise ConfigurationError(f"bad MongoDB URL {redact(url)!r}: {scrub(str(exc), url)}") from exc
            try:
                return cls(client, database=database, collection=collection, url=url)
            except ConfigurationError:
                closing: object = client.close()
                if inspect.iscoroutine(closing):  # the asyncio client: it opens nothing before its first call
                    closing.close()
                raise

    @property
    def collection(self) -> Any:
        """The collection holding one document per queue."""
        return self._collection

    def _retried(self, fn: Callable[..., Any], *args: Any) -> Flow[Any]:
        """``fn(*args)``, called again after a connection failure (see :meth:`RetryLog.retried`)."""
        return self._retries.retried(Call(fn, args))

    def _aggregate_flow(self, steps: Pipeline) -> Flow[list[Document]]:
        """The documents the aggregation ``steps`` returns, as a list (retried as :meth:`_retried`)."""

        def attempt() -> Flow[list[Document]]:
            cursor = yield Call(self._collection.aggregate, (steps,))
            rows: list[Document] = yield Call(cursor.to_list)
            return rows

        return self._retries.retried(attempt)

    def _fixed_now(self) -> int | None:
        """The test clock's ``now`` (us), or ``None`` for the server's."""
        return None if self._clock is None else self._clock()

    def _record_where(self, name: str) -> str:
        return f"{self._collection.full_name}/{name}"

    def _prepare_flow(self) -> Flow[None]:
        """The client connected (a ``hello``), so that the next call's round-trip is a call's."""
        yield from self._retried(self._client.admin.command, "hello")

    def _execute_flow(self, op: Operation) -> Flow[Answer]:
        """Run ``op`` on its queue's document; its answer is read from the document after it.

        When the update matches nothing, the record is missing (it is then
        inserted), or has another interval, burst or max_running or is malformed
        (:meth:`_create_flow` raises), and the update is sent again.
        """
        name, terms = op.name, op.terms
        if terms.keep_us and not self._ttl_ready:
            yield from self._ttl_index_flow()
        steps = pipeline(op, self._fixed_now())
        update = functools.partial(self._collection.find_one_and_update, return_document=ReturnDocument.AFTER)
        for _ in range(CREATE_ATTEMPTS):
            document: Document | None = yield from self._retried(update, update_filter(name, terms), steps)
            if document is not None:
                return PARSERS[op.kind](document, self._record_where(name))
            yield from self._create_flow(name, terms)
        raise StateUnavailable(  # pragma: no cover - only if the document vanishes again and again
            f"MongoDB at {self._where}: queue {name!r} disappeared while being created", where=self._where
        )

    def _create_flow(self, name: str, terms: Terms) -> Flow[None]:
        """Create the record of ``name`` if it is missing; raise if it has other terms or is malformed.

        Not an upsert: under concurrent creation some MongoDB-compatible servers apply an
        upserting ``find_one_and_update`` yet return no document, and retrying it would apply
        the operation twice. Inserting the initial record first is correct everywhere.
        Creating a record sweeps the collection when the last sweep is
        :attr:`sweep_every_us` old (an error in that sweep is ignored: it
        only tidies up).
        """
        try:
            yield from self._retried(self._collection.insert_one, initial_document(name, terms))
        except DuplicateKeyError:  # another shard created it (or our insert's reply was lost)
            stored: Document | None = yield from self._retried(self._collection.find_one, {"_id": name})
            if stored is not None:
                check_terms(name, check_document(stored, self._record_where(name)), terms)
                check_well_formed(stored, self._record_where(name))
            return
        if self._sweep_due():
            with contextlib.suppress(PyMongoError):
                yield from self._sweep_flow(retries=False)

    def _ttl_index_flow(self) -> Flow[None]:
        """Make sure of the TTL index on ``expires``, once per state; if refused, sweeps do its work.

        ``expireAfterSeconds=0``: the server deletes a document once its
        ``expires`` has passed (MongoDB checks every minute, as secantusdb
        does). Creating an index that exists is a no-op; a server without
        TTL indexes, an index of that name with other options, or a user
        not allowed to create indexes leaves expiry to :meth:`_sweep_flow`.
        """
        create = functools.partial(self._collection.create_index, name=TTL_INDEX, expireAfterSeconds=0)
        with contextlib.suppress(OperationFailure):
            yield from self._retried(create, [(EXPIRES, 1)])
        self._ttl_ready = True

    def _names_flow(self, prefix: str) -> Flow[list[str]]:
        rows = yield from self._aggregate_flow(names_pipeline(prefix))
        return [row["_id"] for row in rows]

    def _sweep_flow(self, *, retries: bool = True) -> Flow[int]:
        """Delete the records past their keep time on the server's clock (or the test clock); say how many."""
        self._swept = self._sweep_clock()
        call = Call(self._collection.delete_many, (sweep_filter(self._fixed_now()),))
        result = (yield from self._retries.retried(call)) if retries else (yield call)
        return int(result.deleted_count)

    def _read_flow(self, name: str) -> Flow[Snapshot]:
        fixed_us = self._fixed_now()
        rows = yield from self._aggregate_flow(read_pipeline(name, fixed_us))
        if rows:
            return read_snapshot(rows[0], self._record_where(name))
        if fixed_us is not None:
            return Snapshot(record=None, now=fixed_us)
        hello: Document = yield from self._retried(self._client.admin.command, "hello")
        return Snapshot(record=None, now=datetime_us(hello["localTime"]))

    def _read_clock_flow(self) -> Flow[int]:
        # one attempt, never retried: a shard reads the clock only to tighten its bounds, and a
        # read held for seconds of backoff in an outage would hold its caller for nothing
        fixed_us = self._fixed_now()
        if fixed_us is not None:
            return fixed_us
        hello: Document = yield Call(self._client.admin.command, ("hello",))
        return datetime_us(hello["localTime"])

    def _reset_flow(self, name: str) -> Flow[bool]:
        result = yield from self._retried(self._collection.delete_one, {"_id": name})
        return bool(result.deleted_count)


class MongoState(MongoBackend[MongoClient[Any]], State):
    """Records kept in a MongoDB collection, changed only by server-side update pipelines."""

    _client_class = MongoClient

    def close(self) -> None:
        self._client.close()


class AsyncMongoState(MongoBackend[AsyncMongoClient[Any]], AsyncState):
    """:class:`MongoState` on pymongo's ``AsyncMongoClient``."""

    _client_class = AsyncMongoClient

    async def close(self) -> None:
        await self._client.close()
