"""What limiters and queues report to an ``on_event`` hook: begins, waits, state calls, failures.

Every :class:`~ratequeue.Limiter`, :class:`~ratequeue.Queue`,
:class:`~ratequeue.LimiterGroup` and their :mod:`ratequeue.aio` twins take
``on_event=callback``; the callback is called with one :class:`Event` for
each thing below::

    def count(event: ratequeue.Event) -> None:
        if event.kind == "begin":
            waits.append(event.wait)

    limiter = ratequeue.Limiter("memory://", name="api", interval=0.1, on_event=count)

``ratequeue.prometheus.PrometheusMetrics`` is such a callback. With
``on_event=None`` (the default) nothing is built and nothing is called: each
place that could report costs one ``is not None`` test.

**Delivery: never on the caller's path.** A hook never runs while a caller
waits for its turn, nor under a limiter's lock, so a slow hook cannot make a
begin late (guarantee G7). Where an event happens, the limiter only builds
it and hands it on:

* thread limiters and queues: onto a queue read by ratequeue's *reporter*,
  one daemon thread per process (``ratequeue-events``), started with the
  first event of any limiter that has a hook. It calls the hooks one event
  at a time, in the order the events happened (so in order per limiter);
* :mod:`ratequeue.aio`: ``loop.call_soon``: the hook runs on the event loop
  as soon as the task that reported yields (an ``await``), in order.

So an event reaches its hook a little after the fact: :func:`flush` waits
until every event reported before it has been delivered (``close()`` of a
limiter or queue does, for up to a second); on asyncio ``await
asyncio.sleep(0)`` does the same.

**A slow hook drops events, never the work.** At most
:data:`MAX_PENDING_EVENTS` events wait for the reporter thread; while that
many wait, a new event is dropped (the newest: handing it on stays one
check and no lock, the reporter's end of the queue is left alone, and the
events kept are still delivered in order). :func:`dropped` counts them,
``ratequeue_events_dropped_total`` exports the count (:mod:`ratequeue.prometheus`),
and a WARNING on the ``ratequeue.events`` logger says so at most once a
minute. On asyncio a hook runs on the loop that reports, one round of
ready callbacks after the event: it slows the loop, and no backlog builds.

**The callback's rules.** It is called in the reporter thread (asyncio: on
the event loop, which it must not block), one event at a time; a hook
shared with other threads' code must be thread-safe. It may call the
limiter or queue that reported (``status()``, even ``acquire()``): the
acquire path never waits for a hook, so nothing deadlocks -- but while it
runs, later events wait, so it should be quick. An exception it raises is
caught: the event is dropped, and the first such exception of each limiter
is logged at WARNING on the ``ratequeue.events`` logger with its traceback
(later ones at DEBUG), so a broken metrics hook can never stop the work it
measures. A ``BaseException`` other than ``KeyboardInterrupt`` and
``SystemExit`` is caught and logged the same way; those two end the
reporter thread (the next event starts a new one) or, on asyncio, reach the
event loop as any callback's do. A coroutine function is refused
(:class:`~ratequeue.ConfigurationError`): it would never be awaited. A
limiter pickles without its hook.
"""

from __future__ import annotations

import atexit
import inspect
import logging
import os
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from functools import partial
from queue import SimpleQueue
from typing import Literal, NamedTuple, get_args

from .errors import ConfigurationError

__all__ = [
    "KINDS",
    "REPORTER_THREAD",
    "Event",
    "EventHook",
    "EventKind",
    "MAX_PENDING_EVENTS",
    "Outlet",
    "check_hook",
    "dropped",
    "flush",
    "report",
]

#: the name of the reporter thread (one per process, alive once a hook has had an event); not a
#: queue's thread: those end when their queue is empty (G5), this one lives with the process
REPORTER_THREAD = "ratequeue-events"

#: an ``on_event`` hook that raised, and the reporter thread's own troubles
_log = logging.getLogger("ratequeue.events")

#: what an :class:`Event` reports
EventKind = Literal[
    "begin", "timeout", "call", "state_error", "passed", "late", "retry", "dead_letter",
    "state_down", "state_back", "hold", "slow",
]  # fmt: skip

#: every :data:`EventKind`, in the order the docs list them
KINDS: tuple[EventKind, ...] = get_args(EventKind)


class Event(NamedTuple):
    """One thing a limiter or queue did, for metrics. Fields a kind does not use are ``None``.

    ====================  ==========================================================================
    ``kind``              what happened, and the fields it sets
    ====================  ==========================================================================
    ``"begin"``           a caller's turn begins (``acquire()`` returns; a queue's job is started):
                          ``ticket``, ``wait``, ``lateness``. ``all_of()`` reports one per limiter,
                          once all its turns begin together
    ``"timeout"``         a caller gave up waiting (``AcquireTimeout``): ``wait``; both with
                          ``tenant`` on a fair queue
    ``"call"``            a call to the state was answered: ``operation``, ``outcome``, ``duration``,
                          ``ticket``
    ``"state_error"``     a call to the state raised (after the state's own retries): ``operation``,
                          ``error``, ``duration``, ``ticket``
    ``"passed"``          the state answered that the ticket held here has passed (a later one
                          started, or the record was reset): the caller takes a new one. ``ticket``
    ``"late"``            a started turn woke more than ``max_late`` after its start (G7):
                          ``ticket``, ``lateness``, ``outcome`` (``"moved"``: its start was moved
                          later; ``"given_up"``: the turn was given up for a new ticket;
                          ``"begun"``: a queue with a burst begins it late; ``"sent"``: its
                          call went out that late, :meth:`~ratequeue.Limiter.sent`, and the
                          queue was held)
    ``"retry"``           a queue's job failed and will be tried again: ``error``, ``attempt``,
                          ``wait`` (its backoff)
    ``"dead_letter"``     a queue's job failed for good (its retries ran out, or its error is not
                          retried): ``error``, ``attempt``
    ``"state_down"``      the state failed a call and turns begin locally now (``when_down``):
                          ``outcome`` (``"open"`` or ``"local"``), ``error``
    ``"state_back"``      the state answers again and turns come from it, or the limiter closed
                          while it was down: ``wait`` (seconds down), ``outcome`` (the mode)
    ``"hold"``            this process held the whole queue (:meth:`~ratequeue.Limiter.hold`, or a
                          service's answer heeded): ``wait`` (seconds held from now), ``outcome``
                          (what asked: ``"call"`` or the status answered, e.g. ``"429"``)
    ``"slow"``            this process slowed the whole queue (:meth:`~ratequeue.Limiter.slow_down`,
                          or a refusal heard with ``adaptive=True``): ``outcome`` (what asked)
    ====================  ==========================================================================

    Times are seconds on this process's clock (``time.monotonic`` unless a
    limiter was given another ``clock``). An event is immutable (a named
    tuple: ``event.kind``, ``event._replace(...)``, ``event._asdict()``).
    """

    #: what happened (see the table above)
    kind: EventKind
    #: the queue name (a group's key ``k`` is queue ``f"{group}:{k}"``)
    queue: str
    #: the ticket the event is about, if any
    ticket: int | None = None
    #: ``"begin"``/``"timeout"``: seconds from the ``acquire()`` (or ``wait()``) call to the begin or
    #: the give-up; for a queue's job, the pacer's wait for its turn. ``"retry"``: the backoff
    wait: float | None = None
    #: ``"begin"``: seconds the begin came after the turn's start converted to local time
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
    #: ``"begin"``/``"timeout"`` on a fair queue: the caller's tenant (``""``: none named);
    #: ``None`` on a queue that is not fair
    tenant: str | None = None


#: what ``on_event=`` accepts: called with each :class:`Event`; what it returns is ignored
EventHook = Callable[[Event], object]


def check_hook(value: object) -> EventHook | None:
    """An ``on_event`` argument, checked: ``None`` or a plain callable; else :class:`ConfigurationError`.

    A coroutine function (or an object whose ``__call__`` is one) is refused:
    its coroutine would never be awaited, and nothing would be counted.
    """
    if value is None:
        return None
    if not callable(value):
        raise ConfigurationError(f"on_event must be None or a callable taking an Event, got {value!r}")
    call = type(value).__call__ if not inspect.isfunction(value) else None
    if inspect.iscoroutinefunction(value) or inspect.iscoroutinefunction(call):
        raise ConfigurationError(
            f"on_event must be a plain function, not a coroutine function ({value!r}): it is called, "
            "never awaited. Hand the event on instead, e.g. to an asyncio.Queue with put_nowait"
        )
    return value


#: the log line of a hook that raised: its limiter, and the event's kind
_HOOK_FAILED = (
    "the on_event hook of %r raised on a %r event; the event is dropped and the limiter goes on "
    "(later failures of this hook are logged at DEBUG)"
)
#: the log line of events dropped for a slow hook (at most once a minute)
_DROPPED = (
    "%d on_event events dropped (%d since the process started): the hooks take longer than the "
    "events come, and %d wait already; make the hook quicker (hand the event on, to a queue of its own)"
)
#: the log line of a hook that ended the reporter thread (KeyboardInterrupt, SystemExit)
_REPORTER_STOPPED = (
    "an on_event hook raised %s in ratequeue's reporter thread; the thread stops, and a new one "
    "delivers the next events"
)


class Outlet:
    """Where one limiter's events go: its hook, and whether the hook has failed yet.

    :meth:`deliver` is what the reporter thread (or the event loop) calls;
    the limiter only hands the event on (:func:`report`, ``call_soon``).
    """

    __slots__ = ("failed", "hook", "owner")

    def __init__(self, hook: EventHook, owner: object) -> None:
        self.hook = hook
        #: the limiter or queue the hook belongs to, named in the log line of a failure
        self.owner = owner
        #: whether the hook has raised once (the first failure is logged at WARNING, the rest at DEBUG)
        self.failed = False

    def deliver(self, event: Event) -> None:
        """Call the hook with ``event``; what it raises is logged, not raised (but ``KeyboardInterrupt``,
        ``SystemExit``)."""
        try:
            self.hook(event)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException:
            level = logging.DEBUG if self.failed else logging.WARNING
            self.failed = True
            _log.log(level, _HOOK_FAILED, self.owner, event.kind, exc_info=True)


# The reporter: one daemon thread per process, making the calls of a queue in order: each delivers
# an event to its outlet, or sets a flush marker of flush(). Handing an event on is one put.

_pending: SimpleQueue[Callable[[], object]] = SimpleQueue()
_reporter: threading.Thread | None = None
_starting = threading.Lock()

#: how long (s) the interpreter's exit waits for the events still to be delivered
EXIT_FLUSH = 1.0

#: the most events (of every hook in this process) that wait for the reporter thread; more are
#: dropped, so that a slow hook costs a bounded memory (some 5 MB), never a wait
MAX_PENDING_EVENTS = 10_000
#: the most often (s) events dropped are logged at WARNING
DROPPED_WARNING_EVERY = 60.0

#: events dropped in this process; those since the last warning, and when that was (monotonic)
_counting = threading.Lock()
_dropped = 0
_dropped_since_warning = 0
_warned_at: float | None = None


def report(outlet: Outlet, event: Event) -> None:
    """Hand ``event`` to the reporter thread, for ``outlet``'s hook; never blocks, never raises.

    The reporter is started here the first time, and again after a
    ``KeyboardInterrupt`` or ``SystemExit`` from a hook ended it. While
    :data:`MAX_PENDING_EVENTS` wait, ``event`` is dropped and counted.
    """
    if _pending.qsize() >= MAX_PENDING_EVENTS:
        _drop()
        return
    _pending.put(partial(outlet.deliver, event))
    if _reporter is None:
        _start()


def dropped() -> int:
    """How many events this process has dropped since it started, its hooks being too slow for them."""
    return _dropped


def _drop() -> None:
    """Count an event dropped; warn at most once every :data:`DROPPED_WARNING_EVERY` seconds."""
    global _dropped, _dropped_since_warning, _warned_at
    with _counting:  # (held for a few instructions, by droppers only)
        _dropped += 1
        _dropped_since_warning += 1
        now = time.monotonic()
        if _warned_at is not None and now - _warned_at < DROPPED_WARNING_EVERY:
            return
        count, _dropped_since_warning, _warned_at = _dropped_since_warning, 0, now
    _log.warning(_DROPPED, count, _dropped, _pending.qsize())


def _start() -> None:
    """Start the reporter thread unless one runs; at the interpreter's shutdown, give up quietly."""
    global _reporter
    # at the interpreter's shutdown, "can't create new thread" (RuntimeError): the events are dropped
    with suppress(RuntimeError), _starting:
        if _reporter is not None:
            return
        thread = threading.Thread(target=_run, name=REPORTER_THREAD, daemon=True)
        thread.start()
        _reporter = thread


def _run() -> None:
    """The reporter thread: deliver each event, set each flush marker, in order, for ever."""
    global _reporter
    get = _pending.get
    try:
        while True:
            get()()  # an outlet's delivery of an event, or a flush marker's set; nothing kept while idle
    except (KeyboardInterrupt, SystemExit) as exc:
        _log.warning(_REPORTER_STOPPED, type(exc).__name__, exc_info=True)
    finally:
        with _starting:
            if _reporter is threading.current_thread():
                _reporter = None
        if not _pending.empty():  # handed on while this thread was ending: a new one takes over
            _start()


def flush(timeout: float | None = None) -> bool:
    """Wait until every event reported (in this process) before this call has reached its hook.

    Returns whether it did within ``timeout`` seconds (``None``: no limit).
    ``close()`` of a limiter or queue calls it (for up to a second). Called
    from a hook (in the reporter thread), it cannot wait for itself and
    returns ``False`` at once. On asyncio, ``await asyncio.sleep(0)`` in
    the task that reported delivers its events (they were put on the
    loop's ready queue before it).
    """
    if _reporter is None and _pending.empty():
        return True
    if threading.current_thread() is _reporter:
        return False
    done = threading.Event()
    _pending.put(done.set)
    if _reporter is None:
        _start()
    return done.wait(timeout)


atexit.register(flush, EXIT_FLUSH)  # returns at once in a process that reported nothing


def _after_fork() -> None:
    """In a forked child: the parent's reporter thread is not there; start afresh on the next event."""
    global _pending, _reporter, _starting, _counting, _dropped, _dropped_since_warning, _warned_at
    _pending, _reporter, _starting, _counting = SimpleQueue(), None, threading.Lock(), threading.Lock()
    _dropped = _dropped_since_warning = 0
    _warned_at = None


if hasattr(os, "register_at_fork"):  # not on Windows
    os.register_at_fork(after_in_child=_after_fork)
