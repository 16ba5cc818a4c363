"""Rates, bursts, costs and try_acquire (issue 12), through the public API."""

from __future__ import annotations

import asyncio
import datetime
import itertools
import multiprocessing
import threading

import pytest

import ratequeue
from ratequeue import AcquireTimeout, ConfigurationError, Limiter, Queue, Rate, aio, parse_rate
from ratequeue.state.memory import MemoryState

from . import _workers
from .backends import Backend

LONG = 30.0


@pytest.mark.parametrize(
    ("written", "interval"),
    [
        ("10/second", 0.1),
        ("10/s", 0.1),
        ("10 per second", 0.1),
        ("5000/hour", 0.72),
        ("5000/h", 0.72),
        ("60/min", 1.0),
        ("100/15min", 9.0),
        ("3/2.5s", 2.5 / 3),
        ("1/day", 86400.0),
        ("4/ms", 0.00025),
        ((10, 1), 0.1),
        ((5000, datetime.timedelta(hours=1)), 0.72),
        (Rate(10, per=1), 0.1),
    ],
)
def test_rates_as_people_write_them(written: object, interval: float) -> None:
    assert parse_rate(written).interval == pytest.approx(interval)
    assert Limiter(MemoryState(private=True), name="q", rate=written).interval == pytest.approx(interval)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("written", "words"),
    [
        ("10/fortnight", "unknown unit 'fortnight'"),
        ("0/s", "whole number >= 1, got 0"),
        ("-1/s", "whole number >= 1, got -1"),
        ("1.5/s", "whole number >= 1, got 1.5"),
        ("ten/s", "cannot read rate 'ten/s'; write 'N/UNIT'"),
        ("10", "cannot read rate '10'"),
        ("", "cannot read rate ''"),
        ((0, 1), "whole number >= 1, got 0"),
        ((1, 0), "finite number of seconds > 0, got 0"),
        ((1, float("inf")), "finite number of seconds > 0"),
        ((1, "s"), "seconds or a timedelta, got str"),
        (10, "rate must be 'N/UNIT'"),
        ((1, 2, 3), "rate must be"),
    ],
)
def test_a_rate_that_cannot_be_read_names_the_accepted_forms(written: object, words: str) -> None:
    with pytest.raises(ConfigurationError, match=words.replace("(", r"\(").replace(".", r"\.")):
        parse_rate(written)
    with pytest.raises(ConfigurationError):
        Limiter(MemoryState(private=True), name="q", rate=written)  # type: ignore[arg-type]


def test_interval_or_rate_exactly_one() -> None:
    with pytest.raises(ConfigurationError, match="not both"):
        Limiter(MemoryState(private=True), name="q", interval=0.1, rate="10/s")
    with pytest.raises(ConfigurationError, match=r"give interval= .* or rate="):
        Limiter(MemoryState(private=True), name="q")


@pytest.mark.parametrize(
    ("burst", "cost", "words"),
    [
        (0, 1, "burst must be an integer >= 1, got 0"),
        (2.5, 1, "burst must be an integer >= 1"),
        (True, 1, "burst must be an integer >= 1"),
        (1, 2, r"cost must be a whole number from 1 to the burst \(1\), got 2; a cost above 1 needs burst="),
        (3, 4, r"from 1 to the burst \(3\), got 4"),
        (3, 0, "got 0"),
        (3, 1.0, "got 1.0"),
    ],
)
def test_bad_bursts_and_costs_are_refused_before_any_call(burst: object, cost: object, words: str) -> None:
    state = MemoryState(private=True)

    def acquire() -> None:
        Limiter(state, name="q", rate="10/s", burst=burst).acquire(cost=cost)  # type: ignore[arg-type]

    with pytest.raises(ConfigurationError, match=words):
        acquire()
    assert state.read("q").record is None


def test_a_burst_too_long_for_the_record_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="burst \\* interval must stay under"):
        Limiter(MemoryState(private=True), name="q", rate="1/day", burst=2**31)


def _starts_fit_the_burst(starts: list[int], interval_us: int, burst: int) -> None:
    """Every window holds at most ``burst + w / interval`` starts: k consecutive span >= (k - B) intervals."""
    starts = sorted(starts)
    for i, j in itertools.combinations(range(len(starts)), 2):
        k = j - i + 1
        assert starts[j] - starts[i] >= (k - burst) * interval_us, (i, j, starts)


def test_a_burst_comes_at_once_then_the_steady_rate() -> None:
    """Twelve threads, 50/s with a burst of 5: five start together, the rest one interval apart."""
    state = MemoryState(private=True)
    limiter = Limiter(state, name="q", rate="50/second", burst=5)
    barrier = threading.Barrier(12)
    turns: list[ratequeue.Turn] = []

    def caller() -> None:
        barrier.wait()
        turns.append(limiter.acquire(LONG))

    threads = [threading.Thread(target=caller) for _ in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    starts = sorted(turn.start_us for turn in turns)
    _starts_fit_the_burst(starts, 20_000, 5)
    assert [t.ticket for t in sorted(turns, key=lambda t: t.start_us)] == sorted(t.ticket for t in turns)
    # After the burst, the steady rate is what _starts_fit_the_burst checks (12 starts span at
    # least 7 intervals, and so on for every window). Consecutive starts are not each one interval
    # apart: a caller that wakes late has its start moved later (G7), and the next slot stays where
    # the burst's schedule puts it, so the next gap is shorter (under load, in CI).
    assert state.read("q").record.burst == 5  # type: ignore[union-attr]


def test_a_cost_moves_the_next_start_on_by_that_many_intervals() -> None:
    state = MemoryState(private=True)
    limiter = Limiter(state, name="q", interval=0.01, burst=3)
    first = limiter.acquire(cost=3)
    second = limiter.acquire()
    third = limiter.acquire(cost=2)
    # consecutive starts of total cost C span at least (C - burst) intervals (exactly that, unless a
    # late wake-up moved a start later): the whole burst was spent by the first, so the second
    # waits until one unit comes back, and the third until two more have
    assert second.start_us - first.start_us >= 10_000
    assert third.start_us - first.start_us >= 30_000
    assert state.read("q").record.ticket == 7  # type: ignore[union-attr]  # 3 + 1 + 2 units taken
    with pytest.raises(ConfigurationError, match="cost"):
        limiter.acquire(cost=4)


def test_try_acquire_never_waits_and_leaves_no_ticket_behind() -> None:
    state = MemoryState(private=True)
    limiter = Limiter(state, name="q", interval=3600, burst=2)
    assert limiter.try_acquire() is not None
    assert limiter.try_acquire() is not None  # the burst's second start
    before = state.read("q").record
    assert limiter.try_acquire() is None  # the next start is an hour away: no wait, no error
    assert limiter.status().held_ticket is None, "the try took no ticket"
    assert limiter.try_acquire() is None
    assert state.read("q").record == before, "a try without a turn changes nothing"
    with pytest.raises(AcquireTimeout):
        limiter.acquire(timeout=0)  # a caller that would wait (none left to wait here) takes one
    assert limiter.status().held_ticket == before.ticket  # type: ignore[union-attr]
    assert limiter.try_acquire() is None  # the held ticket tried: still an hour away
    after = state.read("q").record
    assert after is not None
    assert before is not None
    assert (after.pos, after.at, after.ticket) == (before.pos, before.at, before.ticket + 1)


def test_the_decorator_and_the_queue_take_a_cost() -> None:
    state = MemoryState(private=True)
    limiter = Limiter(state, name="d", interval=0.01, burst=4)
    calls: list[int] = []

    @limiter(cost=4)
    def expensive(x: int) -> int:
        calls.append(x)
        return x

    @limiter
    def cheap() -> None:
        calls.append(0)

    assert expensive(7) == 7
    cheap()
    record = state.read("d").record
    assert record is not None
    assert record.ticket == 6  # 4 units, then 1
    queue = Queue(state, name="qq", interval=0.01, burst=3)
    futures = [queue.add(lambda: 1, cost=3), queue.add(lambda: 2, cost=1)]
    assert [f.result(LONG) for f in futures] == [1, 2]
    queue.close()
    record = state.read("qq").record
    assert record is not None
    assert record.ticket == 5
    with pytest.raises(ConfigurationError, match="cost"):
        queue.add(print, cost=9)


def test_asyncio_rates_costs_and_try_acquire() -> None:
    async def main() -> None:
        state = MemoryState(private=True)
        limiter = aio.Limiter(state, name="a", rate="100/s", burst=2)
        first = await limiter.acquire(cost=2)
        assert await limiter.try_acquire() is None
        second = await limiter.acquire()
        assert second.start_us - first.start_us >= 10_000

    asyncio.run(main())


def test_limiters_pickle_with_their_burst() -> None:
    import pickle

    limiter = Limiter("memory://pickled", name="p", rate="10/s", burst=7, keep=5)
    again = pickle.loads(pickle.dumps(limiter))
    assert (again.interval, again.burst, again.keep) == (0.1, 7, 5.0)
    assert "burst=7" in repr(again)


def test_old_records_keep_working_and_a_burst_on_them_is_a_clear_error() -> None:
    """A record from before bursts reads as burst 1; asking it for another burst says how to fix that."""
    state = MemoryState(private=True)
    plain = Limiter(state, name="old", interval=0.01)
    plain.acquire()
    with pytest.raises(
        ConfigurationError, match=r"has burst 1 in this state, not 5; .*state\.reset\('old'\)"
    ):
        Limiter(state, name="old", interval=0.01, burst=5).acquire()


def test_processes_share_one_burst(shared_backend: Backend) -> None:
    """Four processes, 50/s with a burst of 5, on each backend: every window holds at most B + w/I starts."""
    name = shared_backend.fresh_name()
    context = multiprocessing.get_context("spawn")
    reports = context.Queue()
    barrier = context.Barrier(4)
    count = 8
    processes = [
        context.Process(
            target=_workers.acquire_bursts,
            args=(shared_backend.url, name, "50/second", 5, count, index, barrier, reports),
        )
        for index in range(4)
    ]
    for process in processes:
        process.start()
    starts: list[tuple[int, int]] = []
    errors: list[str] = []
    done = 0
    while done < 4:
        _, ticket, value = reports.get(timeout=120)
        if ticket is None:
            done += 1
            if value:
                errors.append(value)
        else:
            starts.append((value, ticket))
    for process in processes:
        process.join(30)
    assert not errors
    assert len(starts) == 4 * count, "nothing lost"
    starts.sort()
    assert [t for _, t in starts] == sorted(t for _, t in starts), "tickets start in order"
    _starts_fit_the_burst([s for s, _ in starts], 20_000, 5)
