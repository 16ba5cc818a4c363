"""``postgresql://`` and ``postgres://``: the protocol run atomically inside PostgreSQL, on its clock.

Each queue is one row of a table (``ratequeue`` unless ``?table=`` names
another, in ``?schema=`` or the connection's search path)::

    name text PRIMARY KEY, ticket bigint, pos bigint, at_us bigint, interval_us bigint,
    burst bigint, due_us bigint, paused boolean, max_running integer,
    leases bigint[]  -- (ticket, expiry, token) triples flattened, in start order
    held_us bigint, keep_until_us bigint,  -- NULL: kept forever
    not_before_us bigint,  -- the end of a hold; NULL: none
    pace_us bigint, paced_at_us bigint,  -- the last slow-down's interval (0: none) and when (NULL: never)
    settled bigint,  -- the ticket of the latest settlement that moved due_us (0: none)
    fair boolean, number bigint, begun bigint,  -- a fair queue's (NULL: not fair)
    waiters bigint[],  -- a fair queue's (number, weight, cost, ticket) of each waiter, flattened
    tenants text[],  -- and each waiter's tenant
    paused_at_us bigint  -- when the pause everywhere began (NULL: not paused, or paused by an older version)

Every operation is **one call** of one server-side PL/pgSQL function
(``<table>_op_v4``, created beside the table): it locks the row (``SELECT
... FOR UPDATE``; a missing row is inserted first, ``ON CONFLICT DO
NOTHING``), reads ``clock_timestamp()`` once the row is locked, applies the
protocol step for step as :mod:`ratequeue.core.protocol` does, writes the row
(only if something changed) and returns the answer. Calls run autocommit,
so each is its own transaction: no transaction is held across round-trips,
and no client reads then writes. The function and the table (``CREATE TABLE
IF NOT EXISTS``) are created at a state's first call if missing, under a
transaction-scoped advisory lock so that racing first users do not collide;
a table made by an older version gains the columns it lacks then
(``not_before_us``, ``pace_us``, ``paced_at_us``, ``settled``, ``fair``,
``number``, ``begun``, ``waiters``, ``tenants``, ``paused_at_us``: its rows
have no hold, were never slowed, never settled, are not fair and say not
since when they are paused), and an older version's function (``_op_v3``...)
is left in place for the clients still calling it. ``paused_at_us`` is
stored only while the row is paused (:func:`~ratequeue.core.protocol.set_paused`):
a row that is not is stored as before. It is read only while the row is paused:
in a row an older version resumed, it is ignored (paused_at reads NEVER) and
this version's next write of the row clears it.
A fair queue's ``take``, ``try_start`` and ``take_and_try`` are
:func:`~ratequeue.core.protocol.enqueue`, ``try_turn`` and
``enqueue_and_try``, in the same function (:attr:`PostgresBackend.fair_queues`).
``try_take`` (:func:`~ratequeue.core.protocol.try_take`) runs ``take_and_try``'s
path (a fair row's too) and writes the row only if it starts.
Their text is ``function.sql`` beside this module.

A shard waiting for a place on a full queue hears of a place freed by another
process at once (:meth:`PostgresBackend.watch`): the function NOTIFYs, and the
state LISTENs on one connection of its own, opened while some shard waits
(:mod:`.freed`). Only a state made from a conninfo (or URL) does; one given a
ready connection or pool cannot open one of its own, and its waiters recheck
every ``FULL_RECHECK_US``.

A write with a keep time (``keep_us``) sets ``keep_until_us`` in the same
call; :meth:`~ratequeue.state.State.sweep` deletes the rows past it, and a
state sweeps by itself now and then (:attr:`PostgresBackend.sweep_every_us`)
when an operation creates a row. A row past its keep time but not yet
deleted behaves as a fresh one would (:func:`ratequeue.core.protocol.expires`).

A connection error is retried on a new connection (:data:`~ratequeue.state._retries.RETRIES`
times, with backoff), so an operation may reach the server twice when only its
reply was lost: a repeated ``try_start`` of the latest start is the same
start (:func:`ratequeue.core.protocol.repeats_start`), a repeated ``take`` leaks
one ticket, which costs at most one interval (G4).

How an operation goes, connections included, is written once, in
:class:`PostgresBackend`, as :mod:`ratequeue.core.flow` generators;
:class:`PostgresState` carries them out with psycopg's synchronous
connections, :class:`AsyncPostgresState` with its asyncio ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import os
import re
import threading
import uuid
import weakref
from collections.abc import Callable
from importlib import resources
from typing import Any, ClassVar, TypeVar, Union
from urllib.parse import quote, urlencode

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from ..._redact import redact, scrub, secrets_kept_out
from ...core.flow import Call, Flow
from ...core.operation import Operation, Terms
from ...core.protocol import Answer, Passed, Started, Taken, Unwritten, Wait, check
from ...errors import ConfigurationError, RateQueueError, StateCorrupted, StateUnavailable
from .._retries import RetryLog
from ..base import AsyncState, Clock, Snapshot, State, StateBase, split_options
from ..records import FIELDS, check_record, check_terms, unwritten
from .freed import FreedListener, channel_of

__all__ = ["AsyncPostgresState", "PostgresBackend", "PostgresState", "split_url"]

#: the table used unless ``?table=`` names another
DEFAULT_TABLE = "ratequeue"
#: the version suffix of the function's name: a new one whenever the function changes (v2: the hold,
#: the slow-down and the settlement; v3: the starter's doubt, p_doubt; v4: fair queues, p_fair,
#: p_tenant and p_weight)
FUNCTION_VERSION = "v4"
#: queries retried after a connection failure (see :mod:`ratequeue.state._retries`)
_log = logging.getLogger("ratequeue.state.postgresql")

#: seconds to wait for a connection unless the URL says (``connect_timeout``)
CONNECT_TIMEOUT = 5
#: how long a statement on the state's own connections may run, row lock waits included, unless
#: the URL says (``?statement_timeout=``, a PostgreSQL duration; ``0``: no limit)
STATEMENT_TIMEOUT = "10s"
_DURATION = re.compile(r"([0-9]{1,12}(?:\.[0-9]{1,6})?)(us|ms|s|min|h|d)?\Z")
_MS = {"us": 0.001, "ms": 1, "s": 1000, "min": 60_000, "h": 3_600_000, "d": 86_400_000}

#: what a table or schema may be called: letters, digits and underscores, not starting with a
#: digit; a table name leaves room for the function's suffix within PostgreSQL's 63 bytes
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_MAX_TABLE = 63 - len(f"_op_{FUNCTION_VERSION}")

#: the text of the table and of the function (``@TABLE@`` and ``@FUNCTION@`` stand for their names)
SETUP_SQL: str = resources.files(__name__).joinpath("function.sql").read_text(encoding="utf-8")

#: one answer of the function: kind, a, b, c, now, created, stored
Row = tuple[str, Any, Any, Any, int, Union[bool, None], Any]

#: a query as psycopg composes it
Query = Union[sql.SQL, sql.Composed]


def split_url(url: str) -> tuple[str, str, str | None]:
    """``url`` without ratequeue's options, and the table and schema they name (checked).

    :raises ConfigurationError: for a table or schema name ratequeue does not
        accept, or a URL psycopg cannot read.
    """
    client_url, ours = split_options(url, "table", "schema", "statement_timeout")
    table, schema = ours.get("table", DEFAULT_TABLE), ours.get("schema")
    check_identifiers(table, schema)
    try:
        conninfo_to_dict(client_url)
    except psycopg.Error as exc:
        raise ConfigurationError(f"bad PostgreSQL URL {redact(url)!r}: {scrub(str(exc), url)}") from None
    return client_url, table, schema


def check_identifiers(table: str, schema: str | None) -> None:
    """Refuse a table or schema name that is not a plain identifier (:class:`ConfigurationError`)."""
    for what, name, longest in (("table", table, _MAX_TABLE), ("schema", schema, 63)):
        if name is not None and not (_IDENTIFIER.match(name) and len(name) <= longest):
            raise ConfigurationError(
                f"bad PostgreSQL {what} name {name!r}: use letters, digits and underscores, not starting "
                f"with a digit, at most {longest} characters (?{what}=NAME)"
            )


def duration_ms(text: str) -> int:
    """A PostgreSQL duration (``500ms``, ``10s``; a bare number is milliseconds) in whole milliseconds.

    :raises ConfigurationError: for anything else, or more than PostgreSQL takes (2**31 - 1 ms).
    """
    match = _DURATION.match(text)
    ms = float(match[1]) * _MS[match[2] or "ms"] if match else -1.0
    if not 0 <= ms < 2**31:
        raise ConfigurationError(
            f"bad PostgreSQL statement_timeout {text!r}: give a duration (500ms, 10s) of at most 24 days"
        )
    return math.ceil(ms)


def where_of(params: dict[str, Any]) -> str:
    """``host:port/dbname`` of connection parameters (never a password)."""
    host = str(params.get("host") or params.get("hostaddr") or "localhost")
    port = str(params.get("port") or 5432)
    dbname = str(params.get("dbname") or params.get("user") or "")
    return f"{host}:{port}/{dbname}"


def url_from(params: dict[str, Any], table: str, schema: str | None) -> str:
    """A URL that connects as ``params`` do (less the password) to ``table`` in ``schema``."""
    user = params.get("user")
    auth = f"{quote(str(user), safe='')}@" if user else ""
    host, port = str(params.get("host") or ""), params.get("port")
    options: dict[str, str] = {}
    if host.startswith("/"):  # a unix socket directory
        options["host"] = host
        host = ""
    netloc = f"{host}:{port}" if host and port else host
    options["table"] = table
    if schema is not None:
        options["schema"] = schema
    return (
        f"postgresql://{auth}{netloc}/{quote(str(params.get('dbname') or ''), safe='')}?{urlencode(options)}"
    )


class PostgresBackend(StateBase):
    """The PostgreSQL state, for both APIs: every entry point and connection as a flow, errors, setup."""

    #: psycopg's connection class: ``Connection`` or ``AsyncConnection``
    _connection_class: ClassVar[Any]

    _client_errors = (psycopg.Error,)

    #: the function carries out fair queues (protocol.enqueue, try_turn, enqueue_and_try)
    fair_queues = True

    def __init__(
        self,
        connection: Any = None,
        *,
        conninfo: str | None = None,
        table: str = DEFAULT_TABLE,
        schema: str | None = None,
        url: str | None = None,
        clock: Clock | None = None,
        statement_timeout: str = STATEMENT_TIMEOUT,
    ) -> None:
        """Use a ready connection (autocommit) or pool, or a ``conninfo``: exactly one of them.

        With ``conninfo`` the state opens its own connections as calls need
        them (one per concurrent call, kept between calls), each with
        ``statement_timeout`` (a PostgreSQL duration, ``"500ms"``; an
        ``options=-c statement_timeout=...`` in the conninfo wins). A call
        that waits longer, for a row lock say, raises :class:`StateUnavailable`.
        Ready connections and pools keep their own settings.

        :param table: the table holding one row per queue (created if missing).
        :param schema: its schema (default: the connection's search path).
        :param url: the URL to pickle limiters as (default: built from the connection, no password).
        :param clock: **for tests only**: a function returning ``now`` in whole
            microseconds, used in place of the server's ``clock_timestamp()``.
        """
        if (connection is None) == (conninfo is None):
            raise ConfigurationError(
                f"give {type(self).__name__} a connection, a pool or a conninfo, one of them"
            )
        if connection is not None and not is_pool(connection) and not connection.autocommit:
            raise ConfigurationError(
                "a PostgreSQL connection given to ratequeue must be in autocommit mode "
                "(psycopg.connect(..., autocommit=True)): each operation is its own transaction"
            )
        timeout_ms = duration_ms(statement_timeout)
        params = describe(conninfo if connection is None else connection)
        #: the connection or pool given, or None (then the state opens its own with ``_connect``)
        self._source: Any = connection
        #: opens a connection of the state's own: autocommit, a connect timeout unless the URL sets one,
        #: the statement timeout before the URL's own options (a later ``-c`` wins)
        timeout: dict[str, Any] = {} if "connect_timeout" in params else {"connect_timeout": CONNECT_TIMEOUT}
        options = f"-c statement_timeout={timeout_ms} {params.get('options') or ''}".rstrip()
        self._connect = functools.partial(
            self._connection_class.connect, conninfo, autocommit=True, options=options, **timeout
        )
        #: opens the connection that LISTENs for freed places (thread API, whatever the state's), or
        #: None for a ready connection or pool; the listener (made at the first watch), its guard
        self._listen_connect: Callable[[], Any] | None = None
        if conninfo is not None:
            self._listen_connect = functools.partial(
                psycopg.Connection.connect, conninfo, autocommit=True, options=options, **timeout
            )
        self._freed: FreedListener | None = None
        self._freed_guard = threading.Lock()
        #: the connections this state opened, idle between calls (a list's pop and append are atomic)
        self._idle: list[Any] = []
        self._closed = False
        check_identifiers(table, schema)
        self._table_name, self._schema = table, schema
        self._function_name = f"{table}_op_{FUNCTION_VERSION}"
        names = (schema, table) if schema else (table,)
        self._table = sql.Identifier(*names)
        self._function = sql.Identifier(*names[:-1], self._function_name)
        self._clock = clock
        self._where = where_of(params)
        self.url = url or url_from(params, table, schema)
        #: the queries retried after a connection failure (on a new connection; a cancelled
        #: statement is not), and their log (never with a password)
        self._retries = RetryLog(
            _log,
            "PostgreSQL",
            self._where,
            url=self.url,
            transient=(psycopg.OperationalError,),
            lasting=(psycopg.errors.QueryCanceled,),
        )
        #: whether the table and the function are known to exist; when this state last swept
        self._ready = False
        arguments = sql.SQL(", ".join(["%s"] * 17))
        self._op_query = sql.SQL("SELECT * FROM {}({})").format(self._function, arguments)
        self._names_query = sql.SQL("SELECT name FROM {} WHERE left(name, %s) = %s").format(self._table)
        self._reset_query = sql.SQL("DELETE FROM {} WHERE name = %s").format(self._table)
        #: the connections (own, given or pooled) that have run :meth:`_warm_up_script`
        self._warmed: weakref.WeakSet[Any] = weakref.WeakSet()

    def _warm_up_script(self) -> Query:
        """Every path of the function, run on a scratch queue in a transaction rolled back: one round-trip.

        PL/pgSQL prepares each expression of a function the first time a
        session evaluates it (some 100 of them here, tens of milliseconds on
        a busy host). Run on a new connection before its first operation,
        this keeps that cost out of the answers that follow: a shard's first
        wait, or first start, is not late because its path was new. Nothing
        is kept (the scratch row is rolled back, and no other session sees it).
        """
        name, n, far = f"ratequeue warm-up {uuid.uuid4()}", 10**12, 10**13

        def select(
            op: str,
            now: int,
            ticket: int,
            lead: int,
            interval: int = 1000,
            token: int = 1,
            burst: int = 1,
            fair: bool = False,
        ) -> Query:
            # the function's arguments: keep and max_running 1, a lease of 1000 us, a cost of 1, no
            # doubt, the tenant "" of weight 1; a burst of 2, or a fair queue, on a queue of its own
            queue = name if burst == 1 else f"{name} burst"
            queue = f"{name} fair" if fair else queue
            values = (
                op, queue, interval, burst, 1, 1, 1000, now, ticket, lead, 1, op == "set_paused", token, 0,
                fair, "", 1,
            )  # fmt: skip
            arguments = sql.SQL(", ").join(map(sql.Literal, values))
            return sql.SQL("SELECT * FROM {}({})").format(self._function, arguments)

        selects = [
            select("take_and_try", n, 0, 0),  # started, with a lease (token 1) and a keep time
            select("take_and_try", n, 0, 0),  # asked again with the lease's token: the same start
            select("take_and_try", n, 0, 10**6, token=2),  # full
            select("try_take", n, 0, 10**6, token=3),  # full: a wait, nothing written
            select("try_start", n, 2, 0, token=2),  # wait
            select("try_start", n, 1, 0),  # the same start again
            select("try_start", n, 9, 0, token=2),  # passed
            select("retime", n, 1, 10),
            select("retime", n, 2, 10),  # passed
            select("renew", n, 1, 0),
            select("release", n, 1, 0),
            select("set_paused", n, 0, 0),
            select("try_start", n, 2, 0),  # paused
            select("hold", n, 0, 10**6),
            select("hold", n, 0, 0),  # the hold stays
            select("lift", n, 0, 0),
            select("lift", n, 0, 0),  # no hold
            select("slow", n, 0, 0),  # slowed: twice the effective interval
            select("slow", n, 0, 1),  # no slower than the effective interval: unchanged
            select("try_start", n, 2, 0),  # (paused) its slots at the slowed, effective interval
            select("settle", n, 1, 0),  # a refund: due moves back
            select("settle", n, 1, 0),  # the ticket that settled last: unchanged
            select("take_and_try", n, 0, 0, burst=2),
            select("settle", n, 1, 2, burst=2),  # an overrun: due moves on
            select("take", far, 0, 0),  # pos jumps
            select("take", far, 0, 0, interval=7),  # mismatch
            select("read", far, 0, 0),
            # a fair queue: waiter 1 started (token 1), 2 holds a ticket, 3 none yet (the weight is 1)
            select("take_and_try", n, 0, 0, fair=True),
            select("take", n, 0, 0, fair=True, token=2),
            select("take", n, 0, 0, fair=True, token=3),
            select("try_start", n, 3, 0, fair=True, token=3),  # no ticket yet: wait
            select("try_start", n, 2, 0, fair=True, token=2),  # its ticket: wait (full)
            select("release", n, 1, 0, fair=True),
            select("try_start", n, 2, 10**6, fair=True, token=2),  # started; 3 gets a ticket
            select("try_start", n, 2, 0, fair=True, token=0),  # the waiter begun: the same start
            select("try_start", n, 1, 0, fair=True, token=0),  # not in line: passed
            select("take_and_try", n + 10**7, 0, 0, fair=True, token=4),  # 3 passed by the jump; waits
            select("try_take", n + 10**7, 0, 0, fair=True, token=5),  # a wait: no waiter added
            select("try_take", far, 0, 0, burst=2),  # the leases expired: started, written
        ]
        return sql.SQL("; ").join([sql.SQL("BEGIN"), *selects, sql.SQL("ROLLBACK")])

    # ----------------------------------------------------------------- errors

    def _error_for(self, exc: Exception, name: str) -> RateQueueError:
        """:class:`StateUnavailable` naming the server (and the queue); never a password."""
        if isinstance(exc, psycopg.errors.NumericValueOutOfRange):
            message = f"PostgreSQL at {self._where}: the record of queue {name!r} is out of range: {exc}"
            return StateCorrupted(scrub(message, self.url), where=self._record_where(name))
        if isinstance(exc, psycopg.errors.QueryCanceled):  # statement_timeout, or a cancel request
            reason = f"cancelled the call on queue {name!r}" if name else "cancelled the call"
        elif isinstance(exc, psycopg.OperationalError):
            reason = "is unreachable or failed"
        else:
            reason = f"failed on queue {name!r}" if name else "failed"
        return StateUnavailable(
            scrub(f"PostgreSQL at {self._where} {reason}: {exc}", self.url), where=self._where
        )

    def _quoted(self, name: str) -> str:
        """``name`` in the state's schema, quoted (names are checked: no quote to escape)."""
        return f'"{self._schema}"."{name}"' if self._schema else f'"{name}"'

    def _record_where(self, name: str) -> str:
        table = f"{self._schema}.{self._table_name}" if self._schema else self._table_name
        return f"{self._where}/{table}#{name}"

    # ----------------------------------------------------------------- flows

    @classmethod
    def from_url(cls: type[S], url: str) -> S:
        """Open ``postgresql://[user[:password]@][host][:port][/dbname][?table=T&schema=S&...]``.

        ``table`` (default ``ratequeue``) and ``schema`` choose where the rows
        live, ``statement_timeout`` bounds each call (default :data:`STATEMENT_TIMEOUT`);
        other options go to libpq (``sslmode``, ``connect_timeout``...).
        Nothing is connected before the first operation.
        """
        with secrets_kept_out(url):
            conninfo, table, schema = split_url(url)
            timeout = split_options(url, "statement_timeout")[1].get("statement_timeout", STATEMENT_TIMEOUT)
            return cls(conninfo=conninfo, table=table, schema=schema, url=url, statement_timeout=timeout)

    def watch(self, name: str, freed: Callable[[], None]) -> Callable[[], None] | None:
        """As :meth:`ratequeue.state.State.watch`: by LISTEN/NOTIFY, on a connection of its own (.freed).

        ``None`` for a state given a ready connection or pool (its waiters
        recheck every ``FULL_RECHECK_US``): the listening connection is opened
        from the state's conninfo.
        """
        listener = self._freed_listener()
        channel = channel_of(self._quoted(self._table_name), name)
        return None if listener is None else listener.watch(channel, freed)

    def _freed_listener(self) -> FreedListener | None:
        """This process's listener for freed places, made at first use; ``None`` without a conninfo."""
        listener = self._freed
        if listener is None or listener.pid != os.getpid():
            connect = self._listen_connect
            if connect is None or self._closed:
                return None
            with self._freed_guard:
                listener = self._freed
                if listener is None or listener.pid != os.getpid():
                    listener = self._freed = FreedListener(connect, self._where)
        return listener

    @property
    def table(self) -> sql.Composable:
        """The (quoted) name of the table holding one row per queue."""
        return self._table

    def _prepare_flow(self) -> Flow[None]:
        """The table and function made sure of, and a connection opened and warmed up, for the next call."""
        if not self._ready:
            yield from self._setup_flow()
        connection = yield from self._checkout_flow()
        try:
            if self._warms(connection):
                yield from self._warm_up_flow(connection)
        except BaseException:
            yield from self._checkin_flow(connection, failed=True)
            raise
        yield from self._checkin_flow(connection)

    def _query_flow(self, query: Query, params: tuple[Any, ...]) -> Flow[Any]:
        """``query`` run, after making sure of the table and function; a connection failure retried."""
        if not self._ready:
            yield from self._setup_flow()
        return (yield from self._retried_flow(query, params))

    def _retried_flow(self, query: Query, params: tuple[Any, ...] | None) -> Flow[tuple[list[Any], int]]:
        """:meth:`_fetch_flow`, run again on a new connection after a connection failure."""
        return self._retries.retried(lambda: self._fetch_flow(query, params))

    def _fetch_flow(self, query: Query, params: tuple[Any, ...] | None) -> Flow[tuple[list[Any], int]]:
        """Run ``query`` (autocommit; without ``params``, maybe several statements): ``(rows, rowcount)``."""
        connection = yield from self._checkout_flow()
        try:
            if self._warms(connection):
                yield from self._warm_up_flow(connection)
            cursor = yield Call(connection.execute, (query, params))
            rows = (yield Call(cursor.fetchall)) if cursor.description is not None else []
        except BaseException:
            yield from self._checkin_flow(connection, failed=True)
            raise
        yield from self._checkin_flow(connection)
        return rows, cursor.rowcount

    def _checkout_flow(self) -> Flow[Any]:
        """A connection for one call: the one given, one from the pool given, or one of this state's own."""
        if self._source is not None:
            return (yield Call(self._source.getconn)) if is_pool(self._source) else self._source
        try:
            return self._idle.pop()
        except IndexError:
            return (yield Call(self._connect))

    def _checkin_flow(self, connection: Any, *, failed: bool = False) -> Flow[None]:
        """Give ``connection`` back; after a failure, one of this state's own that is not idle is closed.

        (A cancelled call may leave its answer on the way: such a connection is never reused.)
        A pool checks what it is given back; a connection the caller gave is the caller's.
        """
        source, busy = self._source, in_transaction(connection)
        if is_pool(source):
            yield Call(source.putconn, (connection,))
        elif source is not None:
            if failed and busy and not connection.broken:  # a setup that failed half-way
                with contextlib.suppress(Exception):
                    yield Call(connection.rollback)
        elif self._closed or (failed and (connection.broken or connection.closed or busy)):
            with contextlib.suppress(Exception):
                yield Call(connection.close)
        else:
            self._idle.append(connection)

    def _warm_up_flow(self, connection: Any) -> Flow[None]:
        """Run :meth:`_warm_up_script` on ``connection``, once; a failure is ignored, unless it broke it.

        Whatever happens, the connection is left outside a transaction.
        """
        self._warmed.add(connection)
        try:
            yield Call(functools.partial(connection.execute, self._warm_up_script(), prepare=False))
        except psycopg.OperationalError:
            raise
        except psycopg.Error:
            pass
        finally:
            if not connection.broken and in_transaction(connection):
                yield Call(connection.rollback)

    def _warms(self, connection: Any) -> bool:
        """Whether ``connection`` is to be warmed up: one of the state's own, or a pool's, not yet warm.

        A single connection the caller gave is left alone: it may be in the
        middle of the caller's own transaction.
        """
        single = self._source is not None and not is_pool(self._source)
        return self._ready and not single and connection not in self._warmed

    def _setup_flow(self) -> Flow[None]:
        """Create the table and the function unless both exist (once per state)."""
        types = (
            "(text, text, bigint, bigint, bigint, integer, "
            "bigint, bigint, bigint, bigint, bigint, boolean, bigint, bigint, boolean, text, bigint)"
        )
        # (a table that lacks the newest column, made by an older version, is set up again: it gains
        # its columns, and the function is made again; a database with only an older version's
        # function, _op_v3, gains this version's beside it, which older clients go on calling)
        exists = sql.SQL(
            "SELECT to_regclass(%s) IS NOT NULL AND to_regprocedure(%s) IS NOT NULL AND EXISTS ("
            "SELECT FROM pg_attribute WHERE attrelid = to_regclass(%s) AND attname = 'paused_at_us' "
            "AND NOT attisdropped)"
        )
        table_text, function_text = self._quoted(self._table_name), self._quoted(self._function_name)
        rows, _ = yield from self._retried_flow(exists, (table_text, f"{function_text}{types}", table_text))
        if not rows[0][0]:
            # racing first users wait for each other: concurrent DDL on one object can fail
            lock = sql.SQL("SELECT pg_advisory_xact_lock(hashtext({}))").format(sql.Literal(table_text))
            text = SETUP_SQL.replace("@TABLE@", table_text).replace("@FUNCTION@", function_text)
            statements = [sql.SQL(part.strip()) for part in text.split("-- ;;\n")]
            script = sql.SQL(";\n").join([sql.SQL("BEGIN"), lock, *statements, sql.SQL("COMMIT")])
            yield from self._retried_flow(script, None)
        self._ready = True

    def _op_flow(self, kind: str, name: str, terms: Terms, op: Operation | None = None) -> Flow[Row]:
        """The function's answer row to ``kind`` (an operation's, ``read`` or ``sweep``) on ``name``."""
        params = (
            kind, name, terms.interval_us, terms.burst, terms.keep_us, terms.max_running or 0, terms.lease_us,
            None if self._clock is None else self._clock(),
            *((op.ticket, op.lead_us, op.cost, op.paused, op.token, op.doubt_us) if op
              else (0, 0, 1, False, 0, 0)),
            terms.fair, *((op.tenant, op.weight) if op else ("", 1)),
        )  # fmt: skip
        rows, _ = yield from self._query_flow(self._op_query, params)
        row: Row = rows[0]
        answer = row[0]
        where = self._record_where(name)
        if answer in ("corrupt", "mismatch"):  # the stored row is malformed, or has other terms
            record = check_record(stored_fields(row[6]), where=where)  # raises, naming the field
            if answer == "mismatch":
                check_terms(name, record, terms)  # raises, naming the term
            raise StateCorrupted(f"record at {where} is malformed: {record}; reset the queue", where=where)
        if answer.startswith("unwritten_"):  # at, held, not_before, paced_at, paused_at, leases or ticket
            exc = Unwritten(answer.removeprefix("unwritten_"), int(row[1]), row[4])
            raise unwritten(exc, f"record at {redact(self.url)}#{name}", where)
        if row[5] and self._sweep_due():
            with contextlib.suppress(psycopg.Error):
                yield from self._sweep_flow()
        return row

    def _execute_flow(self, op: Operation) -> Flow[Answer]:
        row = yield from self._op_flow(op.kind, op.name, op.terms, op)
        answer, first, second, now = row[0], row[1], row[2], row[4]
        if answer in _OUTCOMES:
            return _OUTCOMES[answer](int(first), int(second), now)
        if answer == "taken":
            return Taken(int(first), int(second), int(row[3]), now)
        if answer in ("set", "live"):
            return bool(first)
        raise StateCorrupted(f"unexpected answer {row!r} from {self._where}", where=self._where)

    def _read_flow(self, name: str) -> Flow[Snapshot]:
        row = yield from self._op_flow("read", name, _READ)
        now: int = row[4]
        if row[0] == "none":
            return Snapshot(record=None, now=now)
        where = self._record_where(name)
        record = check_record(stored_fields(row[6]), where=where)
        try:
            check(record, now)
        except Unwritten as exc:
            raise unwritten(exc, f"record at {redact(self.url)}#{name}", where) from None
        return Snapshot(record=record, now=now)

    def _sweep_flow(self) -> Flow[int]:
        self._swept = self._sweep_clock()
        row = yield from self._op_flow("sweep", "", _READ)
        return int(row[1])

    def _names_flow(self, prefix: str) -> Flow[list[str]]:
        rows, _ = yield from self._query_flow(self._names_query, (len(prefix), prefix))
        return [row[0] for row in rows]

    def _reset_flow(self, name: str) -> Flow[bool]:
        _, count = yield from self._query_flow(self._reset_query, (name,))
        return bool(count)


#: the fields a row holds in a column named ``<field>_us`` (times and intervals, in us)
_TIMES = ("at", "interval", "due", "held", "not_before", "pace", "paced_at", "paused_at")

#: the fields of a record that rows made by older versions may lack
_LATER = ("not_before", "pace", "paced_at", "settled", "fair", "number", "begun", "paused_at")

#: the column of a row holding each field of its record
_COLUMNS = {field: f"{field}_us" if field in _TIMES else field for field in (*FIELDS, *_LATER)}


def stored_fields(stored: dict[str, Any]) -> dict[str, Any]:
    """A row as the function returned it (jsonb) as the fields :func:`check_record` reads.

    ``leases``, a flat array in the row, is read as ``[ticket, expiry, token]`` triples; a fair
    row's ``waiters`` and ``tenants`` as ``[number, tenant, weight, cost, ticket]`` lists (arrays
    that do not pair up are passed on as they are, which the check refuses). A row that is not
    fair has no fair fields: its fair columns are not read; nor is ``paused_at_us`` in a row that is
    not paused (an older version's resume leaves it behind: the row reads paused_at NEVER).
    """
    fields = {field: stored[column] for field, column in _COLUMNS.items() if column in stored}
    if fields.get("paused") is not True:
        fields.pop("paused_at", None)
    leases = fields.get("leases")
    if isinstance(leases, list) and all(not isinstance(item, list) for item in leases):
        fields["leases"] = [leases[i : i + 3] for i in range(0, len(leases), 3)]
    if fields.get("fair") in (None, False):  # (check_record would keep a number and begun unchecked)
        for field in ("fair", "number", "begun"):
            fields.pop(field, None)
    else:
        waiters, tenants = stored.get("waiters"), stored.get("tenants")
        if (
            isinstance(waiters, list)
            and isinstance(tenants, list)
            and len(waiters) == 4 * len(tenants)
            and all(not isinstance(item, list) for item in waiters)
        ):
            fields["waiters"] = [
                [waiters[4 * i], tenant, *waiters[4 * i + 1 : 4 * i + 4]] for i, tenant in enumerate(tenants)
            ]
        else:
            fields["waiters"] = {"waiters": waiters, "tenants": tenants}
    return fields


def is_pool(source: object) -> bool:
    """Whether ``source`` is a connection pool (psycopg_pool's, or one like it), not a connection."""
    return callable(getattr(source, "connection", None)) and hasattr(source, "getconn")


def describe(source: Any) -> dict[str, Any]:
    """The connection parameters of a conninfo, a ready connection or a pool, without the password."""
    if isinstance(source, str):
        params = dict(conninfo_to_dict(source))
    elif is_pool(source):
        params = dict(conninfo_to_dict(getattr(source, "conninfo", "") or ""))
        params.update(getattr(source, "kwargs", None) or {})
    else:
        params = dict(source.info.get_parameters())
    params.pop("password", None)
    return params


def in_transaction(connection: Any) -> bool:
    """Whether ``connection`` is not idle: in a transaction (maybe a failed one), or a call is on its way."""
    return bool(connection.info.transaction_status != psycopg.pq.TransactionStatus.IDLE)


#: what try_start, take_and_try, try_take and retime answer, by the function's first column
_OUTCOMES: dict[str, type[Started] | type[Wait] | type[Passed]] = {
    "started": Started,
    "wait": Wait,
    "passed": Passed,
}

#: the terms a read or a sweep sends (the function checks none)
_READ = Terms(1)

S = TypeVar("S", bound=PostgresBackend)


class PostgresState(PostgresBackend, State):
    """Records kept in a PostgreSQL table, changed only by one server-side function call each.

    Made from a ready ``psycopg.Connection`` (autocommit) or
    ``psycopg_pool.ConnectionPool``, or from a ``conninfo``.
    """

    _connection_class = psycopg.Connection

    def close(self) -> None:
        self._closed = True
        if self._freed is not None and self._freed.pid == os.getpid():
            self._freed.close()
        while self._idle:
            self._idle.pop().close()


class AsyncPostgresState(PostgresBackend, AsyncState):
    """:class:`PostgresState` from asyncio.

    Made from a ``psycopg.AsyncConnection``, an ``AsyncConnectionPool`` or a conninfo.
    """

    _connection_class = psycopg.AsyncConnection

    async def close(self) -> None:
        self._closed = True
        if self._freed is not None and self._freed.pid == os.getpid():
            await asyncio.to_thread(self._freed.close)
        while self._idle:
            await self._idle.pop().close()
