"""Several limits held at once: ``all_of``, its flow written once for threads and asyncio.

The rule (docs/rates.md, "Several limits at once"):

1. **Order.** The limits are waited for one after another, the scarcest
   first (the longest interval; ties by state URL, then queue name). Every
   caller uses the same order, so no two callers each hold a turn of one
   limit while waiting for the other's: no deadlock.
2. **No late begin, no wasted turn.** Each limit is first tried without
   waiting; when its turn is not free, its shard knows when it will be, and
   the turns already taken are moved to that moment on their states at once
   (a re-time, as a late wake-up does). Then the job waits for the missing
   turn and begins with all of them. A turn still late at the end is moved
   again; only if another caller has started on that limit meanwhile can it
   not move: that one turn is given up and taken again.
3. After :data:`MAX_ROUNDS` rounds of moving turns the turns are returned
   as they are (each begun at most a wake-up late).
4. **A deadline moves nothing past it.** With a ``timeout``, the records of
   the limits after the first are read before any turn is taken: if one
   plainly cannot give a turn in time (its next ticket's earliest start lies
   past the deadline), ``AcquireTimeout`` is raised at once, no turn taken.
   Turns taken are never moved past the deadline: when the missing turn is
   due after it, they are given up and ``AcquireTimeout`` raised at once. So
   a timed-out call costs another limit's users at most the turn it took.

Events and the DEBUG begin lines follow the begin, not the turns: while the
turns are taken and moved, their limiters report no ``begin``
(:data:`~ratequeue.reporting.QUIET_STARTS`); once the job begins, each
reports one, its ``wait`` counted from the ``all_of()`` call.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence

from .core.flow import Call, Flow, run
from .core.protocol import US, Passed, Unwritten, Wait, take_and_try, try_start
from .core.shard import Place, Turn
from .errors import AcquireTimeout, ConfigurationError
from .limiter import Limiter
from .reporting import QUIET_STARTS
from .running import LimiterBase, ShardRunner, runner_of
from .settings import Seconds, check_cost, check_timeout, not_with_caps

__all__ = ["MAX_ROUNDS", "all_of", "all_of_flow", "order"]

#: how many times the late turns are re-timed before the turns are returned as they are
MAX_ROUNDS = 5

#: how far ahead (s), beyond a round-trip, late turns are moved: the job is awake and waiting
_MOVE_MARGIN = 0.001


def all_of(*limiters: Limiter, timeout: Seconds | None = None, cost: int = 1) -> list[Turn]:
    """Block until this caller has a turn of every one of ``limiters``, begun together; return them.

    The limits are waited for scarcest first, the same order for every
    caller (so callers never deadlock), and a turn made late by the wait for
    another is moved later on its state rather than begun late or thrown
    away (docs/rates.md, "Several limits at once"). The turns come back in
    the order the limiters were given.

    :param timeout: seconds to wait in all at most; ``None`` waits for ever.
    :param cost: what the call costs on each limiter (1 to the smallest burst).
    :raises AcquireTimeout: if a turn cannot come within ``timeout``.
    """
    return run(all_of_flow(limiters, timeout, cost, time.monotonic))


def all_of_flow(
    limiters: Sequence[LimiterBase], timeout: Seconds | None, cost: int, clock: Callable[[], float]
) -> Flow[list[Turn]]:
    """A turn of every limiter in ``limiters``, begun together; the turns in the order given."""
    if not limiters:
        raise ConfigurationError("all_of() needs at least one limiter")
    if len({id(limiter) for limiter in limiters}) != len(limiters):
        raise ConfigurationError(
            "all_of() got the same limiter twice: its two turns could never begin together"
        )
    runners = [runner_of(limiter) for limiter in limiters]
    for runner in runners:
        check_cost(cost, runner.settings.burst)
        not_with_caps(runner.settings, "all_of()")
        if runner.fallback is not None:  # its turns are moved in the record: it needs the state
            raise ConfigurationError(
                f"all_of() takes limiters with when_down='raise' only; {runner.name!r} has "
                f"when_down={runner.settings.when_down!r}"
            )
    seconds = check_timeout(timeout)
    since = clock()
    deadline = None if seconds is None else since + seconds

    def acquire(runner: ShardRunner) -> Flow[Turn]:
        left = None if deadline is None else max(0.0, deadline - clock())
        with runner.driver.lock:
            turn = yield from runner.acquire_flow(runner.place(left, cost))
        assert turn is not None
        return turn

    def expired(runner: ShardRunner) -> AcquireTimeout:
        """The timeout of a caller whose turn of ``runner``'s limit cannot come by the deadline (reported)."""
        runner.reporter.timeout(Place(deadline, seconds, cost), clock() - since)
        return AcquireTimeout(
            f"no turn in queue {runner.name!r} within {seconds} s", name=runner.name, timeout=seconds
        )

    indexes = order(limiters)
    if deadline is not None:
        for i in indexes[1:]:
            if (yield from _plainly_late(runners[i], cost, deadline, clock)):
                raise expired(runners[i])
    turns: dict[int, Turn] = {}
    quiet = QUIET_STARTS.set(True)  # the limiters' own begins are turns taken, not the begin
    try:
        try:
            now = yield from _line_up(indexes, runners, turns, acquire, clock, cost, deadline, expired)
        finally:
            with contextlib.suppress(ValueError):  # closed from another context (a collected flow)
                QUIET_STARTS.reset(quiet)
    except BaseException:
        for i, turn in turns.items():  # the job will not run: its places (max_running) go back
            _drop(runners[i], turn)
        raise
    begun = [turns[i] for i in range(len(runners))]
    for runner, turn in zip(runners, begun, strict=True):
        if runner.reporter.begins:
            runner.reporter.begin(turn, now, since)
    return begun


def order(limiters: Sequence[LimiterBase]) -> list[int]:
    """The indexes of ``limiters`` in the order they are waited for: scarcest first, then by URL and name."""
    runners = [runner_of(limiter) for limiter in limiters]
    return sorted(
        range(len(runners)),
        key=lambda i: (-runners[i].settings.interval, runners[i].state.url, runners[i].name),
    )


def _drop(runner: ShardRunner, turn: Turn) -> None:
    """``turn`` will not be begun: with ``max_running``, its lease is released in the background."""
    with runner.driver.lock:
        runner.end(turn.ticket)


def _plainly_late(runner: ShardRunner, cost: int, deadline: float, clock: Callable[[], float]) -> Flow[bool]:
    """Whether ``runner``'s next turn plainly cannot start by ``deadline`` (local): read from its record.

    Its earliest start, on the state's clock, is that of the ticket its shard
    holds, or else of a new one; it comes no sooner, on this clock, than that
    long after the read was sent. A record of other terms is left to the
    first call (``TermsMismatch``), a corrupted one likewise.
    """
    with runner.driver.lock:
        held = runner.shard.ticket
    sent = clock()
    record, now = yield Call(runner.state.read, (runner.name,))
    terms = runner.settings.terms
    if record is None or (record.interval, record.burst, record.max_running) != (
        terms.interval_us,
        terms.burst,
        terms.max_running,
    ):
        return False
    try:
        answer = try_start(record, held, 0, now, cost)[1] if held is not None else None
        if answer is None or isinstance(answer, Passed):
            answer = take_and_try(record, 0, now, cost)[1]
    except Unwritten:
        return False
    return isinstance(answer, Wait) and sent + (answer.slot - now) / US > deadline


def _line_up(
    indexes: list[int],
    runners: Sequence[ShardRunner],
    turns: dict[int, Turn],
    acquire: Callable[[ShardRunner], Flow[Turn]],
    clock: Callable[[], float],
    cost: int,
    deadline: float | None,
    expired: Callable[[ShardRunner], AcquireTimeout],
) -> Flow[float]:
    """Take a turn of every limiter into ``turns`` and line them up to begin together (see above).

    Returns the local time of the begin: when the final precise wait ended.
    """
    for i in indexes:
        runner = runners[i]
        with runner.driver.lock:
            turn, expected = yield from runner.attempt_flow(cost, keep=True)
        if turn is None:
            if expected is not None and deadline is not None and expected > deadline:
                raise expired(runner)  # the turns taken are given up, never moved past the deadline
            # Not free now. If the state said when it will be, move the turns already taken to
            # that moment at once (nobody can have started after them yet); then wait for this one.
            if expected is not None:
                for j in list(turns):
                    moved = yield from _moved(runners[j], turns[j], clock, until=expected)
                    if moved is not None:
                        turns[j] = moved
            turn = yield from acquire(runner)
        turns[i] = turn
    woke = 0.0  # the local time of a wake-up that came too late: the job cannot begin before it
    first = runners[0]
    for _ in range(MAX_ROUNDS):
        # The job begins with the latest start. Turns it would begin late are moved to a common
        # moment just ahead (all together, so that moving one does not make another late).
        begin = max(max(turn.local_start for turn in turns.values()), woke)
        if not any(_is_late(runners[i], turn, begin) for i, turn in turns.items()):
            yield Call(first.driver.wait_precisely, (begin, first.max_late is not None))
            now = clock()
            if not any(_is_late(runners[i], turn, now) for i, turn in turns.items()):
                break  # every turn begins now, within its tolerance
            woke = now  # woke too late for some turn: move them from now on
            continue
        target = max(begin, clock() + max(_move_lead(runners[i]) for i in turns))
        for i in [i for i, turn in turns.items() if _is_late(runners[i], turn, target)]:
            moved = yield from _moved(runners[i], turns[i], clock, until=target)
            if moved is None:  # passed: this turn is given up for a new one
                _drop(runners[i], turns.pop(i))
                moved = yield from acquire(runners[i])
            turns[i] = moved
    else:  # out of rounds: begin with the latest start all the same, never before it
        latest = max(turn.local_start for turn in turns.values())
        yield Call(first.driver.wait_precisely, (latest, first.max_late is not None))
        now = clock()
    return now


def _is_late(runner: ShardRunner, turn: Turn, begin: float) -> bool:
    """Whether a job beginning at local time ``begin`` would begin ``turn`` late.

    Late is more than the limiter's ``max_late`` (G7) plus its round-trip
    time: a start moved by a call lands up to a round-trip after the moment
    asked for, so turns on two states cannot be lined up closer than that.
    """
    max_late = runner.shard.max_late
    return max_late is not None and begin - turn.local_start > max_late + runner.shard.rtt


def _move_lead(runner: ShardRunner) -> float:
    """How far ahead (s) a turn can be moved: a round-trip, a wake-up and a margin."""
    return runner.shard.retime_lead + _MOVE_MARGIN


def _moved(runner: ShardRunner, turn: Turn, clock: Callable[[], float], until: float) -> Flow[Turn | None]:
    """``turn``'s start moved to local time ``until`` (at the soonest, just ahead); ``None`` once passed."""
    lead = max(_move_lead(runner), until - clock())
    with runner.driver.lock:
        return (yield from runner.retime_flow(turn, lead))
