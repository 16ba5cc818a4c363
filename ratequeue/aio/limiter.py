"""Limiter for asyncio: ``await limiter.acquire()``, ``async with``, and decorated coroutines.

The same shard and flows as :class:`ratequeue.Limiter`, carried out on the
event loop (:class:`~ratequeue.drivers.AsyncioDriver`): waiting tasks sleep on
futures woken when the shard changes, so nothing runs while nobody waits
(G5). Use a limiter from one event loop at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, cast

from ..core.flow import arun
from ..core.leases import Held
from ..core.shard import Turn
from ..drivers import AsyncioDriver
from ..fallback import PROBE_TASK, REJOIN_TASK
from ..headers import Feedback, HeadersLike
from ..running import LimiterBase, ReservationBase, ShardRunner, Status, entered
from ..settings import Options, Seconds, Settings, check_slow
from ..state import AsyncState, AsyncStateLike, State, open_async_state
from ..tenant_caps import CapGroup, TenantCaps

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["Limiter", "Reservation"]

F = TypeVar("F", bound=Callable[..., Any])

_log = logging.getLogger("ratequeue.limiter")

#: the longest (s) close() waits for the lease keeper's call under way
_CLOSE_WAIT = 10.0


class Limiter(LimiterBase):
    """Lets tasks, across every process sharing the state, start one per ``interval``.

    The asyncio twin of :class:`ratequeue.Limiter`: same arguments, same
    guarantees. Cancelling a waiting task gives up its place; the ticket it
    held stays with this shard for the next task.
    """

    _display_name = "aio.Limiter"

    def __init__(self, url: AsyncStateLike = None, *, name: str, **options: Unpack[Options]) -> None:
        """See :class:`ratequeue.Limiter`; Redis, MongoDB and PostgreSQL use their drivers' asyncio clients.

        asyncio's timers wake up to a millisecond late, so while ``max_late``
        is checked the last ~1.5 ms before each begin are slept blocking the
        event loop; ``max_late=None`` keeps the loop free and begins up to
        about a millisecond late. ``on_event`` is called on the event loop
        (``call_soon``) once the reporting task yields; it must not block the
        loop. A state object passed in is left open by :meth:`close`.
        """
        settings, clock, hook = Settings.of(name, options)
        state = open_async_state(url)
        runner = ShardRunner(settings, state, AsyncioDriver(clock or time.monotonic), hook=hook, owner=self)
        #: the tenants' caps (``tenant_max_running``), if any
        self._caps: TenantCaps | None = None
        if settings.tenant_max_running is not None:
            self._caps = runner.in_use = TenantCaps(TenantCapGroup(state, settings, runner.clock))
        super().__init__(runner, owns_state=not isinstance(url, (State, AsyncState)))

    @property
    def state(self) -> AsyncState:
        """The state this limiter uses."""
        return cast(AsyncState, self._runner.state)

    async def acquire(
        self, timeout: Seconds | None = None, *, cost: int = 1, tenant: str | None = None
    ) -> Turn:
        """Wait until this task's global turn, and return it (see :meth:`ratequeue.Limiter.acquire`)."""
        runner = self._runner
        if self._caps is not None:
            return await arun(self._caps.acquire_flow(runner, timeout, cost, tenant))
        turn = await arun(runner.acquire_flow(runner.place(timeout, cost, tenant)))
        assert turn is not None, "only a withdrawn place has no turn, and this one is nobody else's"
        return turn

    async def try_acquire(self, *, cost: int = 1, tenant: str | None = None) -> Turn | None:
        """This task's turn if one is free now, else ``None`` (see :meth:`ratequeue.Limiter.try_acquire`)."""
        runner = self._runner
        if self._caps is not None:
            return await arun(self._caps.attempt_flow(runner, cost, tenant))
        return (await arun(runner.attempt_flow(cost, tenant)))[0]

    async def release(self, turn: Turn) -> bool:
        """End the job of ``turn``: give its place back now (see :meth:`ratequeue.Limiter.release`)."""
        return await self._release((turn.ticket, turn.token))

    async def _release(self, held: Held) -> bool:
        runner = self._runner
        leases, caps = runner.leases, self._caps
        live = False
        try:
            if leases is not None:
                try:
                    live = await arun(leases.release_flow(held))
                except asyncio.CancelledError:
                    leases.release_later(held)  # the keeper releases it (again, if it was)
                    raise
        except BaseException:
            if caps is not None:
                caps.end(held)
            raise
        if caps is not None:
            capped = await arun(caps.release_flow(held))
            if leases is None:
                live = bool(capped)
        return live

    async def _release_quietly(self, held: Held) -> None:
        """:meth:`release`, a failure logged: the job's own outcome matters more, and its lease expires."""
        try:
            await self._release(held)
        except Exception as exc:
            _log.warning("could not release a lease of queue %r: %s", self.name, exc)

    def reserve(self, *, cost: int = 1, tenant: str | None = None) -> Reservation:
        """Take a place in this shard's line now, to await :meth:`Reservation.wait` later."""
        return Reservation(self, cost, tenant)

    async def pause_everywhere(self) -> bool:
        """Pause every shard of the queue (see :meth:`ratequeue.Limiter.pause_everywhere`)."""
        return await arun(self._set_paused_flow(True))

    async def resume_everywhere(self) -> bool:
        """Resume the whole queue after :meth:`pause_everywhere`; whether it was paused."""
        return await arun(self._set_paused_flow(False))

    async def hold(self, seconds: Seconds) -> bool:
        """Hold the whole queue for ``seconds`` (see :meth:`ratequeue.Limiter.hold`); whether it grew."""
        return await arun(self._hold_flow(seconds))

    async def lift_hold(self) -> bool:
        """End the queue's hold now, everywhere; whether one was on."""
        return await arun(self._lift_hold_flow())

    async def slow_down(self, interval: Seconds | None = None) -> bool:
        """Slow the whole queue (see :meth:`ratequeue.Limiter.slow_down`); whether it did."""
        return await arun(self._slow_flow(0 if interval is None else check_slow(interval)))

    async def heed(self, headers: HeadersLike = (), *, status: int | None = None) -> Feedback:
        """Hold the whole queue if a service's answer asks (see :meth:`ratequeue.Limiter.heed`)."""
        return await arun(self._heed_flow(headers, status))

    async def sent(self, turn: Turn) -> bool:
        """Tell the fleet that ``turn``'s call has just gone out (see :meth:`ratequeue.Limiter.sent`)."""
        return await arun(self._sent_flow(turn))

    async def settle(self, turn: Turn, cost: int) -> bool:
        """Tell the fleet what ``turn``'s call really cost (see :meth:`ratequeue.Limiter.settle`)."""
        return await arun(self._settle_flow(turn, cost))

    async def status(self) -> Status:
        """Read the queue's shared record (one call to the state) and this shard's state."""
        return Status.of(self.settings, await self.state.read(self.name), self._runner.shard)

    def wrap(self, fn: F, *, cost: int = 1, tenant: str | None = None) -> F:
        """``fn`` as a coroutine function whose every call first awaits its turn (of ``cost``).

        A coroutine function is awaited after the turn; a plain function is
        called after it. Name, docstring and signature are kept.
        """
        is_coroutine = inspect.iscoroutinefunction(fn)

        @functools.wraps(fn)
        async def wrapped(*args: Any, **kwargs: Any) -> Any:
            turn = await self.acquire(cost=cost, tenant=tenant)
            try:
                result = fn(*args, **kwargs)
                return await result if is_coroutine else result
            finally:
                if self.holds_places:
                    await self._release_quietly((turn.ticket, turn.token))

        return cast(F, wrapped)

    async def __aenter__(self) -> Turn:
        return cast(Turn, entered(self, await self.acquire()))

    async def __aexit__(self, *exc: object) -> None:
        turn = entered(self)
        if turn is not None and self.holds_places:
            await self._release_quietly((turn.ticket, turn.token))

    async def close(self) -> None:
        """Close the state if opened from a URL; release the leases held first (jobs', tenants')."""
        runner = self._runner
        driver = cast(AsyncioDriver, runner.driver)
        for capper in self._caps.limiters() if self._caps is not None else ():
            await capper.close()  # (it releases the tenants' places it holds)
        if runner.fallback is not None:
            runner.fallback.stop(runner)
            # the probe of a state that is down, or a rejoin under way: nothing to finish
            ended = [task for task in driver.tasks if task.get_name().startswith((PROBE_TASK, REJOIN_TASK))]
            for task in ended:
                task.cancel()
            await asyncio.gather(*ended, return_exceptions=True)
        held = runner.leases.drain() if runner.leases is not None else []
        keepers = [task for task in driver.tasks if not task.done()]
        if keepers:  # the keeper finishes the call it may be making (a release taken off the book)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(asyncio.gather(*keepers)), _CLOSE_WAIT)
        for lease in held:
            await self._release_quietly(lease)
        if self._owns_state:
            await self.state.close()
        if runner.reporter.on:
            await asyncio.sleep(0)  # the events reported so far reach the hook (call_soon, in order)


class Reservation(ReservationBase):
    """A place in an :class:`aio.Limiter <Limiter>`'s line (see :meth:`Limiter.reserve`)."""

    async def wait(self, timeout: Seconds | None = None) -> Turn | None:
        """Wait until the turn of this place, and return it; ``None`` if it was cancelled.

        :param timeout: seconds to wait at most, from now; on expiry the place is given up.
        :raises AcquireTimeout: as soon as the turn cannot come within ``timeout``.
        """
        return await arun(self._wait_flow(timeout))

    async def __aenter__(self) -> Reservation:
        return self

    async def __aexit__(self, *exc: object) -> None:
        turn = self.turn
        if turn is None:
            self.cancel()
        elif self._limiter.holds_places:
            await cast(Limiter, self._limiter)._release_quietly((turn.ticket, turn.token))


class TenantCapGroup(CapGroup):
    """The cap queues of an :class:`aio.Limiter <Limiter>`'s tenants (``tenant_max_running``)."""

    _limiter_class = Limiter
