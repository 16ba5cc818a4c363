"""Several limits held at once: the flow of ``all_of``, written once for threads and asyncio.

The rule (docs/rates.md, "Several limits at once"):

1. **Order.** The limits are waited for one after another, the scarcest
   first (the longest interval; ties by state URL, then queue name). Every
   caller uses the same order, so no two callers each hold a turn of one
   limit while waiting for the other's: no deadlock.
2. **No late begin, no wasted turn.** A turn is a start on its limit's
   state. Each limit is first tried without waiting; when its turn is not
   free, its shard knows when it will be (the slot of the ticket it now
   holds), and the turns already taken are moved to that moment on their
   states at once (a re-time, as a late wake-up does; possible while no
   later start exists on that limit, which a moment after the grant is
   nearly always so). Then the job waits for the missing turn and begins
   with all of them. A turn still late at the end (the wait ran longer than
   foreseen) is moved again; only if another caller has started on that
   limit meanwhile can it not move: that one turn is given up (its slot
   goes unused, as a dead caller's does) and taken again.
3. After :data:`MAX_ROUNDS` rounds of moving turns the turns are returned
   as they are (each begun at most a wake-up late).

Events (``on_event``) and the DEBUG begin lines follow the begin, not the
grants: while the turns are taken and moved, their limiters report no
``start`` (:data:`~ratequeue._limiting.QUIET_STARTS`); once the job begins,
each limiter reports one, its ``wait`` counted from the ``all_of()`` call
and its ``lateness`` from its turn's final start.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

from . import _validate
from ._flow import Call, Flow
from ._limiting import QUIET_STARTS, LimiterBase, Seconds, _calls_log, received_and_state_now
from .errors import ConfigurationError
from .protocol import MAX_LEAD_US, US, Started
from .shard import Turn

__all__ = ["MAX_ROUNDS", "all_of_flow", "order"]

#: the begin lines (DEBUG) of the limiters
_log = logging.getLogger("ratequeue.limiter")

#: how many times the late turns are re-timed before the turns are returned as they are
MAX_ROUNDS = 5

#: how far ahead (s), beyond a round-trip, late turns are moved: the job is awake and waiting
_MOVE_MARGIN = 0.001


def order(limiters: Sequence[LimiterBase[Any]]) -> list[int]:
    """The indexes of ``limiters`` in the order they are waited for: scarcest first, then by URL and name."""
    return sorted(
        range(len(limiters)), key=lambda i: (-limiters[i].interval, limiters[i].state.url, limiters[i].name)
    )


def all_of_flow(
    limiters: Sequence[LimiterBase[Any]], timeout: Seconds | None, cost: int, clock: Callable[[], float]
) -> Flow[list[Turn]]:
    """A turn of every limiter in ``limiters``, begun together; the turns in the order given."""
    if not limiters:
        raise ConfigurationError("all_of() needs at least one limiter")
    if len({id(limiter) for limiter in limiters}) != len(limiters):
        raise ConfigurationError(
            "all_of() got the same limiter twice: its two turns could never begin together"
        )
    for limiter in limiters:
        _validate.cost(cost, limiter.burst)
    seconds = _validate.timeout(timeout)
    since = clock()
    deadline = None if seconds is None else since + seconds

    def acquire(limiter: LimiterBase[Any]) -> Call:
        left = None if deadline is None else max(0.0, deadline - clock())
        return Call(functools.partial(limiter.acquire, left, cost=cost))

    turns: dict[int, Turn] = {}
    quiet = QUIET_STARTS.set(True)  # the limiters' own starts are grants, not the begin
    try:
        try:
            now = yield from _line_up(limiters, turns, acquire, clock, cost)
        finally:
            with contextlib.suppress(ValueError):  # closed from another context (a collected flow)
                QUIET_STARTS.reset(quiet)
    except BaseException:
        for i, turn in turns.items():  # the job will not run: its places (max_running) go back
            _drop(limiters[i], turn)
        raise
    begun = [turns[i] for i in range(len(limiters))]
    for limiter, turn in zip(limiters, begun, strict=True):
        if limiter._on_event is not None or _log.isEnabledFor(logging.DEBUG):
            limiter._report_start(turn, now, since)
    return begun


def _drop(limiter: LimiterBase[Any], turn: Turn) -> None:
    """``turn`` will not be begun: with ``max_running``, its lease is released in the background."""
    with limiter._locked():
        limiter._end_lease(turn.ticket, later=True)


def _line_up(
    limiters: Sequence[LimiterBase[Any]],
    turns: dict[int, Turn],
    acquire: Callable[[LimiterBase[Any]], Call],
    clock: Callable[[], float],
    cost: int,
) -> Flow[float]:
    """Take a turn of every limiter into ``turns`` and line them up to begin together (see above).

    Returns the local time of the begin: when the final precise wait ended.
    """
    for i in order(limiters):
        limiter = limiters[i]
        turn, expected = yield Call(limiter._attempt, (cost,))
        if turn is None:
            # Not free now. If the state said when it will be, move the turns already taken to
            # that moment at once (nobody can have started after them yet), so that they are
            # neither begun late nor given up; then wait for this one.
            if expected is not None:
                for j in list(turns):
                    moved = yield from _moved(limiters[j], turns[j], clock, until=expected)
                    if moved is not None:
                        turns[j] = moved
            turn = yield acquire(limiter)
        turns[i] = turn
    woke = 0.0  # the local time of a wake-up that came too late: the job cannot begin before it
    for _ in range(MAX_ROUNDS):
        # The job begins with the latest start. Turns it would begin late are moved to a common
        # moment just ahead (all of them together, so that moving one does not make another late).
        begin = max(max(turn.local_start for turn in turns.values()), woke)
        if not any(_is_late(limiters[i], turn, begin) for i, turn in turns.items()):
            yield Call(limiters[0]._wait_precisely, (begin,))
            now = clock()
            if not any(_is_late(limiters[i], turn, now) for i, turn in turns.items()):
                break  # every turn begins now, within its tolerance
            woke = now  # woke too late for some turn: move them from now on
            continue
        target = max(begin, clock() + max(_move_lead(limiters[i]) for i in turns))
        for i in [i for i, turn in turns.items() if _is_late(limiters[i], turn, target)]:
            moved = yield from _moved(limiters[i], turns[i], clock, until=target)
            if moved is None:  # passed: this turn is given up for a new one
                _drop(limiters[i], turns.pop(i))
                moved = yield acquire(limiters[i])
            turns[i] = moved
    else:  # out of rounds: begin with the latest start all the same, never before it
        yield Call(limiters[0]._wait_precisely, (max(turn.local_start for turn in turns.values()),))
        now = clock()
    return now


def _is_late(limiter: LimiterBase[Any], turn: Turn, begin: float) -> bool:
    """Whether a job beginning at local time ``begin`` would begin ``turn`` late.

    Late is more than the limiter's ``max_late`` (G7) plus its round-trip
    time: a start moved by a call lands up to a round-trip after the moment
    asked for (the state reads its clock during the call), so turns on two
    states cannot be lined up closer than that.
    """
    max_late = limiter._shard.max_late
    return max_late is not None and begin - turn.local_start > max_late + limiter._shard.rtt


def _move_lead(limiter: LimiterBase[Any]) -> float:
    """How far ahead (s) a turn of ``limiter`` can be moved: a round-trip, a wake-up and a margin."""
    return limiter._shard._retime_lead + _MOVE_MARGIN


def _moved(
    limiter: LimiterBase[Any], turn: Turn, clock: Callable[[], float], until: float | None = None
) -> Flow[Turn | None]:
    """``turn``'s start moved to local time ``until`` (at the soonest, just ahead) on its state.

    A start moves only while it is its limit's latest (the state's re-time):
    ``None`` once another caller has started after it.
    """
    lead = _move_lead(limiter)
    if until is not None:
        lead = min(max(lead, until - clock()), MAX_LEAD_US / US)
    state: Any = limiter.state
    call = functools.partial(
        state.retime, limiter.name, limiter._interval_us, turn.ticket, round(lead * US), **limiter._terms
    )
    sent = clock()
    try:
        outcome = yield Call(call)
    except Exception as exc:
        if limiter._on_event is not None or _calls_log.isEnabledFor(logging.DEBUG):
            limiter._call_failed(state.retime, (limiter._interval_us, turn.ticket), exc, sent)
        raise
    received, state_now = received_and_state_now(clock, state.local_now)  # exact on this host's clock
    if limiter._on_event is not None or _calls_log.isEnabledFor(logging.DEBUG):
        limiter._call_answered(state.retime, (limiter._interval_us, turn.ticket), outcome, sent, received)
    if not isinstance(outcome, Started):
        return None
    # otherwise the state read its clock between sent and received: converting with the
    # latest bound never places the start before it happens
    offset = received - (outcome.now / US if state_now is None else state_now)
    local_start = outcome.start / US + offset
    if local_start < sent:  # pragma: no cover - a clock stepped back under us
        local_start = received
    return Turn(turn.ticket, outcome.start, local_start)
