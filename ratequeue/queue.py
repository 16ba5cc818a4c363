"""Queue: run jobs, each at its global turn, from a background thread.

``add`` returns a :class:`concurrent.futures.Future` at once. A pacing thread,
started on demand and ended when the queue is empty (guarantee G5), takes
each job's turn through a :class:`~ratequeue.limiter.Limiter` and starts the
job in a thread of its own, so a slow job never delays the next start.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from . import _validate
from .errors import QueueClosed
from .limiter import Limiter, Status, Withdrawn
from .shard import Job
from .state import State, StateLike
from .state.base import redact

__all__ = ["Queue"]

T = TypeVar("T")


@dataclass(eq=False)
class _Entry:
    future: Future[Any]
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


class _Pausable(Protocol):
    @property
    def paused(self) -> bool: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...


class PauseControls:
    """Pause and resume, shared by the thread and asyncio queues: both delegate to their limiter."""

    _limiter: _Pausable

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


class Queue(PauseControls):
    _limiter: Limiter

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
        interval: float,
        lead: float | None = None,
        max_running: int | None = None,
    ) -> None:
        """
        :param url: the state, as for :class:`~ratequeue.Limiter`.
        :param name: the queue name; every queue and limiter with the same
            state and name shares one rate.
        :param interval: seconds (or a ``timedelta``) between two starts.
        :param lead: as for :class:`~ratequeue.Limiter`.
        :param max_running: how many jobs may run at once; ``None`` for no limit.
        """
        self._limiter = Limiter(url, name=name, interval=interval, lead=lead)
        self.name = self._limiter.name
        self.interval = self._limiter.interval
        if max_running is not None:
            _validate.positive_int("max_running", max_running)
        self._slots = threading.BoundedSemaphore(max_running) if max_running else None
        self._lock = threading.Condition()
        self._pending: deque[_Entry] = deque()
        self._running = 0
        self._pacer: threading.Thread | None = None
        #: the pacer's job waiting in the limiter, withdrawn when no queued job is left to run
        self._pacing: Job | None = None
        self._closed = False

    @property
    def state(self) -> State:
        """The state this queue uses."""
        return self._limiter.state

    def add(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        """Queue ``fn(*args, **kwargs)`` to start at its turn; return its future.

        Cancelling the future before the job starts removes it from the queue.

        :raises QueueClosed: if the queue is closed.
        """
        if not callable(fn):
            raise TypeError(f"add() needs a callable, got {type(fn).__name__}")
        future: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise QueueClosed(f"queue {self.name!r} is closed")
            entry = _Entry(future, fn, args, kwargs)
            self._pending.append(entry)
            future.add_done_callback(lambda _: self._forget_if_cancelled(entry))
            if self._pacer is None:
                self._pacer = threading.Thread(target=self._pace, name=f"ratequeue-pacer-{self.name}")
                self._pacer.start()
        return future

    def join(self, timeout: float | None = None) -> bool:
        """Wait until every added job has finished; return ``False`` if ``timeout`` passed first."""
        seconds = _validate.timeout(timeout)
        with self._lock:
            return self._lock.wait_for(lambda: not self._pending and not self._running, seconds)

    @property
    def pending(self) -> int:
        """Jobs added and not started yet."""
        with self._lock:
            return len(self._pending)

    def status(self) -> Status:
        """The shared record and this queue's view of it (see :meth:`Limiter.status`)."""
        status = self._limiter.status()
        with self._lock:
            waiting = len(self._pending)
        return dataclasses.replace(status, waiting=waiting)

    def close(self, wait: bool = True, *, cancel_pending: bool = False) -> None:
        """Accept no more jobs.

        :param wait: block until the jobs still queued (unless cancelled) and
            the running ones have finished.
        :param cancel_pending: cancel the futures of the jobs not started yet.
        """
        with self._lock:
            self._closed = True
            if cancel_pending:
                while self._pending:
                    self._pending.popleft().future.cancel()
                self._lock.notify_all()
        if cancel_pending:
            self._withdraw_if_idle()
        if wait:
            self.join()
        if wait and not self._pending:
            self._limiter.close()

    def __enter__(self) -> Queue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Queue({redact(self._limiter.state.url)!r}, name={self.name!r}, interval={self.interval!r})"

    def _pace(self) -> None:
        """The pacing thread: take turns for queued jobs until none is left."""
        while True:
            with self._lock:
                if not self._pending:
                    self._pacer = None
                    self._lock.notify_all()
                    return
            if self._slots is not None:
                self._slots.acquire()
            try:
                self._limiter._acquire(None, on_job=self._set_pacing)
            except Withdrawn:  # every queued job was cancelled
                self._pacing = None
                if self._slots is not None:
                    self._slots.release()
                continue
            except BaseException as exc:  # the state failed: fail the head job, go on
                self._fail_head(exc)
                if self._slots is not None:
                    self._slots.release()
                continue
            self._pacing = None
            entry = self._next_runnable()
            if entry is None:  # every queued job was cancelled while we waited
                if self._slots is not None:
                    self._slots.release()
                continue
            threading.Thread(target=self._run, args=(entry,), name=f"ratequeue-job-{self.name}").start()

    def _next_runnable(self) -> _Entry | None:
        """Pop the first queued job that was not cancelled, marking it running."""
        with self._lock:
            while self._pending:
                entry = self._pending.popleft()
                if entry.future.set_running_or_notify_cancel():
                    self._running += 1
                    return entry
            self._lock.notify_all()
            return None

    def _forget_if_cancelled(self, entry: _Entry) -> None:
        """Drop a job whose future was cancelled before it started."""
        if not entry.future.cancelled():
            return
        with self._lock:
            if entry in self._pending:
                self._pending.remove(entry)
                self._lock.notify_all()
        self._withdraw_if_idle()

    def _set_pacing(self, job: Job) -> None:
        self._pacing = job

    def _withdraw_if_idle(self) -> None:
        """Withdraw the pacer's wait for a turn when no queued job is left to use it."""
        with self._lock:
            job = self._pacing if not self._pending else None
        if job is not None:
            self._limiter._withdraw(job)

    def _fail_head(self, exc: BaseException) -> None:
        with self._lock:
            if self._pending:
                entry = self._pending.popleft()
                if entry.future.set_running_or_notify_cancel():
                    entry.future.set_exception(exc)
            self._lock.notify_all()

    def _run(self, entry: _Entry) -> None:
        try:
            result = entry.fn(*entry.args, **entry.kwargs)
        except BaseException as exc:
            entry.future.set_exception(exc)
        else:
            entry.future.set_result(result)
        finally:
            if self._slots is not None:
                self._slots.release()
            with self._lock:
                self._running -= 1
                self._lock.notify_all()
