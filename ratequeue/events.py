"""What limiters and queues report to an ``on_event`` hook: starts, waits, state calls, failures.

Every :class:`~ratequeue.Limiter`, :class:`~ratequeue.Queue`,
:class:`~ratequeue.LimiterGroup` and their :mod:`ratequeue.aio` twins take
``on_event=callback``; the callback is called with one :class:`Event` for
each thing below, in the thread (or on the event loop) where it happened::

    def count(event: ratequeue.Event) -> None:
        if event.kind == "start":
            waits.append(event.wait)

    limiter = ratequeue.Limiter("memory://", name="api", interval=0.1, on_event=count)

``ratequeue.prometheus.PrometheusMetrics`` is such a callback. With
``on_event=None`` (the default) nothing is built and nothing is called: each
place that could report costs one ``is not None`` test.

**The callback's rules.** It may be called while the limiter holds its
lock (the thread driver's condition), and from several threads at once, so
it must be quick, thread-safe, and must not call the limiter or queue that
reported; counting, or putting the event on a queue, is what it is for.
An exception it raises is caught: the event is dropped, the acquire (or
the job) goes on, and the first such exception of each limiter is logged
at WARNING on the ``ratequeue.events`` logger with its traceback (later
ones at DEBUG), so a broken metrics hook can never stop the work it
measures. A limiter pickles without its hook.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from .errors import ConfigurationError

__all__ = ["KINDS", "Event", "EventHook", "EventKind", "check_hook"]

#: what an :class:`Event` reports
EventKind = Literal["start", "timeout", "call", "state_error", "passed", "late", "retry", "dead_letter"]

#: every :data:`EventKind`, in the order the docs list them
KINDS: tuple[EventKind, ...] = (
    "start",
    "timeout",
    "call",
    "state_error",
    "passed",
    "late",
    "retry",
    "dead_letter",
)


@dataclass(frozen=True)
class Event:
    """One thing a limiter or queue did, for metrics. Fields a kind does not use are ``None``.

    ====================  ==========================================================================
    ``kind``              what happened, and the fields it sets
    ====================  ==========================================================================
    ``"start"``           a caller's turn begins (``acquire()`` returns; a queue's job is started):
                          ``ticket``, ``wait``, ``lateness``
    ``"timeout"``         a caller gave up waiting (``AcquireTimeout``): ``wait``
    ``"call"``            a call to the state was answered: ``operation``, ``outcome``, ``duration``,
                          ``ticket``
    ``"state_error"``     a call to the state raised (after the state's own retries): ``operation``,
                          ``error``, ``duration``, ``ticket``
    ``"passed"``          the state answered that the ticket held here has passed (a later one
                          started, or the record was reset): the caller takes a new one. ``ticket``
    ``"late"``            a granted turn woke more than ``max_late`` after its start (G7):
                          ``ticket``, ``lateness``, ``outcome`` (``"moved"``: its start was moved
                          later; ``"given_up"``: the turn was given up for a new ticket;
                          ``"begun"``: a queue with a burst begins it late)
    ``"retry"``           a queue's job failed and will be tried again: ``error``, ``attempt``,
                          ``wait`` (its backoff)
    ``"dead_letter"``     a queue's job failed for good (its retries ran out, or its error is not
                          retried): ``error``, ``attempt``
    ====================  ==========================================================================

    Times are seconds on this process's clock (``time.monotonic`` unless a
    limiter was given another ``clock``).
    """

    #: what happened (see the table above)
    kind: EventKind
    #: the queue name (a group's key ``k`` is queue ``f"{group}:{k}"``)
    queue: str
    #: the ticket the event is about, if any
    ticket: int | None = None
    #: ``"start"``/``"timeout"``: seconds from the ``acquire()`` (or ``wait()``) call to the begin or
    #: the give-up; for a queue's job, the pacer's wait for its turn. ``"retry"``: the backoff
    wait: float | None = None
    #: ``"start"``: seconds the begin came after the turn's start converted to local time
    #: (``Turn.local_start``; at most ``max_late`` while that is checked). ``"late"``: the same,
    #: for a wake-up that came too late to begin
    lateness: float | None = None
    #: ``"call"``/``"state_error"``: seconds the state call took, round-trip included
    duration: float | None = None
    #: ``"call"``/``"state_error"``: the state operation (``"take_and_try"``, ``"try_start"``,
    #: ``"retime"``, ``"release"``, ``"renew"``)
    operation: str | None = None
    #: ``"call"``: the answer (``"started"``, ``"wait"``, ``"passed"``; ``"live"`` or ``"expired"``
    #: for a lease's release or renewal). ``"late"``: what was done about it
    outcome: str | None = None
    #: ``"state_error"``, ``"retry"``, ``"dead_letter"``: the exception's type name
    error: str | None = None
    #: ``"retry"``/``"dead_letter"``: which try of the job failed (1 for the first)
    attempt: int | None = None


#: what ``on_event=`` accepts: called with each :class:`Event`; what it returns is ignored
EventHook = Callable[[Event], object]


def check_hook(value: object) -> EventHook | None:
    """An ``on_event`` argument, checked: ``None`` or a callable; else :class:`ConfigurationError`."""
    if value is not None and not callable(value):
        raise ConfigurationError(f"on_event must be None or a callable taking an Event, got {value!r}")
    return value
