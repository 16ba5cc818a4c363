"""The PostgreSQL state's own edges: URL options, identifiers, ready connections, errors, the clock.

The protocol itself is held to the reference by the contract suite (``backend``
in conftest includes ``postgresql``); this covers what only this backend has.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import sys
import time
from typing import Any

import psycopg
import pytest
from hypothesis import given
from hypothesis import strategies as st

import ratequeue
from ratequeue import aio
from ratequeue.core import protocol
from ratequeue.core.operation import Terms, apply, operation
from ratequeue.core.protocol import MAX_DOUBT_US, MAX_SLOW, MAX_US, NEVER, US, Record, Started, Taken, Wait
from ratequeue.errors import ConfigurationError, StateCorrupted, StateUnavailable, TermsMismatch
from ratequeue.state import open_state, postgresql
from ratequeue.state.postgresql import AsyncPostgresState, PostgresState, split_url

from .ops import ado, do
from .servers import Server
from .strategies import doubts_us, epochs_us, intervals_us, leads_us

SECRET = "s3cr3t-pa55"


def url_of(server: Server, options: str = "") -> str:
    return f"postgresql://postgres@127.0.0.1:{server.port}/postgres{options}"


def test_options_are_ratequeues_and_the_rest_go_to_libpq() -> None:
    assert split_url("postgresql://u@h/db?table=t&schema=s&sslmode=disable&statement_timeout=1s") == (
        "postgresql://u@h/db?sslmode=disable",
        "t",
        "s",
    )
    assert split_url("postgres://h/db") == ("postgres://h/db", "ratequeue", None)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("postgresql://h/db?table=a-b", "bad PostgreSQL table name 'a-b'"),
        ("postgresql://h/db?table=1a", "table name '1a'"),
        ("postgresql://h/db?table=" + "x" * 60, "at most 57 characters"),
        ('postgresql://h/db?schema=a"b', "bad PostgreSQL schema name"),
        ("postgresql://h/db?table=", "table name ''"),
        ("postgresql://h/db?nosuchoption=1", "bad PostgreSQL URL"),
        ("postgresql://h/db?statement_timeout=1x", "bad PostgreSQL statement_timeout '1x'"),
        ("postgresql://h/db?statement_timeout=-1s", "statement_timeout '-1s'"),
        ("postgresql://h/db?statement_timeout=25d", "at most 24 days"),
        ("postgresql://h/db?statement_timeout=", "statement_timeout ''"),
    ],
)
def test_bad_urls_are_refused_before_connecting(url: str, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        open_state(url)
    with pytest.raises(ConfigurationError, match=message):
        aio.open_state(url)


def test_both_schemes_open_both_states() -> None:
    for scheme in ("postgresql", "postgres"):
        state = open_state(f"{scheme}://127.0.0.1:1/db")
        assert isinstance(state, PostgresState)
        assert isinstance(aio.open_state(f"{scheme}://127.0.0.1:1/db"), AsyncPostgresState)


def test_passwords_stay_out_of_reprs_and_errors() -> None:
    url = f"postgresql://u:{SECRET}@127.0.0.1:1/db?connect_timeout=1"
    state = open_state(url)
    assert SECRET not in repr(state)
    with pytest.raises(StateUnavailable) as caught:
        do(state, "take", "q", 1000)
    assert SECRET not in str(caught.value)
    assert SECRET not in str(caught.value.where)
    assert "127.0.0.1:1" in str(caught.value)


def test_a_missing_driver_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "psycopg", None)
    monkeypatch.delitem(sys.modules, "ratequeue.state.postgresql", raising=False)
    with pytest.raises(ConfigurationError, match=r"pip install 'ratequeue\[postgresql\]'"):
        ratequeue.Limiter("postgresql://h/db", name="q", interval=1)


def test_schema_and_table_are_where_the_rows_go(postgresql_server: Server) -> None:
    with psycopg.connect(url_of(postgresql_server), autocommit=True) as connection:
        connection.execute("CREATE SCHEMA IF NOT EXISTS rq_schema")
        with open_state(url_of(postgresql_server, "?schema=rq_schema&table=MixedCase")) as state:
            assert isinstance(do(state, "take_and_try", "q", 1000, 0), Started)
            assert state.names() == ["q"]
        row = connection.execute('SELECT ticket, pos FROM rq_schema."MixedCase" WHERE name = %s', ("q",))
        assert row.fetchall() == [(2, 1)]
        function = connection.execute(
            "SELECT count(*) FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace"
            " WHERE n.nspname = 'rq_schema' AND p.proname = 'MixedCase_op_v4'"
        )
        assert function.fetchone() == (1,)


def test_a_ready_connection_must_be_autocommit(postgresql_server: Server) -> None:
    with psycopg.connect(url_of(postgresql_server)) as connection, pytest.raises(ConfigurationError):
        PostgresState(connection)
    with psycopg.connect(url_of(postgresql_server), autocommit=True) as connection:
        state = PostgresState(connection, table="ready_conn")
        assert SECRET not in state.url
        assert state.url.startswith("postgresql://postgres@127.0.0.1:")
        assert isinstance(do(state, "take_and_try", "q", 1000, 0), Started)
        assert state.read("q").record is not None
        assert state.reset("q") is True
        assert connection.info.transaction_status == psycopg.pq.TransactionStatus.IDLE


def test_a_ready_pool_is_used(postgresql_server: Server) -> None:
    pool_module: Any = pytest.importorskip("psycopg_pool")
    with pool_module.ConnectionPool(
        url_of(postgresql_server), kwargs={"autocommit": True}, min_size=1, max_size=2, open=True
    ) as pool:
        state = PostgresState(pool, table="ready_pool")
        assert isinstance(do(state, "take_and_try", "q", 1000, 0), Started)
        assert state.names("q") == ["q"]


def test_the_state_clock_is_the_servers_in_whole_microseconds(postgresql_server: Server) -> None:
    with open_state(url_of(postgresql_server, "?table=clock")) as state:
        before = time.time_ns() // 1000
        now = state.read("q").now
        after = time.time_ns() // 1000
        assert isinstance(now, int)
        assert before - US <= now <= after + US  # the same host's clock
        nows = {state.read("q").now % 1000 for _ in range(20)}
        assert len(nows) > 1, "microseconds, not whole milliseconds"


def test_an_uncontended_acquire_is_one_statement(postgresql_server: Server) -> None:
    """Once the table and function are known, each operation is one statement on one connection."""
    with psycopg.connect(url_of(postgresql_server), autocommit=True) as connection:
        state = PostgresState(connection, table="one_statement")
        do(state, "take_and_try", "warm", 1000, 0)  # the setup check and the connection's warm-up
        sent: list[str] = []
        original = connection.execute

        def counting(query: Any, *args: Any, **kwargs: Any) -> Any:
            sent.append(str(query))
            return original(query, *args, **kwargs)

        connection.execute = counting  # type: ignore[method-assign]
        limiter = ratequeue.Limiter(state, name="q", interval=0.001)
        limiter.acquire()
        limiter.close()
        assert len(sent) == 1, sent


@pytest.mark.parametrize("bound", ["the URL's", "the default"])
def test_a_call_waits_for_a_row_lock_at_most_statement_timeout(
    postgresql_server: Server, monkeypatch: pytest.MonkeyPatch, bound: str
) -> None:
    """Another session holding the queue's row lock: StateUnavailable after statement_timeout, then it works.

    (The holder's own session ends after 5 s idle in its transaction, so that a
    call with no bound gets the lock then, and the test fails rather than hangs.)
    """
    options = "?table=row_lock"
    if bound == "the URL's":
        options += "&statement_timeout=300ms"
    else:
        monkeypatch.setattr(postgresql, "STATEMENT_TIMEOUT", "0.3s")
    limiter = ratequeue.Limiter(url_of(postgresql_server, options), name="q", interval=0.001)
    limiter.acquire()  # the table, the function and the row exist
    holder_options = "-c idle_in_transaction_session_timeout=5s"
    with psycopg.connect(url_of(postgresql_server), options=holder_options) as holder:
        holder.execute("SELECT * FROM row_lock WHERE name = 'q' FOR UPDATE")
        started = time.monotonic()
        with pytest.raises(StateUnavailable, match=r"(?s)cancelled the call on queue 'q'.*statement timeout"):
            limiter.acquire(timeout=0.5)
        assert 0.3 <= time.monotonic() - started < 2.5
        holder.rollback()
    assert limiter.acquire(timeout=5) is not None
    limiter.close()


def test_asyncio_state_answers_and_closes(postgresql_server: Server) -> None:
    async def main() -> None:
        state = aio.open_state(url_of(postgresql_server, "?table=aio_edges"))
        assert isinstance(state, AsyncPostgresState)
        first = await ado(state, "take_and_try", "q", 1000, 0)
        second = await ado(state, "take_and_try", "q", 1000, 10_000_000)
        assert isinstance(first, Started)
        assert isinstance(second, Started)
        assert second.start - first.start >= 1000
        assert await state.names() == ["q"]
        assert await state.reset("q") is True
        await state.close()

    asyncio.run(main())


# -- the settlement: rows of older tables, stored fields, exact arithmetic ------------------------

#: the state clock of the tests below
NOW = 10**15

#: the table as versions before the settlement made it, by what it lacks
OLDER_TABLES = {
    "settled": """
        CREATE TABLE {} (
            name text PRIMARY KEY, ticket bigint NOT NULL, pos bigint NOT NULL, at_us bigint NOT NULL,
            interval_us bigint NOT NULL, burst bigint NOT NULL DEFAULT 1, due_us bigint NOT NULL,
            paused boolean NOT NULL DEFAULT false, max_running integer NOT NULL DEFAULT 0,
            leases bigint[] NOT NULL DEFAULT '{{}}', held_us bigint NOT NULL DEFAULT -4503599627370496,
            keep_until_us bigint, not_before_us bigint, pace_us bigint NOT NULL DEFAULT 0, paced_at_us bigint
        )""",
    "hold, slow-down and settled (v1)": """
        CREATE TABLE {} (
            name text PRIMARY KEY, ticket bigint NOT NULL, pos bigint NOT NULL, at_us bigint NOT NULL,
            interval_us bigint NOT NULL, burst bigint NOT NULL DEFAULT 1, due_us bigint NOT NULL,
            paused boolean NOT NULL DEFAULT false, max_running integer NOT NULL DEFAULT 0,
            leases bigint[] NOT NULL DEFAULT '{{}}', held_us bigint NOT NULL DEFAULT -4503599627370496,
            keep_until_us bigint
        )""",
}

#: a function of the previous version's name and signature (v2: no p_doubt) that answers "old"
OLD_FUNCTION = """
    CREATE FUNCTION {}(text, text, bigint, bigint, bigint, integer, bigint, bigint, bigint, bigint, bigint,
                       boolean, bigint)
    RETURNS TABLE (o_kind text, o_a numeric, o_b numeric, o_c numeric, o_now bigint, o_created boolean,
                   o_stored jsonb)
    LANGUAGE sql
    AS $$ SELECT 'old'::text, 0::numeric, 0::numeric, 0::numeric, 0::bigint, false, NULL::jsonb $$
"""


def store(connection: psycopg.Connection[Any], table: str, name: str, record: Record, **columns: Any) -> None:
    """``record`` as ``name``'s row of ``table`` (the state's setup done); ``columns`` override its values."""
    row = {
        "ticket": record.ticket, "pos": record.pos, "at_us": record.at, "interval_us": record.interval,
        "burst": record.burst, "due_us": record.due, "paused": record.paused,
        "max_running": record.max_running or 0, "leases": [n for lease in record.leases for n in lease],
        "held_us": record.held, "not_before_us": None if record.not_before == NEVER else record.not_before,
        "pace_us": record.pace, "paced_at_us": None if record.paced_at == NEVER else record.paced_at,
        "settled": record.settled,
        **({} if record.paused_at == NEVER else {"paused_at_us": record.paused_at}), **columns,
    }  # fmt: skip
    connection.execute(f"DELETE FROM {table} WHERE name = %s", (name,))
    connection.execute(
        f"INSERT INTO {table} (name, {', '.join(row)}) VALUES (%s{', %s' * len(row)})", (name, *row.values())
    )


@pytest.mark.parametrize("lacking", list(OLDER_TABLES))
def test_a_table_made_before_the_settlement_gains_its_column(postgresql_server: Server, lacking: str) -> None:
    """An older version's table and function: set up again, its rows read as never settled, then settle.

    The older function is left as it was, for the older clients still calling it.
    """
    table = "before_settle_" + str(list(OLDER_TABLES).index(lacking))
    with psycopg.connect(url_of(postgresql_server), autocommit=True) as connection:
        connection.execute(f"DROP TABLE IF EXISTS {table}")
        connection.execute(f"DROP FUNCTION IF EXISTS {table}_op_v2")
        connection.execute(f"DROP FUNCTION IF EXISTS {table}_op_v3")
        connection.execute(f"DROP FUNCTION IF EXISTS {table}_op_v4")
        connection.execute(OLDER_TABLES[lacking].format(table))
        connection.execute(OLD_FUNCTION.format(f"{table}_op_v2"))
        connection.execute(
            f"INSERT INTO {table} (name, ticket, pos, at_us, interval_us, burst, due_us)"
            " VALUES ('q', 4, 3, %s, 1000, 3, %s)",
            (NOW - 500, NOW + 1500),
        )
        state = PostgresState(conninfo=url_of(postgresql_server), table=table, clock=lambda: NOW)
        stored = state.read("q").record
        assert stored == Record(4, 3, NOW - 500, 1000, NOW + 1500, 3)
        reference, moved = protocol.settle(stored, 3, 3, 1, NOW)
        assert moved
        assert do(state, "settle", "q", 1000, 3, 3, 1, burst=3) is True
        assert state.read("q").record == reference
        assert do(state, "settle", "q", 1000, 3, 3, 1, burst=3) is False  # settled once
        row = connection.execute(f"SELECT settled, due_us FROM {table} WHERE name = 'q'").fetchone()
        assert row == (3, reference.due)
        old = connection.execute(
            f"SELECT o_kind FROM {table}_op_v2('read', 'q', 1, 1, 0, 0, 0, NULL, 0, 0, 1, false, 0)"
        )
        assert old.fetchone() == ("old",)
        state.close()


def test_a_database_of_the_previous_version_gains_this_ones_function(postgresql_server: Server) -> None:
    """A table and function set up by v2: this version's function is made beside it; v2's is left alone."""
    table = "before_doubt"
    with psycopg.connect(url_of(postgresql_server), autocommit=True) as connection:
        connection.execute(f"DROP TABLE IF EXISTS {table}")
        connection.execute(f"DROP FUNCTION IF EXISTS {table}_op_v2")
        connection.execute(f"DROP FUNCTION IF EXISTS {table}_op_v3")
        connection.execute(f"DROP FUNCTION IF EXISTS {table}_op_v4")
        setup = postgresql.SETUP_SQL.replace("@TABLE@", f'"{table}"').split("-- ;;\n")[:2]
        for statement in setup:  # the table as v2 made it: every column it has now
            connection.execute(statement)
        connection.execute(OLD_FUNCTION.format(f"{table}_op_v2"))
        record = Record(4, 3, NOW - 500, 1000, NOW + 1500, 3, settled=2)
        store(connection, table, "q", record)
        state = PostgresState(conninfo=url_of(postgresql_server), table=table, clock=lambda: NOW)
        assert state.read("q").record == record
        reference, outcome = protocol.take_and_try(record, 10**6, NOW, doubt=MAX_DOUBT_US)
        assert isinstance(outcome, Started)
        assert do(state, "take_and_try", "q", 1000, 10**6, MAX_DOUBT_US, burst=3) == outcome
        assert state.read("q").record == reference
        assert reference.due >= outcome.start + MAX_DOUBT_US
        old = connection.execute(
            f"SELECT o_kind FROM {table}_op_v2('read', 'q', 1, 1, 0, 0, 0, NULL, 0, 0, 1, false, 0)"
        )
        assert old.fetchone() == ("old",)
        versions = connection.execute(
            "SELECT proname, pronargs FROM pg_proc WHERE proname LIKE %s ORDER BY proname", (f"{table}_op_%",)
        )
        assert versions.fetchall() == [(f"{table}_op_v2", 13), (f"{table}_op_v4", 17)]
        state.close()


@pytest.mark.parametrize(
    ("columns", "pattern"),
    [
        ({"settled": -1}, "settled=-1"),
        ({"settled": 4}, "settled=4"),
        ({"due_us": NOW - 3 * 1000 - 1}, f"due={NOW - 3001}"),
    ],
    ids=["settled below 0", "settled past pos", "due a burst of intervals below at"],
)
def test_stored_settled_and_due_are_checked(
    postgresql_server: Server, columns: dict[str, Any], pattern: str
) -> None:
    """A row no version could have written is refused by the function and by a read, naming the field."""
    with psycopg.connect(url_of(postgresql_server), autocommit=True) as connection:
        state = PostgresState(conninfo=url_of(postgresql_server), table="settle_checks", clock=lambda: NOW)
        state.read("q")  # the table exists
        store(connection, "settle_checks", "q", Record(5, 3, NOW, 1000, NOW, 3), **columns)
        for call in (
            lambda: state.read("q"),
            lambda: do(state, "take", "q", 1000, burst=3),
            lambda: do(state, "settle", "q", 1000, 3, 1, 0, burst=3),
        ):
            with pytest.raises(StateCorrupted, match=pattern):
                call()
        # the bounds themselves are stored fields a settlement may write
        edge = Record(5, 3, NOW, 1000, NOW - 3 * 1000, 3, settled=3)
        store(connection, "settle_checks", "q", edge)
        assert state.read("q").record == edge
        assert do(state, "take", "q", 1000, burst=3).ticket == 5
        state.close()


@pytest.mark.parametrize(
    "record",
    [
        # a refund whose floor, (pos - ticket - estimate) intervals past at, is far past 2**63
        Record(2**51, 2**51 - 1, NOW, 2**40, NOW + 2**40, 2),
        Record(2**51, 2**51 - 1, NOW, 2**40, NOW + 2**40, 2, settled=2**51 - 2),
        # a refund that meets its floor, far below at
        Record(10, 9, NOW, (MAX_US - 1) // 2**31, NOW, 2**31),
        # overruns to the slowest due, with the largest burst and pace
        Record(10, 9, NOW, 2**20, NOW + 5, 2**31, pace=(MAX_US - 1) // 2**31, paced_at=NOW),
        Record(10, 9, NOW, 3, NOW + 2, 2**31, pace=3 * MAX_SLOW, paced_at=NOW - 7 * 5 * US),
    ],
    ids=["far floor", "far floor, settled", "floor below at", "largest pace", "recovering pace"],
)
def test_settlements_are_exact_at_the_edges(postgresql_server: Server, record: Record) -> None:
    """Every settlement of the last tickets answers and stores what the reference does, whatever the sizes."""
    with psycopg.connect(url_of(postgresql_server), autocommit=True) as connection:
        state = PostgresState(conninfo=url_of(postgresql_server), table="settle_edges", clock=lambda: NOW)
        state.read("q")  # the table exists
        burst = record.burst
        for ticket in (record.pos, record.pos - 1, record.pos + 1, 1):
            for estimate, actual in ((1, 0), (burst, 0), (burst, burst - 1), (1, burst), (1, 2), (2, 2)):
                if not (1 <= estimate <= burst and actual <= burst):
                    continue
                store(connection, "settle_edges", "q", record)
                reference, moved = protocol.settle(record, ticket, estimate, actual, NOW)
                answer = do(state, "settle", "q", record.interval, ticket, estimate, actual, burst=burst)
                assert answer is moved, (ticket, estimate, actual)
                assert state.read("q").record == reference, (ticket, estimate, actual)
        state.close()


def test_the_warm_up_runs_every_path_without_an_error(postgresql_server: Server) -> None:
    """The warm-up's failures are ignored when it runs: here one would fail the test, settle's included."""
    with psycopg.connect(url_of(postgresql_server), autocommit=True) as connection:
        state = PostgresState(connection, table="warm_up")
        do(state, "take", "q", 1000)  # the table and the function exist
        connection.execute(state._warm_up_script(), prepare=False)
        assert connection.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        assert state.names() == ["q"]  # nothing kept


# -- the starter's doubt: due past at + (burst - 1) slowest paces, retimed, never settled back -----


@pytest.mark.parametrize("burst", [1, 3])
def test_a_due_a_doubt_moved_is_stored_checked_and_kept(postgresql_server: Server, burst: int) -> None:
    """due up to MAX_DOUBT_US past its cap is a record; one us more is refused; retime and settle keep it."""
    with psycopg.connect(url_of(postgresql_server), autocommit=True) as connection:
        state = PostgresState(conninfo=url_of(postgresql_server), table="doubt_edges", clock=lambda: NOW)
        state.read("q")  # the table exists
        interval = 1000
        cap = NOW + (burst - 1) * MAX_SLOW * interval + MAX_DOUBT_US
        store(connection, "doubt_edges", "q", Record(5, 3, NOW, interval, cap + 1, burst))
        with pytest.raises(StateCorrupted, match=f"due={cap + 1}"):
            state.read("q")
        with pytest.raises(StateCorrupted, match=f"due={cap + 1}"):
            do(state, "take", "q", interval, burst=burst)
        edge = Record(5, 3, NOW, interval, cap, burst)
        for kind, args in (
            ("settle", (3, 1, burst)),  # an overrun: due lies past its cap already, and never moves back
            ("settle", (3, 1, 0)),  # a refund
            ("retime", (3, 5000)),  # due moves as far as the start
            ("retime", (3, 0)),  # not back
            ("try_start", (4, 10**9, MAX_DOUBT_US)),
            ("take_and_try", (10**9, 1)),
        ):
            store(connection, "doubt_edges", "q", edge)
            if kind == "settle":
                reference, answer = protocol.settle(edge, args[0], args[1], args[2], NOW)
            elif kind == "retime":
                reference, answer = protocol.retime(edge, args[0], args[1], NOW)
            elif kind == "try_start":
                reference, answer = protocol.try_start(edge, args[0], args[1], NOW, doubt=args[2])
            else:
                reference, answer = protocol.take_and_try(edge, args[0], NOW, doubt=args[1])
            assert do(state, kind, "q", interval, *args, burst=burst) == answer, (kind, args)
            assert state.read("q").record == reference, (kind, args)
            if kind == "retime" and args[1]:
                assert reference.due == cap + 5000
        state.close()


# -- fair queues (_v4): the waiters in the row, older tables and functions, stored fields checked ---

#: the table as v3 made it: no fair queues
V3_TABLE = """
    CREATE TABLE {} (
        name text PRIMARY KEY, ticket bigint NOT NULL, pos bigint NOT NULL, at_us bigint NOT NULL,
        interval_us bigint NOT NULL, burst bigint NOT NULL DEFAULT 1, due_us bigint NOT NULL,
        paused boolean NOT NULL DEFAULT false, max_running integer NOT NULL DEFAULT 0,
        leases bigint[] NOT NULL DEFAULT '{{}}', held_us bigint NOT NULL DEFAULT -4503599627370496,
        keep_until_us bigint, not_before_us bigint, pace_us bigint NOT NULL DEFAULT 0, paced_at_us bigint,
        settled bigint NOT NULL DEFAULT 0
    )"""

#: a function of v3's name and signature (p_doubt, no p_fair, p_tenant, p_weight) that answers "v3"
V3_FUNCTION = """
    CREATE FUNCTION {}(text, text, bigint, bigint, bigint, integer, bigint, bigint, bigint, bigint, bigint,
                       boolean, bigint, bigint)
    RETURNS TABLE (o_kind text, o_a numeric, o_b numeric, o_c numeric, o_now bigint, o_created boolean,
                   o_stored jsonb)
    LANGUAGE sql
    AS $$ SELECT 'v3'::text, 0::numeric, 0::numeric, 0::numeric, 0::bigint, false, NULL::jsonb $$
"""

#: tenants of the fair tests below, and their weights
TENANTS = {"a": 1, "b": 2, "ü €": 3}


def fair_terms(interval: int = 1000, burst: int = 1, max_running: int | None = None) -> Terms:
    return Terms.checked(
        interval, burst, max_running=max_running, lease_us=5000 if max_running else 0, fair=True
    )


def test_a_v3_database_gains_v4_and_its_rows_read_not_fair(postgresql_server: Server) -> None:
    """A table and function made by v3: the table gains the fair columns, v4 is made beside v3's."""
    table = "before_fair"
    with psycopg.connect(url_of(postgresql_server), autocommit=True) as connection:
        connection.execute(f"DROP TABLE IF EXISTS {table}")
        for version in ("v3", "v4"):
            connection.execute(f"DROP FUNCTION IF EXISTS {table}_op_{version}")
        connection.execute(V3_TABLE.format(table))
        connection.execute(V3_FUNCTION.format(f"{table}_op_v3"))
        record = Record(4, 3, NOW - 500, 1000, NOW + 1500, 3, settled=2)
        store(connection, table, "q", record)
        state = PostgresState(conninfo=url_of(postgresql_server), table=table, clock=lambda: NOW)
        assert state.fair_queues
        assert state.read("q").record == record, "an older row is not fair"
        row = connection.execute(f"SELECT fair, number, begun, waiters, tenants FROM {table}").fetchone()
        assert row == (None, None, None, None, None)
        reference, outcome = protocol.take_and_try(record, 10**6, NOW)
        assert do(state, "take_and_try", "q", 1000, 10**6, burst=3) == outcome
        assert state.read("q").record == reference
        with pytest.raises(TermsMismatch, match="fair"):
            state.execute(operation("take", "q", fair_terms(burst=3), tenant="a"))
        assert state.read("q").record == reference, "the refusal changed nothing"
        fair = state.execute(operation("take_and_try", "f", fair_terms(), tenant="a", lead_us=10))
        assert fair == Started(1, NOW, NOW)
        old = connection.execute(
            f"SELECT o_kind FROM {table}_op_v3('read', 'q', 1, 1, 0, 0, 0, NULL, 0, 0, 1, false, 0, 0)"
        )
        assert old.fetchone() == ("v3",)
        versions = connection.execute(
            "SELECT proname, pronargs FROM pg_proc WHERE proname LIKE %s ORDER BY proname", (f"{table}_op_%",)
        )
        assert versions.fetchall() == [(f"{table}_op_v3", 14), (f"{table}_op_v4", 17)]
        state.close()


def test_a_fair_row_stores_its_waiters_and_a_row_that_is_not_fair_stores_none(
    postgresql_server: Server,
) -> None:
    with psycopg.connect(url_of(postgresql_server), autocommit=True) as connection:
        state = PostgresState(conninfo=url_of(postgresql_server), table="fair_rows", clock=lambda: NOW)
        for name in ("fair", "unfair"):
            state.reset(name)
        reference = protocol.new_record(1000, fair=True)
        for tenant in ("a", "a", "ü €", "a"):
            reference, taken = protocol.enqueue(reference, NOW, tenant, TENANTS[tenant])
            assert (
                state.execute(operation("take", "fair", fair_terms(), tenant=tenant, weight=TENANTS[tenant]))
                == taken
            )
        assert state.read("fair").record == reference
        row = connection.execute(
            "SELECT fair, number, begun, waiters, tenants FROM fair_rows WHERE name = 'fair'"
        ).fetchone()
        # (each take passed the ticket before it, which nobody tried: G4's jump)
        assert reference.waiters == ((4, "a", 1, 1, 4),)
        assert row == (True, 5, 0, [4, 1, 1, 4], ["a"])
        do(state, "take_and_try", "unfair", 1000, 0)
        row = connection.execute(
            "SELECT fair, number, begun, waiters, tenants FROM fair_rows WHERE name = 'unfair'"
        ).fetchone()
        assert row == (None, None, None, None, None)
        state.close()


@pytest.mark.parametrize(
    ("columns", "pattern"),
    [
        ({"number": 0}, "number=0"),
        ({"number": None}, "number=None"),
        ({"begun": None}, "begun=None"),
        ({"waiters": None}, "waiters="),
        ({"tenants": None}, "waiters="),
        ({"begun": 5}, "begun=5"),
        ({"begun": -1}, "begun=-1"),
        ({"waiters": [1, 1, 1]}, "waiters="),
        ({"tenants": ["a", "b"]}, "waiters="),
        ({"tenants": [None]}, "waiters="),
        ({"waiters": [1, 1, 1, None]}, "waiters="),
        ({"waiters": [5, 1, 1, 0]}, "waiters="),
        ({"waiters": [1, 0, 1, 0]}, "waiters="),
        ({"waiters": [1, 1001, 1, 0]}, "waiters="),
        ({"waiters": [1, 1, 0, 0]}, "waiters="),
        ({"waiters": [1, 1, 1, 3]}, "waiters="),
        ({"waiters": [1, 1, 1, 9]}, "waiters="),
        ({"waiters": [[1, 1], [1, 0]]}, "waiters="),
        ({"waiters": [2, 1, 1, 0, 1, 1, 1, 0], "tenants": ["a", "a"]}, "waiters="),
    ],
)
def test_stored_fair_fields_are_checked(
    postgresql_server: Server, columns: dict[str, Any], pattern: str
) -> None:
    """A fair row no version could have written is refused by the function and by a read, by name."""
    with psycopg.connect(url_of(postgresql_server), autocommit=True) as connection:
        state = PostgresState(conninfo=url_of(postgresql_server), table="fair_checks", clock=lambda: NOW)
        state.read("q")  # the table exists
        good = {"fair": True, "number": 5, "begun": 2, "waiters": [1, 1, 1, 4], "tenants": ["a"]}
        record = Record(5, 3, NOW, 1000, NOW, 1)
        store(connection, "fair_checks", "q", record, **good)
        assert state.read("q").record == record._replace(
            fair=True, number=5, begun=2, waiters=((1, "a", 1, 1, 4),)
        )
        store(connection, "fair_checks", "q", record, **{**good, **columns})
        terms = fair_terms()
        for call in (
            lambda: state.read("q"),
            lambda: state.execute(operation("take", "q", terms, tenant="a")),
            lambda: state.execute(operation("try_start", "q", terms, ticket=1)),
            lambda: state.execute(operation("hold", "q", terms, lead_us=5)),
        ):
            with pytest.raises(StateCorrupted, match=pattern):
                call()
        # a row that is not fair does not read them
        store(connection, "fair_checks", "q", record, **{**good, **columns, "fair": False})
        assert state.read("q").record == record
        assert do(state, "take", "q", 1000).ticket == 5
        state.close()


def test_a_fair_queue_refuses_a_number_or_ticket_past_the_limit(postgresql_server: Server) -> None:
    with psycopg.connect(url_of(postgresql_server), autocommit=True) as connection:
        state = PostgresState(conninfo=url_of(postgresql_server), table="fair_limits", clock=lambda: NOW)
        state.read("q")  # the table exists
        terms = fair_terms()
        fair = {"fair": True, "begun": 0, "waiters": [], "tenants": []}
        store(connection, "fair_limits", "q", Record(5, 3, NOW, 1000, NOW), **fair, number=MAX_US - 1)
        for kind in ("take", "try_take"):
            with pytest.raises(StateCorrupted, match=f"number={MAX_US - 1}"):
                state.execute(operation(kind, "q", terms, tenant="a"))
        store(
            connection, "fair_limits", "q", Record(MAX_US - 1, MAX_US - 2, NOW, 1000, NOW), **fair, number=3
        )
        for kind in ("take_and_try", "try_take"):
            with pytest.raises(StateCorrupted, match=f"ticket={MAX_US - 1}"):
                state.execute(operation(kind, "q", terms, tenant="a"))
        assert connection.execute("SELECT number, waiters FROM fair_limits").fetchone() == (3, [])
        state.close()


def test_the_asyncio_state_carries_out_fair_queues(postgresql_server: Server) -> None:
    async def main() -> None:
        state = AsyncPostgresState(conninfo=url_of(postgresql_server), table="fair_aio", clock=lambda: NOW)
        await state.reset("q")
        terms = fair_terms()
        reference = protocol.new_record(1000, fair=True)
        for tenant in ("a", "a", "b"):
            reference, expected = protocol.enqueue_and_try(reference, tenant, TENANTS[tenant], 0, NOW)
            op = operation("take_and_try", "q", terms, tenant=tenant, weight=TENANTS[tenant])
            assert await state.execute(op) == expected
        reference, expected = protocol.try_turn(reference, 3, 10**6, NOW)
        assert await state.execute(operation("try_start", "q", terms, ticket=3, lead_us=10**6)) == expected
        assert isinstance(expected, Started)
        assert (await state.read("q")).record == reference
        await state.close()

    asyncio.run(main())


#: a fair queue's steps: a take or a take and try of a tenant (of a cost, with a token), a try of a
#: waiter number (one in line, or any), a retime, release, renew or settle of a ticket, the flags
_fair_steps = st.one_of(
    st.tuples(st.just("take"), st.sampled_from(list(TENANTS)), st.integers(1, 3)),
    st.tuples(
        st.just("take_and_try"),
        st.sampled_from(list(TENANTS)),
        leads_us,
        st.integers(1, 3),
        st.integers(0, 3),
        doubts_us,
    ),
    st.tuples(st.just("try"), st.integers(0, 40), leads_us, st.integers(1, 3), st.integers(0, 3), doubts_us),
    st.tuples(st.just("retime"), st.integers(0, 40), leads_us, doubts_us),
    st.tuples(st.just("release"), st.integers(0, 40), st.integers(0, 3)),
    st.tuples(st.just("renew"), st.integers(0, 40), st.integers(0, 3)),
    st.tuples(st.just("settle"), st.integers(0, 40), st.integers(1, 3), st.integers(0, 3)),
    st.tuples(st.just("pause"), st.booleans()),
    st.tuples(st.just("hold"), st.integers(0, 300_000)),
    st.tuples(st.just("lift")),
    st.tuples(st.just("slow"), st.integers(0, 2_000_000)),
    st.tuples(
        st.just("clock"), st.one_of(st.integers(0, 2000), st.integers(0, 300_000), st.integers(-100_000, 0))
    ),
)


def _pick(choice: int, known: list[int], most: int) -> int:
    """One of ``known`` (the tickets or numbers that matter), or any from 1 to ``most``."""
    return max(known[choice % len(known)], 1) if known and choice % 2 else 1 + choice % max(most, 1)


@given(
    interval=st.one_of(st.sampled_from([1000, 20_000, 1_000_000]), intervals_us),
    epoch=epochs_us,
    burst=st.integers(1, 3),
    max_running=st.one_of(st.none(), st.integers(1, 2)),
    steps=st.lists(_fair_steps, min_size=1, max_size=40),
)
def test_a_fair_queue_answers_and_stores_as_the_reference_with_every_kind(
    postgresql_server: Server,
    interval: int,
    epoch: int,
    burst: int,
    max_running: int | None,
    steps: list[tuple[Any, ...]],
) -> None:
    """Every kind, costs, bursts, leases and tokens on a fair queue: each answer, and the row after it."""
    clock = [epoch]
    state = PostgresState(conninfo=url_of(postgresql_server), table="fair_kinds", clock=lambda: clock[0])
    state.reset("q")
    terms = fair_terms(interval, burst, max_running)
    reference = protocol.new_record(interval, burst, max_running, fair=True)
    try:
        for step in steps:
            kind, now = step[0], clock[0]
            if kind == "clock":
                clock[0] = max(0, now + step[1])
                continue
            numbers = [waiter[0] for waiter in reference.waiters] + [reference.begun]
            tickets = [reference.pos] + [lease[0] for lease in reference.leases]
            if kind == "take":
                op = operation(
                    "take", "q", terms, tenant=step[1], weight=TENANTS[step[1]], cost=min(step[2], burst)
                )
            elif kind == "take_and_try":
                _, tenant, lead, cost, token, doubt = step
                op = operation(
                    "take_and_try", "q", terms, tenant=tenant, weight=TENANTS[tenant], lead_us=lead,
                    cost=min(cost, burst), token=token, doubt_us=doubt,
                )  # fmt: skip
            elif kind == "try":
                _, choice, lead, cost, token, doubt = step
                op = operation(
                    "try_start", "q", terms, ticket=_pick(choice, numbers, reference.number), lead_us=lead,
                    cost=min(cost, burst), token=token, doubt_us=doubt,
                )  # fmt: skip
            elif kind == "retime":
                ticket = _pick(step[1], tickets, reference.ticket)
                op = operation("retime", "q", terms, ticket=ticket, lead_us=step[2], doubt_us=step[3])
            elif kind in ("release", "renew"):
                if kind == "renew" and max_running is None:
                    continue
                op = operation(
                    kind, "q", terms, ticket=_pick(step[1], tickets, reference.ticket), token=step[2]
                )
            elif kind == "settle":
                ticket = _pick(step[1], tickets, reference.ticket)
                op = operation(
                    "settle", "q", terms, ticket=ticket, cost=min(step[2], burst), lead_us=min(step[3], burst)
                )
            elif kind == "pause":
                op = operation("set_paused", "q", terms, paused=step[1])
            elif kind in ("hold", "slow"):
                op = operation(kind, "q", terms, lead_us=step[1])
            else:
                op = operation("lift", "q", terms)
            reference, expected = apply(reference, op, now)
            assert state.execute(op) == expected, (op, reference)
            assert state.read("q").record == reference, op
    finally:
        state.reset("q")
        state.close()


@pytest.mark.parametrize("seed", range(4))
def test_a_busy_fair_queue_answers_and_stores_as_the_reference(postgresql_server: Server, seed: int) -> None:
    """Long runs of shards of several tenants asking about as fast as the interval: many waiters in line.

    (The property test above reaches few waiters at once: a take passes every
    ticket whose slot is past, and its clock moves by large steps.)
    """
    rng = random.Random(seed)
    clock = [NOW]
    state = PostgresState(conninfo=url_of(postgresql_server), table="fair_busy", clock=lambda: clock[0])
    most = 0
    try:
        for run in range(25):
            name = f"q{run}"
            state.reset(name)
            interval, burst = rng.choice([(1000, 1), (1000, 3), (5000, 2)])
            max_running = rng.choice([None, None, 1, 3])
            terms = fair_terms(interval, burst, max_running)
            reference = protocol.new_record(interval, burst, max_running, fair=True)
            held: dict[int, int] = {}  # shard -> its waiter number
            for _ in range(80):
                now = clock[0]
                shard = rng.randrange(8)
                tenant = list(TENANTS)[shard % 3]
                roll = rng.random()
                cost = rng.randint(1, burst)
                if roll < 0.15:
                    clock[0] = now + rng.randint(0, interval)
                    continue
                if roll < 0.2:
                    ticket = max(reference.pos, 1)
                    op = operation(
                        rng.choice(["release", "retime"]), name, terms, ticket=ticket, token=shard + 1
                    )
                elif roll < 0.23:
                    op = operation("set_paused", name, terms, paused=rng.random() < 0.5)
                elif roll < 0.26:
                    op = operation(
                        "settle", name, terms, ticket=max(reference.pos, 1), cost=cost, lead_us=burst
                    )
                elif shard in held:
                    lead = rng.choice([0, interval // 2, 3 * interval])
                    op = operation(
                        "try_start", name, terms, ticket=held[shard], lead_us=lead, cost=cost, token=shard + 1
                    )
                elif roll < 0.4:
                    op = operation("take", name, terms, tenant=tenant, weight=TENANTS[tenant], cost=cost)
                else:
                    lead = rng.choice([0, interval // 2])
                    op = operation(
                        "take_and_try", name, terms, tenant=tenant, weight=TENANTS[tenant], lead_us=lead,
                        cost=cost, token=shard + 1,
                    )  # fmt: skip
                reference, expected = apply(reference, op, now)
                assert state.execute(op) == expected, (op, reference)
                assert state.read(name).record == reference, op
                most = max(most, len(reference.waiters))
                if op.kind == "take":
                    assert isinstance(expected, Taken)
                    held[shard] = expected.ticket
                elif op.kind in ("take_and_try", "try_start"):
                    if isinstance(expected, Wait):
                        held[shard] = expected.ticket
                    else:
                        held.pop(shard, None)
            state.reset(name)
        assert most >= 4, "several waiters were in line at once"
    finally:
        state.close()


# -- try_take: take_and_try that writes nothing unless it starts (issue 31) ------------------------


@pytest.mark.parametrize("max_running", [None, 1], ids=["busy", "full"])
@pytest.mark.parametrize("fair", [False, True], ids=["unfair", "fair"])
def test_a_try_take_that_gets_no_turn_leaves_the_row_as_it_was(
    postgresql_server: Server, fair: bool, max_running: int | None
) -> None:
    """Its wait names the ticket (on a fair row the waiter) not taken; the row, keep and held times, stays.

    The same call as take_and_try would have taken a ticket (or added a
    waiter) and, on a full row, noted when it was found full.
    """
    table, name, clock = "try_take", f"q {fair} {max_running}", [NOW]
    lead = 10**6 if max_running else 0  # within reach of its slot: only the full row holds it back
    state = PostgresState(conninfo=url_of(postgresql_server), table=table, clock=lambda: clock[0])
    with psycopg.connect(url_of(postgresql_server), autocommit=True) as connection, contextlib.closing(state):
        state.reset(name)
        terms = Terms.checked(
            1000, keep_us=10**6, max_running=max_running, lease_us=5000 if max_running else 0, fair=fair
        )
        tenant: dict[str, Any] = {"tenant": "a", "weight": 2} if fair else {}
        reference = protocol.new_record(1000, 1, max_running, fair=fair)

        def row() -> Any:
            return connection.execute(f"SELECT * FROM {table} WHERE name = %s", (name,)).fetchone()

        def run(kind: Any, token: int, lead: int = 0) -> Any:
            nonlocal reference
            op = operation(kind, name, terms, lead_us=lead, token=token, **tenant)
            reference, expected = apply(reference, op, clock[0])
            assert state.execute(op) == expected, op
            assert state.read(name).record == reference, op
            return expected

        assert run("try_take", 1) == Started(1, NOW, NOW)  # a missing row: created, started
        stored = row()
        assert stored[11] is not None, "a keep time"
        for token in (2, 3):  # asked twice: the same ticket (waiter) named, not taken
            clock[0] += 100
            assert run("try_take", token, lead) == Wait(2, NOW + (5000 if max_running else 1000), clock[0])
            assert row() == stored
            instead = operation("take_and_try", name, terms, lead_us=lead, **tenant)
            taken, _ = apply(reference, instead, clock[0])
            assert taken != reference, "take_and_try would have written"
            if max_running:
                assert taken.held == clock[0], "take_and_try would have noted the row full"
        if max_running:
            assert run("try_take", 1) == Started(1, NOW, clock[0]), "its lease's token: the same start"
            assert row() == stored
            clock[0] = NOW + 5000  # the lease expired
        else:
            clock[0] = NOW + 1000
        assert run("try_take", 2) == Started(2, clock[0], clock[0])
        assert row() != stored
        state.reset(name)


# -- paused_at: since when a queue is paused everywhere (issue 31) ---------------------------------


@pytest.mark.parametrize("fair", [False, True], ids=["unfair", "fair"])
def test_a_paused_row_stores_when_the_pause_began_and_a_resumed_one_null(
    postgresql_server: Server, fair: bool
) -> None:
    """A pause notes now in paused_at_us; asked again, or another operation, keeps it; a resume clears it."""
    table, name, clock = "paused_at", f"q {fair}", [NOW]
    state = PostgresState(conninfo=url_of(postgresql_server), table=table, clock=lambda: clock[0])
    with psycopg.connect(url_of(postgresql_server), autocommit=True) as connection, contextlib.closing(state):
        state.reset(name)
        terms = Terms.checked(1000, keep_us=10**6, fair=fair)
        tenant: dict[str, Any] = {"tenant": "a"} if fair else {}
        reference = protocol.new_record(1000, fair=fair)

        def stored() -> Any:
            return connection.execute(
                f"SELECT paused, paused_at_us FROM {table} WHERE name = %s", (name,)
            ).fetchone()

        def run(kind: Any, **arguments: Any) -> Any:
            nonlocal reference
            op = operation(kind, name, terms, **arguments)
            reference, expected = apply(reference, op, clock[0])
            assert state.execute(op) == expected, op
            assert state.read(name).record == reference, op
            return expected

        run("take_and_try", lead_us=10, **tenant)
        assert stored() == (False, None), "a row never paused stores no paused_at"
        clock[0] += 100
        assert run("set_paused", paused=True) is True
        assert stored() == (True, NOW + 100)
        assert reference.paused_at == NOW + 100
        for kind, arguments in (
            ("set_paused", {"paused": True}),  # asked again: the first pause's start kept
            ("take", tenant),
            ("try_start", {"ticket": 2}),  # a wait: paused
            ("hold", {"lead_us": 10**6}),
            ("slow", {}),
            ("lift", {}),
        ):
            clock[0] += 100
            run(kind, **arguments)
            assert stored() == (True, NOW + 100), kind
        clock[0] += 100
        assert run("set_paused", paused=False) is True
        assert stored() == (False, None)
        assert run("set_paused", paused=False) is False
        clock[0] += 100
        assert run("set_paused", paused=True) is True, "paused again: since now"
        assert stored() == (True, clock[0])
        state.reset(name)
        reference = protocol.new_record(1000, fair=fair)
        assert run("set_paused", paused=True) is True, "a missing row: created paused"
        assert stored() == (True, clock[0])


#: the table as this version made it before paused_at_us (every other column)
BEFORE_PAUSED_AT = """
    CREATE TABLE {} (
        name text PRIMARY KEY, ticket bigint NOT NULL, pos bigint NOT NULL, at_us bigint NOT NULL,
        interval_us bigint NOT NULL, burst bigint NOT NULL DEFAULT 1, due_us bigint NOT NULL,
        paused boolean NOT NULL DEFAULT false, max_running integer NOT NULL DEFAULT 0,
        leases bigint[] NOT NULL DEFAULT '{{}}', held_us bigint NOT NULL DEFAULT -4503599627370496,
        keep_until_us bigint, not_before_us bigint, pace_us bigint NOT NULL DEFAULT 0, paced_at_us bigint,
        settled bigint NOT NULL DEFAULT 0, fair boolean, number bigint, begun bigint, waiters bigint[],
        tenants text[]
    )"""

#: a function of this version's name and signature (made before paused_at_us) that answers "old"
V4_BEFORE_PAUSED_AT = """
    CREATE FUNCTION {}(text, text, bigint, bigint, bigint, integer, bigint, bigint, bigint, bigint, bigint,
                       boolean, bigint, bigint, boolean, text, bigint)
    RETURNS TABLE (o_kind text, o_a numeric, o_b numeric, o_c numeric, o_now bigint, o_created boolean,
                   o_stored jsonb)
    LANGUAGE sql
    AS $$ SELECT 'old'::text, 0::numeric, 0::numeric, 0::numeric, 0::bigint, false, NULL::jsonb $$
"""


@pytest.mark.parametrize("before", ["v4", "v3"])
def test_a_table_made_before_paused_at_gains_the_column(postgresql_server: Server, before: str) -> None:
    """The nullable column is added; a row paused then reads paused since NEVER (unknown) until resumed.

    A v4 function made before the column (v4 is unreleased) is made again in place; v3's is left alone.
    """
    table = f"before_paused_at_{before}"
    with psycopg.connect(url_of(postgresql_server), autocommit=True) as connection:
        connection.execute(f"DROP TABLE IF EXISTS {table}")
        for version in ("v3", "v4"):
            connection.execute(f"DROP FUNCTION IF EXISTS {table}_op_{version}")
        if before == "v4":
            connection.execute(BEFORE_PAUSED_AT.format(table))
            connection.execute(V4_BEFORE_PAUSED_AT.format(f"{table}_op_v4"))
        else:
            connection.execute(V3_TABLE.format(table))
            connection.execute(V3_FUNCTION.format(f"{table}_op_v3"))
        paused = Record(4, 3, NOW - 500, 1000, NOW + 1500, 3, paused=True)
        store(connection, table, "paused", paused)
        store(connection, table, "running", paused._replace(paused=False))
        clock = [NOW]
        state = PostgresState(conninfo=url_of(postgresql_server), table=table, clock=lambda: clock[0])
        assert state.read("paused").record == paused, "paused, since when unknown"
        assert state.read("running").record == paused._replace(paused=False)
        column = connection.execute(
            "SELECT data_type, is_nullable, column_default FROM information_schema.columns"
            " WHERE table_name = %s AND column_name = 'paused_at_us'",
            (table,),
        ).fetchone()
        assert column == ("bigint", "YES", None)
        rows = connection.execute(f"SELECT paused_at_us FROM {table} ORDER BY name").fetchall()
        assert rows == [(None,), (None,)]
        clock[0] += 10
        assert do(state, "set_paused", "paused", 1000, True, burst=3) is False, "paused already"
        assert state.read("paused").record == paused, "a pause asked again notes no start"
        assert do(state, "set_paused", "paused", 1000, False, burst=3) is True
        assert do(state, "set_paused", "running", 1000, True, burst=3) is True
        assert state.read("running").record == paused._replace(paused_at=NOW + 10)
        rows = connection.execute(f"SELECT name, paused, paused_at_us FROM {table} ORDER BY name").fetchall()
        assert rows == [("paused", False, None), ("running", True, NOW + 10)]
        versions = connection.execute(
            "SELECT proname FROM pg_proc WHERE proname LIKE %s ORDER BY proname", (f"{table}_op_%",)
        )
        assert versions.fetchall() == [(f"{table}_op_{version}",) for version in sorted({before, "v4"})]
        if before == "v3":
            old = connection.execute(
                f"SELECT o_kind FROM {table}_op_v3('read', 'q', 1, 1, 0, 0, 0, NULL, 0, 0, 1, false, 0, 0)"
            )
            assert old.fetchone() == ("v3",)
        state.close()


@pytest.mark.parametrize(
    ("paused_at", "pattern"),
    [
        (MAX_US, f"paused_at={MAX_US}"),
        (NEVER - 1, f"paused_at={NEVER - 1}"),
        (NOW + protocol.MAX_LEAD_US + 1, f"paused_at={NOW + protocol.MAX_LEAD_US + 1}, more than 3600 s"),
    ],
    ids=["past the limit", "before NEVER", "ahead of the clock"],
)
def test_a_stored_paused_at_is_checked(postgresql_server: Server, paused_at: int, pattern: str) -> None:
    """A paused row's paused_at no version could have written is refused by the function and by a read."""
    with psycopg.connect(url_of(postgresql_server), autocommit=True) as connection:
        state = PostgresState(conninfo=url_of(postgresql_server), table="paused_at_checks", clock=lambda: NOW)
        state.reset("q")  # the table exists (and no row another case left)
        record = Record(5, 3, NOW, 1000, NOW, 1, paused=True)
        store(connection, "paused_at_checks", "q", record, paused_at_us=paused_at)
        for call in (
            lambda: state.read("q"),
            lambda: do(state, "take", "q", 1000),
            lambda: do(state, "try_start", "q", 1000, 4),
            lambda: do(state, "set_paused", "q", 1000, True),
            lambda: do(state, "set_paused", "q", 1000, False),
        ):
            with pytest.raises(StateCorrupted, match=pattern):
                call()
        assert connection.execute("SELECT paused_at_us FROM paused_at_checks").fetchone() == (paused_at,)
        # the edges are records: NEVER stored (not NULL) on any row, a pause's start MAX_LEAD_US ahead
        for edge, column in (
            (record._replace(paused=False), NEVER),
            (record._replace(paused=True), NEVER),
            (record._replace(paused=True, paused_at=NOW + protocol.MAX_LEAD_US), NOW + protocol.MAX_LEAD_US),
        ):
            store(connection, "paused_at_checks", "q", edge, paused_at_us=column)
            assert state.read("q").record == edge
            assert do(state, "take", "q", 1000).ticket == 5
        state.close()


@pytest.mark.parametrize(
    "paused_at",
    [NOW, NEVER, MAX_US, NEVER - 1, NOW + protocol.MAX_LEAD_US + 1],
    ids=["well formed", "NEVER stored", "past the limit", "before NEVER", "ahead of the clock"],
)
def test_a_paused_at_left_in_a_row_not_paused_is_ignored_and_the_next_write_clears_it(
    postgresql_server: Server, paused_at: int
) -> None:
    """Whatever a row that is not paused holds in paused_at_us (an older version's resume leaves it), it
    reads NEVER, no operation refuses it, an answer that changes nothing leaves it, and a write clears it."""
    table, clock = "paused_at_ignored", [NOW]
    with psycopg.connect(url_of(postgresql_server), autocommit=True) as connection:
        state = PostgresState(conninfo=url_of(postgresql_server), table=table, clock=lambda: clock[0])
        state.reset("q")  # the table exists (and no row another case left)
        record = Record(5, 3, NOW, 1000, NOW + 1000, 1)
        store(connection, table, "q", record, paused_at_us=paused_at)

        def column() -> Any:
            return connection.execute(f"SELECT paused_at_us FROM {table} WHERE name = 'q'").fetchone()

        assert state.read("q").record == record, "read: paused_at NEVER"
        with pytest.raises(TermsMismatch, match="interval"):  # (the stored row is checked, not refused)
            do(state, "take", "q", 2000)
        assert do(state, "set_paused", "q", 1000, False) is False, "not paused: nothing to resume"
        _, wait = apply(record, operation("try_start", "q", Terms.checked(1000), ticket=4), NOW)
        assert isinstance(wait, Wait)
        assert do(state, "try_start", "q", 1000, 4) == wait, "a wait"
        assert column() == (paused_at,), "an answer that changes nothing writes nothing"
        reference, taken = protocol.take(record, NOW)
        assert do(state, "take", "q", 1000) == taken
        assert column() == (None,), "the write cleared it"
        assert state.read("q").record == reference
        clock[0] += 10
        assert do(state, "set_paused", "q", 1000, True) is True
        assert column() == (NOW + 10,), "a pause begun notes now"
        assert state.read("q").record == reference._replace(paused=True, paused_at=NOW + 10)
        state.close()


#: v3's set_paused as it writes a row (its function's UPDATE names no paused_at_us: a resume leaves it),
#: under v3's name and signature; any other operation answers "v3"
V3_SET_PAUSED = """
    CREATE FUNCTION {function}(p_op text, p_name text, bigint, bigint, bigint, integer, bigint, bigint,
                               bigint, bigint, bigint, p_paused boolean, bigint, bigint)
    RETURNS TABLE (o_kind text, o_a numeric, o_b numeric, o_c numeric, o_now bigint, o_created boolean,
                   o_stored jsonb)
    LANGUAGE plpgsql
    AS $$
    DECLARE
        v_was boolean;
    BEGIN
        IF p_op <> 'set_paused' THEN
            o_kind := 'v3';
            RETURN NEXT;
            RETURN;
        END IF;
        SELECT paused INTO v_was FROM {table} WHERE name = p_name FOR UPDATE;
        UPDATE {table} SET paused = p_paused WHERE name = p_name AND paused <> p_paused;
        o_kind := 'set'; o_a := CASE WHEN v_was <> p_paused THEN 1 ELSE 0 END;
        RETURN NEXT;
    END
    $$
"""


@pytest.mark.parametrize("fair", [False, True], ids=["unfair", "fair"])
def test_a_row_paused_by_this_version_and_resumed_by_v3_reads_never_and_is_cleared(
    postgresql_server: Server, fair: bool
) -> None:
    """A rolling upgrade: this version pauses a row (paused_at_us noted), a v3 client resumes it (leaving
    paused_at_us), then this version reads it (not paused, paused_at NEVER), operates on it, and its
    next write clears the column; pausing again notes the new pause's start."""
    table, name, clock = "paused_at_rolling", f"q {fair}", [NOW]
    state = PostgresState(conninfo=url_of(postgresql_server), table=table, clock=lambda: clock[0])
    with psycopg.connect(url_of(postgresql_server), autocommit=True) as connection, contextlib.closing(state):
        state.reset(name)  # the table and this version's function exist
        connection.execute(f"DROP FUNCTION IF EXISTS {table}_op_v3")
        connection.execute(V3_SET_PAUSED.format(function=f"{table}_op_v3", table=table))
        terms = Terms.checked(1000, keep_us=10**6, fair=fair)
        tenant: dict[str, Any] = {"tenant": "a"} if fair else {}
        reference = protocol.new_record(1000, fair=fair)

        def stored() -> Any:
            return connection.execute(
                f"SELECT paused, paused_at_us FROM {table} WHERE name = %s", (name,)
            ).fetchone()

        def run(kind: Any, **arguments: Any) -> Any:
            nonlocal reference
            op = operation(kind, name, terms, **arguments)
            reference, expected = apply(reference, op, clock[0])
            assert state.execute(op) == expected, op
            assert state.read(name).record == reference, op
            return expected

        run("take_and_try", lead_us=10, **tenant)
        clock[0] += 100
        assert run("set_paused", paused=True) is True
        assert stored() == (True, NOW + 100)
        clock[0] += 100
        v3 = connection.execute(
            f"SELECT o_kind, o_a FROM {table}_op_v3('set_paused', %s, 1000, 1, {10**6}, 0, 0, NULL, 0, 0, 1,"
            " false, 0, 0)",
            (name,),
        )
        assert v3.fetchone() == ("set", 1)
        assert stored() == (False, NOW + 100), "v3's resume leaves the pause's start behind"
        reference = reference._replace(paused=False, paused_at=NEVER)  # (protocol.set_paused's resume)
        assert state.read(name).record == reference, "read: not paused, paused_at NEVER"
        clock[0] += 100
        run("take", **tenant)
        assert stored() == (False, None), "this version's next write clears it"
        assert run("set_paused", paused=False) is False, "resumed already"
        clock[0] += 100
        assert run("set_paused", paused=True) is True
        assert stored() == (True, clock[0])
