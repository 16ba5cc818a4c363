"""The two ways a shard waits and calls: threads (:class:`ThreadDriver`) and asyncio (:class:`AsyncioDriver`).

Everything a limiter, queue or ``all_of`` decides is a :mod:`ratequeue.core.flow`
generator, written once; a driver supplies the few things that differ: the
lock the flows run under, waiting for the shard to change, waiting precisely
until a moment, calling the state without the lock, starting a flow in the
background, and handing an event to its hook. Each limiter has its own driver.

A wake-up late by ``d`` shortens the gap to the next begin by ``d`` (G7), so
the final wait before a begin is precise: Linux lets a thread's sleep end up
to its *timer slack* late (50 us by default), and :func:`wait_until` cuts the
slack to 1 ns for that sleep, then busy-waits the last fraction of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import Any, Protocol

from .core.flow import Flow, arun, run
from .events import Event, Outlet, report

__all__ = ["AsyncioDriver", "Driver", "ThreadDriver", "wait_until"]

#: the last part (s) of a thread's precise wait that is busy-waited: over a loaded host's wake-up lateness
SPIN = 0.0015

#: how long before a begin the event loop's own timers are left for a blocking, precise sleep:
#: asyncio rounds its timeouts up to whole milliseconds
LOOP_RESOLUTION = 0.0015

_PR_SET_TIMERSLACK = 29
_PR_GET_TIMERSLACK = 30


def _load_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # pragma: no cover - a libc without prctl
        return None
    return prctl


_prctl = _load_prctl()


def wait_until(until: float, clock: Callable[[], float] = time.monotonic, *, spin: bool = False) -> None:
    """Return once ``clock()`` has reached ``until``, as soon after it as the host allows.

    ``clock`` must tick at the rate of real time. The thread's timer slack is
    cut for the sleep and restored after. With ``spin``, busy-wait instead:
    only for the last fraction of a millisecond.
    """
    delay = until - clock()
    if delay <= 0:
        return
    if spin:
        while clock() < until:
            pass
        return
    if _prctl is None:
        time.sleep(delay)
        return
    slack = _prctl(_PR_GET_TIMERSLACK, 0, 0, 0, 0)
    _prctl(_PR_SET_TIMERSLACK, 1, 0, 0, 0)
    try:
        while delay > 0:  # time.sleep may return early on some platforms' clocks: finish the wait
            time.sleep(delay)
            delay = until - clock()
    finally:
        if slack > 0:
            _prctl(_PR_SET_TIMERSLACK, slack, 0, 0, 0)


class Driver(Protocol):
    """What a flow needs that threads and asyncio do differently (each method plain or a coroutine)."""

    #: held while a flow runs (a condition in threads; nothing on the event loop)
    lock: Any

    #: how many flows wait for a change: with none, a change wakes nobody, at no cost
    waiters: int
    #: this process's clock (s)
    clock: Callable[[], float]

    def changed(self) -> None:
        """Wake the flows waiting for a change; holding :attr:`lock`."""

    def wait_for_change(self, timeout: float | None) -> Any:
        """Wait (releasing the lock) until :meth:`changed`, or ``timeout`` s."""

    def from_any_thread(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` as flows run, from any thread: now, holding :attr:`lock`; or soon, on the loop."""

    def wait_until(self, until: float, spin: bool, checked: bool) -> Any:
        """Wait (releasing the lock) until local time ``until``: a precise sleep, or a busy-wait if ``spin``.

        On asyncio, precisely only if lateness is ``checked`` (G7).
        """

    def wait_precisely(self, until: float, checked: bool) -> Any:
        """Wait, holding no lock, until local time ``until``: sleep, then busy-wait the last moment."""

    def call(self, fn: Callable[..., Any], arg: Any, lost: Callable[[Any], None] | None = None) -> Any:
        """``fn(arg)``, holding no lock; an answer that comes after its caller left goes to ``lost``."""

    def start(self, flow: Flow[None], name: str, *, locked: bool = True, daemon: bool = True) -> None:
        """Run ``flow`` in the background (a thread, or a task): under :attr:`lock` if ``locked``.

        ``daemon``: a thread the interpreter does not wait for at exit.
        """

    def emit(self, outlet: Outlet, event: Event) -> None:
        """Hand ``event`` to ``outlet``'s hook, to run later, off this path."""

    def now_or_soon(self, flow: Flow[None]) -> Any:
        """Carry ``flow`` out: now, in threads; as a task on asyncio (returned, to be awaited)."""

    def future(self) -> Any:
        """A new, pending future for a queued job (``concurrent.futures`` or ``asyncio``)."""

    def claim(self, future: Any) -> bool:
        """Mark a queued job's future running; ``False`` if it was cancelled."""

    def semaphore(self, places: int) -> Any:
        """A semaphore of ``places`` (its ``acquire`` plain or a coroutine)."""


class ThreadDriver:
    """Threads: flows run holding a condition; the waits and state calls release it."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.lock = threading.Condition()
        self.waiters = 0

    def changed(self) -> None:
        if self.waiters:
            self.lock.notify_all()

    def wait_for_change(self, timeout: float | None) -> None:
        self.waiters += 1
        try:
            self.lock.wait(timeout)
        finally:
            self.waiters -= 1

    def from_any_thread(self, fn: Callable[[], None]) -> None:
        with self.lock:
            fn()

    def wait_for(self, predicate: Callable[[], bool], timeout: float | None) -> bool:
        """Wait (holding :attr:`lock`) until ``predicate()`` holds, or ``timeout`` s; whether it does."""
        self.waiters += 1
        try:
            return self.lock.wait_for(predicate, timeout)
        finally:
            self.waiters -= 1

    def wait_until(self, until: float, spin: bool, checked: bool) -> None:
        self.lock.release()  # a precise wait, not woken by the shard's changes
        try:
            wait_until(until, self.clock, spin=spin)
        finally:
            self.lock.acquire()

    def wait_precisely(self, until: float, checked: bool) -> None:
        if until - self.clock() > SPIN:
            wait_until(until - SPIN, self.clock)
        wait_until(until, self.clock, spin=True)

    def call(self, fn: Callable[..., Any], arg: Any, lost: Callable[[Any], None] | None = None) -> Any:
        lock = self.lock
        lock.release()
        try:
            return fn(arg)
        finally:
            lock.acquire()

    def start(self, flow: Flow[None], name: str, *, locked: bool = True, daemon: bool = True) -> None:
        def carry_out() -> None:
            with self.lock if locked else contextlib.nullcontext():
                run(flow)

        threading.Thread(target=carry_out, name=name, daemon=daemon).start()

    def emit(self, outlet: Outlet, event: Event) -> None:
        report(outlet, event)

    def now_or_soon(self, flow: Flow[None]) -> None:
        run(flow)

    def future(self) -> Future[Any]:
        return Future()

    def claim(self, future: Future[Any]) -> bool:
        return future.set_running_or_notify_cancel()

    def semaphore(self, places: int) -> threading.BoundedSemaphore:
        return threading.BoundedSemaphore(places)


class AsyncioDriver:
    """asyncio: flows run on the event loop, one at a time between two awaits; no lock."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.waiters = 0
        self.lock = contextlib.nullcontext()
        self._waiters: list[asyncio.Future[None]] = []
        #: the loop the flows wait on (known once one has waited)
        self._loop: asyncio.AbstractEventLoop | None = None
        #: the background tasks, kept so that they are not collected while they run
        self.tasks: set[asyncio.Task[None]] = set()

    def changed(self) -> None:
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def wait_for_change(self, timeout: float | None) -> None:
        self._loop = loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        self._waiters.append(waiter)
        self.waiters += 1
        try:
            await asyncio.wait_for(waiter, None if timeout is None else max(0.0, timeout))
        except asyncio.TimeoutError:
            pass
        finally:
            self._waiters.remove(waiter)
            self.waiters -= 1

    def from_any_thread(self, fn: Callable[[], None]) -> None:
        loop = self._loop
        if loop is None:
            return  # no flow has waited: none to wake
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if here is loop:
            fn()
        else:
            with contextlib.suppress(RuntimeError):  # the loop has closed
                loop.call_soon_threadsafe(fn)

    async def wait_until(self, until: float, spin: bool, checked: bool) -> None:
        """On the loop's timers; while lateness is checked, the last ~1.5 ms blocking the loop, precisely."""
        delay = until - self.clock()
        if not checked:
            await asyncio.sleep(delay)
            return
        if delay > LOOP_RESOLUTION:
            await asyncio.sleep(delay - LOOP_RESOLUTION)
        wait_until(until, self.clock, spin=spin)

    async def wait_precisely(self, until: float, checked: bool) -> None:
        await self.wait_until(until, True, checked)

    async def call(self, fn: Callable[..., Any], arg: Any, lost: Callable[[Any], None] | None = None) -> Any:
        if lost is None:
            return await fn(arg)
        # A call cancelled on its way may still be carried out by the state: its answer is
        # awaited in the background and handed to ``lost``.
        call = asyncio.ensure_future(fn(arg))
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            call.add_done_callback(
                lambda done: None if done.cancelled() or done.exception() else lost(done.result())
            )
            raise

    def start(self, flow: Flow[None], name: str, *, locked: bool = True, daemon: bool = True) -> None:
        self.spawn(arun(flow), name)

    def spawn(self, coroutine: Coroutine[Any, Any, None], name: str | None = None) -> asyncio.Task[None]:
        """``coroutine`` as a task of the running loop, kept until it ends."""
        task = asyncio.get_running_loop().create_task(coroutine, name=name)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def now_or_soon(self, flow: Flow[None]) -> asyncio.Task[None]:
        return self.spawn(arun(flow))

    def future(self) -> asyncio.Future[Any]:
        return asyncio.get_running_loop().create_future()

    def claim(self, future: asyncio.Future[Any]) -> bool:
        return not future.cancelled()

    def semaphore(self, places: int) -> asyncio.Semaphore:
        return asyncio.Semaphore(places)

    def emit(self, outlet: Outlet, event: Event) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop runs in this thread (a report from elsewhere): the thread way
            report(outlet, event)
            return
        loop.call_soon(outlet.deliver, event)
