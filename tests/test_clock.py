"""The clock-offset estimator on its own (ratequeue.core.clock): examples and properties.

An answer read on the state's clock at ``state_now`` and received at local
``received`` bounds the local-minus-state offset from above by
``received - state_now``: the true offset plus the answer's delay back, in
``[0, rtt]``. The properties: the offset used is never below the true one
(no start converted to a local time before it happens), never above the
tightest recent bound with its drift allowance, a step back of the state's
clock is noticed (and counted once), and one that is not is never counted.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ratequeue.core.clock import DIRECT_STEP, DRIFT, FEW_BOUNDS, OFFSET_SLACK, OFFSET_WINDOW, OffsetEstimator

TRUE = 10.0  # local = state + 10 s

#: answers: (seconds since the previous one, how late it came back, its round-trip)
answers = st.lists(
    st.tuples(st.floats(0.0, 0.5), st.floats(0.0, 0.005), st.floats(0.0, 0.005)).map(
        lambda a: (a[0], min(a[1], a[2]), a[2])  # a delay back is at most the round-trip
    ),
    min_size=1,
    max_size=40,
)


def feed(estimator: OffsetEstimator, answers: list[tuple[float, float, float]]) -> list[tuple[float, float]]:
    """Feed ``answers`` at a fixed true offset; the (received, offset used) after each."""
    received, used = 100.0, []
    for gap, delay, rtt in answers:
        received += gap
        state_now = received - delay - TRUE
        offset, _ = estimator.bound(received, state_now, rtt)
        used.append((received, offset))
    return used


@given(answers)
def test_the_offset_is_never_below_the_true_one(answers: list[tuple[float, float, float]]) -> None:
    for _, offset in feed(OffsetEstimator(), answers):
        assert offset >= TRUE - 1e-12, "a start would be converted to a local time before it happens"


@given(answers)
def test_the_offset_is_the_tightest_recent_bound_with_its_drift(
    answers: list[tuple[float, float, float]],
) -> None:
    estimator = OffsetEstimator()
    received, bounds = 100.0, []
    for gap, delay, rtt in answers:
        received += gap
        bounds.append((received, TRUE + delay))
        offset, _ = estimator.bound(received, received - delay - TRUE, rtt)
        recent = [bound + DRIFT * (received - at) for at, bound in bounds if received - at <= OFFSET_WINDOW]
        assert offset == pytest.approx(min(recent), abs=1e-9)
    assert estimator.steps == 0, "answers at a fixed offset are no clock step"


@given(answers, st.floats(0.01, 100.0))
def test_a_state_clock_stepping_back_is_noticed_once(
    answers: list[tuple[float, float, float]], back: float
) -> None:
    estimator = OffsetEstimator()
    used = feed(estimator, answers)
    received = used[-1][0] + 0.1
    offset, first = estimator.bound(received, received - TRUE - back, 0.001)  # the state's clock went back
    assert estimator.steps == 1
    assert estimator.step == pytest.approx(back, abs=0.006)
    assert first, "after a step the next bound is a first bound again"
    assert offset == pytest.approx(TRUE + back), "the older bounds are dropped"
    estimator.bound(received + 0.1, received + 0.1 - TRUE - back, 0.001)
    assert estimator.steps == 1


def test_a_bound_older_than_the_window_is_dropped() -> None:
    estimator = OffsetEstimator()
    estimator.bound(10.0, 0.0, 0.0)
    later = OFFSET_WINDOW + 0.5
    offset, _ = estimator.bound(10.0 + later + 0.003, later, 0.006)
    assert offset == pytest.approx(10.003, abs=1e-9), "the old bound was still used"


def test_a_tight_bound_outlives_later_loose_ones_with_its_drift_added() -> None:
    estimator = OffsetEstimator()
    assert estimator.bound(10.0001, 0.0, 0.0002)[0] == pytest.approx(10.0001, abs=1e-9)
    for k in range(1, 16):  # 1.5 s of answers each 2 ms late, as from a busy host
        used, first = estimator.bound(10.002 + k * 0.1, k * 0.1, 0.004)
        assert not first
        assert used == pytest.approx(10.0001 + DRIFT * (0.0019 + k * 0.1), abs=1e-9)


def test_few_bounds_until_enough_recent_answers() -> None:
    estimator = OffsetEstimator()
    for k in range(FEW_BOUNDS):
        assert estimator.few(10.0 + k)
        estimator.bound(10.0 + k * 0.01, k * 0.01, 0.0)
    assert not estimator.few(10.0 + FEW_BOUNDS * 0.01)
    assert estimator.few(10.0 + OFFSET_WINDOW + 1.0), "old answers count no more"


@given(st.floats(-1.0, 1.0), st.floats(DIRECT_STEP * 1.5, 10.0))
def test_a_direct_offset_counts_a_step_only_once_the_next_answer_agrees(start: float, moved: float) -> None:
    estimator = OffsetEstimator()
    estimator.direct(start)
    estimator.direct(start + moved)  # a stall between two reads, or a step: not known yet
    assert estimator.steps == 0
    estimator.direct(start)  # back where it was: it was a stall
    assert estimator.steps == 0
    estimator.direct(start + moved)
    estimator.direct(start + moved + DIRECT_STEP / 2)  # the next answer agrees: a step
    assert estimator.steps == 1
    assert estimator.step == pytest.approx(moved + DIRECT_STEP / 2)
    same = OffsetEstimator(same_clock=True)
    for offset in (start, start + moved, start + moved):
        same.direct(offset)
    assert same.steps == 0, "a state on this process's own clock never steps against it"


def test_a_new_estimator_learns_only_recent_bounds() -> None:
    working = OffsetEstimator()
    working.bound(100.0, 90.0, 0.0)
    new = OffsetEstimator()
    new.learn_from(working, 100.5)
    assert new.ever_bounded
    assert new.bound(100.6, 90.59, 0.02) == (pytest.approx(10.0 + DRIFT * 0.6), False)
    stale = OffsetEstimator()
    stale.learn_from(working, 100.0 + OFFSET_WINDOW + 1)
    assert not stale.ever_bounded
    assert OFFSET_SLACK > 0


@given(answers, st.sampled_from([0.0, 0.001]))
def test_the_width_covers_the_true_offset_and_is_the_tightest_recent_one(
    answers: list[tuple[float, float, float]], resolution: float
) -> None:
    """The offset's bounds hold the true one (a clock of ``resolution`` reads up to that much behind),
    and how far apart they are is what the tightest recent answers on each side allow."""
    estimator = OffsetEstimator(resolution=resolution)
    received, uppers, lowers = 100.0, [], []
    for gap, delay, rtt in answers:
        received += gap
        state_now = received - delay - TRUE
        if resolution:
            state_now = int(state_now / resolution) * resolution  # a coarse clock's reading
        upper, _ = estimator.bound(received, state_now, rtt)
        uppers.append((received, received - state_now))
        lowers.append((received, received - rtt - state_now - resolution))
        width = estimator.width(received)
        assert upper - width <= TRUE + 1e-9 <= upper + 1e-9, "the true offset lies within the bounds"
        recent_upper = min(b + DRIFT * (received - at) for at, b in uppers if received - at <= OFFSET_WINDOW)
        recent_lower = max(b - DRIFT * (received - at) for at, b in lowers if received - at <= OFFSET_WINDOW)
        assert width == pytest.approx(max(0.0, recent_upper - recent_lower), abs=1e-9)
        # Asked ahead (for a call in flight): the bounds aged out by then are left out, not the rest.
        for now, ahead in ((received + 1.5, None), (received, received + 1.5)):
            until = ahead if ahead is not None else now
            ups = [b + DRIFT * (now - at) for at, b in uppers if until - at <= OFFSET_WINDOW]
            lows = [b - DRIFT * (now - at) for at, b in lowers if until - at <= OFFSET_WINDOW]
            expected = max(0.0, min(ups) - max(lows)) if ups and lows else 0.0
            assert estimator.width(now, kept_until=ahead) == pytest.approx(expected, abs=1e-9)


def test_no_width_without_recent_bounds_and_none_after_a_step() -> None:
    estimator = OffsetEstimator()
    assert estimator.width(100.0) == 0.0
    estimator.bound(100.0, 100.0 - 0.001 - TRUE, 0.002)
    assert estimator.width(100.0) == pytest.approx(0.002)
    assert estimator.width(100.0 + OFFSET_WINDOW + 0.1) == 0.0, "too old to vouch for anything"
    estimator.bound(101.0, 101.0 - TRUE - 1.0, 0.002)  # the state's clock went back a second
    assert estimator.steps == 1
    assert estimator.width(101.0) == pytest.approx(0.002), "only the answer after the step counts"
