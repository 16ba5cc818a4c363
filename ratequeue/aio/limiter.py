"""Limiter for asyncio: ``await limiter.acquire()``, ``async with``, and decorated coroutines.

The same :class:`~ratequeue.shard.Shard` as the thread limiter decides every
step; this module only awaits the state's answers and the shard's sleeps.
Waiting tasks sleep on futures woken when the shard changes: nothing runs
while nobody waits (guarantee G5). Use a limiter from one event loop at a time.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

from .. import _validate
from .._sleep import wait_until
from ..errors import AcquireTimeout
from ..limiter import Status, Withdrawn
from ..protocol import Outcome
from ..shard import (
    DEFAULT_MAX_LATE,
    Begin,
    BeginAt,
    Expired,
    Job,
    Retime,
    Shard,
    SleepUntil,
    TakeAndTry,
    TryStart,
    Turn,
    WaitForTurn,
)
from ..state.base import redact
from .state import AsyncState, AsyncStateLike, from_url

__all__ = ["Limiter"]

#: how long before a begin the event loop's own timers are left for a blocking, precise
#: sleep: asyncio rounds its timeouts up to whole milliseconds
_LOOP_RESOLUTION = 0.0015

F = TypeVar("F", bound=Callable[..., Any])


class Limiter:
    """Lets tasks, across every process sharing the state, start one per ``interval``.

    The asyncio twin of :class:`ratequeue.Limiter`: same arguments, same
    guarantees. Cancelling a waiting task gives up its place; the ticket it
    held stays with this shard for the next task.
    """

    def __init__(
        self,
        url: AsyncStateLike = None,
        *,
        name: str,
        interval: float,
        lead: float | None = None,
        max_late: float | None = DEFAULT_MAX_LATE,
        clock: Callable[[], float] | None = None,
    ) -> None:
        """See :class:`ratequeue.Limiter`; Redis and MongoDB use their drivers' asyncio clients.

        asyncio's timers wake up to a millisecond late, so while ``max_late``
        is checked the last ~1.5 ms before each begin are slept blocking the
        event loop (a precise sleep); ``max_late=None`` keeps the loop free
        and begins up to about a millisecond late.
        """
        self.name, self.interval, self._interval_us, self._lead = _validate.limiter(name, interval, lead)
        self._max_late = _validate.max_late(max_late)
        self._clock = clock or time.monotonic
        self._state: AsyncState = from_url(url)
        self._owns_state = not isinstance(url, AsyncState)
        checked = _validate.checked_lateness(self._max_late, self._state.clock_resolution)
        self._shard = Shard(self.interval, lead=self._lead, max_late=checked)
        self._waiters: list[asyncio.Future[None]] = []

    @property
    def state(self) -> AsyncState:
        """The state this limiter uses."""
        return self._state

    async def acquire(self, timeout: float | None = None) -> Turn:
        """Wait until this task's global turn, and return it.

        :param timeout: seconds to wait at most; ``None`` waits for ever, ``0``
            only takes a turn that is free now.
        :raises AcquireTimeout: as soon as the turn cannot come within ``timeout``.
        """
        return await self._acquire(_validate.timeout(timeout))

    async def _acquire(self, seconds: float | None, on_job: Callable[[Job], None] | None = None) -> Turn:
        job = self._shard.add(None if seconds is None else self._clock() + seconds)
        if on_job is not None:
            on_job(job)
        return await self._drive(job, seconds)

    def pause(self) -> None:
        """Pause this shard (call from the event loop's thread)."""
        self._shard.pause()
        self._notify()

    def resume(self) -> None:
        """Resume this shard after :meth:`pause` (call from the event loop's thread)."""
        self._shard.resume()
        self._notify()

    @property
    def paused(self) -> bool:
        """Whether this shard is paused."""
        return self._shard.paused

    async def status(self) -> Status:
        """Read the queue's shared record (one call to the state) and this shard's state."""
        return Status.of(self.name, self.interval, await self._state.read(self.name), self._shard)

    def wrap(self, fn: F) -> F:
        """``fn`` as a coroutine function whose every call first awaits its turn.

        A coroutine function is awaited after the turn; a plain function is
        called after it (the wrapper is a coroutine function either way).
        Name, docstring and signature are kept.
        """
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def wrapped_async(*args: Any, **kwargs: Any) -> Any:
                await self.acquire()
                return await fn(*args, **kwargs)

            return cast(F, wrapped_async)

        @functools.wraps(fn)
        async def wrapped(*args: Any, **kwargs: Any) -> Any:
            await self.acquire()
            return fn(*args, **kwargs)

        return cast(F, wrapped)

    def __call__(self, fn: F) -> F:
        """Decorate ``fn`` so that every call awaits its turn (see :meth:`wrap`)."""
        return self.wrap(fn)

    async def __aenter__(self) -> Turn:
        return await self.acquire()

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def close(self) -> None:
        """Close the state if this limiter opened it from a URL."""
        if self._owns_state:
            await self._state.close()

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self._state.url, self.name, self.interval, self._lead, self._max_late))

    def __repr__(self) -> str:
        url = redact(self._state.url)
        return f"aio.Limiter({url!r}, name={self.name!r}, interval={self.interval!r})"

    def _withdraw(self, job: Job) -> None:
        """Take a waiting ``job`` out; its ``_acquire`` raises ``Withdrawn``."""
        self._shard.cancel(job)
        self._notify()

    def _notify(self) -> None:
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def _changed(self, timeout: float | None) -> None:
        """Wait until the shard changes, or ``timeout`` seconds pass."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await asyncio.wait_for(waiter, None if timeout is None else max(0.0, timeout))
        except asyncio.TimeoutError:
            pass
        finally:
            self._waiters.remove(waiter)

    async def _drive(self, job: Job, timeout: float | None) -> Turn:
        try:
            while True:
                if job.turn is None and not job.queued:
                    raise Withdrawn("the waiting job was withdrawn")
                now = self._clock()
                step = self._shard.step(job, now)
                if isinstance(step, Begin):
                    self._notify()  # the next job is head now
                    return step.turn
                if isinstance(step, Expired):
                    raise AcquireTimeout(
                        f"no turn in queue {self.name!r} within {timeout} s", name=self.name, timeout=timeout
                    )
                if isinstance(step, WaitForTurn):
                    await self._changed(None if step.deadline is None else step.deadline - now)
                elif isinstance(step, SleepUntil):
                    await self._changed(step.until - now)
                elif isinstance(step, BeginAt):
                    await self._wait_until(step.until, now, spin=step.spin)
                else:
                    await self._call(job, step)
        except BaseException:
            self._shard.abandon(job)
            self._notify()
            raise

    async def _wait_until(self, until: float, now: float, *, spin: bool) -> None:
        """Wait until local time ``until``: on the loop's timers, then precisely if lateness is checked."""
        if self._shard.max_late is None:
            await asyncio.sleep(until - now)
            return
        if until - now > _LOOP_RESOLUTION:
            await asyncio.sleep(until - now - _LOOP_RESOLUTION)
        wait_until(until, self._clock, spin=spin)

    async def _call(self, job: Job, step: TakeAndTry | TryStart | Retime) -> None:
        sent = self._clock()
        try:
            outcome: Outcome
            if isinstance(step, TakeAndTry):
                outcome = await self._state.take_and_try(self.name, self._interval_us, step.lead_us)
            elif isinstance(step, TryStart):
                outcome = await self._state.try_start(self.name, self._interval_us, step.ticket, step.lead_us)
            else:
                outcome = await self._state.retime(self.name, self._interval_us, step.ticket, step.lead_us)
        except BaseException:
            self._shard.failed(job)
            raise
        received = self._clock()
        state_now = self._state.local_now()
        offset = None if state_now is None else received - state_now
        self._shard.receive(job, outcome, sent, received, offset=offset)
        self._notify()


def _rebuild(
    cls: type[Limiter],
    url: str,
    name: str,
    interval: float,
    lead: float | None,
    max_late: float | None = DEFAULT_MAX_LATE,
) -> Limiter:
    return cls(url, name=name, interval=interval, lead=lead, max_late=max_late)
