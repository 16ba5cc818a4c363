"""PostgreSQL's freed places, by LISTEN/NOTIFY: a release in one process wakes a waiter in another at once.

As ``test_wakeups.py`` does for Redis and the file state, on a real server:
the function NOTIFYs (``function.sql``) and a state made from a URL LISTENs
on one connection of its own while some shard waits for a place
(``postgresql/freed.py``). Whether a channel is listened to is read from
``pg_stat_activity``: the listening connection's last statement is its
``LISTEN`` (or ``UNLISTEN``), and the connection is gone once nothing is
watched.
"""

from __future__ import annotations

import threading
import time

import psycopg
import pytest

from ratequeue import Limiter
from ratequeue.core.protocol import FULL_RECHECK_US, US, Started, Wait
from ratequeue.state.postgresql import AsyncPostgresState, PostgresState
from ratequeue.state.postgresql.freed import LINGER, channel_of

from . import servers
from .ops import do
from .test_wakeups import (
    PROMPT,
    WAIT,
    Counting,
    _found_full,
    _until,
    asyncio_wake_up,
    cross_process_delays,
)

#: the table of these tests' queues, and its name as the function quotes it (in the channel's md5)
TABLE = "wakeups"
QUOTED = f'"{TABLE}"'


@pytest.fixture
def url(postgresql_server: servers.Server) -> str:
    return f"postgresql://postgres@127.0.0.1:{postgresql_server.port}/postgres?table={TABLE}"


def _activity(url: str, query: str, *args: object) -> int:
    with psycopg.connect(url.partition("?")[0], autocommit=True) as connection:
        row = connection.execute(query, args).fetchone()
        assert row is not None
        return int(row[0])


def _listening(url: str, name: str) -> int:
    """How many connections last said ``LISTEN`` on the channel of queue ``name`` (and are idle)."""
    query = "SELECT count(*) FROM pg_stat_activity WHERE state = 'idle' AND query = %s"
    return _activity(url, query, f'LISTEN "{channel_of(QUOTED, name)}"')


def _unlistened(url: str, name: str) -> int:
    query = "SELECT count(*) FROM pg_stat_activity WHERE state = 'idle' AND query = %s"
    return _activity(url, query, f'UNLISTEN "{channel_of(QUOTED, name)}"')


def _connections(url: str, name: str) -> int:
    """How many connections last spoke of the channel of queue ``name`` (LISTEN or UNLISTEN)."""
    query = (
        "SELECT count(*) FROM pg_stat_activity WHERE position(%s in query) > 0 AND pid <> pg_backend_pid()"
    )
    return _activity(url, query, channel_of(QUOTED, name))


def test_the_channel_is_the_one_the_function_notifies(url: str) -> None:
    """Python's channel and the function's ``pg_notify`` agree, names beyond ASCII included."""
    name = f"chan-é-{time.monotonic_ns()}"
    state = PostgresState.from_url(url)
    assert len(channel_of(QUOTED, name)) <= 63
    assert channel_of(QUOTED, name) != channel_of('"other"', name)
    with psycopg.connect(url.partition("?")[0], autocommit=True) as listener:
        listener.execute(f'LISTEN "{channel_of(QUOTED, name)}"')
        terms = {"max_running": 1, "lease_us": 10 * US}
        first = do(state, "take_and_try", name, 1000, 10_000, token=1, **terms)
        assert isinstance(first, Started)
        assert isinstance(do(state, "take_and_try", name, 1000, 10_000, token=2, **terms), Wait)
        assert do(state, "release", name, 1000, first.ticket, token=1, **terms) is True
        heard = [notify.channel for notify in listener.notifies(timeout=WAIT, stop_after=1)]
    assert heard == [channel_of(QUOTED, name)]
    state.close()


def test_a_release_wakes_a_waiter_in_another_process_at_once(url: str) -> None:
    delays = cross_process_delays(url, lambda name: _listening(url, name) >= 1)
    # each woken by the release (a recheck would come some 100 ms after it was told to wait)
    assert max(delays) < PROMPT, delays
    assert PROMPT < FULL_RECHECK_US / US


def test_an_idle_shard_makes_no_call_and_holds_no_listen_connection(url: str) -> None:
    """A shard that never waited watches nothing; one that waited closes its LISTEN connection once idle."""
    name = f"idle-{time.monotonic_ns()}"
    inner = PostgresState.from_url(url)
    state = Counting(inner)
    limiter = Limiter(state, name=name, interval=0.001, max_running=1)
    for _ in range(3):
        limiter.release(limiter.acquire(timeout=WAIT))
    _until(lambda: limiter._runner.idle, "the shard's going idle")
    calls = state.calls
    time.sleep(3 * FULL_RECHECK_US / US)  # (time for a recheck or a renewal, were any made)
    assert state.calls == calls
    assert state.watches == 0  # it never waited for a place: nothing watched, nothing connected
    assert inner._freed is None

    holder = Limiter(url, name=name, interval=0.001, max_running=1)
    turn = holder.acquire(timeout=WAIT)
    acquired = threading.Thread(target=lambda: limiter.release(limiter.acquire(timeout=WAIT)))
    acquired.start()
    _until(lambda: _listening(url, name) == 1, "the LISTEN of the waiting shard")
    assert holder.release(turn)
    acquired.join(WAIT)
    _until(lambda: limiter._runner.idle, "the shard's going idle")
    _until(lambda: _connections(url, name) == 0, "closing the LISTEN connection", within=LINGER + WAIT)
    calls = state.calls
    time.sleep(3 * FULL_RECHECK_US / US)
    assert state.calls == calls
    holder.close()
    limiter.close()
    inner.close()


def test_a_watch_hears_a_release_and_its_unwatch_unlistens(url: str) -> None:
    """A watch hears a freeing release (not another's); its unwatch UNLISTENs, the last closes it."""
    name, another = f"watch-{time.monotonic_ns()}", f"another-{time.monotonic_ns()}"
    state = PostgresState.from_url(url)
    holder = Limiter(url, name=name, interval=0.001, max_running=1)
    waiting = Limiter(url, name=name, interval=0.001, max_running=1)
    turn = holder.acquire(timeout=WAIT)
    _found_full(waiting, state)  # a release notifies from now on
    waiting.close()  # (with its state: it stops listening)
    heard, elsewhere = threading.Event(), threading.Event()
    unwatch = state.watch(name, heard.set)
    assert unwatch is not None
    _until(lambda: _listening(url, name) == 1, "the LISTEN")
    other = state.watch(another, elsewhere.set)
    assert other is not None
    _until(lambda: _listening(url, another) == 1, "the other LISTEN")
    assert holder.release(turn)
    assert heard.wait(WAIT)
    assert not elsewhere.is_set()
    unwatch()
    _until(lambda: _unlistened(url, name) == 1, "the UNLISTEN", within=LINGER + WAIT)
    other()
    _until(lambda: _connections(url, another) == 0, "closing the LISTEN connection", within=LINGER + WAIT)
    holder.close()
    state.close()


def test_a_start_that_leaves_a_place_free_wakes_the_next_ticket(url: str) -> None:
    """The grace holds every ticket but the next back: a start leaving a place free notifies too."""
    name = f"next-{time.monotonic_ns()}"
    state = PostgresState.from_url(url)
    terms = {"max_running": 2, "lease_us": 10 * US}
    first = do(state, "take_and_try", name, 1000, 10_000, token=1, **terms)
    second = do(state, "take_and_try", name, 1000, 10_000, token=2, **terms)
    assert isinstance(first, Started)
    assert isinstance(second, Started)
    third = do(state, "take_and_try", name, 1000, 10_000, token=3, **terms)
    assert isinstance(third, Wait)  # full: found so (held)
    heard = threading.Event()
    unwatch = state.watch(name, heard.set)
    assert unwatch is not None
    _until(lambda: _listening(url, name) == 1, "the LISTEN")
    for ticket, token in ((first.ticket, 1), (second.ticket, 2)):
        assert do(state, "release", name, 1000, ticket, token=token, **terms) is True
        assert heard.wait(WAIT)
        heard.clear()
    started = do(state, "try_start", name, 1000, third.ticket, 10_000, token=3, **terms)
    assert isinstance(started, Started)  # one place of two taken: the next ticket may take the other
    assert heard.wait(5.0)
    unwatch()
    state.close()


def test_an_asyncio_waiter_is_woken_by_a_release_in_another_process(url: str) -> None:
    """The asyncio PostgreSQL state listens in a thread too; the driver hands the wake-up to the loop."""
    assert asyncio_wake_up(url, AsyncPostgresState, lambda name: _listening(url, name) == 1) < PROMPT


def test_a_state_on_a_ready_connection_cannot_watch(url: str) -> None:
    """Given a connection (or a pool), the state opens none of its own: its waiters recheck."""
    with psycopg.connect(url.partition("?")[0], autocommit=True) as connection:
        state = PostgresState(connection, table=TABLE)
        assert state.watch("any", lambda: None) is None
        state.close()
