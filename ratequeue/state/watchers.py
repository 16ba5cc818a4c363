"""What a state that tells of freed places keeps: who watches which name, and the thread that tells them.

A shard waiting for a place on a full queue watches its record
(:meth:`ratequeue.state.State.watch`); the Redis state hears of freed
places over pub/sub (``redis/freed.py``), the file state by inotify on
doorbell files (``file.py``). Both keep the watchers of each name, one
daemon thread started at the first watch, and a pipe that wakes that thread
when what is wanted changes or the state closes: this class. A message only
hastens a waiter, which asks again within ``FULL_RECHECK_US`` anyway, so a
watcher's failure is logged at DEBUG and the others are still told.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["BACKOFF_CAP", "BACKOFF_FIRST", "LINGER", "Subscriptions", "Watchers"]

_log = logging.getLogger("ratequeue.state")


class Watchers:
    """The watchers of each name, and a daemon thread (:meth:`_run`, the subclass's) that rings them."""

    def __init__(self, thread_name: str) -> None:
        #: the process that made it: a forked child makes its own (the thread does not follow a fork)
        self.pid = os.getpid()
        self._thread_name = thread_name
        self._lock = threading.Lock()
        self._watchers: dict[str, list[Callable[[], None]]] = {}
        self._closed = False
        self._thread: threading.Thread | None = None
        #: written to wake the thread when what it waits on changes, or the state closes
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_write, False)

    def watch(self, name: str, freed: Callable[[], None]) -> Callable[[], None] | None:
        """Call ``freed`` (in the thread) each time ``name`` rings, until unwatched; ``None``: it cannot."""
        with self._lock:
            if self._closed or not self._watching(name):
                return None
            watchers = self._watchers.setdefault(name, [])
            watchers.append(freed)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._thread_name, daemon=True)
                self._thread.start()
            wake = self._first(name) if len(watchers) == 1 else False

        if wake:
            self._wake()

        def unwatch() -> None:
            with self._lock:
                kept = self._watchers.get(name, [])
                for index, watcher in enumerate(kept):
                    if watcher is freed:
                        del kept[index]
                        break
                if kept or name not in self._watchers:
                    return
                del self._watchers[name]
                wake = self._left(name)
            if wake:
                self._wake()

        return unwatch

    def close(self) -> None:
        """Stop the thread and close the descriptors; no watcher is called after it returns."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        self._wake()
        if thread is not None and thread is not threading.current_thread():
            thread.join(5.0)
            if thread.is_alive():
                return  # (stuck: its descriptors are left open rather than closed under it)
        for fd in (*self._descriptors(), self._wake_read, self._wake_write):
            with contextlib.suppress(OSError):
                os.close(fd)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (the thread ends at its next wake-up)."""
        with self._lock:
            return self._closed

    def _ring(self, names: Iterable[str] | None) -> None:
        """Call the watchers of ``names`` (``None``: of every name), in the thread."""
        with self._lock:
            if names is None:
                watchers = [watcher for kept in self._watchers.values() for watcher in kept]
            else:
                watchers = [watcher for name in names for watcher in self._watchers.get(name, ())]
        for freed in watchers:
            try:
                freed()
            except Exception:  # a watcher's failure is its own; the others are still told
                _log.debug("a watcher of %s failed", self._thread_name, exc_info=True)

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # full (a wake-up is pending anyway) or closed
            os.write(self._wake_write, b"w")

    # What a subclass says (the hooks run holding the lock).

    def _watching(self, name: str) -> bool:
        """Before a watcher is added to ``name``: whether it can be (the source can be watched)."""
        return True

    def _first(self, name: str) -> bool:
        """``name`` has its first watcher: whether the thread is to be woken (to subscribe, say)."""
        return False

    def _left(self, name: str) -> bool:
        """``name``'s last watcher left: whether the thread is to be woken (to unsubscribe, say)."""
        return False

    def _descriptors(self) -> tuple[int, ...]:
        """The subclass's own descriptors, closed with the pipe."""
        return ()

    def _run(self) -> None:
        """The thread: wait on the source and the pipe, :meth:`_ring` what rang, end once closed."""
        raise NotImplementedError


#: seconds a channel stays subscribed after its last watcher left: a shard that waits for a
#: place after each job keeps one subscription rather than making one per wait (each made
#: anew could miss a release sent before it is in place)
LINGER = 1.0

#: the first and the longest wait (s) before a failed connection is made again
BACKOFF_FIRST = 0.1
BACKOFF_CAP = 5.0

#: how often (s) a connection with no socket to wait on is read
_POLL = 0.05


class Subscriptions(Watchers):
    """Watchers heard over one connection subscribed to channels (Redis pub/sub, PostgreSQL LISTEN).

    The thread keeps the connection subscribed to the channels watched, and
    to those left under :data:`LINGER` s ago; with none, it closes the
    connection and waits on its pipe alone (no call). A failure closes the
    connection, is logged at DEBUG, and it is made again after a backoff
    (:data:`BACKOFF_FIRST` doubling up to :data:`BACKOFF_CAP`). A subclass
    says how to open, subscribe, unsubscribe, wait on, read and close the
    connection.
    """

    def __init__(self, thread_name: str, where: str, log: logging.Logger) -> None:
        super().__init__(thread_name)
        self._where, self._log = where, log
        #: when the channels left without watchers were left (they linger, subscribed)
        self._left_at: dict[str, float] = {}

    def wanted(self) -> set[str]:
        """The channels to be subscribed now: those watched, and those left under :data:`LINGER` s ago."""
        with self._lock:
            return self._wanted(time.monotonic())[0]

    def _first(self, name: str) -> bool:
        self._left_at.pop(name, None)
        return True  # the thread subscribes

    def _left(self, name: str) -> bool:
        self._left_at[name] = time.monotonic()
        return True  # the thread unsubscribes, once it has lingered

    def _wanted(self, now: float) -> tuple[set[str], float | None]:
        """The channels wanted at ``now`` (holding the lock), and when the next lingering one expires."""
        for channel, left in list(self._left_at.items()):
            if now - left >= LINGER:
                del self._left_at[channel]
        expiry = min((left + LINGER for left in self._left_at.values()), default=None)
        return set(self._watchers) | set(self._left_at), expiry

    def _run(self) -> None:
        """The thread: keep the subscriptions as wanted, ring the channels heard, survive errors."""
        connection: Any = None
        subscribed: set[str] = set()
        failures = 0
        retry_at = 0.0
        while True:
            now = time.monotonic()
            with self._lock:
                if self._closed:
                    break
                wanted, expiry = self._wanted(now)
            timeout = None if expiry is None else max(0.0, expiry - now)
            try:
                if now < retry_at:
                    timeout = retry_at - now if timeout is None else min(timeout, retry_at - now)
                elif wanted != subscribed:
                    if not wanted:
                        self._shut(connection)  # unsubscribes all at once
                        connection, subscribed = None, set()
                    else:
                        if connection is None:
                            connection = self._open()
                        if wanted - subscribed:
                            self._subscribe(connection, sorted(wanted - subscribed))
                            failures = 0  # connected
                        if subscribed - wanted:
                            self._unsubscribe(connection, sorted(subscribed - wanted))
                        subscribed = wanted
                waits = [self._wake_read]
                if connection is not None and now >= retry_at:
                    self._drain(connection)  # (what came while it subscribed, too)
                    sock = self._socket(connection)
                    if sock is None:  # nothing to wait on (an unusual connection class): poll
                        timeout = _POLL if timeout is None else min(timeout, _POLL)
                    else:
                        waits.append(sock)
                readable, _, _ = select.select(waits, [], [], timeout)
                if self._wake_read in readable:
                    os.read(self._wake_read, 4096)
                if len(waits) > 1 and waits[1] in readable:
                    self._drain(connection)
            except Exception as exc:  # the waiters ask again within FULL_RECHECK_US meanwhile
                failures += 1
                delay = min(BACKOFF_FIRST * 2 ** (failures - 1), BACKOFF_CAP)
                self._log.debug(
                    "%s: listening for freed places failed (%s); again in %.1f s", self._where, exc, delay
                )
                self._shut(connection)
                connection, subscribed = None, set()
                retry_at = time.monotonic() + delay
        self._shut(connection)

    # What a subclass says (called in the thread).

    def _open(self) -> Any:
        """A new connection, not yet subscribed."""
        raise NotImplementedError

    def _subscribe(self, connection: Any, channels: list[str]) -> None:
        raise NotImplementedError

    def _unsubscribe(self, connection: Any, channels: list[str]) -> None:
        raise NotImplementedError

    def _socket(self, connection: Any) -> Any:
        """What ``select`` can wait on for ``connection``'s messages; ``None``: poll it."""
        raise NotImplementedError

    def _drain(self, connection: Any) -> None:
        """Read every message ``connection`` holds, and :meth:`_ring` their channels."""
        raise NotImplementedError

    def _shut(self, connection: Any) -> None:
        """Close ``connection`` (``None``: none is open), whatever it raises."""
        raise NotImplementedError
