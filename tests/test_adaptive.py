"""The adaptive rate: a refusal slows the whole queue, which recovers by itself, never below its interval.

G1 under slow-downs (starts at least an interval apart, in ticket order) is
checked under random operation sequences in ``test_protocol.py`` and on
every backend by the contract suite, which generate ``slow`` steps; here:
the rule of the effective interval, the API on every backend, ``adaptive``
in ``heed`` and bad input.
"""

from __future__ import annotations

import math
from contextlib import closing
from typing import Any

import pytest

from ratequeue import ConfigurationError, Limiter
from ratequeue.core import protocol
from ratequeue.core.protocol import MAX_SLOW, RECOVER_US, US

from .backends import Backend
from .ops import do

INTERVAL = 10_000  # 10 ms


def test_a_slow_down_doubles_is_capped_and_recovers_by_halving_its_excess() -> None:
    record = protocol.new_record(INTERVAL)
    record, slowed = protocol.slow(record, 0, 0)
    assert slowed
    assert protocol.effective_interval(record, 0) == 2 * INTERVAL
    for _ in range(10):
        record, _ = protocol.slow(record, 0, 0)
    assert protocol.effective_interval(record, 0) == MAX_SLOW * INTERVAL, "at most MAX_SLOW intervals"
    excess = (MAX_SLOW - 1) * INTERVAL
    assert protocol.effective_interval(record, RECOVER_US - 1) == INTERVAL + excess
    assert protocol.effective_interval(record, RECOVER_US) == INTERVAL + excess // 2
    assert protocol.effective_interval(record, 3 * RECOVER_US) == INTERVAL + excess // 8
    assert protocol.effective_interval(record, 60 * RECOVER_US) == INTERVAL, "never below the interval"


def test_a_slower_pace_asked_is_kept_and_a_faster_one_changes_nothing() -> None:
    record, slowed = protocol.slow(protocol.new_record(INTERVAL), 5 * INTERVAL, 0)
    assert slowed
    assert protocol.effective_interval(record, 0) == 5 * INTERVAL
    same, slowed = protocol.slow(record, 3 * INTERVAL, 0)
    assert not slowed
    assert same is record


def test_slowed_starts_come_at_the_effective_interval() -> None:
    record, _ = protocol.take_and_try(protocol.new_record(INTERVAL), 0, 0)
    record, _ = protocol.slow(record, 4 * INTERVAL, 0)
    record, outcome = protocol.take_and_try(record, 0, INTERVAL)
    assert outcome == protocol.Wait(2, 4 * INTERVAL, INTERVAL), "the next slot is a slowed interval on"
    record, outcome = protocol.try_start(record, 2, 0, 4 * INTERVAL)
    assert outcome == protocol.Started(2, 4 * INTERVAL, 4 * INTERVAL)


def test_slow_down_slows_every_start_of_the_queue(backend: Backend) -> None:
    with closing(Limiter(backend.open(), name=backend.fresh_name(), interval=0.01)) as limiter:
        first = limiter.acquire()
        assert limiter.slow_down() is True
        status = limiter.status()
        assert status.effective_interval is not None
        assert status.effective_interval == pytest.approx(0.02)
        second = limiter.acquire(timeout=10)
        assert second.start_us - first.start_us >= 20_000, "two intervals apart on the state's clock"
        assert limiter.slow_down(0.005) is False, "faster than now: nothing changes"
        assert limiter.slow_down(0.1) is True
        assert limiter.status().effective_interval == pytest.approx(0.1, abs=0.001)


def test_an_adaptive_limiter_slows_on_a_refusal_and_a_plain_one_does_not(backend: Backend) -> None:
    for adaptive, expected in ((True, 0.02), (False, 0.01)):
        with closing(
            Limiter(backend.open(), name=backend.fresh_name(), interval=0.01, adaptive=adaptive)
        ) as limiter:
            limiter.acquire()
            limiter.heed({"Retry-After": "0"}, status=429)
            assert limiter.status().effective_interval == pytest.approx(expected)


def test_an_adaptive_limiter_slows_to_a_stated_slower_quota() -> None:
    with closing(Limiter("memory://", name="quota-policy", interval=0.01, adaptive=True)) as limiter:
        limiter.acquire()
        limiter.heed({"RateLimit-Policy": '"p";q=50;w=1', "RateLimit": '"p";r=40;t=1'}, status=200)
        assert limiter.status().effective_interval == pytest.approx(0.02), "50 a second: 20 ms apart"


@pytest.mark.parametrize("bad", [0, -1, math.nan, math.inf, 3601, "1", True])
def test_a_bad_slow_down_is_refused_at_the_call(bad: Any) -> None:
    with closing(Limiter("memory://", name="bad-slow", interval=0.01)) as limiter:
        limiter.acquire()
        with pytest.raises(ConfigurationError, match="slow-down"):
            limiter.slow_down(bad)
        assert limiter.status().effective_interval == pytest.approx(0.01), "nothing was written"


def test_adaptive_must_be_a_boolean() -> None:
    with pytest.raises(ConfigurationError, match="adaptive"):
        Limiter("memory://", name="bad-adaptive", interval=0.01, adaptive="yes")  # type: ignore[arg-type]


def test_recovery_is_stated_in_whole_halvings_of_five_seconds() -> None:
    assert RECOVER_US == 5 * US
    assert MAX_SLOW == 64


def test_a_due_written_at_a_slower_pace_outlives_a_faster_one(backend: Backend) -> None:
    """Slowed to 64 intervals, a burst used up, then a faster pace: the record is still read and used."""
    state, clock = backend.clocked()
    name = backend.fresh_name()
    clock[0] = 10**9
    terms = {"burst": 3}
    reference = protocol.new_record(1000, 3)
    steps: list[tuple[str, tuple[int, ...]]] = [("slow", (64_000,))] + [("take_and_try", (0,))] * 3
    for kind, args in steps:
        reference, answer = _apply(reference, kind, args, clock[0])
        assert do(state, kind, name, 1000, *args, **terms) == answer  # type: ignore[arg-type]
    clock[0] += 30 * US  # recovered to 1984 us
    for kind, args in (("slow", (2000,)), ("take", ())):
        reference, answer = _apply(reference, kind, args, clock[0])
        assert do(state, kind, name, 1000, *args, **terms) == answer  # type: ignore[arg-type]
    assert state.read(name).record == reference
    state.reset(name)


def _apply(
    record: protocol.Record, kind: str, args: tuple[int, ...], now: int
) -> tuple[protocol.Record, Any]:
    if kind == "slow":
        return protocol.slow(record, args[0], now)
    if kind == "take":
        return protocol.take(record, now)
    return protocol.take_and_try(record, args[0], now)
