"""Limiter: wait for this caller's global turn, in a thread.

The thread driver of :class:`~ratequeue._limiting.LimiterBase`: callers
queue in this process's :class:`~ratequeue.shard.Shard`; the caller at its
head talks to the state, the others sleep on a condition until the shard
changes. No thread runs while nobody waits (guarantee G5).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar, cast

from ._flow import run
from ._limiting import (
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
from ._limiting import _rebuild as _rebuild  # limiters pickled by earlier versions name it here
from ._sleep import wait_until
from .errors import AcquireTimeout
from .events import EventHook, flush
from .rates import RateLike
from .shard import DEFAULT_MAX_LATE, Turn
from .state import State, StateLike, from_url

__all__ = ["Limiter", "Reservation", "Status"]

F = TypeVar("F", bound=Callable[..., Any])

_log = logging.getLogger("ratequeue.limiter")

_DEBUG = logging.DEBUG

#: the longest (s) close() waits for the lease keeper's call under way
_CLOSE_WAIT = 10.0

#: the longest (s) close() waits for this process's events to reach their hooks
_FLUSH_WAIT = 1.0

#: the last part (s) of a precise wait that is busy-waited: more than a loaded host's wake-up lateness
_SPIN = 0.0015


class Limiter(LimiterBase[State]):
    """Lets callers, across every process sharing the state, start one per ``interval``.

    ``acquire()`` blocks until the caller's global turn; so do ``with
    limiter:`` and every call of a function decorated with ``@limiter``.
    Many threads may share one limiter. Each limiter object is one shard: it
    can be paused on its own. It pickles as its configuration (state URL,
    name, interval, lead, max_late) and reconnects lazily where it is unpickled.
    """

    def __init__(
        self,
        url: StateLike = None,
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
        """
        :param url: the state: a URL (``memory://``, ``file:///path.json``,
            ``redis://…``, ``mongodb://…``), a path, a :class:`State`, or
            ``None`` for the per-user default state file.
        :param name: the queue name; every limiter with the same state and
            name shares one rate.
        :param interval: seconds (or a ``timedelta``) between two starts.
        :param rate: the pace as a rate instead: ``"5000/hour"``, ``(10,
            timedelta(seconds=1))`` or :class:`ratequeue.Rate`; its interval is
            ``period / count``. Give ``interval`` or ``rate``, not both.
        :param burst: how many starts may come at once after an idle spell (1:
            none closer than the interval). Any ``k`` consecutive starts span at
            least ``(k - burst)`` intervals (docs/rates.md). Fixed per queue
            name, as the interval is.
        :param keep: seconds an idle queue's record is kept once forgetting it
            changes nothing (then it is deleted, and the queue starts afresh,
            exactly as if it had been kept); ``None`` keeps it for ever.
            :class:`ratequeue.LimiterGroup` sets it for its keys.
        :param lead: how early a caller may reserve its slot before sleeping
            until it; ``None`` adapts it to the state's round-trip time.
        :param max_late: seconds a caller may begin after its granted start
            (0.3 ms by default). A caller that wakes later does not begin:
            its start is moved later, or its turn given up for a new one, so
            that begins stay ``interval - max_late`` apart as the called
            service sees them (G7). ``None`` turns the check off; so does an
            interval under four times ``max_late``, or a state whose clock is
            coarser than ``max_late`` (MongoDB's has whole milliseconds).
        :param clock: this process's clock, ``time.monotonic`` by default; it
            must tick at the rate of real time (tests shift it).
        :param max_running: how many jobs may run at once across every shard
            of the queue (``None``: no cap). Fixed per queue name, as the
            interval is. A job runs from its turn until :meth:`release` (the
            end of ``with limiter:``, or the return of a decorated function);
            it holds a lease on the state meanwhile, renewed every third of
            ``lease`` by a thread of this limiter, so a job whose process
            dies gives its place back within ``lease`` (docs/queues.md).
        :param lease: seconds a running job's lease lasts unless renewed (10 by
            default): the longest a dead job's place stays taken.
        :param on_event: called with a :class:`ratequeue.Event` for each begin,
            timeout, state call, passed ticket and late wake-up of this limiter
            (:mod:`ratequeue.events`; ``ratequeue.prometheus.PrometheusMetrics``
            is one). It is called in ratequeue's reporter thread, in order,
            never on the acquire path nor holding the limiter's lock (so it
            may call the limiter); :func:`ratequeue.events.flush` waits for
            the events reported so far, and :meth:`close` does. An exception
            it raises is logged, never raised. Not pickled.
        """
        self._cond = threading.Condition()
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

    def acquire(self, timeout: Seconds | None = None, *, cost: int = 1) -> Turn:
        """Block until this caller's global turn, and return it.

        :param timeout: seconds to wait at most; ``None`` waits for ever, ``0``
            only takes a turn that is free now.
        :param cost: how many starts of the rate this call uses (1 to the burst).
        :raises AcquireTimeout: as soon as the turn cannot come within ``timeout``.
        :raises StateUnavailable: if the state cannot be reached.

        With ``max_running``, the job runs until :meth:`release` of this turn
        (its place is taken until then, or until its lease runs out if its
        process dies).
        """
        with self._cond:
            turn = run(self._acquire_flow(self._new_job(timeout, cost)))
        assert turn is not None, "only a withdrawn job has no turn, and this one is nobody else's"
        return turn

    def release(self, turn: Turn) -> bool:
        """End the job of ``turn``: with ``max_running``, give its place back now (one call to the state).

        Returns whether its lease was still live (``False`` without
        ``max_running``, for a turn released twice, or one whose lease ran
        out). A caller waiting in this process for a place asks at once.

        :raises StateUnavailable: if the state cannot be reached (the lease then expires by itself).
        """
        return self._release_ticket(turn.ticket)

    def _release_ticket(self, ticket: int) -> bool:
        with self._cond:
            call = self._end_lease(ticket, later=False)
            if call is None:
                return False
            live, *_ = self._call_state(*call)
            self._place_freed()
        return bool(live)

    def try_acquire(self, *, cost: int = 1) -> Turn | None:
        """This caller's turn if one is free now, else ``None``; never waits for a turn.

        It makes at most two calls to the state (the shard's held ticket
        tried, then a new one taken). Without a turn, a ticket taken stays
        with this shard for its next caller, costing nobody anything.

        :raises StateUnavailable: if the state cannot be reached.
        """
        return self._attempt(cost)[0]

    def _attempt(self, cost: int) -> tuple[Turn | None, float | None]:
        """:meth:`try_acquire`, and without a turn the local time its slot comes, if the state said."""
        with self._cond:
            job = self._new_job(0, cost)
            try:
                return run(self._acquire_flow(job, attempt=True)), None
            except AcquireTimeout:
                return None, job.expected

    def reserve(self, *, cost: int = 1) -> Reservation:
        """Take a place in this shard's queue now, to :meth:`Reservation.wait` for its turn later.

        Another thread may :meth:`Reservation.cancel` it. While a reservation
        nobody waits for is at the head of the queue, the callers behind it
        wait too: wait for it, or cancel it (``with limiter.reserve() as r:``
        cancels on exit).
        """
        return Reservation(self, cost)

    def pause(self, *, everywhere: bool = False) -> None:
        """Pause this shard: its callers keep their places, and it stops calling the state.

        With ``everywhere=True``, pause the whole queue instead: a flag in
        its shared record (one call to the state) that stops every shard, in
        every process, from starting a job until :meth:`resume` with
        ``everywhere=True``. This shard is not paused itself: like every
        other, its waiting caller is told to wait and asks again once a
        second. A caller whose timeout ends within that second gets
        :class:`AcquireTimeout` at once.
        """
        if everywhere:
            self._set_paused_everywhere(True)
        else:
            super().pause()

    def resume(self, *, everywhere: bool = False) -> None:
        """Resume this shard after :meth:`pause`; with ``everywhere=True``, the whole queue.

        Resumed everywhere, every shard's waiting caller starts within about
        a second (its next ask), at the rate, in ticket order.
        """
        if everywhere:
            self.resume_everywhere()
        else:
            super().resume()

    def pause_everywhere(self) -> bool:
        """:meth:`pause` with ``everywhere=True``; whether the queue was not paused already."""
        return bool(self._set_paused_everywhere(True))

    def resume_everywhere(self) -> bool:
        """:meth:`resume` with ``everywhere=True``; whether the queue was paused.

        This shard's waiting caller asks again at once; the others, at their next ask.
        """
        changed = bool(self._set_paused_everywhere(False))
        self._ask_again()
        return changed

    def status(self) -> Status:
        """Read the queue's shared record (one call to the state) and this shard's state."""
        snapshot = self._state.read(self.name)
        with self._cond:
            return Status.of(self.name, self.interval, snapshot, self._shard)

    def wrap(self, fn: F, *, cost: int = 1) -> F:
        """``fn`` changed so that every call first waits for its turn (of ``cost``).

        Works on functions, methods and coroutine functions (their wait runs
        in a worker thread, so the event loop is not blocked; a cancelled
        task cancels its wait), and keeps the wrapped function's name,
        docstring and signature.
        """
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def wrapped_async(*args: Any, **kwargs: Any) -> Any:
                reservation = Reservation(self, cost)
                try:
                    turn = await asyncio.to_thread(reservation.wait)
                except BaseException:
                    reservation.cancel()  # the worker thread stops waiting, and no turn is used
                    begun = reservation.turn  # unless it had begun already: its place goes back
                    if begun is not None and self.max_running:
                        with self._cond:
                            self._end_lease(begun.ticket, later=True)
                    raise
                try:
                    return await fn(*args, **kwargs)
                finally:
                    if turn is not None and self.max_running:
                        await asyncio.to_thread(self._release_quietly, turn)

            return cast(F, wrapped_async)

        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            turn = self.acquire(cost=cost)
            if not self.max_running:
                return fn(*args, **kwargs)
            try:
                return fn(*args, **kwargs)
            finally:
                self._release_quietly(turn)

        return cast(F, wrapped)

    def _release_quietly(self, turn: Turn | int) -> None:
        """:meth:`release` of a turn (or ticket), a failure logged: the job's outcome matters more."""
        try:
            self._release_ticket(turn if isinstance(turn, int) else turn.ticket)
        except Exception as exc:  # its lease expires by itself
            _log.warning("could not release a lease of queue %r: %s", self.name, exc)

    def __enter__(self) -> Turn:
        return cast(Turn, entered(self, self.acquire()))

    def __exit__(self, *exc: object) -> None:
        turn = entered(self)
        if turn is not None and self.max_running:
            self._release_quietly(turn)

    def close(self) -> None:
        """Close the state if this limiter opened it from a URL; the limiter may not be used afterwards.

        A :class:`State` object passed in by the caller is left open. With
        ``max_running``, the leases of jobs still running (and those waiting
        to be released) are released first. With ``on_event``, the events
        reported so far reach the hook first (waited for up to a second;
        see :func:`ratequeue.events.flush`).
        """
        with self._cond:
            held = self._leases.drain()  # the keeper, finding nothing left, stops...
            self._cond.notify_all()
            # ...after the call it may be making (a release it took off the book before the drain)
            self._cond.wait_for(lambda: not self._keeping, _CLOSE_WAIT)
        for ticket in held:
            self._release_quietly(ticket)
        if self._owns_state:
            self._state.close()
        if self._on_event is not None:
            flush(_FLUSH_WAIT)

    def _open(self, url: Any) -> State:
        return from_url(url)

    def _locked(self) -> threading.Condition:
        return self._cond

    def _changed(self) -> None:
        self._cond.notify_all()

    def _start_keeper(self) -> None:
        threading.Thread(target=self._keep, name=f"ratequeue-leases-{self.name}", daemon=True).start()

    def _keep(self) -> None:
        with self._cond:
            run(self._keeper_flow())

    def _wait_for_change(self, timeout: float | None) -> None:
        self._cond.wait(timeout)

    def _wait_until(self, until: float, now: float, spin: bool) -> None:
        self._cond.release()  # a precise wait, not woken by the shard's changes
        try:
            wait_until(until, self._clock, spin=spin)
        finally:
            self._cond.acquire()

    def _wait_precisely(self, until: float) -> None:
        if until - self._clock() > _SPIN:
            wait_until(until - _SPIN, self._clock)
        wait_until(until, self._clock, spin=True)

    def _call_state(
        self, operation: Callable[..., Any], args: tuple[int, ...], kwargs: dict[str, int]
    ) -> TimedAnswer:
        self._cond.release()  # the call, and its report, hold no lock
        try:
            sent = self._clock()
            try:
                outcome = operation(self.name, *args, **kwargs)
            except Exception as exc:
                if self._on_event is not None or _calls_log.isEnabledFor(_DEBUG):
                    self._call_failed(operation, args, exc, sent)
                raise
            received, state_now = received_and_state_now(self._clock, self._state.local_now)
            answer = outcome, sent, received, state_now
            if self._on_event is not None or _calls_log.isEnabledFor(_DEBUG):
                self._call_answered(operation, args, outcome, sent, received)
            return answer
        finally:
            self._cond.acquire()


class Reservation(ReservationBase[State]):
    """A place in a :class:`Limiter`'s queue (see :meth:`Limiter.reserve`)."""

    def wait(self, timeout: Seconds | None = None) -> Turn | None:
        """Block until the turn of this place, and return it; ``None`` if it was cancelled.

        :param timeout: seconds to wait at most, from now; on expiry the place is given up.
        :raises AcquireTimeout: as soon as the turn cannot come within ``timeout``.
        :raises StateUnavailable: if the state cannot be reached (the place is given up).

        Called again once its turn has begun, it returns that turn at once
        (the job began once: one ``start`` event, one lease).
        """
        with self._limiter._locked():
            if self._begun is not None:
                return self._begun
            self._begun = turn = run(self._limiter._acquire_flow(self._start_waiting(timeout)))
            return turn

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc: object) -> None:
        turn = self.turn
        if turn is None:
            self.cancel()
        elif self._limiter.max_running:
            cast(Limiter, self._limiter)._release_quietly(turn)
