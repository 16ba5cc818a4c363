"""What the thread and asyncio limiters share: settings, the acquire flow, reservations.

Each limiter is one shard (:mod:`ratequeue.shard`) plus a driver. Everything
a driver does not have to do differently lives here, written once: checking
the settings, pickling, pause and resume, reading the status, and the loop
that carries a waiting job through the shard's steps (:meth:`LimiterBase._acquire_flow`,
a :mod:`ratequeue._flow` generator). A driver supplies its lock, its way of
waiting for the shard to change, its precise wait before a begin, and its
timed call to the state: :class:`ratequeue.Limiter` with a condition and
threads, :class:`ratequeue.aio.Limiter` with futures on the event loop.
"""

from __future__ import annotations

import datetime
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, Union, overload

from . import _validate
from ._flow import Call, Flow
from ._leases import LeaseBook
from ._redact import redact
from .errors import AcquireTimeout
from .events import Event, EventHook, Outlet, check_hook, report
from .protocol import NEVER, US, Outcome, Passed, Started, live_leases
from .rates import RateLike
from .shard import (
    DEFAULT_MAX_LATE,
    Begin,
    BeginAt,
    Expired,
    Job,
    Retime,
    Shard,
    SleepUntil,
    TakeAndTry,
    TryStart,
    Turn,
    WaitForTurn,
)
from .state.base import Snapshot, StateBase, terms
from .state.memory import MemoryState

__all__ = ["DEFAULT_LEASE", "LimiterBase", "ReservationBase", "Seconds", "Status", "TimedAnswer", "entered"]

#: a duration: seconds, or a ``timedelta``
Seconds = Union[float, datetime.timedelta]

#: a state's answer with the local times around its call: (answer, sent, received, the
#: state's clock read on this host just after, if it can be)
TimedAnswer = tuple[Outcome, float, float, Union[float, None]]

#: how long (s) a lease lasts by default: a killed holder's place comes back within this
DEFAULT_LEASE = 10.0

#: the acquire flow and the lease keeper: begins (DEBUG), passed and lost tickets, late turns, clock steps
_log = logging.getLogger("ratequeue.limiter")
#: one DEBUG line per state call of a limiter: operation, queue, ticket, answer, duration
_calls_log = logging.getLogger("ratequeue.limiter.calls")
_DEBUG = logging.DEBUG

#: a clock step (s) at least this large is logged at WARNING; smaller ones (a slow answer, a
#: preempted thread, a state clock's coarse ticks) at DEBUG
CLOCK_STEP_WARNING = 0.05

#: a caller that gives up this many turns in a row for late wake-ups is logged at WARNING (fewer: INFO)
LATE_WARNING_REPEATS = 2
#: the most often (s) a limiter logs turns given up at WARNING; the others meanwhile are INFO
LATE_WARNING_EVERY = 60.0

#: set while ``all_of()`` takes its turns in this thread or task: their limiters report no
#: ``start`` then, as a turn is not begun yet; ``all_of()`` reports them once they begin together
QUIET_STARTS: ContextVar[bool] = ContextVar("ratequeue_quiet_starts", default=False)

#: the turns taken by ``with limiter:`` in this thread or task and not yet left: (limiter id, turn)
_ENTERED: ContextVar[tuple[tuple[int, Turn], ...]] = ContextVar("ratequeue_entered", default=())


def entered(limiter: object, turn: Turn | None = None) -> Turn | None:
    """Note ``turn``, taken by ``with limiter:``; without a turn, forget and return the latest one noted.

    Kept per thread and per asyncio task (a context variable), so that the
    ``__exit__`` of a ``with`` statement finds the turn of its own ``__enter__``.
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


S = TypeVar("S", bound=StateBase)
F = TypeVar("F", bound=Callable[..., Any])


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
    #: jobs waiting in this shard
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

    @property
    def current(self) -> int:
        """The old name of :attr:`pos` (the highest ticket that has started)."""
        return self.pos

    @classmethod
    def of(cls, name: str, interval: float, snapshot: Snapshot, shard: Shard) -> Status:
        """The status of queue ``name`` from a snapshot of its record and this shard."""
        record = snapshot.record
        return cls(
            name=name,
            interval=record.interval / US if record else interval,
            next_ticket=record.ticket if record else 1,
            pos=record.pos if record else 0,
            last_start=record.at / US if record and record.at != NEVER else None,
            now=snapshot.now / US,
            waiting=shard.waiting,
            paused=shard.paused,
            held_ticket=shard.ticket,
            burst=record.burst if record else 1,
            paused_everywhere=record.paused if record else False,
            max_running=record.max_running or None if record else None,
            running=len(live_leases(record, snapshot.now)) if record else 0,
        )


class LimiterBase(ABC, Generic[S]):
    """One shard of a queue and the settings it was made with; the drivers add the waiting."""

    #: the queue name
    name: str
    #: seconds between two starts (of cost 1)
    interval: float
    #: how many starts (of cost 1) may come at once after an idle spell
    burst: int
    #: seconds an idle queue's record is kept once forgetting it changes nothing; ``None``: for ever
    keep: float | None
    #: how many jobs may run at once across every shard; ``None``: no cap
    max_running: int | None
    #: seconds a running job's lease lasts unless renewed (used with ``max_running``)
    lease: float

    def __init__(
        self,
        url: Any,
        *,
        name: str,
        interval: Seconds | None = None,
        rate: RateLike | None = None,
        burst: int = 1,
        keep: Seconds | None = None,
        lead: Seconds | None = None,
        max_late: Seconds | None = DEFAULT_MAX_LATE,
        clock: Callable[[], float] | None = None,
        max_running: int | None = None,
        lease: Seconds = DEFAULT_LEASE,
        on_event: EventHook | None = None,
    ) -> None:
        #: called with an :class:`~ratequeue.events.Event` for each start, state call, ...; or ``None``
        self._on_event = check_hook(on_event)
        #: where the events go (:meth:`_emit`): the hook, called off the acquire path
        self._outlet = None if self._on_event is None else Outlet(self._on_event, self)
        #: turns given up for late wake-ups since the last warning about them, and when that was
        self._late_given_up = 0
        self._late_warned: float | None = None
        pace = _validate.pace(interval, rate)
        self.name, self.interval, self._interval_us, self._lead = _validate.limiter(name, pace, lead)
        self.burst, self.keep = _validate.burst(burst), _validate.keep(keep)
        self.max_running, self.lease = _validate.max_running(max_running), _validate.lease(lease)
        keep_us = 0 if self.keep is None else max(1, round(self.keep * US))
        cap, lease_us = (self.max_running, round(self.lease * US)) if self.max_running else (0, 0)
        rule = terms(self._interval_us, self.burst, keep_us, cap, lease_us)  # checks burst * interval
        #: the keyword arguments every state operation gets
        self._terms = {"burst": rule.burst, "keep_us": rule.keep_us}
        if cap:  # a queue without a cap sends what it sent before leases
            self._terms.update(max_running=cap, lease_us=lease_us)
        #: the leases of the jobs this shard began (with ``max_running``)
        self._leases = LeaseBook(self.lease)
        #: whether a lease keeper (thread or task) runs
        self._keeping = False
        self._max_late = _validate.max_late(max_late)
        self._clock = clock or time.monotonic
        self._state: S = self._open(url)
        #: whether this limiter opened the state (and so closes it); a state object passed in stays open
        self._owns_state = not isinstance(url, StateBase)
        checked = _validate.checked_lateness(self._max_late, self._state.clock_resolution)
        # a memory state reads this process's own clock: no step between the two can happen
        inner = getattr(self._state, "state", self._state)  # the state an asyncio wrapper runs
        same_clock = clock is None and isinstance(inner, MemoryState)
        self._shard = Shard(
            self.interval, lead=self._lead, max_late=checked, burst=self.burst, same_clock=same_clock
        )

    @property
    def state(self) -> S:
        """The state this limiter uses."""
        return self._state

    @property
    def paused(self) -> bool:
        """Whether this shard is paused."""
        return self._shard.paused

    def pause(self) -> None:
        """Pause this shard: its callers keep their places, and it stops calling the state."""
        with self._locked():
            self._shard.pause()
            self._changed()

    def resume(self) -> None:
        """Resume this shard after :meth:`pause`."""
        with self._locked():
            self._shard.resume()
            self._changed()

    def _set_paused_everywhere(self, paused: bool) -> Any:
        """Set the queue's shared pause flag (:meth:`ratequeue.state.State.set_paused`): whether it changed.

        A coroutine on asyncio. The record is created with this limiter's
        terms if it is missing. Only the flag changes: this shard keeps
        running, and its waiting head is told to wait, a second at a time,
        like every other shard's.
        """
        state: Any = self._state
        return state.set_paused(self.name, self._interval_us, paused, **self._terms)

    def _ask_again(self) -> None:
        """Have this shard's head ask the state at once (its record changed: a resume)."""
        with self._locked():
            self._shard.ask_again()
            self._changed()

    def __reduce__(self) -> tuple[Any, ...]:
        # without on_event: a hook (and its metrics) belongs to the process that made it
        settings = (self.name, self.interval, self._lead, self._max_late, self.burst, self.keep)
        return (_rebuild, (type(self), self._state.url, *settings, self.max_running, self.lease))

    def __repr__(self) -> str:
        url = redact(self._state.url)
        more = f", burst={self.burst!r}" if self.burst != 1 else ""
        more += f", max_running={self.max_running!r}" if self.max_running else ""
        return f"{self._display_name}({url!r}, name={self.name!r}, interval={self.interval!r}{more})"

    #: the name ``repr`` shows
    _display_name = "Limiter"

    @abstractmethod
    def acquire(self, timeout: Seconds | None = None, *, cost: int = 1) -> Any:
        """Wait for this caller's turn (a coroutine on asyncio), and return it."""

    @abstractmethod
    def wrap(self, fn: F, *, cost: int = 1) -> F:
        """``fn`` changed so that every call first waits for its turn, of ``cost``."""

    @overload
    def __call__(self, fn: F, /) -> F: ...

    @overload
    def __call__(self, fn: None = None, /, *, cost: int = 1) -> Callable[[F], F]: ...

    def __call__(self, fn: F | None = None, /, *, cost: int = 1) -> F | Callable[[F], F]:
        """Decorate ``fn`` so that every call waits for its turn (see :meth:`wrap`).

        ``@limiter`` costs each call 1; ``@limiter(cost=3)`` costs it 3.
        """
        cost = _validate.cost(cost, self.burst)
        if fn is None:
            return lambda function: self.wrap(function, cost=cost)
        return self.wrap(fn, cost=cost)

    @abstractmethod
    def _open(self, url: Any) -> S:
        """Open the state named by ``url`` for this driver."""

    @abstractmethod
    def _locked(self) -> AbstractContextManager[Any]:
        """A context holding the driver's lock over the shard (a no-op on the event loop)."""

    @abstractmethod
    def _changed(self) -> None:
        """Wake the jobs waiting for the shard to change; called holding :meth:`_locked`."""

    # The effects of the acquire flow, each a plain function or a coroutine function:
    # waiting for a change (or ``timeout`` s), waiting precisely until local time
    # ``until`` (released from the lock), and calling the state, timed, released from it.

    @abstractmethod
    def _wait_for_change(self, timeout: float | None) -> Any: ...

    @abstractmethod
    def _wait_until(self, until: float, now: float, spin: bool) -> Any: ...

    @abstractmethod
    def _wait_precisely(self, until: float) -> Any:
        """Wait, holding no lock, until local time ``until``, as precisely as the driver can."""

    @abstractmethod
    def _call_state(
        self, operation: Callable[..., Any], args: tuple[int, ...], kwargs: dict[str, int]
    ) -> Any: ...

    def _operation(
        self, step: TakeAndTry | TryStart | Retime
    ) -> tuple[Callable[..., Any], tuple[int, ...], dict[str, int]]:
        """The state method, arguments (after the name) and keyword arguments that ``step`` calls for."""
        state: Any = self._state
        if isinstance(step, TakeAndTry):
            return state.take_and_try, (self._interval_us, step.lead_us), {**self._terms, "cost": step.cost}
        if isinstance(step, TryStart):
            args = (self._interval_us, step.ticket, step.lead_us)
            return state.try_start, args, {**self._terms, "cost": step.cost}
        return state.retime, (self._interval_us, step.ticket, step.lead_us), self._terms

    def _shard_changed(self) -> None:
        """Wake the jobs waiting for the shard to change, and hand its unused grants' leases to the keeper.

        Called holding :meth:`_locked`, after every change of the shard.
        """
        if self._shard.unused:
            if self.max_running:
                for ticket in self._shard.unused:
                    self._leases.to_release(ticket)
                self._keep_leases()
            self._shard.unused.clear()
        self._changed()

    def _began(self, turn: Turn) -> None:
        """``turn``'s job begins now: with ``max_running``, its lease is held (and renewed) from now on."""
        if self.max_running:
            self._leases.began(turn.ticket, self._clock())
            self._keep_leases()

    def _end_lease(self, ticket: int, *, later: bool) -> tuple[Any, ...] | None:
        """The job on ``ticket`` has ended: stop renewing its lease; holding :meth:`_locked`.

        With ``later`` the keeper releases it; otherwise the caller does,
        with the state call returned (``None``: nothing to release, no cap).
        """
        if not self.max_running:
            return None
        self._leases.ended(ticket)
        if later:
            self._leases.to_release(ticket)
            self._keep_leases()
            self._changed()  # a keeper sleeping until its next renewal releases it now
            return None
        return self._lease_call("release", ticket)

    def _release_unused(self) -> Flow[None]:
        """Release, now, the leases of the turns this shard was granted and nobody began.

        A release that fails is left to the keeper (which retries it, or the
        lease expires); an interrupted one too, and the interruption goes on.
        """
        tickets, self._shard.unused[:] = list(self._shard.unused), []
        while tickets:
            ticket = tickets.pop(0)
            try:
                yield Call(self._call_state, self._lease_call("release", ticket))
            except Exception:
                self._end_lease(ticket, later=True)
            except BaseException:
                for left in (ticket, *tickets):
                    self._end_lease(left, later=True)
                raise

    def _lease_call(self, what: str, ticket: int) -> tuple[Any, ...]:
        """The arguments of :meth:`_call_state` for a ``release`` or ``renew`` of ``ticket``'s lease."""
        state: Any = self._state
        return getattr(state, what), (self._interval_us, ticket), self._terms

    def _place_freed(self) -> None:
        """A lease was released here: this shard's waiting head asks again at once."""
        self._shard.ask_again()
        self._changed()

    def _keep_leases(self) -> None:
        """Start the lease keeper if there is work for it and none runs; holding :meth:`_locked`."""
        if not self._keeping and self._leases.busy:
            self._keeping = True
            try:
                self._start_keeper()
            except BaseException:  # no thread could be started: the next call tries again
                self._keeping = False
                raise

    @abstractmethod
    def _start_keeper(self) -> None:
        """Run :meth:`_keeper_flow` in the background (a thread, or a task on the event loop)."""

    def _keeper_flow(self) -> Flow[None]:
        """Renew this shard's leases while their jobs run, release those handed over; stop when none is left.

        Runs holding :meth:`_locked`, as the acquire flow does. A failed
        call is logged, never raised: a lease not renewed expires by itself.
        """
        book = self._leases
        try:
            while book.busy:
                ticket = book.next_release()
                if ticket is not None:
                    try:
                        yield Call(self._call_state, self._lease_call("release", ticket))
                    except Exception as exc:  # its lease expires by itself
                        _log.warning("could not release lease %d of queue %r: %s", ticket, self.name, exc)
                    self._place_freed()
                    continue
                now = self._clock()
                due, wait = book.next_renewal(now)
                if due is None:
                    yield Call(self._wait_for_change, (_validate.wait(wait),))
                    continue
                try:
                    live, *_ = yield Call(self._call_state, self._lease_call("renew", due))
                except Exception as exc:
                    _log.warning("could not renew lease %d of queue %r: %s", due, self.name, exc)
                    book.failed(due, self._clock())
                    continue
                if not live and book.holds(due):
                    _log.warning(
                        "the lease of a job of queue %r ran out before it was renewed (ticket %d): "
                        "the job runs on uncounted; a longer lease (now %g s) avoids it",
                        self.name,
                        due,
                        self.lease,
                    )
                book.renewed(due, now, bool(live))
        finally:
            self._keeping = False
            self._changed()  # a close() waiting for the keeper to finish goes on

    # Reporting: events for the on_event hook, and log lines. Each is called only where the
    # hook is set or the level is on, so an unused hook or logger costs one test per place.

    def _emit(self, event: Event) -> None:
        """Hand ``event`` on to the ``on_event`` hook, which runs later, off this path; never raises.

        The thread driver puts it on the reporter thread's queue
        (:func:`ratequeue.events.report`); the asyncio driver schedules it on
        the event loop. The hook never runs here: not under the limiter's
        lock, nor between a turn's lateness check and its begin (G7).
        """
        outlet = self._outlet
        if outlet is not None:
            report(outlet, event)

    def _call_answered(
        self,
        operation: Callable[..., Any],
        args: tuple[int, ...],
        answer: object,
        sent: float,
        received: float,
    ) -> None:
        """Report a state call of this limiter that was answered (a ``"call"`` event, a DEBUG line)."""
        what = getattr(operation, "__name__", "call")
        ticket = getattr(answer, "ticket", None) if what == "take_and_try" else args[1]
        outcome = _outcome_name(answer)
        if self._on_event is not None:
            self._emit(
                Event(
                    "call",
                    self.name,
                    ticket=ticket,
                    duration=received - sent,
                    operation=what,
                    outcome=outcome,
                )
            )
        if _calls_log.isEnabledFor(_DEBUG):
            _calls_log.debug(
                "%s queue=%r ticket=%s -> %s in %d us",
                what,
                self.name,
                ticket,
                outcome,
                round((received - sent) * US),
            )

    def _call_failed(
        self, operation: Callable[..., Any], args: tuple[int, ...], exc: Exception, sent: float
    ) -> None:
        """Report a state call of this limiter that raised (a ``"state_error"`` event, a DEBUG line).

        The error itself goes on to the caller, who sees it; the states log
        the failures they retried (at WARNING) before giving up.
        """
        duration = self._clock() - sent
        what = getattr(operation, "__name__", "call")
        ticket = None if what == "take_and_try" else args[1]
        error = type(exc).__name__
        if self._on_event is not None:
            self._emit(
                Event(
                    "state_error",
                    self.name,
                    ticket=ticket,
                    duration=duration,
                    operation=what,
                    error=error,
                )
            )
        if _calls_log.isEnabledFor(_DEBUG):
            _calls_log.debug(
                "%s queue=%r ticket=%s -> %s (%s) in %d us",
                what,
                self.name,
                ticket,
                error,
                exc,
                round(duration * US),
            )

    def _report_start(self, turn: Turn, now: float, since: float) -> None:
        """Report the begin of ``turn`` at local time ``now``, asked for at ``since``."""
        wait, lateness = now - since, now - turn.local_start
        if self._on_event is not None:
            self._emit(Event("start", self.name, ticket=turn.ticket, wait=wait, lateness=lateness))
        if _log.isEnabledFor(_DEBUG):
            _log.debug(
                "queue %r: ticket %d begins after a wait of %.6f s, %d us after its start",
                self.name,
                turn.ticket,
                wait,
                round(lateness * US),
            )

    def _report_timeout(self, job: Job, waited: float) -> None:
        """Report a caller that gives up after ``waited`` seconds (its ``AcquireTimeout`` follows)."""
        if self._on_event is not None:
            self._emit(Event("timeout", self.name, wait=waited))
        if _log.isEnabledFor(_DEBUG):
            _log.debug(
                "queue %r: a caller gives up after %.6f s (timeout %s s)", self.name, waited, job.timeout
            )

    def _report_passed(self, outcome: Passed) -> None:
        """Report a held ticket the state answered as passed; the shard takes a new one.

        A ticket the record never handed out (``pos`` below it) was lost:
        the record was reset, deleted, or lost in a failover -- a WARNING,
        unless the queue keeps idle records for a while only (``keep``),
        where an expired record is the expected cause. A ticket a later one
        started before is the usual end of a ticket held past its slot (a
        caller that gave up left it; the shard was paused; it woke late).
        """
        if self._on_event is not None:
            self._emit(Event("passed", self.name, ticket=outcome.ticket))
        if outcome.pos < outcome.ticket and self.keep is None:
            _log.warning(
                "queue %r: ticket %d was lost: the state's record no longer knows it (it is at ticket "
                "%d), so it was reset, deleted or lost in a failover; taking a new ticket",
                self.name,
                outcome.ticket,
                outcome.pos,
            )
        elif _log.isEnabledFor(logging.INFO):
            _log.info(
                "queue %r: ticket %d has passed (ticket %d has started; this one was held past its "
                "slot, or its record expired); taking a new ticket",
                self.name,
                outcome.ticket,
                outcome.pos,
            )

    def _report_late(
        self, ticket: int, lateness: float, outcome: str, in_a_row: int, *, paused: bool = False
    ) -> None:
        """Report a granted turn that woke ``lateness`` s after its start: ``outcome`` says what was done.

        ``lateness`` is at worst: for a start granted by the shard's first answer it
        includes that answer's round-trip (see :attr:`ratequeue.shard.Job.doubt`).

        A start moved later keeps every guarantee, and a queue with a burst
        begins a late turn by design (DEBUG). A turn given up costs its slot:
        INFO, as a busy moment of the host makes one now and then; WARNING
        when one caller has given up ``in_a_row`` >= :data:`LATE_WARNING_REPEATS`
        turns in a row -- the host cannot begin within ``max_late`` -- at most
        once a minute per limiter, with the count of turns given up since.
        A turn given up because the shard is ``paused`` (its start cannot be
        moved then, G6) is not the host's fault: INFO, and not counted.
        """
        if self._on_event is not None:
            self._emit(Event("late", self.name, ticket=ticket, lateness=lateness, outcome=outcome))
        if outcome == "given_up" and paused:
            if _log.isEnabledFor(logging.INFO):
                _log.info(
                    "queue %r: ticket %d woke %d us after its start while this shard is paused: given "
                    "up (a paused shard cannot move its start); taking a new ticket on resume",
                    self.name,
                    ticket,
                    round(lateness * US),
                )
            return
        if outcome == "given_up":
            self._late_given_up += 1
            now = self._clock()
            warn = in_a_row >= LATE_WARNING_REPEATS and (
                self._late_warned is None or now - self._late_warned >= LATE_WARNING_EVERY
            )
            if warn:
                _log.warning(
                    "queue %r: a caller gave up %d turns in a row because this process woke more than "
                    "max_late=%g s after their starts (the latest %.6f s late); %d turn(s) given up "
                    "since the last warning, each costing a slot. A busy host: fewer threads or "
                    "processes, or a larger max_late",
                    self.name,
                    in_a_row,
                    self._max_late,
                    lateness,
                    self._late_given_up,
                )
                self._late_given_up, self._late_warned = 0, now
            elif _log.isEnabledFor(logging.INFO):
                _log.info(
                    "queue %r: ticket %d woke %d us after its start, more than max_late: given up "
                    "(%d in a row for this caller); taking a new ticket",
                    self.name,
                    ticket,
                    round(lateness * US),
                    in_a_row,
                )
            return
        if _log.isEnabledFor(_DEBUG):
            _log.debug(
                "queue %r: ticket %d woke %d us after its start, more than max_late: %s",
                self.name,
                ticket,
                round(lateness * US),
                outcome,
            )

    def _report_clock_step(self) -> None:
        """Log the clock step the shard has just noticed (see :attr:`ratequeue.shard.Shard.clock_step`)."""
        step = self._shard.clock_step
        level = logging.WARNING if abs(step) >= CLOCK_STEP_WARNING else _DEBUG
        if _log.isEnabledFor(level):
            _log.log(
                level,
                "queue %r: the state's clock moved %+.6f s against this host's between two answers (a "
                "clock step: %s); starts are converted with the new offset. Check NTP on the hosts",
                self.name,
                -step,
                "the state's went back, or this host's forward" if step > 0 else "the state's went forward",
            )

    def _timeout_error(self, job: Job) -> AcquireTimeout:
        timeout = None if job.deadline is None else job.timeout
        return AcquireTimeout(
            f"no turn in queue {self.name!r} within {timeout} s", name=self.name, timeout=timeout
        )

    def _acquire_flow(self, job: Job, *, attempt: bool = False) -> Flow[Turn | None]:
        """Carry ``job`` through the shard's steps until its turn begins; ``None`` if it is withdrawn.

        Runs holding the driver's lock (:meth:`_locked`), which the driver's
        waits and calls release while they last. With ``attempt`` (a
        ``try_acquire``), no turn free now is not reported as a timeout.

        :raises AcquireTimeout: as soon as the turn cannot come by the job's deadline.
        """
        shard = self._shard
        now = since = self._clock()
        try:
            while True:
                if job.withdrawn:
                    return None
                granted, given_up, given_up_paused = job.turn, job.given_up, job.given_up_paused
                doubt = job.doubt  # how much later than it seems the turn may begin (a first answer)
                step = shard.step(job, now)
                # A doubted start checked before it came (a first, slow answer) did not wake late:
                # moving it or giving it up is not reported as a late wake-up.
                woke_late = granted if granted is not None and now >= granted.local_start else None
                if job.given_up != given_up and woke_late is not None:  # out of re-times: given up
                    paused = job.given_up_paused != given_up_paused  # paused: its start could not move
                    in_a_row = job.given_up - job.given_up_paused
                    lateness = now - woke_late.local_start + doubt
                    self._report_late(woke_late.ticket, lateness, "given_up", in_a_row, paused=paused)
                if isinstance(step, Begin):
                    # From the lateness check (the step) to the return: no hook runs here, only
                    # a put of the event (and the DEBUG line, when that is on).
                    turn = step.turn
                    try:
                        self._began(turn)
                        self._shard_changed()  # the next job is head now
                        reporting = self._on_event is not None or _log.isEnabledFor(_DEBUG)
                        if reporting and not QUIET_STARTS.get():
                            self._report_start(turn, now, since)
                    except BaseException:  # interrupted: the job will not run, its place goes back
                        self._end_lease(turn.ticket, later=True)
                        raise
                    return turn
                if isinstance(step, Expired):
                    if not attempt and (self._on_event is not None or _log.isEnabledFor(_DEBUG)):
                        self._report_timeout(job, now - since)
                    raise self._timeout_error(job)
                # waits are cut to _validate.MAX_WAIT (the loop then looks again), so that
                # no timeout, however long, overflows the driver's wait
                if isinstance(step, WaitForTurn):
                    wait = None if step.deadline is None else step.deadline - now
                    yield Call(self._wait_for_change, (_validate.wait(wait),))
                elif isinstance(step, SleepUntil):
                    yield Call(self._wait_for_change, (_validate.wait(step.until - now),))
                elif isinstance(step, BeginAt):
                    yield Call(self._wait_until, (step.until, now, step.spin))
                else:
                    if self.max_running and self._shard.unused:
                        # a turn given up (G7) holds a place: give it back before asking for a new one
                        yield from self._release_unused()
                    call = self._operation(step)
                    try:
                        outcome, sent, received, state_now = yield Call(self._call_state, call)
                    except BaseException:
                        shard.failed(job)
                        raise
                    offset = None if state_now is None else received - state_now
                    steps = shard.clock_steps
                    shard.receive(job, outcome, sent, received, offset=offset)
                    if shard.clock_steps != steps:
                        self._report_clock_step()
                    if isinstance(step, Retime) and woke_late is not None:
                        done = "begun" if job.begins_late else "moved"  # (a burst begins late)
                        done = "given_up" if job.given_up != given_up else done
                        lateness = now - woke_late.local_start + doubt
                        self._report_late(step.ticket, lateness, done, job.given_up - job.given_up_paused)
                    elif isinstance(outcome, Passed) and isinstance(step, TryStart):
                        self._report_passed(outcome)
                    self._shard_changed()
                now = self._clock()
        except BaseException:
            self._shard.abandon(job)
            self._shard_changed()
            raise

    @abstractmethod
    def reserve(self, *, cost: int = 1) -> ReservationBase[S]:
        """Take a place in this shard's queue now, for a job of ``cost``, to wait for its turn later."""

    @abstractmethod
    def _attempt(self, cost: int) -> Any:
        """``(turn, None)`` if a turn of ``cost`` is free now, else ``(None, when)`` (a coroutine on asyncio).

        ``when`` is the local time the state said this caller's slot comes,
        or ``None`` if it did not say (another caller was ahead in this shard).
        """

    def _is_idle(self) -> bool:
        """Whether nobody waits here and no call or begin is under way (a group may then drop it)."""
        with self._locked():
            return self._shard.idle and not self._leases.busy

    def _add_job(self, cost: int = 1) -> Job:
        """A new job of ``cost`` at the back of the shard's queue (holding the lock), for a reservation."""
        return self._shard.add(cost=cost)

    def _new_job(self, timeout: Seconds | None, cost: int) -> Job:
        """A new job at the back of the shard's queue (holding the lock), its arguments checked."""
        seconds = _validate.timeout(timeout)
        cost = _validate.cost(cost, self.burst)
        return self._shard.add(None if seconds is None else self._clock() + seconds, seconds, cost)


class ReservationBase(ABC, Generic[S]):
    """A place in a limiter's queue, taken when made; the drivers add ``wait``.

    Cancel it from any thread (asyncio: from the event loop's thread) to give
    the place up: a wait in progress then returns ``None``.
    """

    def __init__(self, limiter: LimiterBase[S], cost: int = 1) -> None:
        self._limiter = limiter
        #: the turn :meth:`wait` returned, once it has begun: a second wait returns it again
        self._begun: Turn | None = None
        cost = _validate.cost(cost, limiter.burst)
        with limiter._locked():
            self._job = limiter._add_job(cost)

    @property
    def turn(self) -> Turn | None:
        """The turn, once :meth:`wait` has returned it."""
        job = self._job
        return job.turn if job.turn is not None and not job.queued and not job.withdrawn else None

    @property
    def cancelled(self) -> bool:
        """Whether :meth:`cancel` took the place (before its turn began)."""
        return self._job.withdrawn

    def cancel(self) -> None:
        """Give the place up, unless its turn has begun; a waiting :meth:`wait` returns ``None``.

        A turn granted and not yet begun is dropped: its slot goes unused.
        """
        with self._limiter._locked():
            self._limiter._shard.withdraw(self._job)
            self._limiter._shard_changed()

    @abstractmethod
    def wait(self, timeout: Seconds | None = None) -> Any:
        """Wait for the turn of this place (a coroutine on asyncio); ``None`` if cancelled."""

    def _start_waiting(self, timeout: Seconds | None) -> Job:
        """The job, its deadline set from ``timeout`` seconds (checked) from now."""
        seconds = _validate.timeout(timeout)
        job = self._job
        if job.queued and seconds is not None:
            job.deadline = self._limiter._clock() + seconds
            job.timeout = seconds
        return job

    def __repr__(self) -> str:
        state = "cancelled" if self.cancelled else "granted" if self.turn else "waiting"
        return f"<{type(self).__name__} {state} in {self._limiter!r}>"


def _rebuild(
    cls: type[LimiterBase[Any]],
    url: str,
    name: str,
    interval: float,
    lead: float | None,
    max_late: float | None = DEFAULT_MAX_LATE,
    burst: int = 1,
    keep: float | None = None,
    max_running: int | None = None,
    lease: float = DEFAULT_LEASE,
) -> LimiterBase[Any]:
    return cls(
        url,
        name=name,
        interval=interval,
        lead=lead,
        max_late=max_late,
        burst=burst,
        keep=keep,
        max_running=max_running,
        lease=lease,
    )


#: the most (s) the two reads of :func:`received_and_state_now` may span before they are read again
_PAIR_SPAN = 50e-6
#: how many times the pair is read at most (a stall between two reads rarely comes twice in a row)
_PAIR_TRIES = 3


def received_and_state_now(
    clock: Callable[[], float], local_now: Callable[[], float | None]
) -> tuple[float, float | None]:
    """This host's clock and the state's local clock (``None``: a server's), read as one instant.

    The offset ``received - state_now`` converts a state on this host's
    clock to local time exactly, unless the process stalls between the two
    reads: then one turn's start converts early or late by the stall, and a
    begin comes that much off (G7). So the state's clock is read between two
    reads of this host's, read again while they are more than
    :data:`_PAIR_SPAN` apart (up to :data:`_PAIR_TRIES` times), and placed
    at their midpoint: the error is at most half the span.
    """
    before = clock()
    state_now = local_now()
    after = clock()
    if state_now is None:
        return after, None
    for _ in range(_PAIR_TRIES - 1):
        if after - before <= _PAIR_SPAN:
            break
        before = clock()
        state_now = local_now()
        after = clock()
    assert state_now is not None
    return after, state_now + (after - before) / 2


def _outcome_name(answer: object) -> str:
    """A state's answer as a word: ``started``, ``wait``, ``passed``; ``live``/``expired`` for a lease."""
    if isinstance(answer, Started):
        return "started"
    if isinstance(answer, Passed):
        return "passed"
    if isinstance(answer, bool):
        return "live" if answer else "expired"
    return type(answer).__name__.lower()
