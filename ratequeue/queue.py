"""Queue: run jobs, each at its global turn, from a background thread.

``add`` returns a :class:`concurrent.futures.Future` at once. A pacing
thread, started on demand and ended when the queue is empty (G5), takes each
job's turn through a :class:`~ratequeue.Limiter` reservation and starts the
job in a thread of its own, so a slow job never delays the next start. The
pacer and the run of a job are written once for both queues
(:mod:`ratequeue.queueing`).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, cast

from .drivers import ThreadDriver
from .group import LimiterGroup
from .limiter import Limiter, Status, TenantCapGroup
from .queueing import QueueBase
from .settings import Seconds, check_timeout
from .state import State

__all__ = ["Queue"]


class Queue(QueueBase[Limiter, Future[Any]]):
    """Runs callables at one start per ``interval`` across every process sharing the state.

    Jobs of one queue object start highest ``priority`` first, then in the
    order they were added; a job with a ``not_before`` time, or waiting out a
    retry's backoff, is held until then without a turn or a ticket. At most
    ``max_running`` jobs run at once across every queue and limiter of this
    name (unbounded by default), each holding a lease; a job takes its turn
    only when it could run here. docs/queues.md states the rules.
    """

    _limiter_class = Limiter
    _group_class = LimiterGroup
    _cap_group_class = TenantCapGroup
    _driver_class = ThreadDriver

    @property
    def state(self) -> State:
        """The state this queue uses."""
        return self._limiter.state

    def join(self, timeout: Seconds | None = None) -> bool:
        """Wait until every added job has finished; return ``False`` if ``timeout`` passed first."""
        seconds = check_timeout(timeout)
        driver = cast(ThreadDriver, self._driver)
        with driver.lock:
            return driver.wait_for(self._is_idle, seconds)

    def status(self) -> Status:
        """The shared record and this queue's view of it (see :meth:`Limiter.status`)."""
        return self._with_waiting(self._limiter.status())

    def close(self, wait: bool = True, *, cancel_pending: bool = False) -> None:
        """Accept no more jobs; the state (if the queue opened it) is closed once the last job ends.

        :param wait: block until the jobs still queued (unless cancelled) and the running ones have finished.
        :param cancel_pending: cancel the futures of the jobs not started yet.
        """
        self._close_queue(cancel_pending)
        if wait:
            self.join()

    def __enter__(self) -> Queue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
