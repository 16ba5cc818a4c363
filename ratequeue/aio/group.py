"""aio.LimiterGroup: the asyncio twin of :class:`ratequeue.LimiterGroup`."""

from __future__ import annotations

import asyncio

from ..grouping import SEPARATOR, GroupBase
from ..state import AsyncState
from .limiter import Limiter

__all__ = ["LimiterGroup"]


class LimiterGroup(GroupBase[Limiter]):
    """One :class:`aio.Limiter <ratequeue.aio.Limiter>` per key: see :class:`ratequeue.LimiterGroup`."""

    _limiter_class = Limiter

    @property
    def state(self) -> AsyncState:
        """The state every key's limiter uses."""
        return self._state  # type: ignore[return-value]

    async def keys(self) -> list[str]:
        """The keys that have a record in the state now, sorted (see :meth:`ratequeue.LimiterGroup.keys`)."""
        return self._keys_of(await self.state.names(f"{self.name}{SEPARATOR}"))

    async def close(self) -> None:
        """Close the state if this group opened it from a URL; deliver its keys' events on the loop."""
        self._stop_fallbacks()
        if self._owns_state:
            await self.state.close()
        await asyncio.sleep(0)  # the events its keys scheduled on this loop run now

    async def __aenter__(self) -> LimiterGroup:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
