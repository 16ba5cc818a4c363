"""A timed-out ``all_of`` moves no other limit's schedule past its deadline (issue 27, item 2).

Limit A (2 s) free, limit B (1 s) with four callers queued elsewhere:
``all_of(A, B, timeout=0.5)`` used to raise ``AcquireTimeout`` at once but
only after moving A's turn to B's slot, 4.7 s ahead, so A's next user
waited 6.7 s. Now the call reads B's record first and gives up without
taking any turn; and a turn it did take (B got busy between the read and the
take) is given up where it stands, never moved past the deadline.

The callers queued elsewhere are tickets taken on the record with the
state's own operations, as another process's shard takes them.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator

import pytest
import redis

from ratequeue import AcquireTimeout, Limiter, aio, all_of, operation
from ratequeue.running import runner_of
from ratequeue.state import State
from ratequeue.state.base import Snapshot
from ratequeue.state.memory import MemoryState
from ratequeue.state.redis import RedisState

from .servers import Server

_names = itertools.count()

#: the timeout of the all_of calls, and a bound well below it for "raised at once"
TIMEOUT = 0.5
AT_ONCE = 0.25


@pytest.fixture(params=["memory", "redis"])
def state(request: pytest.FixtureRequest) -> Iterator[State]:
    """A fresh state: memory, or Redis on a real server (a prefix of its own)."""
    if request.param == "memory":
        yield MemoryState(private=True)
        return
    server: Server = request.getfixturevalue("redis_server")
    client = redis.Redis(host="127.0.0.1", port=server.port)
    made = RedisState(client, prefix=f"all-of-deadline-{next(_names)}:")
    yield made
    made.close()


def queue_elsewhere(state: State, limiter: Limiter, callers: int) -> None:
    """Start a turn of ``limiter``'s queue and queue ``callers`` more, as other processes would."""
    terms = runner_of(limiter).settings.terms
    state.execute(operation("take_and_try", limiter.name, terms))
    for _ in range(callers):
        state.execute(operation("take", limiter.name, terms))


def test_a_timeout_leaves_a_free_limit_untouched(state: State) -> None:
    a = Limiter(state, name="A", interval=2)
    b = Limiter(state, name="B", interval=1)
    queue_elsewhere(state, b, 4)  # B's next free slot is 5 s away
    for _ in range(20):  # the loop of the issue: every call times out, none moves A
        began = time.monotonic()
        with pytest.raises(AcquireTimeout):
            all_of(a, b, timeout=TIMEOUT)
        assert time.monotonic() - began < AT_ONCE, "given up at once, not after the timeout"
    assert state.read("A").record is None, "no turn of A was taken"
    # max_late=None: a late wake-up under load would give the free turn up and the try would fail
    other_user = Limiter(state, name="A", interval=2, max_late=None)
    assert other_user.try_acquire() is not None, "A's next user starts at once"


def test_a_timeout_on_the_scarcest_limit_takes_no_turn_of_the_other(state: State) -> None:
    a = Limiter(state, name="A", interval=2)
    b = Limiter(state, name="B", interval=1)
    queue_elsewhere(state, a, 2)  # the first limit waited for (the scarcest) is 6 s away
    began = time.monotonic()
    with pytest.raises(AcquireTimeout):
        all_of(a, b, timeout=TIMEOUT)
    assert time.monotonic() - began < AT_ONCE, "given up at once, not after the timeout"
    assert state.read("B").record is None, "no turn of B was taken"


def test_asyncio_a_timeout_leaves_a_free_limit_untouched() -> None:
    async def main() -> None:
        state = MemoryState(private=True)
        a = aio.Limiter(state, name="A", interval=2)
        b = aio.Limiter(state, name="B", interval=1)
        terms = runner_of(b).settings.terms
        state.execute(operation("take_and_try", "B", terms))
        for _ in range(4):
            state.execute(operation("take", "B", terms))
        began = time.monotonic()
        with pytest.raises(AcquireTimeout):
            await aio.all_of(a, b, timeout=TIMEOUT)
        assert time.monotonic() - began < AT_ONCE
        assert state.read("A").record is None
        # max_late=None: a late wake-up under load would give the free turn up and the try would fail
        assert await aio.Limiter(state, name="A", interval=2, max_late=None).try_acquire() is not None

    asyncio.run(main())


class BusyAfterRead(MemoryState):
    """A real memory state on which other callers queue on ``name`` right after its first read.

    The race the read-ahead cannot see: the limit looked free when read, and
    is busy by the time its turn is asked for.
    """

    def __init__(self, name: str, callers: int) -> None:
        super().__init__(private=True)
        self.busy_name, self.callers = name, callers
        self.limiter: Limiter | None = None

    def read(self, name: str) -> Snapshot:
        snapshot = super().read(name)
        if name == self.busy_name and self.limiter is not None:
            limiter, self.limiter = self.limiter, None
            queue_elsewhere(self, limiter, self.callers)
        return snapshot


def test_turns_taken_are_given_up_where_they_stand_never_moved_past_the_deadline() -> None:
    state = BusyAfterRead("B", 4)
    a = Limiter(state, name="A", interval=2)
    b = Limiter(state, name="B", interval=1)
    state.limiter = Limiter(state, name="B", interval=1)  # the callers elsewhere
    began = time.monotonic()
    with pytest.raises(AcquireTimeout):
        all_of(a, b, timeout=TIMEOUT)
    assert time.monotonic() - began < AT_ONCE, "given up at once, not after the timeout"
    assert state.limiter is None, "B was read first, and got busy before its turn was asked for"
    record, now = state.read("A")
    assert record is not None
    assert record.pos == 1, "A's turn was taken (B looked free)"
    # it was given up where it stood: A's latest start is not moved to B's slot, 5 s ahead
    assert record.at <= now + round(TIMEOUT * 1_000_000), (record.at - now) / 1e6
