"""Limiter: wait for this caller's global turn, in a thread.

Callers queue in this process's shard; the caller at the head of the line
talks to the state, the others sleep on a condition until the shard changes.
No thread runs while nobody waits (guarantee G5). The decisions are the
shard's and the flows are :class:`~ratequeue.running.ShardRunner`'s; this
module runs them in the calling thread (:class:`~ratequeue.drivers.ThreadDriver`).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, cast

from .core.flow import run
from .core.leases import Held
from .core.shard import Turn
from .drivers import ThreadDriver
from .events import flush
from .headers import Feedback, HeadersLike
from .running import LimiterBase, ReservationBase, ShardRunner, Status, entered
from .settings import Options, Seconds, Settings, check_slow, not_with_caps
from .state import State, StateLike, open_state
from .tenant_caps import CapGroup, TenantCaps

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["Limiter", "Reservation", "Status"]

F = TypeVar("F", bound=Callable[..., Any])

_log = logging.getLogger("ratequeue.limiter")

#: the longest (s) close() waits for the lease keeper's call under way, and for the events to be delivered
_CLOSE_WAIT = 10.0
_FLUSH_WAIT = 1.0


class Limiter(LimiterBase):
    """Lets callers, across every process sharing the state, start one per ``interval``.

    ``acquire()`` blocks until the caller's global turn; so do ``with
    limiter:`` and every call of a function decorated with ``@limiter``.
    Many threads may share one limiter. Each limiter object is one shard: it
    can be paused on its own. It pickles as its state's URL and its settings,
    and reconnects lazily where it is unpickled.
    """

    def __init__(self, url: StateLike = None, *, name: str, **options: Unpack[Options]) -> None:
        """
        :param url: the state: a URL (``memory://``, ``file:///path.json``, ``redis://…``,
            ``mongodb://…``, ``postgresql://…``), a path, a :class:`State`, or ``None`` for
            the per-user default state file.
        :param name: the queue name; every limiter with the same state and name shares one rate.
        :param options: the pace (``interval=`` or ``rate=``) and the rest of
            :class:`~ratequeue.settings.Options`. With ``max_running``, a job runs from its
            turn until :meth:`release` (the end of ``with limiter:``, or the return of a
            decorated function), and a thread of this limiter renews its lease meanwhile.
            ``on_event`` is called in ratequeue's reporter thread; :meth:`close` delivers
            the events reported so far.
        """
        settings, clock, hook = Settings.of(name, options)
        state = open_state(url)
        runner = ShardRunner(settings, state, ThreadDriver(clock or time.monotonic), hook=hook, owner=self)
        #: the tenants' caps (``tenant_max_running``), if any
        self._caps: TenantCaps | None = None
        if settings.tenant_max_running is not None:
            self._caps = runner.in_use = TenantCaps(TenantCapGroup(state, settings, runner.clock))
        super().__init__(runner, owns_state=not isinstance(url, State))

    @property
    def state(self) -> State:
        """The state this limiter uses."""
        return cast(State, self._runner.state)

    def acquire(self, timeout: Seconds | None = None, *, cost: int = 1, tenant: str | None = None) -> Turn:
        """Block until this caller's global turn, and return it.

        :param timeout: seconds to wait at most; ``None`` waits for ever, ``0``
            only takes a turn that is free now.
        :param cost: how many starts of the rate this call uses (1 to the burst).
        :param tenant: on a fair queue (``fair=True``), whose share of the turns this call waits in
            (docs/fairness.md); ``None`` is the default tenant, ``""``.
        :raises AcquireTimeout: as soon as the turn cannot come within ``timeout``.
        :raises StateUnavailable: if the state cannot be reached.

        With ``max_running`` or ``tenant_max_running``, the job runs until :meth:`release` of
        this turn; with ``tenant_max_running`` the caller first waits while its tenant has that
        many jobs running (docs/fairness.md, "Per-tenant caps").
        """
        runner = self._runner
        if self._caps is not None:
            return run(self._caps.acquire_flow(runner, timeout, cost, tenant))
        lock = runner.driver.lock
        lock.acquire()  # (not ``with``: one call less on every acquire)
        try:
            turn = run(runner.acquire_flow(runner.place(timeout, cost, tenant)))
        finally:
            lock.release()
        assert turn is not None, "only a withdrawn place has no turn, and this one is nobody else's"
        return turn

    def try_acquire(self, *, cost: int = 1, tenant: str | None = None) -> Turn | None:
        """This caller's turn if one is free now, else ``None``; never waits for a turn.

        At most two calls to the state: the ticket this shard holds (from a
        caller that waited and left) tried, then a new one taken only if it
        starts now. A try that gets no turn leaves no ticket behind: the
        callers that wait lose nothing to it (docs/design.md, "try_take").

        :raises StateUnavailable: if the state cannot be reached.
        """
        runner = self._runner
        if self._caps is not None:
            return run(self._caps.attempt_flow(runner, cost, tenant))
        with runner.driver.lock:
            return run(runner.attempt_flow(cost, tenant))[0]

    def release(self, turn: Turn) -> bool:
        """End the job of ``turn``: with ``max_running``, give its place back now (one call to the state).

        Returns whether its lease was still live (``False`` without
        ``max_running``, for a turn released twice, one whose lease ran
        out, or a turn of another queue: a lease is named by its turn's
        token, so only its own turn frees it). A caller waiting in this
        process for a place asks at once.

        :raises StateUnavailable: if the state cannot be reached (the lease then expires by itself).
        """
        return self._release((turn.ticket, turn.token))

    def _release(self, held: Held) -> bool:
        runner = self._runner
        live = False
        try:
            if runner.leases is not None:
                with runner.driver.lock:
                    live = run(runner.leases.release_flow(held))
        except BaseException:
            if self._caps is not None:
                self._caps.end(held)
            raise
        if self._caps is not None:
            capped = run(self._caps.release_flow(held))
            if runner.leases is None:
                live = bool(capped)
        return live

    def reserve(self, *, cost: int = 1, tenant: str | None = None) -> Reservation:
        """Take a place in this shard's line now, to :meth:`Reservation.wait` for its turn later.

        Another thread may :meth:`Reservation.cancel` it. While a reservation
        nobody waits for is at the head of the line, the callers behind it
        wait too: wait for it, or cancel it (``with limiter.reserve() as r:``
        cancels on exit). Not with ``tenant_max_running`` (:class:`ConfigurationError`).
        """
        return Reservation(self, cost, tenant)

    def pause_everywhere(self) -> bool:
        """Pause the whole queue: no shard, in any process, starts a job until :meth:`resume_everywhere`.

        A flag in the queue's record (one call to the state); whether the queue
        was not paused already. This shard is not paused itself: like every
        other, its waiting caller is told to wait and asks again once a second.
        """
        return run(self._set_paused_flow(True))

    def resume_everywhere(self) -> bool:
        """Resume the whole queue after :meth:`pause_everywhere`; whether it was paused.

        This shard's waiting caller asks again at once; the others at their
        next ask (within a second), at the rate, in ticket order.
        """
        return run(self._set_paused_flow(False))

    def hold(self, seconds: Seconds) -> bool:
        """Hold the whole queue: no shard, in any process, starts a job for ``seconds`` from now.

        One call to the state; "now" is the state's clock. A hold only
        grows: one that already ends later is kept (the answer is then
        ``False``). Waiting callers keep their tickets and their order, and
        ask again when the hold ends, not before; then turns come at the rate
        (or the burst) again. For a service's ``429`` and ``Retry-After``,
        :meth:`heed` does this from the response. ``seconds`` from 0 to a day.
        """
        return run(self._hold_flow(seconds))

    def lift_hold(self) -> bool:
        """End the queue's hold (:meth:`hold`) now, everywhere; whether one was on."""
        return run(self._lift_hold_flow())

    def slow_down(self, interval: Seconds | None = None) -> bool:
        """Slow the whole queue: starts at least ``interval`` s apart (``None``: twice as far as now).

        One call to the state; every process's starts follow the queue's
        effective interval, which recovers by itself (its excess over the
        interval halves every 5 s without another slow-down) and never goes
        below the interval. At most 64 intervals. Whether it slowed the queue
        (``False`` when it is that slow already). ``adaptive=True`` does this
        on every refusal :meth:`heed` hears.
        """
        return run(self._slow_flow(0 if interval is None else check_slow(interval)))

    def heed(self, headers: HeadersLike = (), *, status: int | None = None) -> Feedback:
        """Read a service's answer (its status and headers) and hold the whole queue if it asks.

        The rules of :func:`ratequeue.headers.parse_headers`: a 429 or 503
        with ``Retry-After``, or a quota whose remaining is 0, holds every
        shard until then (:meth:`hold`); a 429 that names no wait holds for
        :data:`~ratequeue.headers.REFUSAL_HOLD` (1 s). With ``adaptive=True``
        a refusal also slows the queue (:meth:`slow_down`), and headers that
        state a slower quota than the limiter's slow it to that quota. No call
        to the state when nothing asks for one. Returns what the headers said.
        """
        return run(self._heed_flow(headers, status))

    def sent(self, turn: Turn) -> bool:
        """Tell the fleet that ``turn``'s call has just gone out; a late one holds the queue an interval.

        Call it right after the request is written (before reading its
        answer). :meth:`acquire` returns within ``max_late`` of the turn's
        start, but a process can be descheduled after that, before its
        request leaves; the next turn, on time, would then reach the service
        less than an interval after this one. If the call went out more than
        ``max_late`` after the start, the whole queue is held for an interval
        (and the margin) from now: one call to the state. Otherwise no call
        is made. Nothing is done with a burst, or with ``max_late=None``,
        whose begins are not spaced. Returns whether the queue was held
        (further); a hold the state could not take is logged, not raised, as
        the call has gone out already (docs/design.md, "Late sends").
        """
        return run(self._sent_flow(turn))

    def settle(self, turn: Turn, cost: int) -> bool:
        """Tell the fleet what ``turn``'s call really cost: an overrun moves later starts on, a refund back.

        ``turn`` is what :meth:`acquire` returned, taken with an estimated
        ``cost=``; ``cost`` here is the actual one, from 0 to the burst
        (LLM tokens, GraphQL points). One call to the state, none when it is
        the estimate. An overrun moves every later start by the excess; a
        refund gives back what the burst still holds of the saving (never
        credit the queue had already lost while idle). A turn settles once.
        Returns whether later starts moved. The guarantee (G8): any run of
        starts costs, as known when its last one started, at most the burst
        plus its length in intervals (docs/feedback.md, "Costs settled after
        the call").

        :raises StateUnavailable: if the state cannot be reached.
        """
        return run(self._settle_flow(turn, cost))

    def status(self) -> Status:
        """Read the queue's shared record (one call to the state) and this shard's state."""
        runner = self._runner
        snapshot = self.state.read(self.name)
        with runner.driver.lock:
            return Status.of(self.settings, snapshot, runner.shard)

    def wrap(self, fn: F, *, cost: int = 1, tenant: str | None = None) -> F:
        """``fn`` changed so that every call first waits for its turn (of ``cost``).

        Works on functions, methods and coroutine functions (their wait runs
        in a worker thread, so the event loop is not blocked; a cancelled
        task cancels its wait), and keeps the wrapped function's name,
        docstring and signature.
        """
        if inspect.iscoroutinefunction(fn):
            not_with_caps(self.settings, "the thread Limiter's decorator of a coroutine (use aio.Limiter)")

            @functools.wraps(fn)
            async def wrapped_async(*args: Any, **kwargs: Any) -> Any:
                reservation = Reservation(self, cost, tenant)
                try:
                    turn = await asyncio.to_thread(reservation.wait)
                except BaseException:
                    reservation.cancel()  # the worker thread stops waiting, and no turn is used
                    begun = reservation.turn  # unless it had begun already: its place goes back
                    if begun is not None:
                        self._end_later(begun)
                    raise
                try:
                    return await fn(*args, **kwargs)
                finally:
                    if turn is not None and self.holds_places:
                        await asyncio.to_thread(self._release_quietly, (turn.ticket, turn.token))

            return cast(F, wrapped_async)

        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            turn = self.acquire(cost=cost, tenant=tenant)
            try:
                return fn(*args, **kwargs)
            finally:
                if self.holds_places:
                    self._release_quietly((turn.ticket, turn.token))

        return cast(F, wrapped)

    def _end_later(self, turn: Turn) -> None:
        runner = self._runner
        with runner.driver.lock:
            runner.end(turn.ticket, turn.token)
        if self._caps is not None:
            self._caps.end((turn.ticket, turn.token))

    def _release_quietly(self, held: Held) -> None:
        """:meth:`release`, a failure logged: the job's outcome matters more, and its lease expires."""
        try:
            self._release(held)
        except Exception as exc:
            _log.warning("could not release a lease of queue %r: %s", self.name, exc)

    def __enter__(self) -> Turn:
        return cast(Turn, entered(self, self.acquire()))

    def __exit__(self, *exc: object) -> None:
        turn = entered(self)
        if turn is not None and self.holds_places:
            self._release_quietly((turn.ticket, turn.token))

    def close(self) -> None:
        """Close the state if this limiter opened it; the limiter may not be used afterwards.

        With ``max_running`` or ``tenant_max_running``, the leases of jobs still running (and
        those waiting to be released) are released first. With ``on_event``, the
        events reported so far reach the hook first (up to a second).
        """
        runner = self._runner
        if runner.fallback is not None:
            runner.fallback.stop(runner)  # a probe of a state that is down ends within a second
        for capper in self._caps.limiters() if self._caps is not None else ():
            capper.close()  # (it releases the tenants' places it holds)
        held: list[Held] = []
        if runner.leases is not None:
            driver = cast(ThreadDriver, runner.driver)
            leases = runner.leases
            with driver.lock:
                held = leases.drain()  # the keeper, finding nothing left, stops after its call
                driver.wait_for(lambda: not leases.running, _CLOSE_WAIT)
        for lease in held:
            self._release_quietly(lease)
        if self._owns_state:
            self.state.close()
        if runner.reporter.on:
            flush(_FLUSH_WAIT)


class Reservation(ReservationBase):
    """A place in a :class:`Limiter`'s line (see :meth:`Limiter.reserve`)."""

    def wait(self, timeout: Seconds | None = None) -> Turn | None:
        """Block until the turn of this place, and return it; ``None`` if it was cancelled.

        :param timeout: seconds to wait at most, from now; on expiry the place is given up.
        :raises AcquireTimeout: as soon as the turn cannot come within ``timeout``.
        :raises StateUnavailable: if the state cannot be reached (the place is given up).

        Called again once its turn has begun, it returns that turn at once.
        """
        with self._runner.driver.lock:
            return run(self._wait_flow(timeout))

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc: object) -> None:
        turn = self.turn
        if turn is None:
            self.cancel()
        elif self._limiter.holds_places:
            cast(Limiter, self._limiter)._release_quietly((turn.ticket, turn.token))


class TenantCapGroup(CapGroup):
    """The cap queues of a :class:`Limiter`'s tenants (``tenant_max_running``)."""

    _limiter_class = Limiter
