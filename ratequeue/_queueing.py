"""What the thread and asyncio queues share: the queued jobs, the pacer, the run of a job.

A queue is a limiter plus the jobs added and not yet started
(:class:`ratequeue._jobs.PendingJobs`, which states their order: priority,
then the order added; held until ``not_before`` or a retry's backoff). A
*pacer* (a thread, or a task) takes the turn of the next ready job through a
reservation of the limiter and starts the job on its own (a thread, or a
task), so a slow job never delays the next start. A failed job may be tried
again (each try takes a new turn) and, when its retries run out, is handed to
a dead-letter handler. The pacer runs only while jobs are queued (guarantee
G5); while every queued job is held, it waits without a turn or a ticket.
The pacer's loop and the run of one job are written here once, as
:mod:`ratequeue._flow` generators; :class:`ratequeue.Queue` and
:class:`ratequeue.aio.Queue` supply the lock, the futures, the running limit
and how a job is started.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Generic, Protocol, TypeVar

from . import _validate
from ._flow import Call, Flow, Sleep
from ._grouping import DEFAULT_KEEP, GroupBase
from ._jobs import (
    Backoff,
    DeadLetter,
    GroupGate,
    Job,
    JobOptions,
    NotBefore,
    PendingJobs,
    check_bound,
    check_group,
    check_priority,
    delay_until,
)
from ._limiting import DEFAULT_LEASE, LimiterBase, Seconds, Status
from ._redact import redact
from .errors import QueueClosed, QueueFull
from .events import Event, EventHook
from .rates import RateLike
from .shard import Turn

__all__ = ["Entry", "QueueBase"]

#: the pacer and the jobs: retries and failures (INFO), turns the state failed to give (WARNING)
_log = logging.getLogger("ratequeue.queue")

#: the pause between two failed turns of the pacer (the state is failing), doubling up to the cap
_FAILURE_BACKOFF = 0.05
_FAILURE_BACKOFF_CAP = 2.0


class JobFuture(Protocol):
    """What both ``concurrent.futures.Future`` and ``asyncio.Future`` offer a queue."""

    def cancel(self) -> bool: ...

    def cancelled(self) -> bool: ...

    def done(self) -> bool: ...

    def set_result(self, result: Any, /) -> None: ...

    def set_exception(self, exception: BaseException, /) -> None: ...

    def add_done_callback(self, fn: Callable[[Any], object], /) -> None: ...


class Releasable(Protocol):
    """A semaphore, threading or asyncio: what counts the running jobs."""

    def release(self) -> None: ...


class PlaceInQueue(Protocol):
    """A limiter's reservation, thread or asyncio: waited for (plain or coroutine), or cancelled."""

    def wait(self) -> Any: ...

    def cancel(self) -> None: ...


FutureT = TypeVar("FutureT", bound=JobFuture)
L = TypeVar("L", bound=LimiterBase[Any])


#: a job of a queue whose futures are ``FutureT`` (the name the drivers use)
Entry = Job


class QueueBase(ABC, Generic[L, FutureT]):
    """The jobs of one queue object and the flows that start and run them."""

    #: the queue name
    name: str
    #: seconds between two starts
    interval: float
    _limiter: L

    def __init__(
        self,
        url: Any = None,
        *,
        name: str,
        interval: Seconds | None = None,
        rate: RateLike | None = None,
        burst: int = 1,
        lead: Seconds | None = None,
        max_running: int | None = None,
        lease: Seconds = DEFAULT_LEASE,
        retries: int = 0,
        backoff: Backoff | None = None,
        retry_on: type[BaseException] | tuple[type[BaseException], ...] = (Exception,),
        dead_letter: Callable[[DeadLetter], Any] | None = None,
        max_waiting: int | None = None,
        overflow: str = "reject",
        on_event: EventHook | None = None,
    ) -> None:
        """
        :param url: the state, as for :class:`~ratequeue.Limiter`.
        :param name: the queue name; every queue and limiter with the same
            state and name shares one rate.
        :param interval: seconds (or a ``timedelta``) between two starts.
        :param rate: the pace as a rate instead (``"5000/hour"``), as for :class:`~ratequeue.Limiter`.
        :param burst: how many starts may come at once after an idle spell (see
            :class:`~ratequeue.Limiter`).
        :param lead: as for :class:`~ratequeue.Limiter`.
        :param max_running: how many jobs may run at once across every queue
            and limiter of this name (``None``: no cap); each running job holds a
            lease, released when it ends (see :class:`~ratequeue.Limiter`).
        :param lease: seconds a running job's lease lasts unless renewed (10 by
            default): the longest a job whose process died keeps its place.
        :param retries: how many times a failed job is tried again (0: never);
            each try takes a new turn, after its ``backoff``. Jobs may set their own.
        :param backoff: the wait before each retry (:class:`~ratequeue.Backoff`;
            by default 1 s doubling up to 60 s, with jitter).
        :param retry_on: the exceptions that are retried (all by default); others fail the job at once.
        :param dead_letter: called with a :class:`~ratequeue.DeadLetter` when a
            job fails for good (its retries ran out, or it was not retried);
            its future fails all the same. On asyncio it may be a coroutine function.
        :param max_waiting: the most jobs this queue object holds waiting
            (``None``: no limit); see ``overflow``.
        :param overflow: when ``max_waiting`` jobs wait: ``"reject"`` the new one
            (:class:`~ratequeue.QueueFull`) or ``"drop_oldest"`` (its future fails with ``QueueFull``).
        :param on_event: called with a :class:`~ratequeue.Event` for each turn its
            limiter takes (as for :class:`~ratequeue.Limiter`), each job retried
            (``"retry"``) and each job failed for good (``"dead_letter"``).
        """
        # every setting is checked before the limiter opens its state
        #: the retry settings of a job added without its own
        self._options = JobOptions.checked(retries, backoff, retry_on, dead_letter)
        self._max_running = _validate.max_running(max_running)
        self._max_waiting, self._overflow = check_bound(max_waiting, overflow)
        self._lease = _validate.lease(lease)
        limiter = self._limiter_class()(
            url,
            name=name,
            interval=interval,
            rate=rate,
            burst=burst,
            lead=lead,
            max_running=self._max_running,
            lease=lease,
            on_event=on_event,
        )
        self._limiter = limiter
        self.name = limiter.name
        self.interval = limiter.interval
        self._pending: PendingJobs[FutureT] = PendingJobs()
        #: counts the jobs added (and retried): a pacer waiting for held jobs wakes when it moves
        self._generation = 0
        #: jobs started and not finished
        self._running = 0
        #: whether a pacer runs
        self._pacing = False
        #: the pacer's place in the limiter's queue, cancelled when no queued job is left to use it
        self._reservation: PlaceInQueue | None = None
        #: the jobs waiting for their group's place, and the groups' limiters (made at the first group)
        self._gate: GroupGate[FutureT] = GroupGate()
        self._groups: GroupBase[Any, Any] | None = None
        #: each group waiter's place in its group limiter's queue, while it waits
        self._group_places: dict[str, PlaceInQueue] = {}
        #: counts the running jobs when their number is bounded (set by the driver)
        self._places: Releasable | None = None
        self._closed = False
        #: whether the state has been closed (once the queue is closed and idle)
        self._state_closed = False
        self._init_driver()

    def add(
        self,
        fn: Callable[..., Any],
        /,
        *args: Any,
        cost: int = 1,
        priority: int = 0,
        not_before: NotBefore | None = None,
        retries: int | None = None,
        backoff: Backoff | None = None,
        retry_on: type[BaseException] | tuple[type[BaseException], ...] | None = None,
        dead_letter: Callable[[DeadLetter], Any] | None = None,
        group: str | None = None,
        **kwargs: Any,
    ) -> FutureT:
        """Queue ``fn(*args, **kwargs)`` to start at its turn; return its future at once.

        On asyncio, call it from the running loop; ``fn`` may be a coroutine
        function (awaited). Cancelling the future before the job starts
        removes it from the queue. The keyword arguments below are the
        queue's, not passed on to ``fn`` (wrap ``fn`` in
        :func:`functools.partial` to give it one of these names):

        :param cost: how many starts of the rate the job uses (1 to the burst).
        :param priority: a whole number; higher starts first (then the order added).
        :param not_before: hold the job until then: a ``datetime`` (wall
            clock), or seconds (or a ``timedelta``) from now. It takes no turn
            and holds no ticket meanwhile.
        :param retries: ``backoff``, ``retry_on``, ``dead_letter``: this job's own, in
            place of the queue's (see the constructor).
        :param group: run at most one job of this group at a time, across
            every process of the queue name, in the order they asked
            (docs/queues.md): the job holds its group's place from before its
            turn until it ends for good (a retry keeps it).
        :raises QueueClosed: if the queue is closed.
        :raises QueueFull: if ``max_waiting`` jobs wait and ``overflow`` is ``"reject"``.
        :raises ConfigurationError: for a bad option.
        """
        future = self._new_future()
        self._add(
            future,
            fn,
            args,
            kwargs,
            cost,
            priority=priority,
            not_before=not_before,
            retries=retries,
            backoff=backoff,
            retry_on=retry_on,
            dead_letter=dead_letter,
            group=group,
        )
        return future

    @property
    def pending(self) -> int:
        """Jobs added and not started yet."""
        with self._locked():
            return len(self._pending)

    def pause(self) -> None:
        """Stop starting jobs from this queue object; they keep their places."""
        self._limiter.pause()

    def resume(self) -> None:
        """Start jobs again after :meth:`pause`."""
        self._limiter.resume()

    @property
    def paused(self) -> bool:
        """Whether this queue object is paused."""
        return self._limiter.paused

    def __repr__(self) -> str:
        url = redact(self._limiter.state.url)
        return f"{self._display_name}({url!r}, name={self.name!r}, interval={self.interval!r})"

    #: the name ``repr`` shows
    _display_name = "Queue"

    # What a driver supplies.

    @abstractmethod
    def _limiter_class(self) -> type[L]:
        """The limiter class of this driver."""

    @abstractmethod
    def _init_driver(self) -> None:
        """Set up the driver's own parts (lock, semaphore, events); the end of the constructor."""

    @abstractmethod
    def _new_future(self) -> FutureT:
        """A new, pending future for a job being added."""

    @abstractmethod
    def _locked(self) -> AbstractContextManager[Any]:
        """A context holding the queue's lock (a no-op on the event loop)."""

    @abstractmethod
    def _wake_joiners(self) -> None:
        """Wake :meth:`join` waiters to look again; called holding :meth:`_locked`."""

    @abstractmethod
    def _close_state_soon(self) -> None:
        """Close the limiter's state (if it opened it) now or, on the event loop, in a task."""

    @abstractmethod
    def _start_pacer(self) -> None:
        """Start the pacer (a thread or a task) running :meth:`_pace_flow`; called holding the lock."""

    @abstractmethod
    def _start_job(self, entry: Entry[FutureT]) -> None:
        """Run ``entry`` on its own (a thread or a task) through :meth:`_job_flow`."""

    @abstractmethod
    def _claim(self, future: FutureT) -> bool:
        """Mark a queued job's future running; ``False`` if it was cancelled."""

    @abstractmethod
    def _wait_for_jobs(self, timeout: float, seen: int) -> Any:
        """Wait (plain or coroutine) until ``_generation`` is no longer ``seen``, or ``timeout`` s pass."""

    @abstractmethod
    def _wake_pacer(self) -> None:
        """Wake a pacer in :meth:`_wait_for_jobs`; called holding the lock."""

    def _jobs_added(self) -> None:
        """A job was added or queued again (holding the lock): a waiting pacer looks again."""
        self._generation += 1
        self._wake_pacer()

    @abstractmethod
    def _group_class(self) -> type[GroupBase[Any, Any]]:
        """The limiter group class of this driver (for the groups' places)."""

    @abstractmethod
    def _start_group_waiter(self, group: str) -> None:
        """Run :meth:`_group_flow` for ``group`` (a thread or a task); called holding the lock."""

    @abstractmethod
    def _take_running_place(self) -> Any:
        """Wait (plain or coroutine) until fewer than ``max_running`` jobs run, and count one more."""

    def _release_running_place(self) -> None:
        """Count one running job less (see :meth:`_take_running_place`)."""
        if self._places is not None:
            self._places.release()

    def _reserve(self, cost: int) -> PlaceInQueue:
        """A new place in the limiter's queue, for a job of ``cost``."""
        return self._limiter.reserve(cost=cost)

    # Written once.

    def _add(
        self,
        future: FutureT,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        cost: int = 1,
        *,
        priority: int = 0,
        not_before: object = None,
        retries: int | None = None,
        backoff: object = None,
        retry_on: object = None,
        dead_letter: object = None,
        group: object = None,
    ) -> None:
        """Queue ``fn(*args, **kwargs)`` with ``future``, starting the pacer if none runs.

        Every option is checked before anything is queued; an option left
        ``None`` is the queue's.
        """
        if not callable(fn):
            raise TypeError(f"add() needs a callable, got {type(fn).__name__}")
        cost = _validate.cost(cost, self._limiter.burst)
        base = self._options
        options = JobOptions.checked(
            base.retries if retries is None else retries,
            base.backoff if backoff is None else backoff,
            base.retry_on if retry_on is None else retry_on,
            base.dead_letter if dead_letter is None else dead_letter,
        )
        entry: Entry[FutureT] = Entry(
            future,
            functools.partial(fn, *args, **kwargs),
            cost,
            check_priority(priority),
            options,
            delay_until(not_before, self._limiter._clock),
            group=check_group(group),
        )
        if entry.group is not None:
            self._group_limiter(entry.group)  # checks the group as part of a queue name, now
        dropped: Entry[FutureT] | None = None
        with self._locked():
            if self._closed:
                raise QueueClosed(f"queue {self.name!r} is closed")
            if self._max_waiting is not None and self._pending.first_tries() >= self._max_waiting:
                if self._overflow == "reject":
                    raise QueueFull(f"queue {self.name!r} holds max_waiting={self._max_waiting} jobs")
                dropped = self._pending.oldest()
                if dropped is not None:
                    self._pending.remove(dropped)
            entry.seq = self._pending.number()
            if entry.group is not None and self._gate.enter(entry):
                self._start_group_waiter(entry.group)
            self._pending.push(entry)
            self._jobs_added()
            if not self._pacing:
                self._pacing = True
                self._start_pacer()
        if dropped is not None and self._takes(dropped):
            dropped.future.set_exception(
                QueueFull(
                    f"dropped from queue {self.name!r}: it held max_waiting={self._max_waiting} jobs "
                    f"and a newer one came"
                )
            )
        future.add_done_callback(lambda _: self._job_done(entry))

    def _is_idle(self) -> bool:
        return not self._pending and not self._running and not self._pacing

    def _idle_changed(self) -> None:
        """Jobs finished or left (holding the lock): wake joiners; a closed, idle queue closes its state."""
        self._wake_joiners()
        if self._closed and not self._state_closed and self._is_idle():
            self._state_closed = True
            self._close_state_soon()

    def _with_waiting(self, status: Status) -> Status:
        """``status`` with this queue's pending jobs as its waiting ones."""
        return dataclasses.replace(status, waiting=self.pending)

    def _close_queue(self, cancel_pending: bool) -> None:
        """Accept no more jobs, cancelling the queued ones if asked; the state is closed once idle."""
        with self._locked():
            self._closed = True
            for entry in self._pending.drain() if cancel_pending else ():
                # a retried job's thread future runs already and cannot be cancelled: fail it
                if not entry.future.cancel() and not entry.future.done():
                    entry.future.set_exception(
                        QueueClosed(f"queue {self.name!r} was closed before its retry")
                    )
            if cancel_pending:
                self._jobs_added()  # a pacer waiting for a held job finds none and stops
            self._idle_changed()
        if cancel_pending:
            self._withdraw_if_idle()

    def _pace_flow(self) -> Flow[None]:
        """The pacer: take a turn for each queued job and start it, until none is queued.

        A turn that fails (the state is unreachable) fails the job at the
        head of the queue and the pacer goes on, after a pause that doubles
        while failures follow each other.
        """
        backoff = _FAILURE_BACKOFF
        clock = self._limiter._clock
        stopped = False
        try:
            while True:
                with self._locked():
                    if not self._pending:
                        # stop in the same locked step that saw no job: a job added (or queued
                        # again for a retry) from now on starts a new pacer
                        self._pacing = False
                        stopped = True
                        self._idle_changed()
                        return
                    self._pending.release_due(clock())
                    due = self._pending.next_due() if self._pending.head() is None else None
                    seen = self._generation
                if due is not None:  # every queued job is held: wait for the first, or a new job
                    yield Call(self._wait_for_jobs, (_validate.wait(max(0.0, due - clock())), seen))
                    continue
                yield Call(self._take_running_place)
                with self._locked():
                    self._pending.release_due(clock())
                    head = self._pending.head()
                    if head is None:  # cancelled, or only held jobs, while a running place was awaited
                        self._release_running_place()
                        continue
                    cost = head.cost
                    reservation = self._reservation = self._reserve(cost)
                try:
                    turn: Turn | None = yield Call(reservation.wait)
                except Exception as exc:  # the state failed: fail the head job, go on
                    self._release_running_place()
                    _log.warning(
                        "queue %r: no turn for its next job, which fails with the error (%s: %s); "
                        "the next job tries again in %g s",
                        self.name,
                        type(exc).__name__,
                        exc,
                        backoff,
                    )
                    self._fail_head(exc)
                    yield Sleep(backoff)
                    backoff = min(backoff * 2, _FAILURE_BACKOFF_CAP)
                    continue
                finally:
                    with self._locked():
                        self._reservation = None
                backoff = _FAILURE_BACKOFF
                entry = self._next_runnable(cost) if turn is not None else None
                if entry is None:  # the queued jobs were cancelled while we waited, or cost more
                    self._release_running_place()
                    if turn is not None:
                        self._end_lease(turn.ticket)
                    continue
                entry.ticket = turn.ticket if turn is not None else None
                self._start_job(entry)
        finally:
            if not stopped:  # an exception (or a cancelled task) ended the pacer
                with self._locked():
                    self._pacing = False
                    self._idle_changed()

    def _job_flow(self, entry: Entry[FutureT]) -> Flow[None]:
        """Run one started job and settle its future; a coroutine's result is awaited (asyncio).

        A failure its options retry puts it back among the queued jobs,
        held for its backoff (the future stays pending); one that is not
        retried any more goes to the dead-letter handler (if it was retried
        or a handler is set) and fails the future.
        """
        future = entry.future
        entry.attempts += 1
        # this attempt's lease: taken off the entry now, since a retry queued below may get a
        # new turn (and set a new ticket) before this attempt's end releases its own
        ticket, entry.ticket = entry.ticket, None
        try:
            result = yield Call(entry.call)
        except asyncio.CancelledError:
            future.cancel()
            raise
        except BaseException as exc:
            if not future.done() and not self._retried(entry, exc):
                self._report_failed(entry, exc)
                options = entry.options
                if options.dead_letter is not None:
                    try:
                        yield Call(options.dead_letter, (entry.dead_letter(exc),))
                    except Exception:  # the handler's own failure must not lose the job's
                        _log.exception("the dead-letter handler of queue %r failed", self.name)
                if not future.done():
                    future.set_exception(exc)
        else:
            if not future.done():
                future.set_result(result)
        finally:
            if ticket is not None:
                self._end_lease(ticket)
            self._release_running_place()
            with self._locked():
                self._running -= 1
                self._idle_changed()

    def _end_lease(self, ticket: int) -> None:
        """The job on ``ticket`` has ended (or none began on it): its lease is released in the background."""
        limiter = self._limiter
        with limiter._locked():
            limiter._end_lease(ticket, later=True)

    def _retried(self, entry: Entry[FutureT], exc: BaseException) -> bool:
        """Queue ``entry`` again after its backoff if its options retry ``exc``; say whether it was."""
        options = entry.options
        if entry.attempts > options.retries or not isinstance(exc, options.retry_on):
            return False
        delay = options.backoff.delay(entry.attempts)
        entry.not_before = self._limiter._clock() + delay
        limiter = self._limiter
        if limiter._on_event is not None:
            error = type(exc).__name__
            limiter._emit(Event("retry", self.name, error=error, attempt=entry.attempts, wait=delay))
        if _log.isEnabledFor(logging.INFO):
            # the type only: a job's error text may hold what it called (a URL with its key); the
            # error itself is the job's to see, in its future or dead letter
            _log.info(
                "queue %r: a job failed on try %d of %d (%s); retried in %.3f s",
                self.name,
                entry.attempts,
                options.retries + 1,
                type(exc).__name__,
                delay,
            )
        with self._locked():
            self._pending.push(entry)  # its own place in the order; not counted against max_waiting
            self._jobs_added()
            if not self._pacing:
                self._pacing = True
                self._start_pacer()
        return True

    def _report_failed(self, entry: Entry[FutureT], exc: BaseException) -> None:
        """Report a job that failed for good: its future fails with ``exc``, its dead letter follows."""
        limiter = self._limiter
        if limiter._on_event is not None:
            limiter._emit(Event("dead_letter", self.name, error=type(exc).__name__, attempt=entry.attempts))
        if _log.isEnabledFor(logging.INFO):
            error = type(exc).__name__  # the type only, as for a retry
            _log.info("queue %r: a job failed for good on try %d (%s)", self.name, entry.attempts, error)

    def _next_runnable(self, cost: int) -> Entry[FutureT] | None:
        """Pop the next ready job that was not cancelled, counting it as running.

        ``None`` if there is none, or if it costs more than ``cost`` (the
        turn's): it stays first, and the turn goes unused.
        """
        with self._locked():
            self._pending.release_due(self._limiter._clock())
            while (head := self._pending.head()) is not None:
                if head.cost > cost:
                    return None
                entry = self._pending.pop_head()
                # a retry's future already runs (a thread future cannot be claimed twice)
                if self._takes(entry):
                    self._running += 1
                    return entry
            self._idle_changed()
            return None

    def _takes(self, entry: Entry[FutureT]) -> bool:
        """Claim ``entry``'s future for a start or a failure; ``False`` if it was cancelled.

        A retried job's future was claimed at its first start (a thread
        future cannot be claimed twice): it only must not be done.
        """
        return self._claim(entry.future) if entry.attempts == 0 else not entry.future.done()

    def _group_limiter(self, group: str) -> LimiterBase[Any]:
        """The limiter of ``group``'s place: a queue of its own, ``max_running=1``, no rate to speak of."""
        if self._groups is None:
            self._groups = self._group_class()(
                self._limiter.state,
                name=f"{self.name}:group",
                interval=1e-6,
                max_running=1,
                lease=self._lease,
                keep=DEFAULT_KEEP,
                # no on_event: a group's place is no start of the queue (its jobs' turns are)
            )
        limiter: LimiterBase[Any] = self._groups[group]
        return limiter

    def _group_flow(self, group: str) -> Flow[None]:
        """A group waiter: get ``group``'s place for the first job in its line, make that job ready, stop.

        A job that leaves the line meanwhile (cancelled, dropped) has its
        request withdrawn, and the waiter asks for the next one. A failure of
        the state fails the job it asked for, and the waiter goes on.
        """
        backoff = _FAILURE_BACKOFF
        while True:
            with self._locked():
                job = self._gate.first(group)
                if job is None:
                    return
                limiter = self._group_limiter(group)
                place = self._group_places[group] = limiter.reserve()
            try:
                turn: Turn | None = yield Call(place.wait)
            except Exception as exc:
                with self._locked():
                    self._group_places.pop(group, None)
                    self._gate.leave(job)
                    if self._pending.remove(job) and self._takes(job):
                        job.future.set_exception(exc)
                    self._idle_changed()
                yield Sleep(backoff)
                backoff = min(backoff * 2, _FAILURE_BACKOFF_CAP)
                continue
            with self._locked():
                self._group_places.pop(group, None)
                if turn is None or self._gate.first(group) is not job:  # it left the line meanwhile
                    if turn is not None:
                        self._end_group_lease(group, turn.ticket)
                    continue
                self._gate.granted(job)
                job.group_ticket = turn.ticket
                self._pending.ungate(job)
                self._jobs_added()
                if not self._pacing:
                    self._pacing = True
                    self._start_pacer()
                return

    def _end_group_lease(self, group: str, ticket: int) -> None:
        """Release ``group``'s place (held on ``ticket``) in the background."""
        limiter = self._group_limiter(group)
        with limiter._locked():
            limiter._end_lease(ticket, later=True)

    def _job_done(self, entry: Entry[FutureT]) -> None:
        """``entry``'s future is done (the job ended for good, or left): give its group's place back."""
        self._forget_if_cancelled(entry)
        group = entry.group
        if group is None:
            return
        cancel: PlaceInQueue | None = None
        with self._locked():
            if entry.gated:
                if self._gate.leave(entry):  # the waiter asks for it now: withdraw that request
                    cancel = self._group_places.get(group)
                entry.gated = False
            elif entry.group_ticket is not None:
                self._end_group_lease(group, entry.group_ticket)
                entry.group_ticket = None
                if self._gate.ended(group):
                    self._start_group_waiter(group)
        if cancel is not None:
            cancel.cancel()

    def _group_limiters(self) -> list[LimiterBase[Any]]:
        """The groups' limiters this queue made (closing them releases the places they hold)."""
        return list(self._groups._limiters.values()) if self._groups is not None else []

    def _forget_if_cancelled(self, entry: Entry[FutureT]) -> None:
        """Drop a job whose future was cancelled before it started."""
        if not entry.future.cancelled():
            return
        with self._locked():
            if self._pending.remove(entry):
                self._jobs_added()  # a pacer waiting for a held job looks again (and may stop)
                self._idle_changed()
        self._withdraw_if_idle()

    def _withdraw_if_idle(self) -> None:
        """Cancel the pacer's reservation when no queued job is left to use its turn."""
        with self._locked():
            reservation = self._reservation if not self._pending else None
        if reservation is not None:
            reservation.cancel()

    def _fail_head(self, exc: Exception) -> None:
        with self._locked():
            if self._pending.head() is not None:
                entry = self._pending.pop_head()
                if self._takes(entry):
                    entry.future.set_exception(exc)
            self._idle_changed()
