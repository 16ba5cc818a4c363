"""Queue for asyncio: run callables and coroutines, each at its global turn.

The queue written once in :mod:`ratequeue.queueing`, run on the event loop:
``add`` returns an :class:`asyncio.Future` at once; a pacing task, started on
demand and ended when the queue is empty, takes each job's turn and starts
the job as a task of its own.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

from ..drivers import AsyncioDriver
from ..queueing import QueueBase
from ..running import Status
from ..settings import Seconds, check_timeout
from ..state import AsyncState
from .group import LimiterGroup
from .limiter import Limiter, TenantCapGroup

__all__ = ["Queue"]


class Queue(QueueBase[Limiter, asyncio.Future[Any]]):
    """Runs callables and coroutine functions at one start per ``interval`` across every process.

    The asyncio twin of :class:`ratequeue.Queue`; use it from one event loop.
    ``fn`` may be a coroutine function (awaited); ``dead_letter`` too.
    """

    _display_name = "aio.Queue"
    _limiter_class = Limiter
    _group_class = LimiterGroup
    _cap_group_class = TenantCapGroup
    _driver_class = AsyncioDriver

    @property
    def state(self) -> AsyncState:
        """The state this queue uses."""
        return self._limiter.state

    async def join(self, timeout: Seconds | None = None) -> bool:
        """Wait until every added job has finished; return ``False`` if ``timeout`` passed first."""
        seconds = check_timeout(timeout)
        driver = cast(AsyncioDriver, self._driver)
        deadline = None if seconds is None else driver.clock() + seconds
        while not self._is_idle():
            left = None if deadline is None else deadline - driver.clock()
            if left is not None and left <= 0:
                return False
            await driver.wait_for_change(left)
        return True

    async def status(self) -> Status:
        """The shared record and this queue's view of it."""
        return self._with_waiting(await self._limiter.status())

    async def close(self, wait: bool = True, *, cancel_pending: bool = False) -> None:
        """Accept no more jobs; optionally cancel the queued ones; the state is closed once idle.

        :param wait: wait until the jobs queued and running have finished, and the state is closed.
        """
        self._close_queue(cancel_pending)
        if wait:
            await self.join()
            if isinstance(self._state_closing, asyncio.Task):
                await self._state_closing

    async def __aenter__(self) -> Queue:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
