"""``mongodb://`` and ``mongodb+srv://``: the protocol run atomically inside MongoDB, on its clock.

Each queue is one document ``{_id: name, ticket, pos, at, interval, burst,
due, paused, max_running, leases, held, answer, expires}`` (integers,
microseconds; a queue of burst 1 has no ``burst`` and no ``due``, as before
bursts; ``paused`` is there, ``true``, only while the queue is paused for
every shard; ``max_running``, ``leases`` and ``held`` only on a queue with a
cap on running jobs). Every operation is a single
``find_one_and_update`` whose update pipeline reads ``$$NOW`` on the server,
applies the protocol and leaves its answer in ``answer``: no
read-then-write from the client and no transaction. The filter names the
expected interval, burst and max_running, so an operation on a record with others
matches nothing and changes nothing; only then (and for a queue's first
operation) does the client insert the initial record or report the
mismatch. What is sent and how answers are read is in
:mod:`ratequeue.state._mongodb_codec`.

A write with a keep time (``keep_us``) sets the ``Date`` ``expires`` in the
same pipeline, from the same ``$$NOW``; one without removes it. A TTL index
on ``expires`` (created before a state's first write with a keep time) lets
the server delete idle records; :meth:`MongoStateBase._sweep_flow` deletes
them itself too, and runs now and then (:attr:`~MongoStateBase.sweep_every_us`)
when an operation creates a record, for servers whose TTL monitor is slow
or missing. A record past its keep time but not yet deleted behaves as a
fresh one would (:func:`ratequeue.protocol.expires`), so reads show it.

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

import contextlib
import functools
import inspect
import logging
import time
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
    EXPIRES,
    TTL_INDEX,
    ChangeOp,
    Document,
    Op,
    OutcomeOp,
    Pipeline,
    check_document,
    check_well_formed,
    client_options,
    datetime_us,
    initial_document,
    names_pipeline,
    parse_changed,
    parse_outcome,
    parse_taken,
    pipeline,
    read_now,
    read_pipeline,
    split_url,
    sweep_filter,
    update_filter,
    where_of,
)
from ._retries import RetryLog
from .base import Clock, Snapshot, State, StateBase, Terms, check_terms_match

__all__ = ["MongoState", "MongoStateBase", "split_url"]

#: calls retried after a connection failure (see :mod:`ratequeue.state._retries`)
_log = logging.getLogger("ratequeue.state.mongodb")

#: how often a transient connection failure is retried, the first backoff and the longest (s)
RETRIES = 5
BACKOFF = 0.02
BACKOFF_CAP = 0.5

#: how often an update finding no document creates it and tries again
CREATE_ATTEMPTS = 3

#: the client a state drives: pymongo's synchronous or asyncio one
ClientT = TypeVar("ClientT", MongoClient[Any], AsyncMongoClient[Any])


def retrying(log: RetryLog, call: Call) -> Flow[Any]:
    """``call`` carried out; after a connection failure, again (with backoff), :data:`RETRIES` times at most.

    Any other error, and the last connection failure, is raised: the state
    maps it (:meth:`MongoStateBase._error_for`). The failures go to ``log``:
    a first retry is INFO (a connection closed while idle is routine), a
    retry that fails again or a call that gives up a WARNING (see :class:`RetryLog`).
    """
    delay = BACKOFF
    failures = 0
    while True:
        try:
            return (yield call)
        except ConnectionFailure as exc:
            failures += 1
            if failures > RETRIES:
                log.gave_up(exc, failures)
                raise
            log.retrying(exc, failures, RETRIES)
            yield Sleep(delay)
            delay = min(delay * 2, BACKOFF_CAP)


class MongoStateBase(StateBase, ABC, Generic[ClientT]):
    """What the synchronous and the asyncio MongoDB states share: every operation's flow, errors, setup."""

    #: ``$$NOW`` has whole milliseconds
    clock_resolution = 0.001

    _driver_errors = (PyMongoError,)

    #: how often (us) creating a record also sweeps the collection's records past their keep time
    #: (on this host's monotonic clock, or a test clock); the server's TTL monitor deletes them too
    sweep_every_us = 60_000_000

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
        #: the calls retried after a connection failure, logged
        self._retries = RetryLog(_log, "MongoDB", self._where, scrub=lambda text: scrub(text, self.url))
        #: when (:meth:`_sweep_clock`) this state last swept; whether it has made sure of the TTL index
        self._swept: int | None = None
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

    @abstractmethod
    def _aggregate_list(self, steps: Pipeline) -> list[Document] | Awaitable[list[Document]]:
        """The documents the aggregation ``steps`` returns, as a list."""

    def _fixed_now(self) -> int | None:
        """The test clock's ``now`` (us), or ``None`` for the server's."""
        return None if self._clock is None else self._clock()

    def _record_where(self, name: str) -> str:
        return f"{self._collection.full_name}/{name}"

    def _sweep_clock(self) -> int:
        """The clock (us) that spaces automatic sweeps: the test clock, or this host's monotonic one."""
        return self._clock() if self._clock is not None else time.monotonic_ns() // 1000

    def _take_flow(self, name: str, terms: Terms, cost: int) -> Flow[Taken]:
        document = yield from self._update_flow("take", name, terms, cost=cost)
        return parse_taken(document, self._record_where(name))

    def _outcome_flow(
        self, op: OutcomeOp, name: str, terms: Terms, ticket: int = 0, lead_us: int = 0, cost: int = 1
    ) -> Flow[Outcome]:
        document = yield from self._update_flow(op, name, terms, ticket, lead_us, cost)
        return parse_outcome(document, self._record_where(name))

    def _changed_flow(
        self, op: ChangeOp, name: str, terms: Terms, ticket: int = 0, *, paused: bool = False
    ) -> Flow[bool]:
        """``set_paused`` (of ``paused``), ``release`` or ``renew`` (of ``ticket``): its yes or no."""
        document = yield from self._update_flow(op, name, terms, ticket, paused=paused)
        return parse_changed(document, self._record_where(name), op)

    def _update_flow(
        self,
        op: Op,
        name: str,
        terms: Terms,
        ticket: int = 0,
        lead_us: int = 0,
        cost: int = 1,
        *,
        paused: bool = False,
    ) -> Flow[Document]:
        """Run ``op`` on ``name``'s document and return the document after it (with the answer).

        When the update matches nothing, the record is missing (it is then
        inserted), or has another interval, burst or max_running or is malformed
        (:meth:`_create_flow` raises), and the update is sent again.
        """
        if terms.keep_us and not self._ttl_ready:
            yield from self._ttl_index_flow()
        steps = pipeline(
            op, terms, self._fixed_now(), ticket=ticket, lead_us=lead_us, cost=cost, paused=paused
        )
        update = functools.partial(self._collection.find_one_and_update, return_document=ReturnDocument.AFTER)
        for _ in range(CREATE_ATTEMPTS):
            document: Document | None = yield from retrying(
                self._retries, Call(update, (update_filter(name, terms), steps))
            )
            if document is not None:
                return document
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
            yield from retrying(
                self._retries, Call(self._collection.insert_one, (initial_document(name, terms),))
            )
        except DuplicateKeyError:  # another shard created it (or our insert's reply was lost)
            stored: Document | None = yield from retrying(
                self._retries, Call(self._collection.find_one, ({"_id": name},))
            )
            if stored is not None:
                record = check_document(stored, self._record_where(name))
                check_terms_match(name, record, terms)
                check_well_formed(stored, self._record_where(name))
            return
        if self._swept is None or self._sweep_clock() - self._swept >= self.sweep_every_us:
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
            yield from retrying(self._retries, Call(create, ([(EXPIRES, 1)],)))
        self._ttl_ready = True

    def _names_flow(self, prefix: str) -> Flow[list[str]]:
        rows: list[Document] = yield from retrying(
            self._retries, Call(self._aggregate_list, (names_pipeline(prefix),))
        )
        return [row["_id"] for row in rows]

    def _sweep_flow(self, *, retries: bool = True) -> Flow[int]:
        """Delete the records past their keep time on the server's clock (or the test clock); say how many."""
        self._swept = self._sweep_clock()
        call = Call(self._collection.delete_many, (sweep_filter(self._fixed_now()),))
        result = yield from (retrying(self._retries, call) if retries else _once(call))
        return int(result.deleted_count)

    def _read_flow(self, name: str) -> Flow[Snapshot]:
        fixed_us = self._fixed_now()
        rows: list[Document] = yield from retrying(
            self._retries, Call(self._aggregate_list, (read_pipeline(name, fixed_us),))
        )
        if rows:
            where = self._record_where(name)
            return Snapshot(record=check_document(rows[0], where), now=read_now(rows[0], where))
        if fixed_us is not None:
            return Snapshot(record=None, now=fixed_us)
        hello: Document = yield from retrying(self._retries, Call(self._client.admin.command, ("hello",)))
        return Snapshot(record=None, now=datetime_us(hello["localTime"]))

    def _reset_flow(self, name: str) -> Flow[bool]:
        result = yield from retrying(self._retries, Call(self._collection.delete_one, ({"_id": name},)))
        return bool(result.deleted_count)


def _once(call: Call) -> Flow[Any]:
    """``call`` carried out, once."""
    return (yield call)


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

    def _take(self, name: str, terms: Terms, cost: int) -> Taken:
        return run(self._take_flow(name, terms, cost))

    def _try_start(self, name: str, terms: Terms, ticket: int, lead_us: int, cost: int) -> Outcome:
        return run(self._outcome_flow("try_start", name, terms, ticket, lead_us, cost))

    def _take_and_try(self, name: str, terms: Terms, lead_us: int, cost: int) -> Outcome:
        return run(self._outcome_flow("take_and_try", name, terms, lead_us=lead_us, cost=cost))

    def _retime(self, name: str, terms: Terms, ticket: int, lead_us: int) -> Outcome:
        return run(self._outcome_flow("retime", name, terms, ticket, lead_us))

    def _set_paused(self, name: str, terms: Terms, paused: bool) -> bool:
        return run(self._changed_flow("set_paused", name, terms, paused=paused))

    def _release(self, name: str, terms: Terms, ticket: int) -> bool:
        return run(self._changed_flow("release", name, terms, ticket))

    def _renew(self, name: str, terms: Terms, ticket: int) -> bool:
        return run(self._changed_flow("renew", name, terms, ticket))

    def _read(self, name: str) -> Snapshot:
        return run(self._read_flow(name))

    def _reset(self, name: str) -> bool:
        return run(self._reset_flow(name))

    def _names(self, prefix: str) -> list[str]:
        return run(self._names_flow(prefix))

    def _sweep(self) -> int:
        return run(self._sweep_flow())
