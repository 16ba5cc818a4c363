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
from ._limiting import Seconds
from ._queueing import Entry, QueueBase
from .limiter import Limiter, Status
from .rates import RateLike
from .state import State, StateLike

__all__ = ["Queue"]

T = TypeVar("T")


class Queue(QueueBase[Limiter, "Future[Any]"]):
    """Runs callables at one start per ``interval`` across every process sharing the state.

    Jobs of one queue object start in the order they were added. At most
    ``max_running`` of them run at once (unbounded by default): a job takes
    its turn only when it could run.
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
        """
        limiter = Limiter(url, name=name, interval=interval, rate=rate, burst=burst, lead=lead)
        super().__init__(limiter, max_running)
        self._lock = threading.Condition()
        self._semaphore = threading.BoundedSemaphore(self._max_running) if self._max_running else None
        self._places = self._semaphore

    @property
    def state(self) -> State:
        """The state this queue uses."""
        return self._limiter.state

    def add(self, fn: Callable[..., T], /, *args: Any, cost: int = 1, **kwargs: Any) -> Future[T]:
        """Queue ``fn(*args, **kwargs)`` to start at its turn; return its future.

        Cancelling the future before the job starts removes it from the queue.
        ``cost`` is how many starts of the rate the job uses (1 to the
        burst); it is not passed on to ``fn`` (wrap ``fn`` in
        :func:`functools.partial` to give it an argument named ``cost``).

        :raises QueueClosed: if the queue is closed.
        """
        future: Future[T] = Future()
        self._add(future, fn, args, kwargs, cost)
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

    def _take_running_place(self) -> None:
        if self._semaphore is not None:
            self._semaphore.acquire()
