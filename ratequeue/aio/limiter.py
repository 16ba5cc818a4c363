"""Limiter for asyncio: ``await limiter.acquire()``, ``async with``, and decorated coroutines.

The asyncio driver of :class:`~ratequeue._limiting.LimiterBase`: the same
shard and the same acquire flow as the thread limiter; this module only
awaits the state's answers and the shard's sleeps. Waiting tasks sleep on
futures woken when the shard changes: nothing runs while nobody waits
(guarantee G5). Use a limiter from one event loop at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any, TypeVar, cast

from .._flow import arun
from .._limiting import (
    DEFAULT_LEASE,
    LimiterBase,
    ReservationBase,
    Seconds,
    Status,
    TimedAnswer,
    _calls_log,
    entered,
    received_and_state_now,
)
from .._limiting import _rebuild as _rebuild  # limiters pickled by earlier versions name it here
from .._sleep import wait_until
from ..errors import AcquireTimeout
from ..events import Event, EventHook, report
from ..protocol import Started
from ..rates import RateLike
from ..shard import DEFAULT_MAX_LATE, Turn
from .state import AsyncState, AsyncStateLike, from_url

__all__ = ["Limiter", "Reservation"]

#: how long before a begin the event loop's own timers are left for a blocking, precise
#: sleep: asyncio rounds its timeouts up to whole milliseconds
_LOOP_RESOLUTION = 0.0015

F = TypeVar("F", bound=Callable[..., Any])

#: the longest (s) close() waits for the lease keeper's call under way
_CLOSE_WAIT = 10.0

_log = logging.getLogger("ratequeue.limiter")

_DEBUG = logging.DEBUG


class Limiter(LimiterBase[AsyncState]):
    """Lets tasks, across every process sharing the state, start one per ``interval``.

    The asyncio twin of :class:`ratequeue.Limiter`: same arguments, same
    guarantees. Cancelling a waiting task gives up its place; the ticket it
    held stays with this shard for the next task.
    """

    _display_name = "aio.Limiter"

    def __init__(
        self,
        url: AsyncStateLike = None,
        *,
        name: str,
        interval: Seconds | None = None,
        rate: RateLike | None = None,
        burst: int = 1,
        keep: Seconds | None = None,
        lead: Seconds | None = None,
        max_late: Seconds | None = DEFAULT_MAX_LATE,
        clock: Callable[[], float] | None = None,
        max_running: int | None = None,
        lease: Seconds = DEFAULT_LEASE,
        on_event: EventHook | None = None,
    ) -> None:
        """See :class:`ratequeue.Limiter`; Redis and MongoDB use their drivers' asyncio clients.

        asyncio's timers wake up to a millisecond late, so while ``max_late``
        is checked the last ~1.5 ms before each begin are slept blocking the
        event loop (a precise sleep); ``max_late=None`` keeps the loop free
        and begins up to about a millisecond late. A :class:`State` or
        :class:`AsyncState` object passed in is left open by :meth:`close`.
        ``on_event`` is called on the event loop (``loop.call_soon``), soon
        after the event, once the task that reported it yields: never between
        a turn's lateness check and its begin. It must not block the loop
        (and must not be a coroutine function: it is not awaited).
        ``await asyncio.sleep(0)`` lets the events reported so far reach it;
        :meth:`close` does.
        """
        self._waiters: list[asyncio.Future[None]] = []
        #: the lease keeper's task, while it runs (a reference keeps it from being collected)
        self._keeper: asyncio.Task[None] | None = None
        super().__init__(
            url,
            name=name,
            interval=interval,
            rate=rate,
            burst=burst,
            keep=keep,
            lead=lead,
            max_late=max_late,
            clock=clock,
            max_running=max_running,
            lease=lease,
            on_event=on_event,
        )

    async def acquire(self, timeout: Seconds | None = None, *, cost: int = 1) -> Turn:
        """Wait until this task's global turn, and return it.

        :param timeout: seconds to wait at most; ``None`` waits for ever, ``0``
            only takes a turn that is free now.
        :param cost: how many starts of the rate this call uses (1 to the burst).
        :raises AcquireTimeout: as soon as the turn cannot come within ``timeout``.
        """
        turn = await arun(self._acquire_flow(self._new_job(timeout, cost)))
        assert turn is not None, "only a withdrawn job has no turn, and this one is nobody else's"
        return turn

    async def release(self, turn: Turn) -> bool:
        """End the job of ``turn``: with ``max_running``, give its place back now.

        As :meth:`ratequeue.Limiter.release`: whether its lease was still live.
        """
        return await self._release_ticket(turn.ticket)

    async def _release_ticket(self, ticket: int) -> bool:
        call = self._end_lease(ticket, later=False)
        if call is None:
            return False
        try:
            live, *_ = await self._call_state(*call)
        except asyncio.CancelledError:
            self._end_lease(ticket, later=True)  # the keeper releases it (again, if it was)
            raise
        self._place_freed()
        return bool(live)

    async def _release_quietly(self, ticket: int) -> None:
        """:meth:`release`, a failure logged: the job's own outcome matters more, and its lease expires."""
        try:
            await self._release_ticket(ticket)
        except Exception as exc:
            _log.warning("could not release a lease of queue %r: %s", self.name, exc)

    async def try_acquire(self, *, cost: int = 1) -> Turn | None:
        """This task's turn if one is free now, else ``None`` (see :meth:`ratequeue.Limiter.try_acquire`)."""
        return (await self._attempt(cost))[0]

    async def _attempt(self, cost: int) -> tuple[Turn | None, float | None]:
        """:meth:`try_acquire`, and without a turn the local time its slot comes, if the state said."""
        job = self._new_job(0, cost)
        try:
            return await arun(self._acquire_flow(job, attempt=True)), None
        except AcquireTimeout:
            return None, job.expected

    def reserve(self, *, cost: int = 1) -> Reservation:
        """Take a place in this shard's queue now, to await :meth:`Reservation.wait` later.

        As :meth:`ratequeue.Limiter.reserve`; cancel it from the event loop's thread.
        """
        return Reservation(self, cost)

    async def pause_everywhere(self) -> bool:
        """Pause the whole queue, every shard in every process; whether it was not paused already.

        As :meth:`ratequeue.Limiter.pause` with ``everywhere=True``: a flag
        in the queue's shared record (one call to the state). :meth:`pause`
        pauses this shard only.
        """
        return bool(await self._set_paused_everywhere(True))

    async def resume_everywhere(self) -> bool:
        """Resume the whole queue after :meth:`pause_everywhere`; whether it was paused.

        This shard's waiting task asks again at once; the others, at their next ask.
        """
        changed = bool(await self._set_paused_everywhere(False))
        self._ask_again()
        return changed

    async def status(self) -> Status:
        """Read the queue's shared record (one call to the state) and this shard's state."""
        return Status.of(self.name, self.interval, await self._state.read(self.name), self._shard)

    def wrap(self, fn: F, *, cost: int = 1) -> F:
        """``fn`` as a coroutine function whose every call first awaits its turn (of ``cost``).

        A coroutine function is awaited after the turn; a plain function is
        called after it (the wrapper is a coroutine function either way).
        Name, docstring and signature are kept.
        """
        is_coroutine = inspect.iscoroutinefunction(fn)

        @functools.wraps(fn)
        async def wrapped(*args: Any, **kwargs: Any) -> Any:
            turn = await self.acquire(cost=cost)
            try:
                result = fn(*args, **kwargs)
                return await result if is_coroutine else result
            finally:
                if self.max_running:
                    await self._release_quietly(turn.ticket)

        return cast(F, wrapped)

    async def __aenter__(self) -> Turn:
        return cast(Turn, entered(self, await self.acquire()))

    async def __aexit__(self, *exc: object) -> None:
        turn = entered(self)
        if turn is not None and self.max_running:
            await self._release_quietly(turn.ticket)

    async def close(self) -> None:
        """Close the state if opened from a URL; with ``max_running``, release leases first."""
        held = self._leases.drain()  # the keeper, finding nothing left, stops...
        self._changed()
        if self._keeper is not None and not self._keeper.done():
            # ...after the call it may be making (a release it took off the book before the drain)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._keeper), _CLOSE_WAIT)
        for ticket in held:
            await self._release_quietly(ticket)
        if self._owns_state:
            await self._state.close()
        if self._on_event is not None:
            await asyncio.sleep(0)  # the events reported so far reach the hook (call_soon, in order)

    def _open(self, url: Any) -> AsyncState:
        return from_url(url)

    def _locked(self) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()  # one event loop: nothing runs between two awaits

    def _changed(self) -> None:
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _start_keeper(self) -> None:
        self._keeper = asyncio.get_running_loop().create_task(arun(self._keeper_flow()))

    async def _wait_for_change(self, timeout: float | None) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await asyncio.wait_for(waiter, None if timeout is None else max(0.0, timeout))
        except asyncio.TimeoutError:
            pass
        finally:
            self._waiters.remove(waiter)

    async def _wait_until(self, until: float, now: float, spin: bool) -> None:
        """On the loop's timers, then (while lateness is checked) precisely, blocking the loop."""
        if self._shard.max_late is None:
            await asyncio.sleep(until - now)
            return
        if until - now > _LOOP_RESOLUTION:
            await asyncio.sleep(until - now - _LOOP_RESOLUTION)
        wait_until(until, self._clock, spin=spin)

    async def _wait_precisely(self, until: float) -> None:
        await self._wait_until(until, self._clock(), spin=True)

    async def _call_state(
        self, operation: Callable[..., Any], args: tuple[int, ...], kwargs: dict[str, int]
    ) -> TimedAnswer:
        sent = self._clock()
        try:
            if not self.max_running:
                outcome = await operation(self.name, *args, **kwargs)
            else:
                # A call cancelled on its way may still be carried out by the state: its answer
                # is awaited in the background, and a start it granted gives its lease back.
                call = asyncio.ensure_future(operation(self.name, *args, **kwargs))
                try:
                    outcome = await asyncio.shield(call)
                except asyncio.CancelledError:
                    call.add_done_callback(self._answer_lost)
                    raise
        except Exception as exc:
            if self._on_event is not None or _calls_log.isEnabledFor(_DEBUG):
                self._call_failed(operation, args, exc, sent)
            raise
        received, state_now = received_and_state_now(self._clock, self._state.local_now)
        answer = outcome, sent, received, state_now
        if self._on_event is not None or _calls_log.isEnabledFor(_DEBUG):
            self._call_answered(operation, args, outcome, sent, received)
        return answer

    def _emit(self, event: Event) -> None:
        """Schedule the ``on_event`` hook with ``event`` on the running loop (else: the reporter thread)."""
        outlet = self._outlet
        if outlet is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop runs in this thread (a report from elsewhere): the thread way
            report(outlet, event)
            return
        loop.call_soon(outlet.deliver, event)

    def _answer_lost(self, call: asyncio.Future[Any]) -> None:
        """A state call whose caller was cancelled has ended: release the lease of a start it granted."""
        if call.cancelled() or call.exception() is not None:
            return
        answer = call.result()
        if isinstance(answer, Started):
            self._end_lease(answer.ticket, later=True)


class Reservation(ReservationBase[AsyncState]):
    """A place in an :class:`aio.Limiter <Limiter>`'s queue (see :meth:`Limiter.reserve`)."""

    async def wait(self, timeout: Seconds | None = None) -> Turn | None:
        """Wait until the turn of this place, and return it; ``None`` if it was cancelled.

        :param timeout: seconds to wait at most, from now; on expiry the place is given up.
        :raises AcquireTimeout: as soon as the turn cannot come within ``timeout``.

        Awaited again once its turn has begun, it returns that turn at once.
        """
        if self._begun is not None:
            return self._begun
        self._begun = turn = await arun(self._limiter._acquire_flow(self._start_waiting(timeout)))
        return turn

    async def __aenter__(self) -> Reservation:
        return self

    async def __aexit__(self, *exc: object) -> None:
        turn = self.turn
        if turn is None:
            self.cancel()
        elif self._limiter.max_running:
            limiter = cast(Limiter, self._limiter)
            await limiter._release_quietly(turn.ticket)
