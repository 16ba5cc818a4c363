"""Queue for asyncio: run callables and coroutines, each at its global turn.

The asyncio driver of the queue written once in :mod:`ratequeue._queueing`:
``add`` returns an :class:`asyncio.Future` at once; a pacing task, started
on demand and ended when the queue is empty, takes each job's turn and
starts the job as a task of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any, cast

from .. import _validate
from .._flow import arun
from .._limiting import Seconds, Status
from .._queueing import Entry, QueueBase
from .group import LimiterGroup
from .limiter import Limiter
from .state import AsyncState

__all__ = ["Queue"]


class Queue(QueueBase[Limiter, "asyncio.Future[Any]"]):
    """Runs callables and coroutine functions at one start per ``interval`` across every process.

    The asyncio twin of :class:`ratequeue.Queue`; use it from one event loop.
    """

    _display_name = "aio.Queue"

    @property
    def state(self) -> AsyncState:
        """The state this queue uses."""
        return self._limiter.state

    async def join(self, timeout: Seconds | None = None) -> bool:
        """Wait until every added job has finished; return ``False`` if ``timeout`` passed first."""
        seconds = _validate.timeout(timeout)
        try:
            await asyncio.wait_for(self._idle.wait(), seconds)
        except asyncio.TimeoutError:
            return False
        return True

    async def status(self) -> Status:
        """The shared record and this queue's view of it."""
        return self._with_waiting(await self._limiter.status())

    async def close(self, wait: bool = True, *, cancel_pending: bool = False) -> None:
        """Accept no more jobs; optionally cancel the queued ones; the state is closed once idle.

        :param wait: wait until the jobs still queued and the running ones have
            finished, and the state is closed.
        """
        self._close_queue(cancel_pending)
        if wait:
            await self.join()
            if self._state_closing is not None:
                await self._state_closing

    async def __aenter__(self) -> Queue:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _limiter_class(self) -> type[Limiter]:
        return Limiter

    def _init_driver(self) -> None:
        self._semaphore = asyncio.Semaphore(self._max_running) if self._max_running else None
        self._places = self._semaphore
        #: the pacer and job tasks, kept so that they are not collected while they run
        self._tasks: set[asyncio.Task[None]] = set()
        self._idle = asyncio.Event()
        #: set when a job is added, for a pacer waiting for held jobs
        self._added = asyncio.Event()
        self._idle.set()
        self._state_closing: asyncio.Task[None] | None = None

    def _new_future(self) -> asyncio.Future[Any]:
        return asyncio.get_running_loop().create_future()

    def _locked(self) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()  # one event loop: nothing runs between two awaits

    def _wake_joiners(self) -> None:
        if self._is_idle():
            self._idle.set()

    def _close_state_soon(self) -> None:
        self._state_closing = self._spawn(self._close_limiters())

    async def _close_limiters(self) -> None:
        for limiter in self._group_limiters():
            await cast(Limiter, limiter).close()  # releases the places they hold
        await self._limiter.close()

    def _start_pacer(self) -> None:
        self._spawn(arun(self._pace_flow()), name=f"ratequeue-pacer-{self.name}")

    def _start_job(self, entry: Entry[asyncio.Future[Any]]) -> None:
        self._spawn(arun(self._job_flow(entry)))

    def _spawn(self, coroutine: Coroutine[Any, Any, None], name: str | None = None) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coroutine, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _group_class(self) -> type[LimiterGroup]:
        return LimiterGroup

    def _start_group_waiter(self, group: str) -> None:
        self._spawn(arun(self._group_flow(group)), name=f"ratequeue-group-{self.name}")

    def _claim(self, future: asyncio.Future[Any]) -> bool:
        return not future.cancelled()

    async def _wait_for_jobs(self, timeout: float, seen: int) -> None:
        if self._generation != seen:
            return
        self._added.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._added.wait(), timeout)

    def _wake_pacer(self) -> None:
        self._added.set()
        self._idle.clear()  # a job was added, or queued again for a retry

    async def _take_running_place(self) -> None:
        if self._semaphore is not None:
            await self._semaphore.acquire()
