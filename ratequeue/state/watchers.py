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
import threading
from collections.abc import Callable, Iterable

__all__ = ["Watchers"]

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
