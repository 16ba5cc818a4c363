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
from concurrent.futures import Future
from typing import Any, TypeVar, cast

from . import _validate
from ._flow import run
from ._limiting import Seconds
from ._queueing import Entry, QueueBase
from .group import LimiterGroup
from .limiter import Limiter, Status
from .state import State

__all__ = ["Queue"]

T = TypeVar("T")


class Queue(QueueBase[Limiter, "Future[Any]"]):
    """Runs callables at one start per ``interval`` across every process sharing the state.

    Jobs of one queue object start highest ``priority`` first, then in the
    order they were added; a job with a ``not_before`` time, or waiting out a
    retry's backoff, is held until then without a turn or a ticket. At most
    ``max_running`` jobs run at once across every queue and limiter of this
    name (unbounded by default), each holding a lease; a job takes its turn
    only when it could run here. docs/queues.md states the rules.
    """

    @property
    def state(self) -> State:
        """The state this queue uses."""
        return self._limiter.state

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

    def _limiter_class(self) -> type[Limiter]:
        return Limiter

    def _init_driver(self) -> None:
        self._lock = threading.Condition()
        self._semaphore = threading.BoundedSemaphore(self._max_running) if self._max_running else None
        self._places = self._semaphore

    def _new_future(self) -> Future[Any]:
        return Future()

    def _locked(self) -> threading.Condition:
        return self._lock

    def _wake_joiners(self) -> None:
        self._lock.notify_all()

    def _close_state_soon(self) -> None:
        for limiter in self._group_limiters():
            cast(Limiter, limiter).close()  # releases the group places still held (the state is the queue's)
        self._limiter.close()

    def _start_pacer(self) -> None:
        threading.Thread(target=run, args=(self._pace_flow(),), name=f"ratequeue-pacer-{self.name}").start()

    def _start_job(self, entry: Entry[Future[Any]]) -> None:
        threading.Thread(target=run, args=(self._job_flow(entry),), name=f"ratequeue-job-{self.name}").start()

    def _group_class(self) -> type[LimiterGroup]:
        return LimiterGroup

    def _start_group_waiter(self, group: str) -> None:
        threading.Thread(
            target=run, args=(self._group_flow(group),), name=f"ratequeue-group-{self.name}", daemon=True
        ).start()

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
