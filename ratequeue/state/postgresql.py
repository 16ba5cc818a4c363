"""``postgresql://`` and ``postgres://``: the protocol run atomically inside PostgreSQL, on its clock.

Each queue is one row of a table (``ratequeue`` unless ``?table=`` names
another, in ``?schema=`` or the connection's search path)::

    name text PRIMARY KEY, ticket bigint, pos bigint, at_us bigint, interval_us bigint,
    burst bigint, due_us bigint, paused boolean, max_running integer,
    leases bigint[]  -- (ticket, expiry) pairs flattened, in start order
    held_us bigint, keep_until_us bigint  -- NULL: kept forever

Every operation is **one call** of one server-side PL/pgSQL function
(``<table>_op_v1``, created beside the table): it locks the row (``SELECT
... FOR UPDATE``; a missing row is inserted first, ``ON CONFLICT DO
NOTHING``), reads ``clock_timestamp()`` once the row is locked, applies the
protocol step for step as :mod:`ratequeue.protocol` does, writes the row
(only if something changed) and returns the answer. Calls run autocommit,
so each is its own transaction: no transaction is held across round-trips,
and no client reads then writes. The function and the table (``CREATE TABLE
IF NOT EXISTS``) are created at a state's first call if missing, under a
transaction-scoped advisory lock so that racing first users do not collide.
Their text is ``postgresql.sql`` beside this module.

A write with a keep time (``keep_us``) sets ``keep_until_us`` in the same
call; :meth:`~ratequeue.state.State.sweep` deletes the rows past it, and a
state sweeps by itself now and then (:attr:`PostgresStateBase.sweep_every_us`)
when an operation creates a row. A row past its keep time but not yet
deleted behaves as a fresh one would (:func:`ratequeue.protocol.expires`).

A connection error is retried on a new connection (:data:`RETRIES` times,
with backoff), so an operation may reach the server twice when only its
reply was lost: a repeated ``try_start`` of the latest start is the same
grant (:func:`ratequeue.protocol.is_same_grant`), a repeated ``take`` leaks
one ticket, which costs at most one interval (G4).

How an operation goes is written once, in :class:`PostgresStateBase`, as
:mod:`ratequeue._flow` generators; :class:`PostgresState` carries them out
with psycopg's synchronous connections, :class:`ratequeue.aio.postgresql.AsyncPostgresState`
with its asyncio ones.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
import uuid
import weakref
from abc import ABC, abstractmethod
from collections.abc import Iterator
from importlib import resources
from typing import Any, Literal, Union
from urllib.parse import quote, urlencode

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from .._flow import Call, Flow, Sleep, run
from .._redact import redact, scrub, secrets_kept_out
from ..errors import ConfigurationError, RateQueueError, StateCorrupted, StateUnavailable
from ..protocol import Outcome, Passed, Started, Taken, Unwritten, Wait, check
from ._retries import RetryLog
from .base import Clock, Snapshot, State, StateBase, Terms, check_record, check_terms_match, split_options
from .base import unwritten as unwritten_error

__all__ = ["PostgresState", "PostgresStateBase", "split_url"]

#: the table used unless ``?table=`` names another
DEFAULT_TABLE = "ratequeue"
#: the version suffix of the function's name: a new one whenever the function changes
FUNCTION_VERSION = "v1"
#: queries retried after a connection failure (see :mod:`ratequeue.state._retries`)
_log = logging.getLogger("ratequeue.state.postgresql")

#: how often a connection failure is retried (on a new connection), the first backoff and the longest (s)
RETRIES = 5
BACKOFF = 0.02
BACKOFF_CAP = 0.5
#: seconds to wait for a connection unless the URL says (``connect_timeout``)
CONNECT_TIMEOUT = 5

#: what a table or schema may be called: letters, digits and underscores, not starting with a
#: digit; a table name leaves room for the function's suffix within PostgreSQL's 63 bytes
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_MAX_TABLE = 63 - len(f"_op_{FUNCTION_VERSION}")

#: the text of the table and of the function (``@TABLE@`` and ``@FUNCTION@`` stand for their names)
SETUP_SQL: str = (
    resources.files(__name__.rpartition(".")[0]).joinpath("postgresql.sql").read_text(encoding="utf-8")
)

#: what the function can be asked to do (its ``p_op``)
Op = Literal["take", "try_start", "take_and_try", "retime", "set_paused", "release", "renew", "read", "sweep"]

#: one answer of the function: kind, a, b, c, now, created, stored
Row = tuple[str, Any, Any, Any, int, Union[bool, None], Any]

#: a query as psycopg composes it
Query = Union[sql.SQL, sql.Composed]


def split_url(url: str) -> tuple[str, str, str | None]:
    """``url`` without ratequeue's options, and the table and schema they name (checked).

    :raises ConfigurationError: for a table or schema name ratequeue does not
        accept, or a URL psycopg cannot read.
    """
    client_url, ours = split_options(url, "table", "schema")
    table, schema = ours.get("table", DEFAULT_TABLE), ours.get("schema")
    check_identifiers(table, schema)
    try:
        conninfo_to_dict(client_url)
    except psycopg.Error as exc:
        raise ConfigurationError(f"bad PostgreSQL URL {redact(url)!r}: {scrub(str(exc), url)}") from None
    return client_url, table, schema


def check_identifiers(table: str, schema: str | None) -> None:
    """Refuse a table or schema name that is not a plain identifier (:class:`ConfigurationError`)."""
    if not (_IDENTIFIER.match(table) and len(table) <= _MAX_TABLE):
        raise ConfigurationError(
            f"bad PostgreSQL table name {table!r}: use letters, digits and underscores, not starting "
            f"with a digit, at most {_MAX_TABLE} characters (?table=NAME)"
        )
    if schema is not None and not (_IDENTIFIER.match(schema) and len(schema) <= 63):
        raise ConfigurationError(
            f"bad PostgreSQL schema name {schema!r}: use letters, digits and underscores, not starting "
            f"with a digit, at most 63 characters (?schema=NAME)"
        )


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


def clock_arg(clock: Clock | None) -> int | None:
    return None if clock is None else clock()


class PostgresStateBase(StateBase, ABC):
    """What the synchronous and the asyncio PostgreSQL states share: every operation's flow, errors, setup."""

    _driver_errors = (psycopg.Error,)

    #: how often (us) creating a row also sweeps the table's rows past their keep time (on this
    #: host's monotonic clock, or a test clock)
    sweep_every_us = 60_000_000

    def __init__(
        self,
        connection: Any = None,
        *,
        conninfo: str | None = None,
        table: str = DEFAULT_TABLE,
        schema: str | None = None,
        url: str | None = None,
        clock: Clock | None = None,
    ) -> None:
        """Use a ready connection (autocommit) or pool, or a ``conninfo``: exactly one of them.

        With ``conninfo`` the state opens its own connections as calls need
        them (one per concurrent call, kept between calls).

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
        if connection is not None:
            check_autocommit(connection)
            params = describe(connection)
        else:
            assert conninfo is not None
            params = dict(conninfo_to_dict(conninfo))
            params.pop("password", None)
        url = url or url_from(params, table, schema)
        where = where_of(params)
        #: the connection or pool given, or None (then connections are opened from ``_conninfo``)
        self._source: Any = connection
        self._conninfo = conninfo
        self._idle: list[Any] = []
        self._closed = False
        check_identifiers(table, schema)
        self._table_name, self._schema = table, schema
        self._function_name = f"{table}_op_{FUNCTION_VERSION}"
        names = (schema, table) if schema else (table,)
        self._table = sql.Identifier(*names)
        self._function = sql.Identifier(*names[:-1], self._function_name)
        self._clock = clock
        self._where = where
        self.url = url or ""
        #: the queries retried after a connection failure, logged (never with a password)
        self._retries = RetryLog(_log, "PostgreSQL", where, scrub=lambda text: scrub(text, self.url))
        #: whether the table and the function are known to exist; when this state last swept
        self._ready = False
        self._swept: int | None = None
        self._op_query = sql.SQL("SELECT * FROM {}(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)").format(
            self._function
        )
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
        name = f"ratequeue warm-up {uuid.uuid4()}"
        n, far = 10**12, 10**13
        calls = [
            # op, now, ticket, lead, cost, paused, interval: started with a lease and a keep time ...
            ("take_and_try", n, 0, 0, 1, False, 1000),
            ("take_and_try", n, 0, 10**6, 1, False, 1000),  # ... full
            ("try_start", n, 2, 0, 1, False, 1000),  # wait
            ("try_start", n, 1, 0, 1, False, 1000),  # the same grant
            ("try_start", n, 9, 0, 1, False, 1000),  # passed
            ("retime", n, 1, 10, 1, False, 1000),
            ("retime", n, 2, 10, 1, False, 1000),  # passed
            ("renew", n, 1, 0, 1, False, 1000),
            ("release", n, 1, 0, 1, False, 1000),
            ("set_paused", n, 0, 0, 1, True, 1000),
            ("try_start", n, 2, 0, 1, False, 1000),  # paused
            ("take", far, 0, 0, 1, False, 1000),  # pos jumps
            ("take", far, 0, 0, 1, False, 7),  # mismatch
            ("read", far, 0, 0, 1, False, 1000),
        ]
        selects = [
            sql.SQL("SELECT * FROM {}({})").format(
                self._function,
                sql.SQL(", ").join(
                    sql.Literal(value)
                    for value in (op, name, interval, 1, 1, 1, 1000, now, ticket, lead, cost, paused)
                ),
            )
            for op, now, ticket, lead, cost, paused, interval in calls
        ]
        return sql.SQL("; ").join([sql.SQL("BEGIN"), *selects, sql.SQL("ROLLBACK")])

    # ----------------------------------------------------------------- what the drivers supply

    @abstractmethod
    def _fetch(self, query: Query, params: tuple[Any, ...]) -> Any:
        """Run ``query`` (one statement, autocommit) and return ``(rows, rowcount)``; asyncio: awaitable."""

    @abstractmethod
    def _setup_call(self, statements: list[Query]) -> Any:
        """Run ``statements`` in one transaction; asyncio: awaitable."""

    # ----------------------------------------------------------------- errors

    def _error_for(self, exc: Exception, name: str) -> RateQueueError:
        """:class:`StateUnavailable` naming the server (and the queue); never a password."""
        if isinstance(exc, psycopg.errors.NumericValueOutOfRange):
            return StateCorrupted(
                scrub(
                    f"PostgreSQL at {self._where}: the record of queue {name!r} is out of range: {exc}",
                    self.url,
                ),
                where=self._record_where(name),
            )
        if isinstance(exc, psycopg.OperationalError):
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

    def _query_flow(self, query: Query, params: tuple[Any, ...]) -> Flow[Any]:
        """``query`` run, after making sure of the table and function; a connection failure retried."""
        if not self._ready:
            yield from self._setup_flow()
        return (yield from self._retrying(Call(self._fetch, (query, params))))

    def _warms(self, connection: Any) -> bool:
        """Whether ``connection`` is to be warmed up: one of the state's own, or a pool's, not yet warm.

        A single connection the caller gave is left alone: it may be in the
        middle of the caller's own transaction.
        """
        single = self._source is not None and not is_pool(self._source)
        return self._ready and not single and connection not in self._warmed

    def _retrying(self, call: Call) -> Flow[Any]:
        """``call`` carried out; after a connection failure, again on a new connection, with backoff.

        A connection closed while it was idle (``idle_session_timeout``,
        pgbouncer, a firewall) is routine: a first retry is INFO; a retry that
        fails again, or a call that gives up, is a WARNING (see :class:`RetryLog`).
        """
        delay = BACKOFF
        failures = 0
        while True:
            try:
                return (yield call)
            except psycopg.OperationalError as exc:
                if isinstance(exc, psycopg.errors.QueryCanceled):
                    raise
                failures += 1
                if failures > RETRIES:
                    self._retries.gave_up(exc, failures)
                    raise
                self._retries.retrying(exc, failures, RETRIES)
                yield Sleep(delay)
                delay = min(delay * 2, BACKOFF_CAP)

    def _setup_flow(self) -> Flow[None]:
        """Create the table and the function unless both exist (once per state)."""
        types = (
            "(text, text, bigint, bigint, bigint, integer, bigint, bigint, bigint, bigint, bigint, boolean)"
        )
        exists = sql.SQL("SELECT to_regclass(%s) IS NOT NULL AND to_regprocedure(%s) IS NOT NULL")
        table_text, function_text = self._quoted(self._table_name), self._quoted(self._function_name)
        rows, _ = yield from self._retrying(
            Call(self._fetch, (exists, (table_text, f"{function_text}{types}")))
        )
        if not rows[0][0]:
            # racing first users wait for each other: concurrent DDL on one object can fail
            lock = sql.SQL("SELECT pg_advisory_xact_lock(hashtext({}))").format(sql.Literal(table_text))
            text = SETUP_SQL.replace("@TABLE@", table_text)
            text = text.replace("@FUNCTION@", function_text)
            statements: list[Query] = [lock]
            statements += [sql.SQL(part.strip()) for part in text.split("-- ;;\n")]
            yield from self._retrying(Call(self._setup_call, (statements,)))
        self._ready = True

    def _op_flow(
        self,
        op: Op,
        name: str,
        terms: Terms | None = None,
        *,
        ticket: int = 0,
        lead_us: int = 0,
        cost: int = 1,
        paused: bool = False,
    ) -> Flow[Row]:
        t = terms or Terms(1)
        params = (
            op, name, t.interval_us, t.burst, t.keep_us, t.max_running, t.lease_us, clock_arg(self._clock),
            ticket, lead_us, cost, paused,
        )  # fmt: skip
        rows, _ = yield from self._query_flow(self._op_query, params)
        row: Row = rows[0]
        kind = row[0]
        where = self._record_where(name)
        if kind == "corrupt":
            record = check_record(stored_fields(row[6]), where=where)  # raises, naming the field
            raise StateCorrupted(f"record at {where} is malformed: {record}; reset the queue", where=where)
        if kind == "mismatch":
            assert terms is not None
            check_terms_match(name, check_record(stored_fields(row[6]), where=where), terms)
            raise StateCorrupted(f"record at {where} does not match {terms}", where=where)  # pragma: no cover
        if kind in ("unwritten_at", "unwritten_ticket"):
            exc = Unwritten(kind.removeprefix("unwritten_"), int(row[1]), row[4])
            raise unwritten_error(exc, f"record at {redact(self.url)}#{name}", where)
        if row[5] and (self._swept is None or self._sweep_clock() - self._swept >= self.sweep_every_us):
            with contextlib.suppress(psycopg.Error):
                yield from self._sweep_flow()
        return row

    def _take_flow(self, name: str, terms: Terms, cost: int) -> Flow[Taken]:
        row = yield from self._op_flow("take", name, terms, cost=cost)
        return Taken(ticket=int(row[1]), pos=int(row[2]), at=int(row[3]), now=row[4])

    def _outcome_flow(
        self, op: Op, name: str, terms: Terms, ticket: int = 0, lead_us: int = 0, cost: int = 1
    ) -> Flow[Outcome]:
        row = yield from self._op_flow(op, name, terms, ticket=ticket, lead_us=lead_us, cost=cost)
        kind, first, second, now = row[0], int(row[1]), int(row[2]), row[4]
        if kind == "started":
            return Started(ticket=first, start=second, now=now)
        if kind == "wait":
            return Wait(ticket=first, slot=second, now=now)
        if kind == "passed":
            return Passed(ticket=first, pos=second, now=now)
        raise StateCorrupted(f"unexpected answer {row!r} from {self._where}", where=self._where)

    def _changed_flow(
        self, op: Op, name: str, terms: Terms, ticket: int = 0, *, paused: bool = False
    ) -> Flow[bool]:
        row = yield from self._op_flow(op, name, terms, ticket=ticket, paused=paused)
        return bool(row[1])

    def _read_flow(self, name: str) -> Flow[Snapshot]:
        row = yield from self._op_flow("read", name)
        now: int = row[4]
        if row[0] == "none":
            return Snapshot(record=None, now=now)
        where = self._record_where(name)
        record = check_record(stored_fields(row[6]), where=where)
        try:
            check(record, now)
        except Unwritten as exc:
            raise unwritten_error(exc, f"record at {redact(self.url)}#{name}", where) from None
        return Snapshot(record=record, now=now)

    def _sweep_clock(self) -> int:
        """The clock (us) that spaces automatic sweeps: the test clock, or this host's monotonic one."""
        return self._clock() if self._clock is not None else time.monotonic_ns() // 1000

    def _sweep_flow(self) -> Flow[int]:
        self._swept = self._sweep_clock()
        row = yield from self._op_flow("sweep", "")
        return int(row[1])

    def _names_flow(self, prefix: str) -> Flow[list[str]]:
        rows, _ = yield from self._query_flow(self._names_query, (len(prefix), prefix))
        return [row[0] for row in rows]

    def _reset_flow(self, name: str) -> Flow[bool]:
        _, count = yield from self._query_flow(self._reset_query, (name,))
        return bool(count)


def stored_fields(stored: Any) -> Any:
    """A row as the function returned it (jsonb) as the fields :func:`check_record` reads."""
    if not isinstance(stored, dict):
        return stored
    fields = {
        "ticket": stored.get("ticket"),
        "pos": stored.get("pos"),
        "at": stored.get("at_us"),
        "interval": stored.get("interval_us"),
        "burst": stored.get("burst"),
        "due": stored.get("due_us"),
        "paused": stored.get("paused"),
        "max_running": stored.get("max_running"),
        "held": stored.get("held_us"),
    }
    leases = stored.get("leases")
    if isinstance(leases, list) and all(not isinstance(item, list) for item in leases):
        fields["leases"] = [leases[i : i + 2] for i in range(0, len(leases), 2)]
    else:
        fields["leases"] = leases
    return fields


def connect_kwargs(conninfo: str) -> dict[str, Any]:
    """The keyword arguments ratequeue connects with: autocommit, and a connect timeout unless given."""
    kwargs: dict[str, Any] = {"autocommit": True}
    if "connect_timeout" not in conninfo_to_dict(conninfo):
        kwargs["connect_timeout"] = CONNECT_TIMEOUT
    return kwargs


def is_pool(source: object) -> bool:
    """Whether ``source`` is a connection pool (psycopg_pool's, or one like it), not a connection."""
    return callable(getattr(source, "connection", None)) and hasattr(source, "getconn")


def describe(source: Any) -> dict[str, Any]:
    """The connection parameters of a ready connection or pool, without the password."""
    if is_pool(source):
        params = dict(conninfo_to_dict(getattr(source, "conninfo", "") or ""))
        params.update(getattr(source, "kwargs", None) or {})
    else:
        params = dict(source.info.get_parameters())
    params.pop("password", None)
    return params


def check_autocommit(source: Any) -> None:
    """A ready connection must be autocommit: each call its own transaction, no lock held after it."""
    if not is_pool(source) and not source.autocommit:
        raise ConfigurationError(
            "a PostgreSQL connection given to ratequeue must be in autocommit mode "
            "(psycopg.connect(..., autocommit=True)): each operation is its own transaction"
        )


class PostgresState(PostgresStateBase, State):
    """Records kept in a PostgreSQL table, changed only by one server-side function call each.

    Made from a ready ``psycopg.Connection`` (autocommit) or
    ``psycopg_pool.ConnectionPool``, or from a ``conninfo`` (see
    :class:`PostgresStateBase`); every operation runs one flow, in this thread.
    """

    def __init__(self, connection: psycopg.Connection[Any] | Any | None = None, **options: Any) -> None:
        super().__init__(connection, **options)
        self._lock = threading.Lock()

    @classmethod
    def from_url(cls, url: str) -> PostgresState:
        """Open ``postgresql://[user[:password]@][host][:port][/dbname][?table=T&schema=S&...]``.

        ``table`` (default ``ratequeue``) and ``schema`` choose where the rows
        live; other options go to libpq (``sslmode``, ``connect_timeout``...).
        Nothing is connected before the first operation.
        """
        with secrets_kept_out(url):
            conninfo, table, schema = split_url(url)
            return cls(conninfo=conninfo, table=table, schema=schema, url=url)

    @property
    def table(self) -> sql.Composable:
        """The (quoted) name of the table holding one row per queue."""
        return self._table

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()

    @contextlib.contextmanager
    def _connection(self) -> Iterator[psycopg.Connection[Any]]:
        if self._source is not None:
            if is_pool(self._source):
                with self._source.connection() as pooled:
                    yield pooled
            else:
                yield self._source
            return
        with self._lock:
            connection = self._idle.pop() if self._idle else None
        if connection is None:
            assert self._conninfo is not None
            connection = psycopg.Connection.connect(self._conninfo, **connect_kwargs(self._conninfo))
        try:
            yield connection
        except BaseException:
            if (
                connection.broken
                or connection.closed
                or connection.info.transaction_status not in (psycopg.pq.TransactionStatus.IDLE,)
            ):
                connection.close()
            else:
                self._give_back(connection)
            raise
        self._give_back(connection)

    def _give_back(self, connection: psycopg.Connection[Any]) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(connection)
                return
        connection.close()

    def _fetch(self, query: Query, params: tuple[Any, ...]) -> tuple[list[Any], int]:
        with self._connection() as connection:
            if self._warms(connection):
                self._warm_up(connection)
            cursor = connection.execute(query, params)
            rows = cursor.fetchall() if cursor.description is not None else []
            return rows, cursor.rowcount

    def _warm_up(self, connection: psycopg.Connection[Any]) -> None:
        """Run :meth:`_warm_up_script` on ``connection``, once; ignore a failure but a broken connection.

        Whatever happens, the connection is left outside a transaction.
        """
        self._warmed.add(connection)
        try:
            connection.execute(self._warm_up_script(), prepare=False)
        except psycopg.OperationalError:
            raise
        except psycopg.Error:
            pass
        finally:
            if (
                not connection.broken
                and connection.info.transaction_status != psycopg.pq.TransactionStatus.IDLE
            ):
                connection.rollback()

    def _setup_call(self, statements: list[Query]) -> None:
        with self._connection() as connection, connection.transaction():
            for statement in statements:
                connection.execute(statement)

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
