"""LimiterGroup: one rate per key (customer, API key), each key's record expiring when idle."""

from __future__ import annotations

from typing import Any

from ._grouping import SEPARATOR, GroupBase
from .events import flush
from .limiter import Limiter
from .state import State, from_url

__all__ = ["LimiterGroup"]


class LimiterGroup(GroupBase[Limiter, State]):
    """One :class:`~ratequeue.Limiter` per key, all with the same rate, across every process.

    ``group["customer-42"].acquire()`` waits for that key's turn: each key
    has its own rate, shared by every process using the same state and
    group name, and keys do not wait for each other. A key's record is
    created by its first use and deleted by the state once it has been idle
    for ``keep`` seconds past the moment forgetting it changes nothing, so
    a million keys seen once do not stay.
    """

    def keys(self) -> list[str]:
        """The keys that have a record in the state now (from every process), sorted; one call to the state.

        A key idle past its keep time is listed until the state has deleted it.
        """
        return self._keys_of(self._state.names(f"{self.name}{SEPARATOR}"))

    def close(self) -> None:
        """Close the state if this group opened it from a URL; deliver its keys' events (up to 1 s)."""
        if self._owns_state:
            self._state.close()
        if self._settings["on_event"] is not None:
            flush(1.0)

    def __enter__(self) -> LimiterGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _limiter_class(self) -> type[Limiter]:
        return Limiter

    def _open(self, url: Any) -> State:
        return from_url(url)
