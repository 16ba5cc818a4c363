"""What the thread and asyncio queues share: the queued jobs, the pacer, the run of a job.

A queue is a limiter plus a list of jobs added and not yet started. A
*pacer* (a thread, or a task) takes each job's turn through a reservation
of the limiter and starts the job on its own (a thread, or a task), so a
slow job never delays the next start. The pacer runs only while jobs are
queued (guarantee G5). The pacer's loop and the run of one job are written
here once, as :mod:`ratequeue._flow` generators; :class:`ratequeue.Queue`
and :class:`ratequeue.aio.Queue` supply the lock, the futures, the running
limit and how a job is started.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from . import _validate
from ._flow import Call, Flow, Sleep
from ._limiting import LimiterBase, Status
from ._redact import redact
from .errors import QueueClosed
from .shard import Turn

__all__ = ["Entry", "QueueBase"]

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


@dataclass(eq=False)
class Entry(Generic[FutureT]):
    """A job added to a queue: its call and the future of its result."""

    future: FutureT
    call: Callable[[], Any]
    #: how many starts of the queue's rate the job uses
    cost: int = 1


class QueueBase(ABC, Generic[L, FutureT]):
    """The jobs of one queue object and the flows that start and run them."""

    #: the queue name
    name: str
    #: seconds between two starts
    interval: float
    _limiter: L

    def __init__(self, limiter: L, max_running: int | None) -> None:
        self._limiter = limiter
        self.name = limiter.name
        self.interval = limiter.interval
        self._max_running = (
            None if max_running is None else _validate.positive_int("max_running", max_running)
        )
        self._pending: deque[Entry[FutureT]] = deque()
        #: jobs started and not finished
        self._running = 0
        #: whether a pacer runs
        self._pacing = False
        #: the pacer's place in the limiter's queue, cancelled when no queued job is left to use it
        self._reservation: PlaceInQueue | None = None
        #: counts the running jobs when their number is bounded (set by the driver)
        self._places: Releasable | None = None
        self._closed = False
        #: whether the state has been closed (once the queue is closed and idle)
        self._state_closed = False

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
    ) -> None:
        """Queue ``fn(*args, **kwargs)`` of ``cost`` with ``future``, starting the pacer if none runs."""
        if not callable(fn):
            raise TypeError(f"add() needs a callable, got {type(fn).__name__}")
        cost = _validate.cost(cost, self._limiter.burst)
        entry: Entry[FutureT] = Entry(future, functools.partial(fn, *args, **kwargs), cost)
        with self._locked():
            if self._closed:
                raise QueueClosed(f"queue {self.name!r} is closed")
            self._pending.append(entry)
            if not self._pacing:
                self._pacing = True
                self._start_pacer()
        future.add_done_callback(lambda _: self._forget_if_cancelled(entry))

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
            while cancel_pending and self._pending:
                self._pending.popleft().future.cancel()
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
        try:
            while True:
                with self._locked():
                    if not self._pending:
                        return
                yield Call(self._take_running_place)
                with self._locked():
                    if not self._pending:  # cancelled while a running place was awaited
                        self._release_running_place()
                        continue
                    cost = self._pending[0].cost
                    reservation = self._reservation = self._reserve(cost)
                try:
                    turn: Turn | None = yield Call(reservation.wait)
                except Exception as exc:  # the state failed: fail the head job, go on
                    self._release_running_place()
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
                    continue
                self._start_job(entry)
        finally:
            with self._locked():
                self._pacing = False
                self._idle_changed()

    def _job_flow(self, entry: Entry[FutureT]) -> Flow[None]:
        """Run one started job and settle its future; a coroutine's result is awaited (asyncio)."""
        future = entry.future
        try:
            result = yield Call(entry.call)
        except asyncio.CancelledError:
            future.cancel()
            raise
        except BaseException as exc:
            if not future.done():
                future.set_exception(exc)
        else:
            if not future.done():
                future.set_result(result)
        finally:
            self._release_running_place()
            with self._locked():
                self._running -= 1
                self._idle_changed()

    def _next_runnable(self, cost: int) -> Entry[FutureT] | None:
        """Pop the first queued job that was not cancelled, counting it as running.

        ``None`` if there is none, or if it costs more than ``cost`` (the
        turn's): it stays first, and the turn goes unused.
        """
        with self._locked():
            while self._pending:
                if self._pending[0].cost > cost:
                    return None
                entry = self._pending.popleft()
                if self._claim(entry.future):
                    self._running += 1
                    return entry
            self._idle_changed()
            return None

    def _forget_if_cancelled(self, entry: Entry[FutureT]) -> None:
        """Drop a job whose future was cancelled before it started."""
        if not entry.future.cancelled():
            return
        with self._locked():
            if entry in self._pending:
                self._pending.remove(entry)
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
            if self._pending:
                entry = self._pending.popleft()
                if self._claim(entry.future):
                    entry.future.set_exception(exc)
            self._idle_changed()
