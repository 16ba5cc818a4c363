"""Limiter: wait for this caller's global turn, in a thread.

Callers queue in this process's :class:`~ratequeue.shard.Shard`; the caller
at its head talks to the state, the others sleep on a condition until the
shard changes. No thread runs while nobody waits (guarantee G5).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from . import _validate
from ._sleep import wait_until
from .errors import AcquireTimeout
from .protocol import NEVER, US, Outcome
from .shard import (
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
from .state import Snapshot, State, StateLike, from_url
from .state.base import redact

__all__ = ["Limiter", "Status"]

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Status:
    """A queue's shared record and this shard's view of it, as read just now."""

    #: the queue name
    name: str
    #: seconds between starts
    interval: float
    #: the next ticket the state will hand out
    next_ticket: int
    #: the highest ticket that has started (0: none)
    current: int
    #: state-clock time (s) of the latest start, or ``None`` if none
    last_start: float | None
    #: the state clock's time (s) when this was read
    now: float
    #: jobs waiting in this shard
    waiting: int
    #: whether this shard is paused
    paused: bool
    #: the ticket this shard holds, if any
    held_ticket: int | None

    @classmethod
    def of(cls, name: str, interval: float, snapshot: Snapshot, shard: Shard) -> Status:
        """The status of queue ``name`` from a snapshot of its record and this shard."""
        record = snapshot.record
        return cls(
            name=name,
            interval=record.interval / US if record else interval,
            next_ticket=record.ticket if record else 1,
            current=record.pos if record else 0,
            last_start=record.at / US if record and record.at != NEVER else None,
            now=snapshot.now / US,
            waiting=shard.waiting,
            paused=shard.paused,
            held_ticket=shard.ticket,
        )


class Limiter:
    """Lets callers, across every process sharing the state, start one per ``interval``.

    ``acquire()`` blocks until the caller's global turn; so do ``with
    limiter:`` and every call of a function decorated with ``@limiter``.
    Many threads may share one limiter. Each limiter object is one shard: it
    can be paused on its own. It pickles as its configuration (state URL,
    name, interval, lead) and reconnects lazily where it is unpickled.
    """

    def __init__(
        self,
        url: StateLike = None,
        *,
        name: str,
        interval: float,
        lead: float | None = None,
        max_late: float | None = DEFAULT_MAX_LATE,
        clock: Callable[[], float] | None = None,
    ) -> None:
        """
        :param url: the state: a URL (``memory://``, ``file:///path.json``,
            ``redis://…``, ``mongodb://…``), a path, a :class:`State`, or
            ``None`` for the per-user default state file.
        :param name: the queue name; every limiter with the same state and
            name shares one rate.
        :param interval: seconds (or a ``timedelta``) between two starts.
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
        """
        self.name, self.interval, self._interval_us, self._lead = _validate.limiter(name, interval, lead)
        self._max_late = _validate.max_late(max_late)
        self._clock = clock or time.monotonic
        self._state: State = from_url(url)
        #: whether this limiter opened the state (and so closes it)
        self._owns_state = not isinstance(url, State)
        checked = _validate.checked_lateness(self._max_late, self._state.clock_resolution)
        self._shard = Shard(self.interval, lead=self._lead, max_late=checked)
        self._cond = threading.Condition()

    @property
    def state(self) -> State:
        """The state this limiter uses."""
        return self._state

    def acquire(self, timeout: float | None = None) -> Turn:
        """Block until this caller's global turn, and return it.

        :param timeout: seconds to wait at most; ``None`` waits for ever, ``0``
            only takes a turn that is free now.
        :raises AcquireTimeout: as soon as the turn cannot come within ``timeout``.
        :raises StateUnavailable: if the state cannot be reached.
        """
        return self._acquire(_validate.timeout(timeout))

    def _acquire(self, seconds: float | None, on_job: Callable[[Job], None] | None = None) -> Turn:
        """:meth:`acquire`, telling ``on_job`` (under the lock) which job waits, so it can be withdrawn."""
        now = self._clock()
        with self._cond:
            job = self._shard.add(None if seconds is None else now + seconds)
            if on_job is not None:
                on_job(job)
            return self._drive(job, seconds)

    def pause(self) -> None:
        """Pause this shard: its callers keep waiting, and it stops calling the state."""
        with self._cond:
            self._shard.pause()
            self._cond.notify_all()

    def resume(self) -> None:
        """Resume this shard after :meth:`pause`."""
        with self._cond:
            self._shard.resume()
            self._cond.notify_all()

    @property
    def paused(self) -> bool:
        """Whether this shard is paused."""
        return self._shard.paused

    def status(self) -> Status:
        """Read the queue's shared record (one call to the state) and this shard's state."""
        snapshot = self._state.read(self.name)
        with self._cond:
            return Status.of(self.name, self.interval, snapshot, self._shard)

    def wrap(self, fn: F) -> F:
        """``fn`` changed so that every call first waits for its turn.

        Works on functions, methods and coroutine functions (their wait runs
        in a worker thread, so the event loop is not blocked), and keeps the
        wrapped function's name, docstring and signature.
        """
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def wrapped_async(*args: Any, **kwargs: Any) -> Any:
                await asyncio.to_thread(self.acquire)
                return await fn(*args, **kwargs)

            return cast(F, wrapped_async)

        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            self.acquire()
            return fn(*args, **kwargs)

        return cast(F, wrapped)

    def __call__(self, fn: F) -> F:
        """Decorate ``fn`` so that every call waits for its turn (see :meth:`wrap`)."""
        return self.wrap(fn)

    def __enter__(self) -> Turn:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        return None

    def close(self) -> None:
        """Close the state if this limiter opened it from a URL; the limiter may not be used afterwards.

        A :class:`State` object passed in by the caller is left open.
        """
        if self._owns_state:
            self._state.close()

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self._state.url, self.name, self.interval, self._lead, self._max_late))

    def __repr__(self) -> str:
        url = redact(self._state.url)
        return f"{type(self).__name__}({url!r}, name={self.name!r}, interval={self.interval!r})"

    def _withdraw(self, job: Job) -> None:
        """Take a waiting ``job`` out from another thread; its ``_acquire`` raises :class:`Withdrawn`."""
        with self._cond:
            self._shard.cancel(job)
            self._cond.notify_all()

    def _drive(self, job: Job, timeout: float | None) -> Turn:
        """Run ``job``'s steps until its turn; called and returns holding ``self._cond``."""
        try:
            while True:
                if job.turn is None and not job.queued:
                    raise Withdrawn("the waiting job was withdrawn")
                now = self._clock()
                step = self._shard.step(job, now)
                if isinstance(step, Begin):
                    self._cond.notify_all()  # the next job is head now
                    return step.turn
                if isinstance(step, Expired):
                    raise AcquireTimeout(
                        f"no turn in queue {self.name!r} within {timeout} s", name=self.name, timeout=timeout
                    )
                if isinstance(step, WaitForTurn):
                    self._cond.wait(None if step.deadline is None else step.deadline - now)
                elif isinstance(step, SleepUntil):
                    self._cond.wait(step.until - now)
                elif isinstance(step, BeginAt):
                    self._cond.release()  # a precise wait, not woken by the shard's changes
                    try:
                        wait_until(step.until, self._clock, spin=step.spin)
                    finally:
                        self._cond.acquire()
                else:
                    self._call(job, step)
        except BaseException:
            self._shard.abandon(job)
            self._cond.notify_all()
            raise

    def _call(self, job: Job, step: TakeAndTry | TryStart | Retime) -> None:
        """Make the state call ``step`` asks for, without holding the condition."""
        self._cond.release()
        try:
            sent = self._clock()
            outcome: Outcome
            if isinstance(step, TakeAndTry):
                outcome = self._state.take_and_try(self.name, self._interval_us, step.lead_us)
            elif isinstance(step, TryStart):
                outcome = self._state.try_start(self.name, self._interval_us, step.ticket, step.lead_us)
            else:
                outcome = self._state.retime(self.name, self._interval_us, step.ticket, step.lead_us)
            received = self._clock()
            state_now = self._state.local_now()
        except BaseException:
            self._cond.acquire()
            self._shard.failed(job)
            raise
        self._cond.acquire()
        offset = None if state_now is None else received - state_now
        self._shard.receive(job, outcome, sent, received, offset=offset)
        self._cond.notify_all()


class Withdrawn(Exception):
    """Internal: a waiting job was withdrawn by another thread (see ``Limiter._withdraw``)."""


def _rebuild(
    cls: type[Limiter],
    url: str,
    name: str,
    interval: float,
    lead: float | None,
    max_late: float | None = DEFAULT_MAX_LATE,
) -> Limiter:
    return cls(url, name=name, interval=interval, lead=lead, max_late=max_late)
