"""One shard at work: settings, state, decisions, driver, reports and leases; and the limiters' shared API.

A :class:`ShardRunner` carries a caller's :class:`~ratequeue.core.shard.Place`
through the shard's steps (:meth:`ShardRunner.acquire_flow`), making each
operation the shard asks for through :meth:`ShardRunner.call_flow` -- the one
place that times and reports a state call -- and hands the answers back. It
is the package-internal interface the limiters, queues, groups and
``all_of`` drive (:func:`runner_of`). :class:`LimiterBase` is what the thread
and asyncio limiters share beyond it: the settings, pause, status, pickling
and the decorator.
"""

from __future__ import annotations

import functools
import logging
import time
from asyncio import CancelledError
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from operator import methodcaller
from typing import Any, Protocol, TypeVar, overload

from ._redact import redact
from .core.clock import OffsetEstimator
from .core.flow import Call, Flow
from .core.operation import Operation
from .core.protocol import (
    MAX_HOLD_US,
    MAX_LEAD_US,
    NEVER,
    US,
    Answer,
    Passed,
    Started,
    effective_interval,
    live_leases,
    new_record,
    waiting_tenants,
)
from .core.shard import Begin, BeginAt, Expired, Place, Shard, SleepUntil, Turn, WaitForTurn
from .drivers import Driver
from .errors import AcquireTimeout, ConfigurationError, StateUnavailable
from .events import Event, EventHook, check_hook
from .fallback import LOCAL_TICKET, Fallback
from .headers import REFUSAL_HOLD, Feedback, HeadersLike, parse_headers
from .leasing import LeaseKeeper
from .reporting import Reporter
from .settings import (
    Seconds,
    Settings,
    check_cost,
    check_hold,
    check_settled,
    check_slow,
    check_tenant_for,
    check_timeout,
    not_with_caps,
    wait,
)
from .state.base import AsyncState, Snapshot, State, no_fair_queues

__all__ = ["LimiterBase", "ReservationBase", "ShardRunner", "Status", "entered", "runner_of"]

F = TypeVar("F", bound=Callable[..., Any])

#: a state's answer with the local times around its call: (answer, sent, received, the state's
#: clock read on this host just after, if it can be)
Timed = tuple[Answer, float, float, "float | None"]

#: the most (s) the two reads of :func:`received_and_state_now` may span before they are read again,
#: and how many times they are read at most
_PAIR_SPAN = 50e-6
_PAIR_TRIES = 3

#: a hold this process put on the whole queue (INFO: it is rare, and every process should see why)
_log = logging.getLogger("ratequeue.limiter")
_HELD = "queue %r held everywhere for %.3f s (asked by: %s)"
_SETTLED = "queue %r: ticket %d, taken for cost %d, settled at %d; later starts moved"
_SENT_LATE = "queue %r: ticket %d's call went out %d us after its start, more than max_late: queue held"
_SENT_NOT_HELD = "queue %r: ticket %d's call went out %d us after its start; the queue could not be held (%s)"
_SLOWED = "queue %r slowed down everywhere (asked by: %s); it recovers while no refusal comes"


@dataclass(frozen=True)
class Status:
    """A queue's shared record and this shard's view of it, as read just now."""

    #: the queue name
    name: str
    #: seconds between starts
    interval: float
    #: the next ticket the state will hand out
    next_ticket: int
    #: the highest ticket that has started (0: none); the record's ``pos``
    pos: int
    #: state-clock time (s) of the latest start, or ``None`` if none
    last_start: float | None
    #: the state clock's time (s) when this was read
    now: float
    #: callers (or a queue's jobs) waiting in this shard
    waiting: int
    #: whether this shard is paused
    paused: bool
    #: the ticket this shard holds, if any
    held_ticket: int | None
    #: how many starts may come at once after an idle spell
    burst: int = 1
    #: whether the queue is paused for every shard (its record's flag; ``paused`` is this shard's)
    paused_everywhere: bool = False
    #: how many jobs may run at once across every shard; ``None``: no cap
    max_running: int | None = None
    #: how many jobs hold a live lease across every shard (0 without a cap)
    running: int = 0
    #: state-clock time (s) until which the whole queue is held (:meth:`LimiterBase.hold`);
    #: ``None`` when no hold is on
    held_until: float | None = None
    #: seconds between starts now: ``interval``, or more while the queue recovers from a slow-down
    effective_interval: float | None = None
    #: whether tenants take turns (a fair queue)
    fair: bool = False
    #: a fair queue's tenants with waiters: each one's waiters (in every shard) and its weight
    tenants: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: state-clock time (s) since which the queue is paused everywhere; ``None`` when it is not
    #: (or when a version that did not note it paused it)
    paused_since: float | None = None

    @classmethod
    def of(cls, settings: Settings, snapshot: Snapshot, shard: Shard) -> Status:
        """The status of ``settings``' queue from a snapshot of its record (or a fresh one) and a shard."""
        record = snapshot.record or new_record(
            settings.terms.interval_us, settings.burst, settings.max_running, settings.fair
        )
        return cls(
            name=settings.name,
            interval=record.interval / US,
            next_ticket=record.ticket,
            pos=record.pos,
            last_start=None if record.at == NEVER else record.at / US,
            now=snapshot.now / US,
            waiting=shard.waiting,
            paused=shard.paused,
            held_ticket=shard.ticket,
            burst=record.burst,
            paused_everywhere=record.paused,
            paused_since=record.paused_at / US if record.paused and record.paused_at != NEVER else None,
            max_running=record.max_running,
            running=len(live_leases(record, snapshot.now)),
            held_until=record.not_before / US if record.not_before > snapshot.now else None,
            effective_interval=effective_interval(record, snapshot.now) / US,
            fair=record.fair,
            tenants={
                tenant: (waiting, weight) for tenant, (waiting, _, weight) in waiting_tenants(record).items()
            },
        )


#: the turns taken by ``with limiter:`` in this thread or task and not yet left: (limiter id, turn)
_ENTERED: ContextVar[tuple[tuple[int, Turn], ...]] = ContextVar("ratequeue_entered", default=())


def entered(limiter: object, turn: Turn | None = None) -> Turn | None:
    """Note ``turn``, taken by ``with limiter:``; without a turn, forget and return the latest one noted.

    Kept per thread and per asyncio task, so that the ``__exit__`` of a
    ``with`` statement finds the turn of its own ``__enter__``.
    """
    stack = _ENTERED.get()
    if turn is not None:
        _ENTERED.set((*stack, (id(limiter), turn)))
        return turn
    for index in range(len(stack) - 1, -1, -1):
        if stack[index][0] == id(limiter):
            _ENTERED.set(stack[:index] + stack[index + 1 :])
            return stack[index][1]
    return None


class InUse(Protocol):
    """Something beside a shard that keeps its limiter in use while :attr:`busy` (tenants' caps)."""

    @property
    def busy(self) -> bool:
        """Whether it is in use now."""


class ShardRunner:
    """One shard of a queue at work; every method but the flows is called holding the driver's lock."""

    def __init__(
        self,
        settings: Settings,
        state: State | AsyncState,
        driver: Driver,
        *,
        hook: EventHook | None = None,
        owner: object = None,
        estimator: OffsetEstimator | None = None,
    ) -> None:
        self.settings, self.name, self.state, self.driver = settings, settings.name, state, driver
        if settings.fair and not state.fair_queues:
            raise no_fair_queues(state)
        self.clock = clock = driver.clock
        max_late = settings.max_late
        #: whether the shard reads the state's clock by itself when its bounds are loose
        self._reads_clock = getattr(state, "reads_clock", False) and state.local_now() is None
        #: the lateness checked: none where the state's clock is coarser than it, unless the
        #: shard can read that clock to bound its offset (MongoDB's ``hello``)
        coarse = state.clock_resolution > (max_late or 0.0) and not self._reads_clock
        self.max_late = None if max_late is None or coarse else max_late
        #: whether the state's clock is this one (a memory state's, read on ``time.monotonic``)
        self._same_clock = clock is time.monotonic and state.reads_monotonic and state.local_now() is not None
        if estimator is None:  # a memory state reads this process's own clock: it never steps against it
            estimator = OffsetEstimator(same_clock=self._same_clock, resolution=state.clock_resolution)
        self.shard = Shard(
            settings.name,
            settings.terms,
            lead=settings.lead,
            max_late=self.max_late,
            estimator=estimator,
            # only where lateness is checked and the offset is not read directly (exactly); on a
            # state whose answers come slowly (MongoDB's), reads of its clock keep the doubt small
            doubting=self.max_late is not None and state.local_now() is None,
            margin=settings.margin,
            tokens=settings.tenant_max_running is not None,  # (a turn's place is found by its token)
        )
        self.reporter = Reporter(
            settings.name,
            check_hook(hook),
            owner,
            driver,
            clock,
            keep=settings.keep,
            max_late=settings.max_late,
            fair=settings.fair,
        )
        self.leases = LeaseKeeper(self) if settings.max_running else None
        #: the local turns while the state is down, unless ``when_down`` is ``"raise"``
        down = settings.when_down
        self.fallback = None if down == "raise" else Fallback(down, settings.interval)
        #: stops the state's watch for places freed elsewhere, while the held ticket waits for one
        self._unwatch: Callable[[], None] | None = None
        #: what beside the shard keeps this runner's limiter in use (its tenants' caps), if anything
        self.in_use: InUse | None = None
        #: whether the state has connected and set up (before the first call: :meth:`call_flow`); a
        #: state object of the user's own that is no StateBase may have nothing to prepare
        self._prepared = not hasattr(state, "prepare")

    @property
    def idle(self) -> bool:
        """Whether nobody waits, no call, begin or lease runs, the state is up (a group may drop it)."""
        return (
            self.shard.idle
            and (self.leases is None or not self.leases.busy)
            and (self.fallback is None or self.fallback.down_since is None)  # (its probe runs)
            and (self.in_use is None or not self.in_use.busy)
        )

    def place(self, timeout: Seconds | None, cost: int, tenant: str | None = None) -> Place:
        """A new place at the back of the line (of ``tenant``'s share on a fair queue), checked."""
        if timeout is None and cost == 1 and type(cost) is int and tenant is None:  # (the common call)
            return self.shard.add()
        seconds = check_timeout(timeout)
        cost = check_cost(cost, self.settings.burst)
        mine = check_tenant_for(self.settings, tenant)
        deadline = None if seconds is None else self.clock() + seconds
        return self.shard.add(deadline, seconds, cost, mine, self.settings.weight(mine))

    def changed(self) -> None:
        """The shard changed: hand its unused turns' leases to the keeper, wake the waiting flows."""
        shard = self.shard
        if shard.unused:
            if self.leases is not None:
                for held in shard.unused:
                    self.leases.release_later(held)
            shard.unused.clear()
        if self.leases is not None:
            self._follow_places()
        self.driver.changed()

    def _follow_places(self) -> None:
        """Watch the state for places freed elsewhere while the held ticket waits for one; not after."""
        full = self.shard.full
        if full and self._unwatch is None:
            self._unwatch = self.state.watch(self.name, self._freed_elsewhere) or _unwatched
        elif not full and self._unwatch is not None:
            unwatch, self._unwatch = self._unwatch, None
            unwatch()

    def _freed_elsewhere(self) -> None:
        """A place may have been freed in another process: the waiting head asks again at once."""

        def ask_again() -> None:
            self.shard.ask_again()
            self.driver.changed()

        self.driver.from_any_thread(ask_again)

    def end(self, ticket: int, token: int | None = None) -> None:
        """The job on ``ticket`` ended (or none began on it): its lease is released in the background.

        ``token``: the turn's (by default, the token of the lease a job on ``ticket`` holds here).
        """
        if self.leases is not None:
            token = self.leases.book.token_of(ticket) if token is None else token
            if token is not None:
                self.leases.release_later((ticket, token))

    def call_flow(self, op: Operation, lost: Callable[[Any], None] | None = None) -> Flow[Timed]:
        """``op`` carried out on the state (holding no lock), timed and reported.

        ``lost``: where an answer goes that comes after its caller was cancelled (asyncio).
        """
        clock, reporter = self.clock, self.reporter
        if not self._prepared:
            # connecting and setting up are no round-trip of a call: measured, they would set a lead
            # and a bound of the state's clock far too wide (PostgreSQL: 50-170 ms against 1 ms), and
            # a lead of several intervals starts tickets that pass other shards' (docs/design.md).
            # Failed, it is the call's failure (a second try would double the wait for it); it is
            # tried again before the next call.
            started = clock()
            try:
                yield Call(self.driver.call, (methodcaller("prepare"), self.state))
            except Exception as exc:
                if reporter.calls:
                    reporter.call_failed(op, exc, clock() - started)
                raise
            self._prepared = True
        sent = clock()
        try:
            answer = yield Call(self.driver.call, (self.state.execute, op, lost))
        except Exception as exc:
            if reporter.calls:
                reporter.call_failed(op, exc, clock() - sent)
            raise
        state_now: float | None
        if self._same_clock:  # the state's clock is this one: no offset to read
            received = state_now = clock()
        else:
            received, state_now = received_and_state_now(clock, self.state.local_now)
        if reporter.calls:
            reporter.call_answered(op, answer, received - sent)
        return answer, sent, received, state_now

    def acquire_flow(self, place: Place, *, attempt: bool = False) -> Flow[Turn | None]:
        """Carry ``place`` through the shard's steps until its turn begins; ``None`` if it is withdrawn.

        Runs holding the driver's lock, which its waits and calls release.
        With ``attempt`` (``try_acquire``), no turn now is not reported as a timeout.

        :raises AcquireTimeout: as soon as the turn cannot come by the place's deadline.
        """
        shard, clock, reporter, driver = self.shard, self.clock, self.reporter, self.driver
        lost = None
        now = since = clock()
        fallback = self.fallback
        try:
            while True:
                if place.withdrawn:
                    return None
                if fallback is not None and fallback.down_since is not None and not fallback.rejoining:
                    break  # the state is down: this place's turn begins locally (below)
                started = place.turn
                if started is None:
                    step = shard.step(place, now)
                    woke_late = None
                else:
                    given_up, paused_given_up, doubt = place.given_up, place.given_up_paused, place.doubt
                    step = shard.step(place, now)
                    # A doubted start checked before it came (a first, slow answer) did not wake late.
                    woke_late = started if now >= started.local_start else None
                    if place.given_up != given_up and woke_late is not None:  # out of re-times: given up
                        lateness = now - woke_late.local_start + doubt
                        in_a_row = place.given_up - place.given_up_paused
                        paused = place.given_up_paused != paused_given_up  # (a paused shard cannot move it)
                        reporter.late(woke_late.ticket, lateness, "given_up", in_a_row, paused=paused)
                kind = type(step)
                if kind is Begin:
                    # From the lateness check (the step) to the return: no hook runs here.
                    turn = step.turn  # type: ignore[union-attr]
                    try:
                        if self.leases is not None:
                            self.leases.began(turn.ticket, turn.token, clock())
                        if shard.unused or driver.waiters:
                            self.changed()  # the next caller is head now
                        if reporter.begins:
                            reporter.begin(turn, now, since, place.tenant if reporter.fair else None)
                    except BaseException:  # interrupted: the job will not run, its place goes back
                        self.end(turn.ticket, turn.token)
                        raise
                    return turn
                if kind is Operation:
                    op: Operation = step  # type: ignore[assignment]
                    if self.leases is not None:
                        if shard.unused:
                            # a turn given up (G7) holds a place: give it back before asking for another
                            unused, shard.unused[:] = list(shard.unused), []
                            yield from self.leases.release_unused_flow(unused)
                        lost = functools.partial(self._lost, op.token)
                    try:
                        answer, sent, received, state_now = yield from self.call_flow(op, lost)
                    except BaseException as exc:
                        # an asyncio call cancelled on its way hands its answer to ``lost``
                        shard.failed(
                            place, answered_elsewhere=lost is not None and isinstance(exc, CancelledError)
                        )
                        raise
                    steps = shard.estimator.steps
                    offset = None if state_now is None else received - state_now
                    shard.receive(place, answer, sent, received, offset=offset)
                    if self.leases is not None:
                        self._follow_places()
                    if shard.estimator.steps != steps:
                        reporter.clock_step(shard.estimator.step)
                    if op.kind == "retime" and woke_late is not None:
                        done = "begun" if place.begins_late else "moved"  # (a burst begins late)
                        done = "given_up" if place.given_up != given_up else done
                        lateness = now - woke_late.local_start + doubt
                        reporter.late(op.ticket, lateness, done, place.given_up - place.given_up_paused)
                    elif op.kind == "try_start" and isinstance(answer, Passed):
                        reporter.passed(answer)
                    if shard.unused or driver.waiters:
                        self.changed()
                elif kind is Expired:
                    timeout = None if place.deadline is None else place.timeout
                    why = ""
                    if not attempt:
                        reporter.timeout(place, now - since)
                        why = yield from self.why_no_turn_flow()
                    raise AcquireTimeout(
                        f"no turn in queue {self.name!r} within {timeout} s{why}",
                        name=self.name,
                        timeout=timeout,
                    )
                elif kind is WaitForTurn:
                    deadline = step.deadline  # type: ignore[union-attr]
                    yield Call(driver.wait_for_change, (wait(None if deadline is None else deadline - now),))
                elif kind is SleepUntil:
                    until: float = step.until  # type: ignore[union-attr]
                    if self._reads_clock and shard.wants_clock(now, until):
                        yield from self._read_clock_flow()
                        now = clock()
                        continue
                    yield Call(driver.wait_for_change, (wait(until - now),))
                else:
                    at: BeginAt = step  # type: ignore[assignment]
                    yield Call(driver.wait_until, (at.until, at.spin, self.max_late is not None))
                now = clock()
        except BaseException as exc:
            shard.abandon(place)
            self.changed()
            if fallback is None or fallback.rejoining or not isinstance(exc, StateUnavailable):
                raise
            fallback.went_down(self, exc)  # (the places behind this one find the state down too)
        else:  # left the loop: the state was down already
            shard.abandon(place)
            self.changed()
        return (yield from fallback.turn_flow(self, place, since, attempt=attempt))

    def _read_clock_flow(self) -> Flow[None]:
        """Read the state's clock for a tighter bound of its offset (:meth:`Shard.wants_clock`).

        A failed read is no failure of the caller's: its next operation meets the state's trouble.
        """
        clock = self.clock
        sent = clock()
        try:
            state_now: int = yield Call(self.driver.call, (methodcaller("read_clock"), self.state))
        except Exception:
            self.shard.clock_read(sent, clock(), None)
            return
        self.shard.clock_read(sent, clock(), state_now)

    def why_no_turn_flow(self) -> Flow[str]:
        """What keeps turns from coming, as the end of a timeout's message; ``""`` if nothing known.

        This shard paused, or the queue paused everywhere or held (read from
        the record: one call to the state, made only when a caller times
        out; a state error there leaves the reason out).
        """
        reasons = []
        if self.shard.paused:
            reasons.append("this limiter is paused: resume() it")
        try:
            snapshot: Snapshot = yield Call(self.driver.call, (self.state.read, self.name))
        except Exception:  # (the timeout is what the caller is told; the state's error is not its news)
            snapshot = None  # type: ignore[assignment]
        record = None if snapshot is None else snapshot.record
        if record is not None and record.paused:
            since = record.paused_at
            for_ = max(0, snapshot.now - since) / US
            said = "" if since == NEVER else f" (for {for_:.3g} s, until resumed)"
            reasons.append(
                f"the queue is paused everywhere{said}: resume_everywhere(), or `ratequeue resume URL NAME`"
            )
        if record is not None and record.not_before > snapshot.now:
            reasons.append(
                f"the queue is held for {(record.not_before - snapshot.now) / US:.3g} s more: "
                "lift_hold(), or `ratequeue hold URL NAME 0 --lift`"
            )
        return "" if not reasons else " (" + "; ".join(reasons) + ")"

    def attempt_flow(
        self, cost: int, tenant: str | None = None, *, keep: bool = False
    ) -> Flow[tuple[Turn | None, float | None]]:
        """A turn if one is free now, else ``(None, when)``: when the state said it comes, if it said.

        Without ``keep``, a ticket is taken only if it starts at once (``try_take``): a try that
        gets no turn leaves nothing behind for others to wait for. With ``keep`` (``all_of``,
        which waits for the turn next), the ticket taken stays with the shard for its next caller.
        """
        place = self.place(0, cost, tenant)
        place.attempt = not keep
        try:
            return (yield from self.acquire_flow(place, attempt=True)), None
        except AcquireTimeout:
            return None, place.expected

    def retime_flow(self, turn: Turn, lead: float) -> Flow[Turn | None]:
        """``turn``'s start moved to ``lead`` s from now at the soonest (``None`` once a later one started).

        The state's re-time, converted to local time by the shard (for ``all_of``).
        """
        op = Operation(
            "retime", self.name, self.settings.terms, turn.ticket, round(min(lead, MAX_LEAD_US / US) * US)
        )
        answer, sent, received, state_now = yield from self.call_flow(op)
        if not isinstance(answer, Started):
            return None
        offset = None if state_now is None else received - state_now
        return self.shard.convert(answer, sent, received, offset=offset, token=turn.token, cost=turn.cost)

    def _lost(self, token: int, answer: Answer) -> None:
        """A call naming ``token`` was answered after its caller was cancelled: its lease goes back."""
        if isinstance(answer, Started):
            self.end(answer.ticket, token)


def _unwatched() -> None:
    """What stops a watch the state could not keep (see :meth:`ratequeue.state.State.watch`)."""


def runner_of(limiter: LimiterBase) -> ShardRunner:
    """The runner of ``limiter``: what queues, groups and ``all_of`` drive."""
    return limiter._runner


class LimiterBase:
    """What the thread and asyncio limiters share: one shard, its settings, pause, status, the decorator."""

    #: the name ``repr`` shows
    _display_name = "Limiter"

    def __init__(self, runner: ShardRunner, owns_state: bool) -> None:
        self._runner = runner
        #: whether this limiter opened the state (and so closes it); a state object passed in stays open
        self._owns_state = owns_state

    @property
    def name(self) -> str:
        """The queue name."""
        return self._runner.name

    @property
    def settings(self) -> Settings:
        """The settings this limiter was made with."""
        return self._runner.settings

    @property
    def interval(self) -> float:
        """Seconds between two starts (of cost 1)."""
        return self._runner.settings.interval

    @property
    def burst(self) -> int:
        """How many starts (of cost 1) may come at once after an idle spell."""
        return self._runner.settings.burst

    @property
    def keep(self) -> float | None:
        """Seconds an idle queue's record is kept once forgetting it changes nothing; ``None``: for ever."""
        return self._runner.settings.keep

    @property
    def max_running(self) -> int | None:
        """How many jobs may run at once across every shard; ``None``: no cap."""
        return self._runner.settings.max_running

    @property
    def lease(self) -> float:
        """Seconds a running job's lease lasts unless renewed (with ``max_running``)."""
        return self._runner.settings.lease

    @property
    def tenant_max_running(self) -> int | None:
        """How many of one tenant's jobs may run at once across every shard; ``None``: no cap."""
        return self._runner.settings.tenant_max_running

    @property
    def holds_places(self) -> bool:
        """Whether a job holds a place until its turn is released (``max_running``, ``tenant_max_running``).

        Code that takes turns of a user's limiter releases them when this is true.
        """
        settings = self._runner.settings
        return bool(settings.max_running or settings.tenant_max_running)

    @property
    def paused(self) -> bool:
        """Whether this shard is paused."""
        return self._runner.shard.paused

    def pause(self) -> None:
        """Pause this shard: its callers keep their places, and it stops calling the state.

        :meth:`pause_everywhere` pauses every shard of the queue instead.
        """
        self._pause_shard(True)

    def resume(self) -> None:
        """Resume this shard after :meth:`pause`."""
        self._pause_shard(False)

    def _pause_shard(self, paused: bool) -> None:
        runner = self._runner
        with runner.driver.lock:
            if paused:
                runner.shard.pause()
            else:
                runner.shard.resume()
            runner.changed()

    def _set_paused_flow(self, paused: bool) -> Flow[bool]:
        """Set the queue's shared pause flag (one call to the state): whether that changed it.

        Only the flag changes: this shard keeps running, and its waiting head
        is told to wait, a second at a time, like every other shard's. On
        resume this shard's head asks again at once.
        """
        runner = self._runner
        op = Operation("set_paused", self.name, self.settings.terms, paused=paused)
        changed = yield Call(runner.state.execute, (op,))
        if not paused:
            with runner.driver.lock:
                runner.shard.ask_again()
                runner.changed()
        return bool(changed)

    def _hold_flow(self, seconds: Seconds, why: str = "call") -> Flow[bool]:
        """Hold the whole queue for ``seconds`` from now on the state's clock (one call): whether it grew."""
        runner = self._runner
        lead_us = check_hold(seconds)
        op = Operation("hold", self.name, self.settings.terms, lead_us=lead_us)
        grew = bool((yield Call(runner.state.execute, (op,))))
        if grew:
            if runner.reporter.on:
                runner.reporter.emit(Event("hold", self.name, wait=lead_us / US, outcome=why))
            _log.info(_HELD, self.name, lead_us / US, why)
        return grew

    def _heed_flow(self, headers: HeadersLike, status: int | None) -> Flow[Feedback]:
        """Parse a service's answer; hold (and, adaptive, slow) the queue as it asks (calls only then)."""
        feedback = parse_headers(headers, status=status)
        why = "headers" if status is None else str(status)
        refused = status == 429 or (status == 503 and feedback.hold is not None)
        if refused:
            yield from self._refused_flow(REFUSAL_HOLD if feedback.hold is None else feedback.hold, why)
        elif feedback.hold:
            yield from self._hold_flow(min(feedback.hold, MAX_HOLD_US / US), why)
        if self.settings.adaptive:
            floor = feedback.slow_to(self.interval)
            if floor is not None:  # (a day's quota says an hour at most: the pace is capped anyway)
                yield from self._slow_flow(check_slow(min(floor, MAX_LEAD_US / US)), "headers")
        return feedback

    def _refused_flow(self, held: float, why: str = "refused") -> Flow[None]:
        """A refusal heard: hold the queue ``held`` s and, with ``adaptive``, slow it down."""
        yield from self._hold_flow(min(held, MAX_HOLD_US / US), why)
        if self.settings.adaptive:
            yield from self._slow_flow(0, why)

    def _slow_flow(self, interval_us: int, why: str = "call") -> Flow[bool]:
        """Slow the queue to ``interval_us`` at least (0: twice its effective interval): whether it did."""
        runner = self._runner
        op = Operation("slow", self.name, self.settings.terms, lead_us=interval_us)
        slowed = bool((yield Call(runner.state.execute, (op,))))
        if slowed:
            if runner.reporter.on:
                runner.reporter.emit(Event("slow", self.name, outcome=why))
            _log.info(_SLOWED, self.name, why)
        return slowed

    def _settle_flow(self, turn: Turn, cost: int) -> Flow[bool]:
        """Tell the state what ``turn``'s call cost (one call; none at the estimate): whether starts moved.

        A refund lets this shard's waiting head ask again at once.
        """
        if not isinstance(turn, Turn):
            raise ConfigurationError(f"settle() takes the Turn acquire() returned, got {type(turn).__name__}")
        runner = self._runner
        actual = check_settled(cost, self.settings.burst)
        if actual == turn.cost or turn.ticket == LOCAL_TICKET:  # (a local turn: the state never knew it)
            return False
        op = Operation("settle", self.name, self.settings.terms, turn.ticket, actual, turn.cost)
        moved = bool((yield Call(runner.state.execute, (op,))))
        if moved:
            _log.debug(_SETTLED, self.name, turn.ticket, turn.cost, actual)
            if actual < turn.cost:
                with runner.driver.lock:
                    runner.shard.ask_again()
                    runner.changed()
        return moved

    def _sent_flow(self, turn: Turn) -> Flow[bool]:
        """Hold the queue from a send later than ``max_late`` after ``turn``'s start (a call then only).

        The next start then comes at least an interval less ``max_late``
        (plus the margin) after this send, as G7 spaces begins: the hold is
        counted from the state's now as the call arrives, later than the
        send. A hold not written is logged and answered ``False``: the call
        went out already.
        """
        if not isinstance(turn, Turn):
            raise ConfigurationError(f"sent() takes the Turn acquire() returned, got {type(turn).__name__}")
        runner, settings = self._runner, self.settings
        late, max_late = runner.clock() - turn.local_start, settings.max_late
        if max_late is None or late <= max_late or settings.burst > 1 or turn.ticket == LOCAL_TICKET:
            return False
        # G7 spaces begins an interval less max_late apart: a late send is held to the same
        lead_us = min(settings.terms.interval_us + runner.shard.margin_us - round(max_late * US), MAX_HOLD_US)
        if lead_us <= 0:
            return False
        op = Operation("hold", self.name, settings.terms, lead_us=lead_us)
        try:
            grew = bool((yield Call(runner.state.execute, (op,))))
        except StateUnavailable as exc:
            _log.warning(_SENT_NOT_HELD, self.name, turn.ticket, round(late * US), exc)
            return False
        if runner.reporter.on:
            runner.reporter.emit(Event("late", self.name, turn.ticket, lateness=late, outcome="sent"))
        _log.debug(_SENT_LATE, self.name, turn.ticket, round(late * US))
        return grew

    def _lift_hold_flow(self) -> Flow[bool]:
        """Lift the queue's hold (one call): whether one was on. This shard's head asks again at once."""
        runner = self._runner
        lifted = yield Call(runner.state.execute, (Operation("lift", self.name, self.settings.terms),))
        with runner.driver.lock:
            runner.shard.ask_again()
            runner.changed()
        return bool(lifted)

    def __reduce__(self) -> tuple[Any, ...]:
        # without on_event: a hook (and its metrics) belongs to the process that made it
        return (_rebuild, (type(self), self._runner.state.url, self.settings))

    def __repr__(self) -> str:
        settings = self.settings
        more = f", burst={settings.burst!r}" if settings.burst != 1 else ""
        more += f", max_running={settings.max_running!r}" if settings.max_running else ""
        more += f", tenant_max_running={settings.tenant_max_running!r}" if settings.tenant_max_running else ""
        url = redact(self._runner.state.url)
        return f"{self._display_name}({url!r}, name={self.name!r}, interval={self.interval!r}{more})"

    def wrap(self, fn: F, *, cost: int = 1, tenant: str | None = None) -> F:
        """``fn`` changed so that every call first waits for its turn, of ``cost`` (for ``tenant``)."""
        raise NotImplementedError

    def reserve(self, *, cost: int = 1, tenant: str | None = None) -> Any:
        """Take a place in this shard's line now, to wait for its turn later (see the drivers')."""
        raise NotImplementedError

    def close(self) -> Any:
        """Close the state if this limiter opened it (see the drivers')."""
        raise NotImplementedError

    @overload
    def __call__(self, fn: F, /) -> F: ...

    @overload
    def __call__(
        self, fn: None = None, /, *, cost: int = 1, tenant: str | None = None
    ) -> Callable[[F], F]: ...

    def __call__(
        self, fn: F | None = None, /, *, cost: int = 1, tenant: str | None = None
    ) -> F | Callable[[F], F]:
        """Decorate ``fn`` so that every call waits for its turn (see :meth:`wrap`).

        ``@limiter`` costs each call 1; ``@limiter(cost=3)`` costs it 3; on a
        fair queue ``@limiter(tenant="acme")`` waits in acme's share.
        """
        cost = check_cost(cost, self.burst)
        check_tenant_for(self.settings, tenant)
        if fn is None:
            return lambda function: self.wrap(function, cost=cost, tenant=tenant)
        return self.wrap(fn, cost=cost, tenant=tenant)


class ReservationBase:
    """A place in a limiter's line, taken when made; the drivers add ``wait``.

    Cancel it from any thread (asyncio: from the event loop's thread) to give
    the place up: a wait in progress then returns ``None``.
    """

    def __init__(self, limiter: LimiterBase, cost: int = 1, tenant: str | None = None) -> None:
        not_with_caps(limiter.settings, "reserve()")
        self._limiter = limiter
        self._runner = runner = runner_of(limiter)
        #: the turn :meth:`wait` returned, once it has begun: a second wait returns it again
        self._begun: Turn | None = None
        with runner.driver.lock:
            self._place = runner.place(None, cost, tenant)

    @property
    def turn(self) -> Turn | None:
        """The turn, once :meth:`wait` has returned it."""
        place = self._place
        return place.turn if place.turn is not None and not place.queued and not place.withdrawn else None

    @property
    def cancelled(self) -> bool:
        """Whether :meth:`cancel` took the place (before its turn began)."""
        return self._place.withdrawn

    def cancel(self) -> None:
        """Give the place up, unless its turn has begun; a waiting :meth:`wait` returns ``None``.

        A turn started and not yet begun is dropped: its slot goes unused.
        """
        runner = self._runner
        with runner.driver.lock:
            runner.shard.withdraw(self._place)
            runner.changed()

    def _wait_flow(self, timeout: Seconds | None) -> Flow[Turn | None]:
        """The flow of :meth:`wait`: the place's deadline set from ``timeout`` s from now."""
        if self._begun is not None:
            return self._begun
        seconds = check_timeout(timeout)
        place = self._place
        if place.queued and seconds is not None:
            place.deadline = self._runner.clock() + seconds
            place.timeout = seconds
        self._begun = turn = yield from self._runner.acquire_flow(place)
        return turn

    def __repr__(self) -> str:
        state = "cancelled" if self.cancelled else "started" if self.turn else "waiting"
        return f"<{type(self).__name__} {state} in {self._limiter!r}>"


def _rebuild(cls: Any, url: str, settings: Settings) -> LimiterBase:
    limiter: LimiterBase = cls(url, **settings.arguments())
    return limiter


def received_and_state_now(
    clock: Callable[[], float], local_now: Callable[[], float | None]
) -> tuple[float, float | None]:
    """This host's clock and the state's local clock (``None``: a server's), read as one instant.

    The offset ``received - state_now`` converts a state on this host's clock
    exactly, unless the process stalls between the two reads: so the state's
    clock is read between two reads of this host's, read again while they
    are more than :data:`_PAIR_SPAN` apart, and placed at their midpoint.
    """
    for _ in range(_PAIR_TRIES):
        before, state_now, after = clock(), local_now(), clock()  # (read in this order)
        if state_now is None:
            return after, None
        if after - before <= _PAIR_SPAN:
            break
    assert state_now is not None
    return after, state_now + (after - before) / 2
