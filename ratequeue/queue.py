"""Queue: run jobs, each at its global turn, from a background thread.

``add`` returns a :class:`concurrent.futures.Future` at once. A pacing thread,
started on demand and ended when the queue is empty (guarantee G5), takes
each job's turn through a :class:`~ratequeue.Limiter` reservation and starts
the job in a thread of its own, so a slow job never delays the next start.
The pacer and the run of a job are written once for both queues
(:mod:`ratequeue._queueing`); this module supplies threads and futures.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from . import _validate
from ._flow import run
from ._jobs import Backoff, DeadLetter, JobOptions, NotBefore
from ._limiting import Seconds
from ._queueing import Entry, QueueBase
from .limiter import Limiter, Status
from .rates import RateLike
from .state import State, StateLike

__all__ = ["Queue"]

T = TypeVar("T")


class Queue(QueueBase[Limiter, "Future[Any]"]):
    """Runs callables at one start per ``interval`` across every process sharing the state.

    Jobs of one queue object start highest ``priority`` first, then in the
    order they were added; a job with a ``not_before`` time, or waiting out a
    retry's backoff, is held until then without a turn or a ticket. At most
    ``max_running`` of them run at once (unbounded by default): a job takes
    its turn only when it could run. docs/queues.md states the rules.
    """

    def __init__(
        self,
        url: StateLike = None,
        *,
        name: str,
        interval: Seconds | None = None,
        rate: RateLike | None = None,
        burst: int = 1,
        lead: Seconds | None = None,
        max_running: int | None = None,
        retries: int = 0,
        backoff: Backoff | None = None,
        retry_on: type[BaseException] | tuple[type[BaseException], ...] = (Exception,),
        dead_letter: Callable[[DeadLetter], Any] | None = None,
        max_waiting: int | None = None,
        overflow: str = "reject",
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
        :param max_running: how many jobs may run at once; ``None`` for no limit.
        :param retries: how many times a failed job is tried again (0: never);
            each try takes a new turn, after its ``backoff``. Jobs may set their own.
        :param backoff: the wait before each retry (:class:`~ratequeue.Backoff`;
            by default 1 s doubling up to 60 s, with jitter).
        :param retry_on: the exceptions that are retried (all by default); others fail the job at once.
        :param dead_letter: called with a :class:`~ratequeue.DeadLetter` when a
            job fails for good (its retries ran out, or it was not retried);
            its future fails all the same.
        :param max_waiting: the most jobs this queue object holds waiting
            (``None``: no limit); see ``overflow``.
        :param overflow: when ``max_waiting`` jobs wait: ``"reject"`` the new one
            (:class:`~ratequeue.QueueFull`) or ``"drop_oldest"`` (its future fails with ``QueueFull``).
        """
        limiter = Limiter(url, name=name, interval=interval, rate=rate, burst=burst, lead=lead)
        options = JobOptions.checked(retries, backoff, retry_on, dead_letter)
        super().__init__(limiter, max_running, options, max_waiting, overflow)
        self._lock = threading.Condition()
        self._semaphore = threading.BoundedSemaphore(self._max_running) if self._max_running else None
        self._places = self._semaphore

    @property
    def state(self) -> State:
        """The state this queue uses."""
        return self._limiter.state

    def add(
        self,
        fn: Callable[..., T],
        /,
        *args: Any,
        cost: int = 1,
        priority: int = 0,
        not_before: NotBefore | None = None,
        retries: int | None = None,
        backoff: Backoff | None = None,
        retry_on: type[BaseException] | tuple[type[BaseException], ...] | None = None,
        dead_letter: Callable[[DeadLetter], Any] | None = None,
        **kwargs: Any,
    ) -> Future[T]:
        """Queue ``fn(*args, **kwargs)`` to start at its turn; return its future.

        Cancelling the future before the job starts removes it from the queue.
        The keyword arguments below are the queue's, not passed on to ``fn``
        (wrap ``fn`` in :func:`functools.partial` to give it one of these names):

        :param cost: how many starts of the rate the job uses (1 to the burst).
        :param priority: a whole number; higher starts first (then the order added).
        :param not_before: hold the job until then: a ``datetime`` (wall
            clock), or seconds (or a ``timedelta``) from now. It takes no turn
            and holds no ticket meanwhile.
        :param retries: ``backoff``, ``retry_on``, ``dead_letter``: this job's own, in
            place of the queue's (see :class:`Queue`).
        :raises QueueClosed: if the queue is closed.
        :raises QueueFull: if ``max_waiting`` jobs wait and ``overflow`` is ``"reject"``.
        :raises ConfigurationError: for a bad option.
        """
        future: Future[T] = Future()
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
        )
        return future

    def join(self, timeout: Seconds | None = None) -> bool:
        """Wait until every added job has finished; return ``False`` if ``timeout`` passed first."""
        seconds = _validate.timeout(timeout)
        with self._lock:
            return self._lock.wait_for(self._is_idle, seconds)

    def status(self) -> Status:
        """The shared record and this queue's view of it (see :meth:`Limiter.status`)."""
        return self._with_waiting(self._limiter.status())

    def close(self, wait: bool = True, *, cancel_pending: bool = False) -> None:
        """Accept no more jobs; the state (if the queue opened it) is closed once the last job ends.

        :param wait: block until the jobs still queued (unless cancelled) and
            the running ones have finished.
        :param cancel_pending: cancel the futures of the jobs not started yet.
        """
        self._close_queue(cancel_pending)
        if wait:
            self.join()

    def __enter__(self) -> Queue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _locked(self) -> threading.Condition:
        return self._lock

    def _wake_joiners(self) -> None:
        self._lock.notify_all()

    def _close_state_soon(self) -> None:
        self._limiter.close()

    def _start_pacer(self) -> None:
        threading.Thread(target=run, args=(self._pace_flow(),), name=f"ratequeue-pacer-{self.name}").start()

    def _start_job(self, entry: Entry[Future[Any]]) -> None:
        threading.Thread(target=run, args=(self._job_flow(entry),), name=f"ratequeue-job-{self.name}").start()

    def _claim(self, future: Future[Any]) -> bool:
        return future.set_running_or_notify_cancel()

    def _wait_for_jobs(self, timeout: float, seen: int) -> None:
        with self._lock:
            self._lock.wait_for(lambda: self._generation != seen, timeout)

    def _wake_pacer(self) -> None:
        self._lock.notify_all()

    def _take_running_place(self) -> None:
        if self._semaphore is not None:
            self._semaphore.acquire()
