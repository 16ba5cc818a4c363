"""Late sends: ``Limiter.sent(turn)`` holds the queue when a call went out after ``max_late``.

``acquire()`` returns within ``max_late`` of the turn's start (G7), but a
process can be descheduled after that, before its request leaves. Told of
the send, the limiter holds the whole queue so that the next start comes an
interval (less ``max_late``, plus the margin) after the send. Here: the hold
on every backend, no call for a send in time or where begins are not
spaced, a state that fails the hold, bad input, the asyncio limiter, and two
shards of which one is descheduled (injected) before each send.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from contextlib import closing

import pytest

from ratequeue import ConfigurationError, Limiter, StateUnavailable, aio
from ratequeue.core.operation import Operation
from ratequeue.core.protocol import NEVER, Answer
from ratequeue.state import open_state

from .backends import Backend
from .test_settle import _Kinds


def test_a_late_send_holds_the_next_start_an_interval_after_it(backend: Backend) -> None:
    with closing(Limiter(backend.open(), name=backend.fresh_name(), interval=0.2)) as limiter:
        turn = limiter.acquire()
        # the send came 50 ms after the start: as if the process had been descheduled that long
        late = turn._replace(local_start=turn.local_start - 0.05)
        before = limiter.status().now
        assert limiter.sent(late) is True
        after = limiter.status()
        held, max_late = after.held_until, limiter.settings.max_late
        assert max_late is not None
        assert held is not None
        margin = limiter.settings.margin
        margin = max_late if margin is None else margin  # (the margin is max_late unless set)
        assert held >= before + 0.2 - max_late + margin - 1e-6, (
            "the hold ends an interval less max_late, plus the margin, after the send"
        )
        assert held <= after.now + 0.2, "and no later than an interval after the hold was written"
        assert limiter.acquire(timeout=10).start >= held, "no start before the hold's end"


def test_a_send_in_time_makes_no_call(backend: Backend) -> None:
    inner, name = backend.open(), backend.fresh_name()
    state = _Kinds(inner)
    with closing(Limiter(state, name=name, interval=1.0, max_late=0.5)) as limiter:
        turn = limiter.acquire()
        state.kinds.clear()
        assert limiter.sent(turn) is False
        assert state.kinds == [], "a send within max_late of its start costs no call"
        record = inner.read(name).record
        assert record is not None
        assert record.not_before == NEVER, "and holds nothing"


@pytest.mark.parametrize("options", [{"burst": 3}, {"max_late": None}], ids=["burst", "max_late=None"])
def test_no_hold_where_begins_are_not_spaced(options: dict[str, object]) -> None:
    state = _Kinds(open_state("memory://"))
    name = f"sent-unspaced-{sorted(options)}"
    with closing(Limiter(state, name=name, interval=0.5, **options)) as limiter:  # type: ignore[arg-type]
        turn = limiter.acquire()
        state.kinds.clear()
        assert limiter.sent(turn._replace(local_start=turn.local_start - 1.0)) is False
        assert state.kinds == []


class _FailingHold(_Kinds):
    """A state whose holds fail, as a state that went down would; every other call goes through."""

    def execute(self, op: Operation) -> Answer:
        if op.kind == "hold":
            raise StateUnavailable("the state is down (injected)", where="test")
        return super().execute(op)


def test_a_hold_the_state_fails_is_logged_and_moves_nothing(caplog: pytest.LogCaptureFixture) -> None:
    inner = open_state("memory://sent-down")
    with closing(Limiter(_FailingHold(inner), name="sent-down", interval=0.01)) as limiter:
        turn = limiter.acquire()
        before = inner.read("sent-down").record
        with caplog.at_level(logging.WARNING, logger="ratequeue"):
            assert limiter.sent(turn._replace(local_start=turn.local_start - 1.0)) is False
        assert "could not be held" in caplog.text
        assert "injected" in caplog.text
        assert inner.read("sent-down").record == before, "no schedule moved"
        assert limiter.acquire(timeout=5).ticket > turn.ticket, "the next caller still gets its turn"


@pytest.mark.parametrize("bad", [3, None, "turn", (1, 2, 3)])
def test_sent_takes_a_turn(bad: object) -> None:
    with (
        closing(Limiter("memory://", name="sent-bad", interval=0.01)) as limiter,
        pytest.raises(ConfigurationError, match="sent\\(\\) takes the Turn acquire"),
    ):
        limiter.sent(bad)  # type: ignore[arg-type]


def test_the_asyncio_limiter_holds_after_a_late_send() -> None:
    async def main() -> None:
        limiter = aio.Limiter("memory://", name="sent-aio", interval=0.2)
        try:
            turn = await limiter.acquire()
            assert await limiter.sent(turn._replace(local_start=turn.local_start - 0.05)) is True
            held = (await limiter.status()).held_until
            assert held is not None
            assert (await limiter.acquire(timeout=10)).start >= held
        finally:
            await limiter.close()

    asyncio.run(main())


def test_a_descheduled_sender_keeps_the_sends_an_interval_apart() -> None:
    """Two shards; one is descheduled (injected: 20 ms) between each turn and its send.

    Without ``sent()`` the other's on-time send would come 80 ms after the
    late one, for an interval of 100 ms.
    """
    interval, delay, turns = 0.1, 0.02, 3
    sends: list[float] = []
    lock = threading.Lock()
    failures: list[BaseException] = []

    def shard(descheduled: bool) -> None:
        try:
            with closing(Limiter("memory://", name="sent-two-shards", interval=interval)) as limiter:
                for _ in range(turns):
                    turn = limiter.acquire(timeout=30)
                    if descheduled:
                        time.sleep(delay)  # the fault: a process held off the CPU before its send
                    with lock:
                        sends.append(time.monotonic())
                    limiter.sent(turn)
        except BaseException as exc:  # (reported by the test)
            failures.append(exc)

    threads = [threading.Thread(target=shard, args=(d,)) for d in (True, False)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not failures, failures
    assert len(sends) == 2 * turns
    ordered = sorted(sends)
    gap = min(b - a for a, b in itertools.pairwise(ordered))
    max_late = 0.0003  # the default
    assert gap >= interval - max_late, f"sends {gap * 1000:.2f} ms apart for {interval * 1000:g} ms"
