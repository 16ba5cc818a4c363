"""Redis with replies lost on purpose: a re-sent ``try_start`` keeps its turn (docs/design.md, "try_start").

The states talk to the test's redis-server through :class:`ReplyDropper`, a
real TCP proxy: armed with the bytes of one operation's name as the script
call carries it (an ARGV of ``EVALSHA``), it lets the next such call reach
the server but swallows its reply and closes the connection. The lean call
path sees the connection fail, reconnects and sends the call again, so the
server runs the same operation twice. Before the protocol answered a
repeated try_start of the latest start with the same grant, the second run
answered *passed* and the turn was lost silently.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator

import pytest
import redis
import redis.asyncio

import ratequeue
from ratequeue import aio
from ratequeue.core.protocol import Outcome, Record, Started, Wait
from ratequeue.core.shard import Turn
from ratequeue.state.redis import AsyncRedisState, RedisState

from ._proxy import ReplyDropper
from .ops import ado, do
from .servers import Server

#: what only a try_start call sends: its operation name, a bulk string of the EVALSHA
#: (the script's own text holds the name too, but never in this form)
TRY_START = b"$9\r\ntry_start\r\n"
#: what only a take_and_try call sends
TAKE_AND_TRY = b"$12\r\ntake_and_try\r\n"
#: what only a settle call sends
SETTLE = b"$6\r\nsettle\r\n"

#: the limiters' interval: long enough that a turn after the first waits for its slot and then
#: calls try_start (the lead, about one round-trip, is far shorter), short enough for a quick test
INTERVAL = 0.2
INTERVAL_US = 200_000
#: no lateness check: on a loaded host a turn whose wake-ups come late three times is given
#: up for the next ticket (G7), which these tests would read as a turn lost to the reply
LATENESS = None

#: the limiters' turns: the second one's try_start loses its reply, the third follows it
TURNS = 3

_names = itertools.count()


@pytest.fixture
def proxy(redis_server: Server) -> Iterator[ReplyDropper]:
    with ReplyDropper(redis_server.port) as dropper:
        yield dropper


def fresh_name() -> str:
    return f"lost{next(_names)}"


def sync_state(proxy: ReplyDropper) -> RedisState:
    """A state on the lean call path, through the proxy."""
    state = RedisState(redis.Redis(host="127.0.0.1", port=proxy.port), prefix="lost:")
    assert state._lean is not None
    return state


def async_state(proxy: ReplyDropper) -> AsyncRedisState:
    state = AsyncRedisState(redis.asyncio.Redis(host="127.0.0.1", port=proxy.port), prefix="lost:")
    assert state._lean is not None
    return state


def test_a_try_start_whose_reply_is_lost_still_starts(proxy: ReplyDropper) -> None:
    with sync_state(proxy) as state:
        name = fresh_name()
        ticket = do(state, "take", name, INTERVAL_US).ticket
        proxy.drop_reply_to(TRY_START)
        outcome = do(state, "try_start", name, INTERVAL_US, ticket, 0)
        assert proxy.dropped.is_set(), "the reply was not dropped: the test proves nothing"
        assert_started_once(outcome, ticket, state.read(name).record)


def test_an_async_try_start_whose_reply_is_lost_still_starts(proxy: ReplyDropper) -> None:
    async def main() -> None:
        async with async_state(proxy) as state:
            name = fresh_name()
            ticket = (await ado(state, "take", name, INTERVAL_US)).ticket
            proxy.drop_reply_to(TRY_START)
            outcome = await ado(state, "try_start", name, INTERVAL_US, ticket, 0)
            assert proxy.dropped.is_set(), "the reply was not dropped: the test proves nothing"
            assert_started_once(outcome, ticket, (await state.read(name)).record)

    asyncio.run(main())


def test_a_lost_try_start_reply_on_a_burst_queue_still_starts(proxy: ReplyDropper) -> None:
    """Burst 3, a ticket of cost 2 behind a started one: the re-sent try_start is the same grant."""
    with sync_state(proxy) as state:
        name = fresh_name()
        first = do(state, "take_and_try", name, INTERVAL_US, 0, burst=3, keep_us=INTERVAL_US)
        assert isinstance(first, Started)
        ticket = do(state, "take", name, INTERVAL_US, burst=3, cost=2, keep_us=INTERVAL_US).ticket
        proxy.drop_reply_to(TRY_START)
        outcome = do(state, "try_start", name, INTERVAL_US, ticket, 0, burst=3, cost=2, keep_us=INTERVAL_US)
        assert proxy.dropped.is_set(), "the reply was not dropped: the test proves nothing"
        record = state.read(name).record
        assert isinstance(outcome, Started), f"the turn was lost: {outcome}"
        assert record is not None
        assert (record.ticket, record.pos, record.at) == (ticket + 2, ticket, outcome.start)
        assert record.due == first.start + INTERVAL_US, "its strict slot, one interval after the first"
        assert record.at < record.due, "it started early, from the burst"


def test_a_lost_settle_reply_counts_once(proxy: ReplyDropper) -> None:
    """A re-sent settle finds its ticket settled: the overrun moves due once, and the answer is False."""
    with sync_state(proxy) as state:
        name = fresh_name()
        first = do(state, "take_and_try", name, INTERVAL_US, 0, burst=3)
        assert isinstance(first, Started)
        before = state.read(name).record
        assert before is not None
        proxy.drop_reply_to(SETTLE)
        assert do(state, "settle", name, INTERVAL_US, first.ticket, 1, 3, burst=3) is False
        assert proxy.dropped.is_set(), "the reply was not dropped: the test proves nothing"
        record = state.read(name).record
        assert record is not None
        assert record == before._replace(due=before.due + 2 * INTERVAL_US, settled=first.ticket)


def assert_started_once(outcome: Outcome, ticket: int, record: Record | None) -> None:
    """``ticket`` started, once: the answer is its start, and the record moved to it and no further."""
    assert isinstance(outcome, Started), f"the turn was lost: {outcome}"
    assert outcome.ticket == ticket
    assert record is not None
    assert (record.ticket, record.pos, record.at) == (ticket + 1, ticket, outcome.start)


def test_a_lost_take_and_try_reply_costs_one_ticket_at_most(proxy: ReplyDropper) -> None:
    """A re-sent take_and_try takes a second ticket: the first, started unseen, is leaked (one interval).

    docs/design.md allows this much: a ticket has no owner the server could
    recognise. The call still answers, for the second ticket, which waits
    one interval behind the leaked start.
    """
    with sync_state(proxy) as state:
        name = fresh_name()
        proxy.drop_reply_to(TAKE_AND_TRY)
        outcome = do(state, "take_and_try", name, INTERVAL_US, 0)
        assert proxy.dropped.is_set(), "the reply was not dropped: the test proves nothing"
        record = state.read(name).record
        assert record is not None
        assert isinstance(outcome, Wait), "ticket 1 started unseen: ticket 2 waits for its slot"
        assert (outcome.ticket, record.ticket, record.pos) == (2, 3, 1)
        assert outcome.slot == record.at + INTERVAL_US


def test_a_limiter_loses_no_turn_to_a_lost_reply(proxy: ReplyDropper) -> None:
    """Three turns, one try_start's reply lost: tickets 1-3 start, each once, and no ticket is taken in vain.

    A lost turn would show as a ticket started but never returned: the
    limiter, told *passed*, takes another ticket, so its turns would skip one
    and the record would have handed out more tickets than turns.
    """
    with sync_state(proxy) as state:
        name = fresh_name()
        limiter = ratequeue.Limiter(state, name=name, interval=INTERVAL, max_late=LATENESS)
        proxy.drop_reply_to(TRY_START)  # the second turn's try_start (the first one needs none)
        turns = [limiter.acquire(timeout=30) for _ in range(TURNS)]
        limiter.close()
        assert proxy.dropped.is_set(), "no reply was dropped: the test proves nothing"
        assert_no_turn_lost(turns, state.read(name).record)


def test_an_async_limiter_loses_no_turn_to_a_lost_reply(proxy: ReplyDropper) -> None:
    async def main() -> None:
        async with async_state(proxy) as state:
            name = fresh_name()
            limiter = aio.Limiter(state, name=name, interval=INTERVAL, max_late=LATENESS)
            proxy.drop_reply_to(TRY_START)
            turns = [await limiter.acquire(timeout=30) for _ in range(TURNS)]
            await limiter.close()
            assert proxy.dropped.is_set(), "no reply was dropped: the test proves nothing"
            assert_no_turn_lost(turns, (await state.read(name)).record)

    asyncio.run(main())


def test_a_limiter_whose_take_and_try_reply_is_lost_leaks_one_ticket(proxy: ReplyDropper) -> None:
    """A lost take_and_try reply: the limiter still gets its turns, one interval apart; one ticket leaks.

    The leaked ticket started unseen, so the next turn comes one interval
    after it: a slot lost, as docs/design.md allows for a re-sent take.
    """
    with sync_state(proxy) as state:
        name = fresh_name()
        limiter = ratequeue.Limiter(state, name=name, interval=INTERVAL, max_late=LATENESS)
        proxy.drop_reply_to(TAKE_AND_TRY)  # the first turn's
        turns = [limiter.acquire(timeout=30) for _ in range(TURNS)]
        limiter.close()
        assert proxy.dropped.is_set(), "no reply was dropped: the test proves nothing"
        record = state.read(name).record
        assert [turn.ticket for turn in turns] == list(range(2, TURNS + 2)), "ticket 1 leaked, no other"
        assert record is not None
        assert (record.ticket, record.pos, record.at) == (TURNS + 2, TURNS + 1, turns[-1].start_us)
        for earlier, later in itertools.pairwise(turns):
            assert later.start_us - earlier.start_us >= INTERVAL_US


def assert_no_turn_lost(turns: list[Turn], record: Record | None) -> None:
    """Every ticket handed out was returned as a turn, in order, one interval apart."""
    assert [turn.ticket for turn in turns] == list(range(1, TURNS + 1)), (
        "a ticket started but was not returned"
    )
    assert record is not None
    assert (record.ticket, record.pos, record.at) == (TURNS + 1, TURNS, turns[-1].start_us)
    for earlier, later in itertools.pairwise(turns):
        assert later.start_us - earlier.start_us >= INTERVAL_US


def test_a_lost_take_and_try_reply_on_a_capped_queue_holds_no_place(proxy: ReplyDropper) -> None:
    """With ``max_running``, the re-sent take_and_try names its token: it gets the start it made.

    Before lease tokens (issue 27) the re-sent call found the queue full --
    the first call had started ticket 1 with a lease nobody held -- and the
    caller waited for that orphan lease to expire (5.28 s with a 5 s lease).
    """
    with sync_state(proxy) as state:
        name = fresh_name()
        capped = {"max_running": 1, "lease_us": 5 * 10**6}
        proxy.drop_reply_to(TAKE_AND_TRY)
        outcome = do(state, "take_and_try", name, INTERVAL_US, 0, token=77, **capped)
        assert proxy.dropped.is_set(), "the reply was not dropped: the test proves nothing"
        record = state.read(name).record
        assert isinstance(outcome, Started), f"the first call's start was not answered again: {outcome}"
        assert outcome.ticket == 1
        assert record is not None
        assert (record.ticket, record.pos) == (2, 1), "one ticket taken, not two"
        assert [lease[::2] for lease in record.leases] == [(1, 77)], "one place held, by the caller"


@pytest.mark.parametrize("turns", [4])
def test_a_capped_limiter_never_waits_for_the_lease_of_its_own_lost_reply(
    proxy: ReplyDropper, turns: int
) -> None:
    """``max_running=1, lease=5``: each acquire whose take_and_try reply is lost still returns at once.

    The issue's run (``socket_timeout=0.05`` and ``DEBUG SLEEP 0.3``): 5.28 s
    per acquire, 4 times of 4. Here a proxy loses the reply; every acquire
    returns well within one lease, and each job's release frees the place.
    """
    with sync_state(proxy) as state:
        limiter = ratequeue.Limiter(
            state, name=fresh_name(), interval=0.01, max_running=1, lease=5, max_late=LATENESS
        )
        took = []
        for _ in range(turns):
            proxy.drop_reply_to(TAKE_AND_TRY)
            began = time.monotonic()
            turn = limiter.acquire(timeout=30)
            took.append(time.monotonic() - began)
            assert proxy.dropped.is_set(), "no reply was dropped: the test proves nothing"
            assert limiter.release(turn) is True, "the turn holds the place the lost call took"
        limiter.close()
        assert max(took) < 2.5, f"an acquire waited for an orphan lease: {took}"
