"""``memory://``: a state inside this process, for the threads of one process and for tests."""

from __future__ import annotations

import threading
import time
from typing import ClassVar
from urllib.parse import urlsplit

from ..core.operation import Operation
from ..core.protocol import Answer, Record
from ..errors import ConfigurationError
from ._local import Clock, LocalState, keep_until
from .base import Snapshot

__all__ = ["MemoryState"]


class MemoryState(LocalState):
    """Records kept in this process's memory, timed on ``time.monotonic``.

    Every ``MemoryState`` opened from the same URL shares one store, so
    limiters built from ``"memory://"`` in one process share one rate.
    ``memory://NAME`` opens a separate store called NAME. Nothing is shared
    with other processes.
    """

    _stores: ClassVar[dict[str, tuple[threading.Lock, dict[str, Record], dict[str, int]]]] = {}
    _stores_lock: ClassVar[threading.Lock] = threading.Lock()
    # looked up at each call, so that tests that move time.monotonic (freezegun) move this too
    _host_seconds = staticmethod(lambda: time.monotonic())

    def __init__(self, store: str = "", *, clock: Clock | None = None, private: bool = False) -> None:
        """Open the in-process store called ``store``.

        :param clock: the state's clock in whole microseconds (``time.monotonic``'s by
            default); tests pass a fake one to drive time.
        :param private: give this object a store of its own, whatever its name.
        """
        self.url = f"memory://{store}"
        self._clock = clock
        self.reads_monotonic = clock is None
        self._lock: threading.Lock
        self._records: dict[str, Record]
        #: when (state clock, us) each record that expires may be deleted
        self._keep: dict[str, int]
        if private:
            self._lock, self._records, self._keep = threading.Lock(), {}, {}
        else:
            with self._stores_lock:
                self._lock, self._records, self._keep = self._stores.setdefault(
                    store, (threading.Lock(), {}, {})
                )

    @classmethod
    def from_url(cls, url: str) -> MemoryState:
        """Open ``memory://`` or ``memory://NAME``."""
        parts = urlsplit(url)
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise ConfigurationError(f"a memory URL is memory:// or memory://NAME, got {url!r}")
        return cls(parts.netloc)

    def _now(self) -> int:
        return self._clock() if self._clock else time.monotonic_ns() // 1000

    def _execute(self, op: Operation) -> Answer:
        name, terms = op.name, op.terms
        with self._lock:
            now = self._clock() if self._clock else time.monotonic_ns() // 1000
            record = self._records.get(name)
            updated, answer = self._applied(op, record, now)
            if updated is record and op.kind == "try_take":
                return answer  # a try that did not start changes nothing, its keep time neither
            self._records[name] = updated
            until = keep_until(updated, terms, now) if terms.keep_us else None
            if until is not None:
                self._keep[name] = until
            elif self._keep:
                self._keep.pop(name, None)
            if record is None and self._sweep_due(now):
                self._sweep_locked(now)
            return answer

    def _read(self, name: str) -> Snapshot:
        with self._lock:
            return self._checked(name, self._records.get(name), self._now())

    def _reset(self, name: str) -> bool:
        with self._lock:
            self._keep.pop(name, None)
            return self._records.pop(name, None) is not None

    def _names(self, prefix: str) -> list[str]:
        with self._lock:
            return [name for name in self._records if name.startswith(prefix)]

    def _sweep(self) -> int:
        with self._lock:
            return self._sweep_locked(self._now())

    def _sweep_locked(self, now: int) -> int:
        self._swept = now
        gone = [name for name, until in self._keep.items() if until <= now]
        for name in gone:
            del self._records[name], self._keep[name]
        return len(gone)
