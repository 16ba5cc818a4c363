"""The PostgreSQL state's own edges: URL options, identifiers, ready connections, errors, the clock.

The protocol itself is held to the reference by the contract suite (``backend``
in conftest includes ``postgresql``); this covers what only this backend has.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

import psycopg
import pytest

import ratequeue
from ratequeue import aio
from ratequeue.core import protocol
from ratequeue.core.protocol import MAX_DOUBT_US, MAX_SLOW, MAX_US, NEVER, US, Record, Started
from ratequeue.errors import ConfigurationError, StateCorrupted, StateUnavailable
from ratequeue.state import open_state, postgresql
from ratequeue.state.postgresql import AsyncPostgresState, PostgresState, split_url

from .ops import ado, do
from .servers import Server

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
            " WHERE n.nspname = 'rq_schema' AND p.proname = 'MixedCase_op_v3'"
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
        "settled": record.settled, **columns,
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
        assert versions.fetchall() == [(f"{table}_op_v2", 13), (f"{table}_op_v3", 14)]
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
