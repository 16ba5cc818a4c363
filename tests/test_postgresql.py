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
from ratequeue.core.protocol import US, Started
from ratequeue.errors import ConfigurationError, StateUnavailable
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
            " WHERE n.nspname = 'rq_schema' AND p.proname = 'MixedCase_op_v2'"
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
