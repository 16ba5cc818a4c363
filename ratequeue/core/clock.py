"""The clock-offset estimator: how to convert a state's clock to this process's, from its answers alone.

Every answer carries the state clock's ``now``. It was read after the call
was sent and before the answer came back, so ``received - now`` bounds the
local-minus-state offset from above: it is the true offset plus a delay in
``[0, rtt]``. The estimator keeps the tightest bound of the last
:data:`OFFSET_WINDOW` seconds, each loosened by the drift the two clocks may
have had since (:data:`DRIFT`), so a start is never converted to a local time
before it happens and one slow answer does not loosen the conversion. An
answer whose bound exceeds the best by more than its round-trip means the
state's clock stepped back: the older bounds are dropped. A state on this
host's own clock (file) gives its offset directly; there a move confirmed by
the next answer is a clock step (docs/design.md, "Clocks").

Free of I/O, like the shard that uses it.
"""

from __future__ import annotations

from collections import deque

from ..errors import ConfigurationError

__all__ = [
    "DIRECT_STEP",
    "DRIFT",
    "FEW_BOUNDS",
    "OFFSET_SLACK",
    "OFFSET_WINDOW",
    "OffsetEstimator",
    "to_float",
]

#: how fast (s per s) a state's clock may drift from this host's: 500 ppm, the fastest rate at
#: which the kernel slews a clock that NTP corrects (undisciplined quartz differs by ~200 ppm)
DRIFT = 500e-6
#: how old (s) a bound may be and still be used (with its drift added)
OFFSET_WINDOW = 2.0
#: how far (s) a bound may exceed the best, beyond its round-trip, before a clock step is assumed
OFFSET_SLACK = 0.0005
#: how far (s) an offset read directly may move between two answers before it may be a step: more
#: than a thread preempted between two clock reads, less than the steps NTP makes
DIRECT_STEP = 0.01
#: fewer recent bounds than this: the shard asks once more before converting a new ticket's slot
FEW_BOUNDS = 3


class OffsetEstimator:
    """The local-minus-state offset of one state's clock, learnt from answers."""

    def __init__(self, *, same_clock: bool = False, resolution: float = 0.0) -> None:
        """
        :param same_clock: the state's clock is this process's own (a memory state): an
            offset read directly can differ from the last only by a stall between two
            reads, never by a clock step, so no step is looked for.
        :param resolution: how coarsely (s) the state's clock ticks (MongoDB's: 1 ms); an
            answer's ``now`` may be that much behind the true time it was read at.
        """
        self.same_clock = same_clock
        self.resolution = resolution
        #: (local receive time, bound) of recent answers; the front is the tightest once
        #: each bound's drift since is added (the bounds loosen alike, so order holds)
        self._bounds: deque[tuple[float, float]] = deque()
        #: (local receive time, lower bound) of recent answers: ``sent - now`` less the clock's
        #: resolution; the front is the tightest (the highest) once each one's drift is taken off
        self._lows: deque[tuple[float, float]] = deque()
        #: local receive times of the latest answers that bounded the offset
        self._bounded_at: deque[float] = deque(maxlen=FEW_BOUNDS)
        #: whether an answer has bounded the offset since the start (or the latest step)
        self.ever_bounded = False
        #: the latest offset read directly that agreed with the one before, and one that moved
        #: from it, until the next answer confirms or denies the move
        self._direct: float | None = None
        self._moved: float | None = None
        #: how many clock steps were noticed, and the latest (s): positive when the state's
        #: clock went back against this host's
        self.steps = 0
        self.step = 0.0

    def bound(self, received: float, state_now: float, rtt: float) -> tuple[float, bool]:
        """The offset to convert with after an answer read at ``state_now`` (s), received at ``received``.

        Also whether this was the first bound since the start (or a step):
        such a conversion may be off by the answer's whole round-trip.
        """
        sample = received - state_now
        bounds, lows = self._bounds, self._lows
        while bounds and received - bounds[0][0] > OFFSET_WINDOW:
            bounds.popleft()
        while lows and received - lows[0][0] > OFFSET_WINDOW:
            lows.popleft()
        if bounds:
            best = bounds[0][1] + DRIFT * (received - bounds[0][0])
            if sample - best > rtt + OFFSET_SLACK + self.resolution:  # the state's clock stepped back
                bounds.clear()
                lows.clear()
                self._bounded_at.clear()
                self.ever_bounded = False
                self._stepped(sample - best)
        # a bound no tighter than this one is never the tightest again
        while bounds and bounds[-1][1] + DRIFT * (received - bounds[-1][0]) >= sample:
            bounds.pop()
        bounds.append((received, sample))
        low = sample - rtt - self.resolution  # (now was read after the call was sent)
        while lows and lows[-1][1] - DRIFT * (received - lows[-1][0]) <= low:
            lows.pop()
        lows.append((received, low))
        self._bounded_at.append(received)
        first, self.ever_bounded = not self.ever_bounded, True
        first_received, tightest = bounds[0]
        return tightest + DRIFT * (received - first_received), first

    def width(self, now: float, *, kept_until: float | None = None) -> float:
        """How far apart (s) the tightest upper and lower bounds of the offset are at local time ``now``.

        A start converted with the upper bound (as every start is) may be
        converted that much later than it truly was: the doubt a shard adds
        to its starts (docs/design.md, "Doubt"). 0 without recent bounds (a
        shard's first answer is doubted otherwise) or for an offset read
        directly. With ``kept_until`` (when a call in flight will be
        answered), only the bounds still in the window then count.
        """
        # the tightest of those still in the window: the first of each deque not aged out (the next
        # answer drops the older ones; until then they must not hide the rest)
        horizon = now if kept_until is None else kept_until
        bound = next((b for b in self._bounds if horizon - b[0] <= OFFSET_WINDOW), None)
        low = next((b for b in self._lows if horizon - b[0] <= OFFSET_WINDOW), None)
        if bound is None or low is None:
            return 0.0
        upper = bound[1] + DRIFT * (now - bound[0])
        lower = low[1] - DRIFT * (now - low[0])
        return upper - lower if upper > lower else 0.0

    def direct(self, offset: float) -> None:
        """Look for a clock step in ``offset``, read directly (a state on this host's clock).

        A stall between the two reads moves one answer's offset, not the
        next: a move beyond :data:`DIRECT_STEP` counts once the next answer
        agrees with it, by how far it moved.
        """
        if self.same_clock:
            return
        known, moved = self._direct, self._moved
        if known is None or abs(offset - known) <= DIRECT_STEP:
            self._direct, self._moved = offset, None
        elif moved is not None and abs(offset - moved) <= DIRECT_STEP:
            self._stepped(offset - known)
            self._direct, self._moved = offset, None
        else:
            self._moved = offset

    def few(self, now: float) -> bool:
        """Whether fewer than :data:`FEW_BOUNDS` answers of the last window bound the offset at ``now``."""
        at = self._bounded_at
        return len(at) < FEW_BOUNDS or now - at[0] > OFFSET_WINDOW

    def learn_from(self, other: OffsetEstimator, now: float) -> None:
        """Start from the recent bounds of ``other``, an estimator of the same state's clock.

        A group's new key need not count its first answer as a first: its
        first start is not doubted. Only bounds of the last window are
        taken; with none, nothing is learnt. ``other`` may be in use by
        another thread (each copy is taken in one step).
        """
        if self.ever_bounded or other.same_clock != self.same_clock:
            return
        bounds = [bound for bound in list(other._bounds) if now - bound[0] <= OFFSET_WINDOW]
        if bounds:
            self._bounds = deque(bounds)
            self._lows = deque(low for low in list(other._lows) if now - low[0] <= OFFSET_WINDOW)
            recent = [at for at in list(other._bounded_at) if now - at <= OFFSET_WINDOW]
            self._bounded_at = deque(recent, maxlen=FEW_BOUNDS)
            self.ever_bounded = True

    def _stepped(self, by: float) -> None:
        self.steps += 1
        self.step = by


def to_float(what: str, value: float) -> float:
    """``value``, a number a user gave (seconds, a rate's period), as a float.

    :class:`ConfigurationError` for an integer too large for a float
    (``10**400``), where ``float()`` raises a bare ``OverflowError``.
    """
    try:
        return float(value)
    except OverflowError:
        bits = int(value).bit_length()
        raise ConfigurationError(
            f"{what} must be a number a float can hold, got an integer of {bits} bits"
        ) from None
