"""What the thread and asyncio queues share: the queued jobs, the pacer, the run of a job.

A queue is a limiter plus the jobs added and not yet started
(:class:`~ratequeue.core.jobs.PendingJobs` states their order: priority,
then the order added; held until ``not_before`` or a retry's backoff). A
*pacer* takes the turn of the next ready job through a reservation of the
limiter and starts the job on its own, so a slow job never delays the next
start. A failed job may be tried again (each try takes a new turn) and, when
its retries run out, goes to a dead-letter handler. The pacer runs only
while jobs are queued (G5); while every queued job is held it waits without
a turn or a ticket. The pacer, the run of a job and a group's waiter are
flows, written once; the queue's driver (threads or asyncio) runs them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar, cast

from ._redact import redact
from .core.flow import Call, Flow, Sleep
from .core.jobs import (
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
from .core.shard import Turn
from .drivers import AsyncioDriver, ThreadDriver
from .errors import QueueClosed, QueueFull
from .events import Event
from .grouping import DEFAULT_KEEP, GroupBase
from .headers import refusal_of
from .running import LimiterBase, Status, runner_of
from .settings import QueueOptions, check_cost, check_tenant_for, check_tenant_max_running, wait
from .tenant_caps import CapGroup

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["QueueBase"]

#: the pacer and the jobs: retries and failures (INFO), turns the state failed to give (WARNING)
_log = logging.getLogger("ratequeue.queue")

#: the options of a queue that its limiter does not take
#: how many refusals of one job are waited out (the queue held, no retry used); the next one is a
#: failure like any other (retries, dead letter), so that a job the service never accepts ends
MAX_REFUSALS = 100

_QUEUE_ONLY = ("retries", "backoff", "retry_on", "dead_letter", "max_waiting", "overflow", "on_refusal")

_NO_TURN = (
    "queue %r: no turn for its next job, which fails with the error (%s: %s); "
    "the next job tries again in %g s"
)
_RETRIED = "queue %r: a job failed on try %d of %d (%s); retried in %.3f s"
_INTERRUPTED = (
    "queue %r: the dead-letter handler raised %s; the job's future failed with the job's own error, "
    "and the exception goes on in the job's thread (asyncio: out of the event loop)"
)

#: the pause between two failed turns of the pacer (the state is failing), doubling up to the cap
_FAILURE_BACKOFF = 0.05
_FAILURE_BACKOFF_CAP = 2.0


@dataclasses.dataclass
class _Gate:
    """A place a job takes before its turn, one of each key's: its group's, or its tenant's under the cap."""

    #: ``"group"`` or ``"cap"``: names the place's ticket in :attr:`Job.held`
    name: str
    #: the jobs waiting for their key's place, in the order they asked
    lines: GroupGate[Any]
    #: the limiter of a key's places
    limiter: Callable[[str], LimiterBase]
    #: whether a key has several places: its waiter asks for the next job's as soon as one has its own
    several: bool
    #: each waiter's place in its key's limiter's line, while it waits
    places: dict[str, PlaceInLine] = dataclasses.field(default_factory=dict)


def _tenant_of(job: Job[Any]) -> str | None:
    return job.tenant


class PlaceInLine(Protocol):
    """A limiter's reservation, thread or asyncio: waited for (plain or coroutine), or cancelled."""

    def wait(self) -> Any: ...

    def cancel(self) -> None: ...


class JobFuture(Protocol):
    """What both ``concurrent.futures.Future`` and ``asyncio.Future`` offer a queue."""

    def cancel(self) -> bool: ...
    def cancelled(self) -> bool: ...
    def done(self) -> bool: ...
    def set_result(self, result: Any, /) -> None: ...
    def set_exception(self, exception: BaseException, /) -> None: ...
    def add_done_callback(self, fn: Callable[[Any], object], /) -> None: ...


L = TypeVar("L", bound=LimiterBase)
FutureT = TypeVar("FutureT", bound=JobFuture)


class QueueBase(Generic[L, FutureT]):
    """The jobs of one queue object and the flows that start and run them."""

    #: the limiter and group classes, and the driver, of the thread or asyncio API
    _limiter_class: ClassVar[type[Any]]
    _group_class: ClassVar[type[GroupBase[Any]]]
    _cap_group_class: ClassVar[type[CapGroup]]
    _driver_class: ClassVar[type[ThreadDriver] | type[AsyncioDriver]]
    #: the name ``repr`` shows
    _display_name = "Queue"

    def __init__(self, url: Any = None, *, name: str, **options: Unpack[QueueOptions]) -> None:
        """
        :param url: the state, as for :class:`~ratequeue.Limiter`.
        :param name: the queue name; every queue and limiter with the same state and name shares one rate.
        :param options: the limiter's settings (:class:`~ratequeue.settings.Options`) and the
            queue's own (:class:`~ratequeue.settings.QueueOptions`: retries, backoff,
            dead letters, the bound on waiting jobs). ``on_event`` also gets each job retried
            (``"retry"``) and failed for good (``"dead_letter"``).
        """
        own: dict[str, Any] = {key: options.pop(key) for key in _QUEUE_ONLY if key in options}  # type: ignore[misc]
        max_waiting, overflow = own.pop("max_waiting", None), own.pop("overflow", "reject")
        # every setting is checked before the limiter opens its state
        #: the retry settings of a job added without its own
        self._options = JobOptions(**own)
        self._max_waiting, self._overflow = check_bound(max_waiting, overflow)
        # the tenants' caps are the queue's gate, not its limiter's: its turns are taken for jobs through
        fair, down = options.get("fair", False), options.get("when_down", "raise")
        cap = check_tenant_max_running(options.pop("tenant_max_running", None), fair, down)
        self._limiter: L = self._limiter_class(url, name=name, **options)
        self._runner = runner_of(self._limiter)
        self.name, self.interval = self._limiter.name, self._limiter.interval
        self._clock = self._runner.clock
        self._driver = self._driver_class(self._clock)
        self._pending: PendingJobs[Any] = PendingJobs()
        #: jobs started and not finished; whether a pacer runs
        self._running = 0
        self._pacing = False
        #: the pacer's place in the limiter's line, cancelled when no queued job is left to use it
        self._reservation: PlaceInLine | None = None
        #: the groups' limiters and the tenants' caps' (made at the first use, once: a place is given
        #: back on the limiter that took it), and their gates
        self._groups: GroupBase[LimiterBase] | None = None
        self._caps: GroupBase[LimiterBase] | None = None
        self._making = threading.Lock()
        settings = self._limiter.settings
        self._cap_settings = None if cap is None else dataclasses.replace(settings, tenant_max_running=cap)
        self._cap_gate = None if cap is None else _Gate("cap", GroupGate(_tenant_of), self._cap_limiter, True)
        self._gates = [_Gate("group", GroupGate(), self._group_limiter, False)]
        if self._cap_gate is not None:
            self._gates.append(self._cap_gate)
        #: counts the running jobs when their number is bounded
        max_running = self._limiter.max_running
        self._places: Any = self._driver.semaphore(max_running) if max_running else None
        self._closed = False
        #: the closing of the state (once the queue is closed and idle): ``None`` until it begins
        self._state_closing: Any = None

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
        tenant: str | None = None,
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
        :param tenant: on a fair queue (``fair=True``), whose share of the turns the job waits in
            (docs/fairness.md): tenants take turns, in this queue object and across the fleet.
        :raises QueueClosed: if the queue is closed.
        :raises QueueFull: if ``max_waiting`` jobs wait and ``overflow`` is ``"reject"``.
        :raises ConfigurationError: for a bad option.
        """
        if not callable(fn):
            raise TypeError(f"add() needs a callable, got {type(fn).__name__}")
        # an option left None is the queue's; every one is checked first
        options = self._options.overridden(
            retries=retries, backoff=backoff, retry_on=retry_on, dead_letter=dead_letter
        )
        future = cast(FutureT, self._driver.future())
        job: Job[Any] = Job(
            future,
            functools.partial(fn, *args, **kwargs),
            check_cost(cost, self._limiter.burst),
            check_priority(priority),
            options,
            delay_until(not_before, self._clock),
            group=check_group(group),
        )
        if tenant is not None or self._limiter.settings.fair:
            job.tenant = check_tenant_for(self._limiter.settings, tenant)
        if job.group is not None:
            self._group_limiter(job.group)  # checks the group as part of a queue name, now
        if self._cap_gate is not None:
            self._cap_limiter(job.tenant or "")  # and the tenant as part of its cap queue's
        dropped: Job[Any] | None = None
        with self._driver.lock:
            if self._closed:
                raise QueueClosed(f"queue {self.name!r} is closed")
            if self._max_waiting is not None and self._pending.first_tries() >= self._max_waiting:
                if self._overflow == "reject":
                    raise QueueFull(f"queue {self.name!r} holds max_waiting={self._max_waiting} jobs")
                dropped = self._pending.drop_oldest()
            job.seq = self._pending.number()
            if job.tenant is not None:
                job.tag = self._pending.fair_tag(job.tenant, self._limiter.settings.weight(job.tenant))
            if job.not_before is None:  # (a job for later asks for its places when its time comes)
                self._gated_now(job)
            self._pending.push(job)
            self._wake_pacer()
        if dropped is not None and self._takes(dropped):
            why = f"it held max_waiting={self._max_waiting} jobs and a newer one came"
            dropped.future.set_exception(QueueFull(f"dropped from queue {self.name!r}: {why}"))
        future.add_done_callback(lambda _: self._job_done(job))
        return future

    @property
    def pending(self) -> int:
        """Jobs added and not started yet."""
        with self._driver.lock:
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
        url = redact(self._runner.state.url)
        return f"{self._display_name}({url!r}, name={self.name!r}, interval={self.interval!r})"

    def _wake_pacer(self) -> None:
        """A job was queued, or made ready (holding the lock): wake the pacer, or start one if none runs."""
        self._driver.changed()
        if not self._pacing:
            self._pacing = True
            self._driver.start(self._pace_flow(), f"ratequeue-pacer-{self.name}", locked=False, daemon=False)

    def _is_idle(self) -> bool:
        return not self._pending and not self._running and not self._pacing

    def _jobs_changed(self) -> None:
        """Jobs left or ended (holding the lock): wake the pacer and the joiners.

        Both wait for the driver's change: the pacer for a held job (a job
        gated for its group is held with no due time, so only this wakes it
        once that job has left) or for a ready one, a joiner for the queue to
        go idle. A closed, idle queue then closes its state.
        """
        self._driver.changed()
        if self._closed and self._state_closing is None and self._is_idle():
            self._state_closing = True
            self._state_closing = self._driver.now_or_soon(self._close_state_flow())

    def _close_state_flow(self) -> Flow[None]:
        """Close the groups' limiters (releasing the places they hold), then the queue's limiter."""
        for group in (self._groups, self._caps):
            for limiter in list(group.limiters()) if group is not None else []:
                yield Call(limiter.close)
        yield Call(self._limiter.close)

    def _with_waiting(self, status: Status) -> Status:
        """``status`` with this queue's pending jobs as its waiting ones."""
        return dataclasses.replace(status, waiting=self.pending)

    def _close_queue(self, cancel_pending: bool) -> None:
        """Accept no more jobs, cancelling the queued ones if asked; the state is closed once idle."""
        with self._driver.lock:
            self._closed = True
            for job in self._pending.drain() if cancel_pending else ():
                # a retried job's thread future runs already and cannot be cancelled: fail it
                if not job.future.cancel() and not job.future.done():
                    job.future.set_exception(QueueClosed(f"queue {self.name!r} was closed before its retry"))
            self._jobs_changed()  # a pacer waiting for a held job looks again (and may stop)
        if cancel_pending:
            self._withdraw_if_idle()

    def _pace_flow(self) -> Flow[None]:
        """The pacer: take a turn for each queued job and start it, until none is queued.

        A turn that fails (the state is unreachable) fails the job at the
        head of the queue and the pacer goes on, after a pause that doubles
        while failures follow each other.
        """
        backoff = _FAILURE_BACKOFF
        try:
            while True:
                with self._driver.lock:
                    if not self._pending:
                        # stop in the same locked step that saw no job: a job added (or queued
                        # again for a retry) from now on starts a new pacer
                        self._pacing = False
                        self._jobs_changed()
                        return
                    self._pending.release_due(self._clock(), self._gated_now)
                    # every queued job is held: wait for the first, or for a change (a job queued,
                    # made ready or gone), in the same locked step that saw none ready: none is missed
                    if self._pending.head() is None:
                        left = self._pending.next_due() - self._clock()
                        yield Call(self._driver.wait_for_change, (wait(max(0.0, left)),))
                        continue
                if self._places is not None:
                    yield Call(self._places.acquire)
                with self._driver.lock:
                    self._pending.release_due(self._clock(), self._gated_now)
                    head = self._pending.head()
                    if head is None:  # cancelled, or only held jobs, while a running place was awaited
                        self._release_running_place()
                        continue
                    reservation = self._reservation = self._limiter.reserve(
                        cost=head.cost, tenant=head.tenant
                    )
                try:
                    turn: Turn | None = yield Call(reservation.wait)
                except Exception as exc:  # the state failed: fail the head job, go on
                    self._release_running_place()
                    _log.warning(_NO_TURN, self.name, type(exc).__name__, exc, backoff)
                    self._fail_head(exc)
                    yield Sleep(backoff)
                    backoff = min(backoff * 2, _FAILURE_BACKOFF_CAP)
                    continue
                finally:
                    with self._driver.lock:
                        self._reservation = None
                backoff = _FAILURE_BACKOFF
                if turn is None or (job := self._next_runnable(head.cost)) is None:
                    # the queued jobs were cancelled while we waited, or cost more
                    self._release_running_place()
                    if turn is not None:
                        _end_lease(self._limiter, turn.ticket)
                    continue
                job.ticket = turn.ticket
                self._driver.start(
                    self._job_flow(job), f"ratequeue-job-{self.name}", locked=False, daemon=False
                )
        except BaseException:  # an exception (or a cancelled task) ended the pacer
            with self._driver.lock:
                self._pacing = False
                self._jobs_changed()
            raise

    def _job_flow(self, job: Job[Any]) -> Flow[None]:
        """Run one started job and settle its future; a coroutine's result is awaited (asyncio).

        A failure its options retry puts it back among the queued jobs,
        held for its backoff (the future stays pending); one that is not
        retried any more goes to the dead-letter handler (if it was retried
        or a handler is set) and fails the future. A handler raising
        ``SystemExit`` or ``KeyboardInterrupt`` has it raised again once the
        job is settled (its future failed, its group's place given back): in
        the job's thread, or out of the event loop (docs/queues.md).
        """
        future = job.future
        job.attempts += 1
        interrupted: BaseException | None = None
        # this attempt's lease: taken off the job now, since a retry queued below may get a
        # new turn (and set a new ticket) before this attempt's end releases its own
        ticket, job.ticket = job.ticket, None
        try:
            result = yield Call(job.call)
        except asyncio.CancelledError:
            future.cancel()
            raise
        except BaseException as exc:
            holds = job.options.on_refusal == "hold" and job.refused < MAX_REFUSALS and not future.done()
            held = refusal_of(exc) if holds else None
            if held is not None:
                yield from self._hold_and_requeue(job, held)
            elif not future.done() and not self._retried(job, exc):
                self._report_failed(job, exc)
                if job.options.dead_letter is not None:
                    try:
                        yield Call(job.options.dead_letter, (job.dead_letter(exc),))
                    except Exception:  # the handler's own failure must not lose the job's
                        _log.exception("the dead-letter handler of queue %r failed", self.name)
                    except BaseException as stop:  # SystemExit, KeyboardInterrupt: it goes on, once settled
                        interrupted = stop
                if not future.done():
                    future.set_exception(exc)
                if interrupted is not None:
                    # asyncio runs a future's callbacks later, and the interruption may stop the loop
                    self._job_done(job)  # so its group's place goes back now
        else:
            if not future.done():
                future.set_result(result)
        finally:
            if ticket is not None:
                _end_lease(self._limiter, ticket)
            self._release_running_place()
            with self._driver.lock:
                self._running -= 1
                self._jobs_changed()
        if interrupted is not None:  # the job is settled: the interruption goes on
            _log.error(_INTERRUPTED, self.name, type(interrupted).__name__)
            raise interrupted

    def _release_running_place(self) -> None:
        """Count one running job less."""
        if self._places is not None:
            self._places.release()

    def _hold_and_requeue(self, job: Job[Any], held: float) -> Flow[None]:
        """Hold the whole queue ``held`` s for a refused try and queue ``job`` again, using no retry.

        Should the state fail the hold, the job is queued again all the same
        (nothing is lost); its next turn then comes at the rate.
        """
        job.refused += 1
        try:
            yield from self._limiter._refused_flow(held)
        except Exception as exc:
            _log.warning("queue %r: could not hold the queue after a refusal: %s", self.name, exc)
        except BaseException:  # cancelled meanwhile: the job is queued again all the same
            self._requeue(job)
            raise
        _log.info("queue %r: the service refused a job (try %d); held %.3f s", self.name, job.attempts, held)
        self._requeue(job)

    def _requeue(self, job: Job[Any]) -> None:
        with self._driver.lock:
            self._pending.push(job)  # its own place in the order; not counted against max_waiting
            self._wake_pacer()

    def _retried(self, job: Job[Any], exc: BaseException) -> bool:
        """Queue ``job`` again after its backoff if its options retry ``exc``; say whether it was."""
        options = job.options
        if job.attempts - job.refused > options.retries or not isinstance(exc, options.retry_on):
            return False
        delay = options.backoff.delay(job.attempts - job.refused)
        job.not_before = self._clock() + delay
        # the type only: a job's error text may hold what it called (a URL with its key)
        error = type(exc).__name__
        if self._runner.reporter.on:
            self._runner.reporter.emit(
                Event("retry", self.name, error=error, attempt=job.attempts, wait=delay)
            )
        _log.info(_RETRIED, self.name, job.attempts, options.retries + 1, error, delay)
        with self._driver.lock:
            self._pending.push(job)  # its own place in the order; not counted against max_waiting
            self._wake_pacer()
        return True

    def _report_failed(self, job: Job[Any], exc: BaseException) -> None:
        """Report a job that failed for good: its future fails with ``exc``, its dead letter follows."""
        error = type(exc).__name__  # the type only, as for a retry
        if self._runner.reporter.on:
            self._runner.reporter.emit(Event("dead_letter", self.name, error=error, attempt=job.attempts))
        _log.info("queue %r: a job failed for good on try %d (%s)", self.name, job.attempts, error)

    def _next_runnable(self, cost: int) -> Job[Any] | None:
        """Pop the next ready job that was not cancelled, counting it as running.

        ``None`` if there is none, or if it costs more than ``cost`` (the
        turn's): it stays first, and the turn goes unused.
        """
        with self._driver.lock:
            self._pending.release_due(self._clock(), self._gated_now)
            while (head := self._pending.head()) is not None:
                if head.cost > cost:
                    return None
                job = self._pending.pop_head()
                # a retry's future already runs (a thread future cannot be claimed twice)
                if self._takes(job):
                    self._running += 1
                    return job
            self._jobs_changed()
            return None

    def _takes(self, job: Job[Any]) -> bool:
        """Claim ``job``'s future for a start or a failure; ``False`` if it was cancelled.

        A retried job's future was claimed at its first start (a thread
        future cannot be claimed twice): it only must not be done.
        """
        return self._driver.claim(job.future) if job.attempts == 0 else not job.future.done()

    def _group_limiter(self, group: str) -> LimiterBase:
        """The limiter of ``group``'s place: a queue of its own, ``max_running=1``, no rate to speak of."""
        with self._making:
            if self._groups is None:
                self._groups = self._group_class(
                    self._runner.state,
                    name=f"{self.name}:group",
                    interval=1e-6,
                    max_running=1,
                    lease=self._limiter.lease,
                    keep=DEFAULT_KEEP,
                    # no on_event: a group's place is no start of the queue (its jobs' turns are)
                )
        return self._groups[group]

    def _cap_limiter(self, tenant: str) -> LimiterBase:
        """The limiter of ``tenant``'s places under ``tenant_max_running``: the limiters' own cap queue."""
        with self._making:
            if self._caps is None:
                assert self._cap_settings is not None
                self._caps = self._cap_group_class(self._runner.state, self._cap_settings, self._clock)
        return self._caps[tenant]

    def _start_gate_waiter(self, gate: _Gate, key: str) -> None:
        """Start the waiter of ``key``'s place at ``gate`` (holding the lock)."""
        self._driver.start(self._gate_flow(gate, key), f"ratequeue-{gate.name}-{self.name}", locked=False)

    def _gate_flow(self, gate: _Gate, key: str) -> Flow[None]:
        """A gate's waiter: get ``key``'s place for the first job in its line and let that job through.

        Then a group's waiter stops (its one place is taken); a cap's goes on
        to the next job in the line, until none is left. A job that leaves
        the line meanwhile (cancelled, dropped) has its request withdrawn,
        and the waiter asks for the next one. A failure of the state fails
        the job it asked for, and the waiter goes on.
        """
        backoff = _FAILURE_BACKOFF
        while True:
            with self._driver.lock:
                job = gate.lines.first(key)
                if job is None:
                    return
                place = gate.places[key] = gate.limiter(key).reserve()
            try:
                turn: Turn | None = yield Call(place.wait)
            except Exception as exc:
                with self._driver.lock:
                    gate.places.pop(key, None)
                    gate.lines.leave(job)
                    if self._pending.remove(job) and self._takes(job):
                        job.future.set_exception(exc)
                    self._jobs_changed()  # a pacer waiting for this (gated) job looks again, and may stop
                yield Sleep(backoff)
                backoff = min(backoff * 2, _FAILURE_BACKOFF_CAP)
                continue
            with self._driver.lock:
                gate.places.pop(key, None)
                if turn is None or gate.lines.first(key) is not job:  # it left the line meanwhile
                    if turn is not None:
                        _end_lease(gate.limiter(key), turn.ticket)
                    continue
                gate.lines.granted(job)
                job.held[gate.name] = turn.ticket
                self._through(job, gate)
                if not gate.several:
                    return

    def _gated_now(self, job: Job[Any]) -> bool:
        """Whether ``job`` must first wait for a place (holding the lock): it is put in that gate's line.

        At its ``add``, or once its ``not_before`` has come: a job for later holds no place meanwhile.
        """
        for gate in self._gates:
            key = gate.lines.key(job)
            if key is not None and gate.name not in job.held:
                if gate.lines.enter(job):
                    self._start_gate_waiter(gate, key)
                return True
        return False

    def _through(self, job: Job[Any], gate: _Gate) -> None:
        """``job`` has its place at ``gate`` (holding the lock): on to its tenant's cap, or ready."""
        caps = self._cap_gate
        if caps is not None and gate is not caps:
            tenant = caps.lines.key(job)
            assert tenant is not None
            if caps.lines.enter(job):
                self._start_gate_waiter(caps, tenant)
            return
        self._pending.ungate(job)
        self._wake_pacer()

    def _job_done(self, job: Job[Any]) -> None:
        """``job``'s future is done (the job ended for good, or left): give its places back.

        A job cancelled before it started leaves the queued ones.
        """
        if job.future.cancelled():
            with self._driver.lock:
                if self._pending.remove(job):
                    self._jobs_changed()  # a pacer waiting for a held job looks again (and may stop)
            self._withdraw_if_idle()
        if not job.held and not job.gated:
            return
        cancels: list[PlaceInLine] = []
        with self._driver.lock:
            for gate in self._gates:
                key = gate.lines.key(job)
                if key is None:
                    continue
                if gate.lines.waits(job):
                    if gate.lines.leave(job) and key in gate.places:  # its waiter asks for it now
                        cancels.append(gate.places[key])  # withdraw that request
                    continue
                ticket = job.held.pop(gate.name, None)
                if ticket is not None:
                    _end_lease(gate.limiter(key), ticket)
                    if not gate.several and gate.lines.ended(key):
                        self._start_gate_waiter(gate, key)
            job.gated = False
        for cancel in cancels:
            cancel.cancel()

    def _withdraw_if_idle(self) -> None:
        """Cancel the pacer's reservation when no queued job is left to use its turn."""
        with self._driver.lock:
            reservation = self._reservation if not self._pending else None
        if reservation is not None:
            reservation.cancel()

    def _fail_head(self, exc: Exception) -> None:
        with self._driver.lock:
            if self._pending.head() is not None:
                job = self._pending.pop_head()
                if self._takes(job):
                    job.future.set_exception(exc)
            self._jobs_changed()


def _end_lease(limiter: LimiterBase, ticket: int) -> None:
    """The job on ``ticket`` of ``limiter`` ended (or none began on it): its lease goes, in the background."""
    runner = runner_of(limiter)
    with runner.driver.lock:
        runner.end(ticket)
