"""MongoDB with replies lost on purpose: a re-sent ``try_start`` keeps its turn (docs/design.md, "try_start").

The states talk to the test's server through :class:`ReplyDropper`, a real
TCP proxy: armed with ``b"findAndModify"`` (which only an operation's
command carries, not the client's monitoring), it lets the next update reach
the server but swallows its reply and closes the connection. pymongo raises
``AutoReconnect``; the state retries, and the server sees the same
``try_start`` twice. Before the protocol answered a repeated try_start of
the latest start with the same grant, the second one was answered *passed*
and the turn was lost silently.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from typing import Any

import pytest
from pymongo import AsyncMongoClient, MongoClient

import ratequeue
from ratequeue import aio
from ratequeue.core.flow import Flow
from ratequeue.core.operation import Operation, Terms, operation
from ratequeue.core.protocol import NEVER, Answer, Outcome, Record, Started, Taken
from ratequeue.core.shard import Turn
from ratequeue.errors import StateCorrupted, StateUnavailable
from ratequeue.state.mongodb import AsyncMongoState, MongoBackend, MongoState
from ratequeue.state.mongodb.codec import parse_outcome, parse_taken

from ._proxy import ReplyDropper
from .ops import ado, do
from .servers import Server, free_port

#: the command name every update carries, and nothing else the clients send
UPDATE = b"findAndModify"

#: The same grant is given while the grant's interval lasts, and pymongo sends nothing to a server
#: after a network error until its monitor has checked it again, at most twice a second: a lost
#: reply is recovered about 0.5 s later. The intervals leave that room, and more.
INTERVAL = 1.5
INTERVAL_US = 1_500_000
#: no lateness check: on a loaded host a turn whose wake-ups come late three times is given
#: up for the next ticket (G7), which these tests would read as a turn lost to the reply
LATENESS = None

#: the limiters' turns: the second one's try_start loses its reply, the third follows it
TURNS = 3

_names = itertools.count()


@pytest.fixture
def proxy(mongodb_server: Server) -> Iterator[ReplyDropper]:
    with ReplyDropper(mongodb_server.port) as dropper:
        yield dropper


def proxied(proxy: ReplyDropper) -> str:
    """The proxy's URL, without pymongo's retryable writes.

    secantusdb says it is a replica set's primary, so pymongo would retry a
    write itself, once, under the same transaction number, and the server
    would answer it from its record of the first: that hides the re-sent
    operation a standalone server (or a second failure) leaves to the
    state's own retries, which the tests are about.
    """
    return f"mongodb://127.0.0.1:{proxy.port}/?directConnection=true&retryWrites=false"


def fresh_name() -> str:
    return f"lost{next(_names)}"


def test_a_try_start_whose_reply_is_lost_still_starts(proxy: ReplyDropper) -> None:
    client: MongoClient[Any] = MongoClient(proxied(proxy))
    with MongoState(client, database="lost_replies") as state:
        name = fresh_name()
        ticket = do(state, "take", name, INTERVAL_US).ticket
        proxy.drop_reply_to(UPDATE)
        outcome = do(state, "try_start", name, INTERVAL_US, ticket, 0)
        assert proxy.dropped.is_set(), "the reply was not dropped: the test proves nothing"
        assert_started_once(outcome, ticket, state.read(name).record)


def test_an_async_try_start_whose_reply_is_lost_still_starts(proxy: ReplyDropper) -> None:
    async def main() -> None:
        client: AsyncMongoClient[Any] = AsyncMongoClient(proxied(proxy))
        async with AsyncMongoState(client, database="lost_replies") as state:
            name = fresh_name()
            ticket = (await ado(state, "take", name, INTERVAL_US)).ticket
            proxy.drop_reply_to(UPDATE)
            outcome = await ado(state, "try_start", name, INTERVAL_US, ticket, 0)
            assert proxy.dropped.is_set(), "the reply was not dropped: the test proves nothing"
            assert_started_once(outcome, ticket, (await state.read(name)).record)

    asyncio.run(main())


def test_a_settle_whose_reply_is_lost_counts_once(proxy: ReplyDropper) -> None:
    """An overrun settled, its reply lost and the call re-sent: ``due`` moves by the excess once."""
    client: MongoClient[Any] = MongoClient(proxied(proxy))
    with MongoState(client, database="lost_replies") as state:
        name = fresh_name()
        started = do(state, "take_and_try", name, INTERVAL_US, 0, burst=4)
        assert isinstance(started, Started)
        before = state.read(name).record
        assert before is not None
        proxy.drop_reply_to(UPDATE)
        # the first call moved due; the one re-sent finds the ticket settled and answers no move
        assert do(state, "settle", name, INTERVAL_US, started.ticket, 1, 3, burst=4) is False
        assert proxy.dropped.is_set(), "the reply was not dropped: the test proves nothing"
        after = state.read(name).record
        assert after is not None
        assert (after.due, after.settled) == (before.due + 2 * INTERVAL_US, started.ticket)


@pytest.mark.parametrize("fair", [False, True], ids=["unfair", "fair"])
def test_a_try_take_whose_reply_is_lost_still_starts(proxy: ReplyDropper, fair: bool) -> None:
    """A try_take with its lease's token, its reply lost and the call re-sent: its start answered again.

    The second call finds the live lease its token names and changes nothing: one ticket taken.
    """
    client: MongoClient[Any] = MongoClient(proxied(proxy))
    with MongoState(client, database="lost_replies") as state:
        name = fresh_name()
        terms = Terms.checked(INTERVAL_US, max_running=2, lease_us=10 * INTERVAL_US, fair=fair)
        tenant = {"tenant": "a"} if fair else {}
        assert state.execute(operation("lift", name, terms)) is False  # the record, so the update is applied
        proxy.drop_reply_to(UPDATE)
        outcome = state.execute(operation("try_take", name, terms, lead_us=0, token=5, **tenant))
        assert proxy.dropped.is_set(), "the reply was not dropped: the test proves nothing"
        assert_started_once(outcome, 1, state.read(name).record)


def assert_started_once(outcome: Outcome, ticket: int, record: Record | None) -> None:
    """``ticket`` started, once: the answer is its start, and the record moved to it and no further."""
    assert isinstance(outcome, Started), f"the turn was lost: {outcome}"
    assert outcome.ticket == ticket
    assert record is not None
    assert (record.ticket, record.pos, record.at) == (ticket + 1, ticket, outcome.start)


class Losing(MongoBackend[Any]):
    """A MongoDB state whose first ``try_start`` loses its reply (the operation itself reaches the server).

    The flow is written once for both APIs, so one override serves the sync and the asyncio state.
    """

    proxy: ReplyDropper
    armed = False

    def _execute_flow(self, op: Operation) -> Flow[Answer]:
        if op.kind == "try_start" and not self.armed:
            self.armed = True
            self.proxy.drop_reply_to(UPDATE)
        return super()._execute_flow(op)


class LosingState(Losing, MongoState):
    """A MongoState whose first ``try_start`` loses its reply."""


class AsyncLosingState(Losing, AsyncMongoState):
    """An AsyncMongoState whose first ``try_start`` loses its reply."""


def test_a_limiter_loses_no_turn_to_a_lost_reply(proxy: ReplyDropper) -> None:
    """Three turns, one try_start's reply lost: tickets 1-3 start, each once, and no ticket is taken in vain.

    A lost turn would show as a ticket started but never returned: the
    limiter, told *passed*, takes another ticket, so its turns would skip one
    and the record would have handed out more tickets than turns.
    """
    state = LosingState(MongoClient(proxied(proxy)), database="lost_replies")
    state.proxy = proxy
    with state:
        name = fresh_name()
        limiter = ratequeue.Limiter(state, name=name, interval=INTERVAL, max_late=LATENESS)
        turns = [limiter.acquire(timeout=30) for _ in range(TURNS)]
        limiter.close()
        assert proxy.dropped.is_set(), "no reply was dropped: the test proves nothing"
        assert_no_turn_lost(turns, state.read(name).record)


def test_an_async_limiter_loses_no_turn_to_a_lost_reply(proxy: ReplyDropper) -> None:
    async def main() -> None:
        state = AsyncLosingState(AsyncMongoClient(proxied(proxy)), database="lost_replies")
        state.proxy = proxy
        async with state:
            name = fresh_name()
            limiter = aio.Limiter(state, name=name, interval=INTERVAL, max_late=LATENESS)
            turns = [await limiter.acquire(timeout=30) for _ in range(TURNS)]
            await limiter.close()
            assert proxy.dropped.is_set(), "no reply was dropped: the test proves nothing"
            assert_no_turn_lost(turns, (await state.read(name)).record)

    asyncio.run(main())


def assert_no_turn_lost(turns: list[Turn], record: Record | None) -> None:
    assert [turn.ticket for turn in turns] == list(range(1, TURNS + 1)), (
        "a ticket started but was not returned"
    )
    assert record is not None
    assert (record.ticket, record.pos, record.at) == (TURNS + 1, TURNS, turns[-1].start_us)
    for earlier, later in itertools.pairwise(turns):
        assert later.start_us - earlier.start_us >= INTERVAL_US


def test_an_unreachable_server_is_reported_without_the_password() -> None:
    port = free_port()  # nobody listens there
    url = f"mongodb://user:s3cret@127.0.0.1:{port}/?serverSelectionTimeoutMS=100&connectTimeoutMS=100"
    with MongoState.from_url(url) as state, pytest.raises(StateUnavailable, match="unreachable") as raised:
        do(state, "take", "q", INTERVAL_US)
    assert "s3cret" not in str(raised.value)
    assert "s3cret" not in repr(state)


#: a whole stored record (every field), as the state writes one
RECORD = {
    "_id": "q",
    "ticket": 3,
    "pos": 1,
    "at": 5,
    "interval": 10,
    "due": 5,
    "burst": 1,
    "paused": False,
    "max_running": 0,
    "leases": [],
    "held": NEVER,
}


@pytest.mark.parametrize(
    "answer",
    [
        None,
        "started",
        {"kind": "begun", "ticket": 2, "value": 5, "now": 5},
        {"kind": None, "ticket": 2, "value": 5, "now": 5},
        {"kind": "started", "ticket": 2, "value": 5.5, "now": 5},
        {"kind": "started", "ticket": True, "value": 5, "now": 5},
        {"kind": "wait", "ticket": 2, "value": 5},
    ],
)
def test_a_bad_answer_is_corrupted_and_names_the_record(answer: object) -> None:
    document = RECORD if answer is None else {**RECORD, "answer": answer}
    with pytest.raises(StateCorrupted, match=r"ratequeue\.queues/q") as raised:
        parse_outcome(document, "ratequeue.queues/q")
    assert raised.value.where == "ratequeue.queues/q"


def test_a_take_must_answer_taken() -> None:
    started = {**RECORD, "answer": {"kind": "started", "ticket": 2, "value": 5, "now": 5}}
    with pytest.raises(StateCorrupted, match="kind 'started'"):
        parse_taken(started, "db.c/q")
    taken = {
        **RECORD,
        "at": NEVER,
        "due": NEVER,
        "answer": {"kind": "taken", "ticket": 2, "value": 1, "now": 7},
    }
    assert parse_taken(taken, "db.c/q") == Taken(ticket=2, pos=1, at=NEVER, now=7)
