"""Reads of a state's clock alone (MongoDB's ``hello``), which keep a waiting shard's offset bounds tight.

An operation's answer bounds the state clock's offset only as tightly as the
time between the state reading its clock and the answer coming back; on
MongoDB that includes the operation's work, and the clock has whole
milliseconds. A shard on a state that :attr:`~ratequeue.state.StateBase.reads_clock`
reads it while it sleeps toward a slot, when its bounds are loose: its starts
are then converted within about a millisecond, and the doubt each start moves
the next by (docs/design.md, "Doubt") is as small. Lateness is then checked on
MongoDB too (G7).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import pytest

from ratequeue import Limiter, aio
from ratequeue.core.clock import DRIFT, OffsetEstimator
from ratequeue.core.flow import Flow, Sleep
from ratequeue.core.operation import Operation, Terms
from ratequeue.core.protocol import US, Wait
from ratequeue.core.shard import DEFAULT_MAX_LATE, DOUBT_FREE, Shard, SleepUntil
from ratequeue.errors import StateUnavailable
from ratequeue.running import runner_of
from ratequeue.state import ThreadedState
from ratequeue.state.memory import MemoryState
from ratequeue.state.mongodb import AsyncMongoState, MongoState

from .servers import Server

#: the state's clock, this far (s) behind this host's, in the pure shard tests
BEHIND = 10.0
#: MongoDB's grain
MS = 0.001
#: the limiters' interval in the tests on a server: long beside secantusdb's answers, which take
#: 50 ms and more late in a test session (a shard reads the clock only with a round-trip to spare)
INTERVAL = 1.0


def _waiting_shard(*, answer_delay: float, doubting: bool = True) -> tuple[Shard, Any, float, SleepUntil]:
    """A shard on a millisecond clock whose first ticket waits half a second; each answer comes
    ``answer_delay`` after the state read its clock (at the call's arrival). Returns the shard, the
    place, the local time, and the sleep it was told to take."""
    shard = Shard(
        "q",
        Terms.checked(100_000, 1),
        estimator=OffsetEstimator(resolution=MS),
        lead=0.005,
        doubting=doubting,
        margin=0.0,  # (the doubt alone)
    )
    place = shard.add()
    now = 100.0
    step = shard.step(place, now)
    assert isinstance(step, Operation)
    assert step.kind == "take_and_try"
    state_now = round((now - BEHIND) * US) // 1000 * 1000  # (whole milliseconds)
    shard.receive(place, Wait(ticket=1, slot=state_now + 500_000, now=state_now), now, now + answer_delay)
    now += answer_delay
    sleep = shard.step(place, now)
    assert isinstance(sleep, SleepUntil)
    return shard, place, now, sleep


def _doubt_of_next_call(shard: Shard, place: Any, at: float) -> int:
    """The doubt (us) the shard's next call carries, made at ``at`` (past its sleep)."""
    step = shard.step(place, at)
    assert isinstance(step, Operation), step
    return step.doubt_us


def _read_clock(shard: Shard, now: float, rtt: float) -> float:
    """The shard reads the state's clock: sent at ``now``, read halfway, answered ``rtt`` later."""
    state_now = round((now + rtt / 2 - BEHIND) * US) // 1000 * 1000
    shard.clock_read(now, now + rtt, state_now)
    return now + rtt


def test_a_clock_read_narrows_the_doubt_a_start_moves_the_next_by() -> None:
    """Answers 10 ms late bound the offset within ~11 ms, and each start would move the next by
    that much (halving the rate at 20 ms); one quick read of the clock bounds it within its grain."""
    loose, loose_place, now, sleep = _waiting_shard(answer_delay=0.010)
    read, read_place, _, _ = _waiting_shard(answer_delay=0.010)
    assert loose.wants_clock(now, sleep.until)
    assert read.wants_clock(now, sleep.until)
    _read_clock(read, now, rtt=0.0002)
    assert not read.wants_clock(now + 0.05, sleep.until)  # as tight as a read makes it: no more reads
    at = sleep.until
    without = _doubt_of_next_call(loose, loose_place, at)
    with_read = _doubt_of_next_call(read, read_place, at)
    # without: the answer's delay plus the grain, less DOUBT_FREE (and the bounds' drift since)
    assert without >= round((0.010 + MS - DOUBT_FREE) * US)
    # with: the grain plus the read's round-trip, less DOUBT_FREE, and the drift since
    assert with_read <= round((MS + 0.0002 - DOUBT_FREE + 2 * DRIFT * (at - 100.0)) * US) + 1
    assert with_read < without / 7


def test_a_clock_read_is_wanted_only_when_it_can_help_and_has_time() -> None:
    """No read while the bounds are as tight as the grain allows, when the sleep is shorter than a
    round-trip and a few ms, within ``_CLOCK_READ_EVERY`` of the last (even a failed one), nor on a
    shard that does not doubt (no lateness checked, or an offset read directly)."""
    tight, _, now, sleep = _waiting_shard(answer_delay=0.0001)
    assert not tight.wants_clock(now, sleep.until)
    shard, _, now, sleep = _waiting_shard(answer_delay=0.010)
    assert shard.wants_clock(now, sleep.until)
    assert not shard.wants_clock(now, now + 0.010)  # a round-trip (10 ms) and 4 ms do not fit
    shard.clock_read(now, now + 0.001, None)  # a failed read
    assert not shard.wants_clock(now + 0.001, sleep.until)
    assert shard.wants_clock(now + 0.1, sleep.until)  # ... and, later, another try
    undoubting, _, now, sleep = _waiting_shard(answer_delay=0.010, doubting=False)
    assert not undoubting.wants_clock(now, sleep.until)


class _CountedMongoState(MongoState):
    """A MongoDB state that counts its clock reads, and fails them while ``failing``."""

    reads = 0
    failing = False

    def _read_clock_flow(self) -> Flow[int]:
        self.reads += 1
        if self.failing:
            raise StateUnavailable("the clock read failed (injected)", where="test")
        return (yield from super()._read_clock_flow())


def _why_no_read(limiter: Limiter) -> str:
    shard = runner_of(limiter).shard
    width = shard.estimator.width(time.monotonic())
    return f"no read of the clock: lead {shard.lead:.4f} s, width {width:.4f} s, round-trip {shard.rtt:.4f} s"


def _mongodb_url(server: Server) -> str:
    return f"mongodb://127.0.0.1:{server.port}/?database=ratequeue_clock_reads"


def test_mongodb_reads_its_clock_between_two_answers_of_the_same_clock(mongodb_server: Server) -> None:
    """``read_clock`` is the clock ``$$NOW`` reads (an operation's ``now``), in whole milliseconds."""
    state = MongoState.from_url(_mongodb_url(mongodb_server))
    try:
        assert state.reads_clock
        assert ThreadedState(state).reads_clock
        before = state.read("clock-reads").now
        read = state.read_clock()
        after = state.read("clock-reads").now
        assert before <= read <= after
        assert read % 1000 == 0
    finally:
        state.close()


def test_mongodb_reads_its_clock_from_asyncio(mongodb_server: Server) -> None:
    """The asyncio state reads the same clock."""

    async def main() -> tuple[int, int, int]:
        state = AsyncMongoState.from_url(_mongodb_url(mongodb_server))
        try:
            assert state.reads_clock
            before = (await state.read("clock-reads")).now
            read = await state.read_clock()
            return before, read, (await state.read("clock-reads")).now
        finally:
            await state.close()

    before, read, after = asyncio.run(main())
    assert before <= read <= after


def test_states_that_read_no_clock_say_so() -> None:
    """Elsewhere every answer already bounds the offset tightly (or the offset is read directly)."""
    assert not MemoryState(private=True).reads_clock


def test_a_limiter_on_mongodb_checks_lateness_and_reads_the_clock_while_it_waits(
    mongodb_server: Server,
) -> None:
    """MongoDB's coarse clock no longer turns G7's check off: the shard reads the clock while its
    callers wait (here 1 s apart) and begins them in order, an interval apart."""
    state = _CountedMongoState.from_url(_mongodb_url(mongodb_server))
    limiter = Limiter(state, name=f"reads-{time.monotonic_ns()}", interval=INTERVAL)
    try:
        shard = runner_of(limiter).shard
        assert shard.max_late == DEFAULT_MAX_LATE
        assert shard.doubting
        begins = []
        for _ in range(3):
            limiter.acquire(timeout=30)
            begins.append(time.monotonic())
        assert state.reads >= 1, _why_no_read(limiter)
        assert all(b - a >= INTERVAL - DEFAULT_MAX_LATE for a, b in itertools.pairwise(begins))
        # the bounds of the last window are tighter than an operation's answers alone make them
        assert shard.estimator.width(time.monotonic()) < 0.1
    finally:
        limiter.close()
        state.close()


def test_a_failed_clock_read_costs_the_caller_nothing(mongodb_server: Server) -> None:
    """A clock read that fails is not the caller's failure: its turns still come, an interval
    apart; the shard tries again only after ``_CLOCK_READ_EVERY``."""
    state = _CountedMongoState.from_url(_mongodb_url(mongodb_server))
    state.failing = True
    limiter = Limiter(state, name=f"reads-failing-{time.monotonic_ns()}", interval=INTERVAL)
    try:
        begins = []
        for _ in range(3):
            limiter.acquire(timeout=30)
            begins.append(time.monotonic())
        assert state.reads >= 1, _why_no_read(limiter)  # tried, failed, and the turns came anyway
        assert all(b - a >= INTERVAL - DEFAULT_MAX_LATE for a, b in itertools.pairwise(begins))
    finally:
        limiter.close()
        state.close()


def test_an_asyncio_limiter_on_mongodb_reads_the_clock_too(mongodb_server: Server) -> None:
    """The runner's flow is the same under asyncio: the read is awaited."""

    class Counted(AsyncMongoState):
        reads = 0

        def _read_clock_flow(self) -> Flow[int]:
            self.reads += 1
            return (yield from super()._read_clock_flow())

    async def main() -> int:
        state = Counted.from_url(_mongodb_url(mongodb_server))
        limiter = aio.Limiter(state, name=f"reads-aio-{time.monotonic_ns()}", interval=INTERVAL)
        try:
            for _ in range(3):
                await limiter.acquire(timeout=30)
            return state.reads
        finally:
            await limiter.close()
            await state.close()

    assert asyncio.run(main()) >= 1


def test_a_caller_cancelled_during_a_clock_read_leaves_no_place_held(mongodb_server: Server) -> None:
    """An asyncio caller cancelled while its shard reads the clock (a read that never answers):
    the read ends with it, the shard holds no place, and the next caller starts an interval on."""

    class Stuck(AsyncMongoState):
        stuck = True

        def _read_clock_flow(self) -> Flow[int]:
            if self.stuck:
                reading.set()
                yield Sleep(3600.0)  # the injected fault: an answer that never comes
            return (yield from super()._read_clock_flow())

    reading = asyncio.Event()

    async def main() -> None:
        state = Stuck.from_url(_mongodb_url(mongodb_server))
        limiter = aio.Limiter(state, name=f"reads-cancelled-{time.monotonic_ns()}", interval=INTERVAL)
        try:
            first = await limiter.acquire(timeout=30)
            waiting = asyncio.ensure_future(limiter.acquire(timeout=30))
            await asyncio.wait_for(reading.wait(), 30)
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            shard = runner_of(limiter).shard
            assert not shard.holding, "no started turn waits for the caller who left"
            state.stuck = False
            turn = await limiter.acquire(timeout=30)
            assert turn.start_us - first.start_us >= INTERVAL * US, "the schedule did not move back"
            assert turn.ticket > first.ticket
        finally:
            await limiter.close()
            await state.close()

    asyncio.run(main())


@pytest.mark.parametrize("width_ms", [0.5, 30.0])
def test_an_estimator_width_is_what_a_read_of_the_clock_narrows(width_ms: float) -> None:
    """(The check ``wants_clock`` relies on.) A bound read with a 0.2 ms round-trip on a 1 ms clock
    leaves the offset's bounds at most the grain and the round-trip apart, however loose before."""
    estimator = OffsetEstimator(resolution=MS)
    now = 50.0
    state_now = now - BEHIND - width_ms / 1000  # an answer width_ms late
    estimator.bound(now, state_now // MS * MS, width_ms / 1000)
    estimator.bound(now + 0.0002, (now + 0.0001 - BEHIND) // MS * MS, 0.0002)
    assert estimator.width(now + 0.0002) <= MS + 0.0002 + 1e-6
