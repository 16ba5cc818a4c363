"""Queue for asyncio: run callables and coroutines, each at its global turn.

The asyncio twin of :class:`ratequeue.Queue`. ``add`` returns an
:class:`asyncio.Future` at once; a pacing task, started on demand and ended
when the queue is empty, takes each job's turn and starts the job as a task
of its own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import _validate
from ..errors import QueueClosed
from ..limiter import Status, Withdrawn
from ..queue import PauseControls
from ..shard import Job
from ..state.base import redact
from .limiter import Limiter
from .state import AsyncState, AsyncStateLike

__all__ = ["Queue"]


@dataclass(eq=False)
class _Entry:
    future: asyncio.Future[Any]
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


class Queue(PauseControls):
    _limiter: Limiter

    """Runs callables and coroutine functions at one start per ``interval`` across every process."""

    def __init__(
        self,
        url: AsyncStateLike = None,
        *,
        name: str,
        interval: float,
        lead: float | None = None,
        max_running: int | None = None,
    ) -> None:
        """See :class:`ratequeue.Queue`."""
        self._limiter = Limiter(url, name=name, interval=interval, lead=lead)
        self.name = self._limiter.name
        self.interval = self._limiter.interval
        if max_running is not None:
            _validate.positive_int("max_running", max_running)
        self._max_running = max_running
        self._slots: asyncio.Semaphore | None = None
        self._pending: deque[_Entry] = deque()
        self._running: set[asyncio.Task[None]] = set()
        self._pacer: asyncio.Task[None] | None = None
        self._pacing: Job | None = None
        self._idle: asyncio.Event | None = None
        self._closed = False

    @property
    def state(self) -> AsyncState:
        """The state this queue uses."""
        return self._limiter.state

    def add(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> asyncio.Future[Any]:
        """Queue ``fn(*args, **kwargs)`` (awaited if it is a coroutine function); return its future.

        Call from a running event loop. Cancelling the future before the job
        starts removes it from the queue.

        :raises QueueClosed: if the queue is closed.
        """
        if not callable(fn):
            raise TypeError(f"add() needs a callable, got {type(fn).__name__}")
        if self._closed:
            raise QueueClosed(f"queue {self.name!r} is closed")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        entry = _Entry(future, fn, args, kwargs)
        self._pending.append(entry)
        future.add_done_callback(lambda _: self._forget_if_cancelled(entry))
        self._busy()
        if self._pacer is None:
            self._pacer = loop.create_task(self._pace(), name=f"ratequeue-pacer-{self.name}")
        return future

    async def join(self, timeout: float | None = None) -> bool:
        """Wait until every added job has finished; return ``False`` if ``timeout`` passed first."""
        seconds = _validate.timeout(timeout)
        if self._is_idle():
            return True
        assert self._idle is not None
        try:
            await asyncio.wait_for(self._idle.wait(), seconds)
        except asyncio.TimeoutError:
            return False
        return True

    @property
    def pending(self) -> int:
        """Jobs added and not started yet."""
        return len(self._pending)

    async def status(self) -> Status:
        """The shared record and this queue's view of it."""
        status = await self._limiter.status()
        return dataclasses.replace(status, waiting=len(self._pending))

    async def close(self, wait: bool = True, *, cancel_pending: bool = False) -> None:
        """Accept no more jobs; optionally cancel the queued ones, then wait for the rest."""
        self._closed = True
        if cancel_pending:
            while self._pending:
                self._pending.popleft().future.cancel()
            self._withdraw_if_idle()
        if wait:
            await self.join()
            await self._limiter.close()

    async def __aenter__(self) -> Queue:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        url = redact(self._limiter.state.url)
        return f"aio.Queue({url!r}, name={self.name!r}, interval={self.interval!r})"

    async def _pace(self) -> None:
        try:
            while self._pending:
                if self._max_running is not None:
                    if self._slots is None:
                        self._slots = asyncio.Semaphore(self._max_running)
                    await self._slots.acquire()
                try:
                    await self._limiter._acquire(None, on_job=self._set_pacing)
                except Withdrawn:
                    self._release_slot()
                    continue
                except Exception as exc:  # the state failed: fail the head job, go on
                    self._fail_head(exc)
                    self._release_slot()
                    continue
                finally:
                    self._pacing = None
                entry = self._next_runnable()
                if entry is None:
                    self._release_slot()
                    continue
                task = asyncio.get_running_loop().create_task(self._run(entry))
                self._running.add(task)
        finally:
            self._pacer = None
            self._check_idle()

    def _next_runnable(self) -> _Entry | None:
        while self._pending:
            entry = self._pending.popleft()
            if not entry.future.cancelled():
                return entry
        return None

    def _fail_head(self, exc: BaseException) -> None:
        if self._pending:
            entry = self._pending.popleft()
            if not entry.future.done():
                entry.future.set_exception(exc)

    async def _run(self, entry: _Entry) -> None:
        try:
            result = entry.fn(*entry.args, **entry.kwargs)
            if inspect.isawaitable(result):
                result = await result
        except asyncio.CancelledError:
            entry.future.cancel()
            raise
        except BaseException as exc:
            if not entry.future.done():
                entry.future.set_exception(exc)
        else:
            if not entry.future.done():
                entry.future.set_result(result)
        finally:
            self._release_slot()
            self._running.discard(asyncio.current_task())  # type: ignore[arg-type,unused-ignore]
            self._check_idle()

    def _set_pacing(self, job: Job) -> None:
        self._pacing = job

    def _forget_if_cancelled(self, entry: _Entry) -> None:
        if entry.future.cancelled() and entry in self._pending:
            self._pending.remove(entry)
            self._withdraw_if_idle()
            self._check_idle()

    def _withdraw_if_idle(self) -> None:
        if not self._pending and self._pacing is not None:
            self._limiter._withdraw(self._pacing)

    def _release_slot(self) -> None:
        if self._slots is not None:
            self._slots.release()

    def _is_idle(self) -> bool:
        return not self._pending and not self._running and self._pacer is None

    def _busy(self) -> None:
        if self._idle is None:
            self._idle = asyncio.Event()
        self._idle.clear()

    def _check_idle(self) -> None:
        if self._idle is not None and self._is_idle():
            self._idle.set()
