"""What one shard tells the world: events for its ``on_event`` hook, and log lines.

A :class:`Reporter` is called where something happens (a begin, a state call,
a timeout, a passed ticket, a late wake-up, a clock step) and builds the
:class:`~ratequeue.events.Event` and the log line only when a hook is set or
the logger's level is on, so an unused hook costs one test per place
(:attr:`Reporter.on`). A hook never runs here: the driver hands the event on
(docs/design.md, "Events"), never between a turn's lateness check and its begin.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from .core.operation import Operation
from .core.protocol import US, Passed, Started
from .core.shard import Place, Turn
from .events import Event, EventHook, Outlet

if TYPE_CHECKING:
    from .drivers import Driver

__all__ = ["CLOCK_STEP_WARNING", "LATE_WARNING_EVERY", "LATE_WARNING_REPEATS", "QUIET_STARTS", "Reporter"]

#: begins (DEBUG), passed and lost tickets, late turns, clock steps
_log = logging.getLogger("ratequeue.limiter")
#: one DEBUG line per state call: operation, queue, ticket, answer, duration
_calls_log = logging.getLogger("ratequeue.limiter.calls")
_DEBUG = logging.DEBUG

#: a clock step (s) at least this large is logged at WARNING; smaller ones at DEBUG
CLOCK_STEP_WARNING = 0.05
#: a caller that gives up this many turns in a row for late wake-ups is logged at WARNING (fewer: INFO)
LATE_WARNING_REPEATS = 2
#: the most often (s) one shard logs turns given up at WARNING; the others meanwhile are INFO
LATE_WARNING_EVERY = 60.0

#: set while ``all_of()`` takes its turns in this thread or task: their begins are reported
#: once they begin together, not as each is taken
QUIET_STARTS: ContextVar[bool] = ContextVar("ratequeue_quiet_starts", default=False)


class Reporter:
    """The events and log lines of one shard (a limiter, or a queue's limiter)."""

    def __init__(
        self,
        name: str,
        hook: EventHook | None,
        owner: object,
        driver: Driver,
        clock: Callable[[], float],
        *,
        keep: float | None = None,
        max_late: float | None = None,
        fair: bool = False,
    ) -> None:
        self.name = name
        #: whether the queue is fair: its begins and timeouts carry the caller's tenant
        self.fair = fair
        #: whether a hook is set: the places that report test this first
        self.on = hook is not None
        self._outlet = None if hook is None else Outlet(hook, owner)
        self._driver, self._clock = driver, clock
        self._keep, self._max_late = keep, max_late
        #: turns given up for late wake-ups since the last warning about them, and when that was
        self._given_up = 0
        self._warned: float | None = None

    @property
    def calls(self) -> bool:
        """Whether state calls are reported (a hook, or DEBUG on ``ratequeue.limiter.calls``)."""
        return self.on or _calls_log.isEnabledFor(_DEBUG)

    @property
    def begins(self) -> bool:
        """Whether begins are reported (a hook, or DEBUG on ``ratequeue.limiter``), outside ``all_of``."""
        return (self.on or _log.isEnabledFor(_DEBUG)) and not QUIET_STARTS.get()

    def emit(self, event: Event) -> None:
        """Hand ``event`` on to the hook, which runs later, off this path; never raises."""
        if self._outlet is not None:
            self._driver.emit(self._outlet, event)

    def call_answered(self, op: Operation, answer: object, duration: float) -> None:
        """A state call was answered (a ``"call"`` event, a DEBUG line)."""
        if op.kind == "take_and_try" or (op.kind == "try_take" and isinstance(answer, Started)):
            ticket = answer.ticket  # type: ignore[attr-defined]
        else:  # (a try_take that waited took no ticket: it names none)
            ticket = None if op.kind == "try_take" else op.ticket
        outcome = _outcome_name(answer)
        if self.on:
            self.emit(Event("call", self.name, ticket, duration=duration, operation=op.kind, outcome=outcome))
        _calls_log.debug(_CALL, op.kind, self.name, ticket, outcome, round(duration * US))

    def call_failed(self, op: Operation, exc: Exception, duration: float) -> None:
        """A state call raised (a ``"state_error"`` event, a DEBUG line); the error goes on to the caller."""
        ticket, error = (None if op.kind in ("take_and_try", "try_take") else op.ticket), type(exc).__name__
        if self.on:
            self.emit(
                Event("state_error", self.name, ticket, duration=duration, operation=op.kind, error=error)
            )
        _calls_log.debug(_CALL_FAILED, op.kind, self.name, ticket, error, exc, round(duration * US))

    def begin(self, turn: Turn, now: float, since: float, tenant: str | None = None) -> None:
        """The begin of ``turn`` at local time ``now``, asked for at ``since`` (by ``tenant``, if fair)."""
        wait, lateness = now - since, now - turn.local_start
        if self.on:
            self.emit(Event("begin", self.name, turn.ticket, wait=wait, lateness=lateness, tenant=tenant))
        _log.debug(_BEGIN, self.name, turn.ticket, wait, round(lateness * US))

    def timeout(self, place: Place, waited: float) -> None:
        """A caller gives up after ``waited`` seconds (its ``AcquireTimeout`` follows)."""
        if self.on:
            tenant = place.tenant if self.fair else None
            self.emit(Event("timeout", self.name, wait=waited, tenant=tenant))
        _log.debug(_TIMEOUT, self.name, waited, place.timeout)

    def state_down(self, mode: str, error: str) -> None:
        """The state failed a call; turns begin locally now (a ``"state_down"`` event)."""
        if self.on:
            self.emit(Event("state_down", self.name, outcome=mode, error=error))

    def state_back(self, mode: str, down_for: float) -> None:
        """After ``down_for`` s down, turns come from the state again, or the limiter closed."""
        if self.on:
            self.emit(Event("state_back", self.name, wait=down_for, outcome=mode))

    def passed(self, outcome: Passed) -> None:
        """A held ticket was answered as passed; the shard takes a new one.

        A ticket the record never handed out (``pos`` below it) was lost: the
        record was reset, deleted or lost in a failover -- a WARNING, unless
        the queue keeps idle records for a while only (``keep``), where an
        expired record is the expected cause.
        """
        if self.on:
            self.emit(Event("passed", self.name, outcome.ticket))
        lost = outcome.pos < outcome.ticket and self._keep is None
        _log.log(
            logging.WARNING if lost else logging.INFO,
            _LOST if lost else _PASSED,
            self.name,
            outcome.ticket,
            outcome.pos,
        )

    def late(
        self, ticket: int, lateness: float, outcome: str, in_a_row: int, *, paused: bool = False
    ) -> None:
        """A started turn woke ``lateness`` s after its start; ``outcome`` says what was done.

        A start moved later keeps every guarantee, and a bursty queue begins a
        late turn by design (DEBUG). A turn given up costs its slot: INFO; a
        WARNING when one caller gave up :data:`LATE_WARNING_REPEATS` in a row
        (the host cannot begin within ``max_late``), at most once a minute. A
        turn given up because the shard is ``paused`` is not the host's fault:
        INFO, not counted.
        """
        if self.on:
            self.emit(Event("late", self.name, ticket, lateness=lateness, outcome=outcome))
        late_us = round(lateness * US)
        if paused:  # given up: a paused shard cannot move its start
            _log.info(_PAUSED_LATE, self.name, ticket, late_us)
            return
        if outcome != "given_up":
            _log.debug(_LATE, self.name, ticket, late_us, outcome)
            return
        self._given_up += 1
        now = self._clock()
        if in_a_row >= LATE_WARNING_REPEATS and (
            self._warned is None or now - self._warned >= LATE_WARNING_EVERY
        ):
            _log.warning(_GIVEN_UP_WARNING, self.name, in_a_row, self._max_late, lateness, self._given_up)
            self._given_up, self._warned = 0, now
        else:
            _log.info(_GIVEN_UP, self.name, ticket, late_us, in_a_row)

    def clock_step(self, step: float) -> None:
        """The shard noticed a clock step of ``step`` s (positive: the state's clock went back)."""
        which = "the state's went back, or this host's forward" if step > 0 else "the state's went forward"
        _log.log(
            logging.WARNING if abs(step) >= CLOCK_STEP_WARNING else _DEBUG, _STEP, self.name, -step, which
        )

    def lease_warning(self, message: str, *args: Any) -> None:
        """A lease could not be renewed or released (it expires by itself)."""
        _log.warning(message, *args)


_CALL = "%s queue=%r ticket=%s -> %s in %d us"
_CALL_FAILED = "%s queue=%r ticket=%s -> %s (%s) in %d us"
_BEGIN = "queue %r: ticket %d begins after a wait of %.6f s, %d us after its start"
_TIMEOUT = "queue %r: a caller gives up after %.6f s (timeout %s s)"
_LOST = (
    "queue %r: ticket %d was lost: the state's record no longer knows it (it is at ticket %d), so it was "
    "reset, deleted or lost in a failover; taking a new ticket"
)
_PASSED = (
    "queue %r: ticket %d has passed (ticket %d has started; this one was held past its slot, or its record "
    "expired); taking a new ticket"
)
_LATE = "queue %r: ticket %d woke %d us after its start, more than max_late: %s"
_PAUSED_LATE = (
    "queue %r: ticket %d woke %d us after its start while this shard is paused: given up (a paused shard "
    "cannot move its start); taking a new ticket on resume"
)
_GIVEN_UP = (
    "queue %r: ticket %d woke %d us after its start, more than max_late: given up (%d in a row for this "
    "caller); taking a new ticket"
)
_GIVEN_UP_WARNING = (
    "queue %r: a caller gave up %d turns in a row because this process woke more than max_late=%g s after "
    "their starts (the latest %.6f s late); %d turn(s) given up since the last warning, each costing a slot. "
    "A busy host: fewer threads or processes, or a larger max_late"
)
_STEP = (
    "queue %r: the state's clock moved %+.6f s against this host's between two answers (a clock step: %s); "
    "starts are converted with the new offset. Check NTP on the hosts"
)


def _outcome_name(answer: object) -> str:
    """A state's answer as a word: ``started``, ``wait``, ``passed``; ``live``/``expired`` for a lease."""
    if isinstance(answer, Started):
        return "started"
    if isinstance(answer, Passed):
        return "passed"
    if isinstance(answer, bool):
        return "live" if answer else "expired"
    return type(answer).__name__.lower()
