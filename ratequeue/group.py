"""LimiterGroup: one rate per key (customer, API key), each key's record expiring when idle."""

from __future__ import annotations

from .events import flush
from .grouping import SEPARATOR, GroupBase
from .limiter import Limiter
from .state import State

__all__ = ["LimiterGroup"]


class LimiterGroup(GroupBase[Limiter]):
    """One :class:`~ratequeue.Limiter` per key, all with the same rate, across every process.

    ``group["customer-42"].acquire()`` waits for that key's turn: each key
    has its own rate, shared by every process using the same state and
    group name, and keys do not wait for each other. A key's record is
    created by its first use and deleted by the state once it has been idle
    for ``keep`` seconds past the moment forgetting it changes nothing, so
    a million keys seen once do not stay.
    """

    _limiter_class = Limiter

    @property
    def state(self) -> State:
        """The state every key's limiter uses."""
        return self._state  # type: ignore[return-value]

    def keys(self) -> list[str]:
        """The keys that have a record in the state now (from every process), sorted; one call to the state.

        A key idle past its keep time is listed until the state has deleted it.
        """
        return self._keys_of(self.state.names(f"{self.name}{SEPARATOR}"))

    def close(self) -> None:
        """Close the state if this group opened it from a URL; deliver its keys' events (up to 1 s)."""
        self._stop_fallbacks()
        if self._owns_state:
            self.state.close()
        if self._hook is not None:
            flush(1.0)

    def __enter__(self) -> LimiterGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
