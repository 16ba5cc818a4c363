"""ratequeue for asyncio: the same names, arguments and guarantees, as coroutines.

::

    from ratequeue import aio

    limiter = aio.Limiter("redis://localhost", name="github", interval=0.1)
    async with limiter:
        await call_the_api()

Redis, MongoDB and PostgreSQL use their drivers' asyncio clients; the memory
and file states run in a thread.
"""

from __future__ import annotations

from ..events import Event
from ..state import AsyncState, ThreadedState
from ..state import open_async_state as open_state
from .combined import all_of
from .group import LimiterGroup
from .limiter import Limiter, Reservation
from .queue import Queue

__all__ = [
    "AsyncState",
    "Event",
    "Limiter",
    "LimiterGroup",
    "Queue",
    "Reservation",
    "ThreadedState",
    "all_of",
    "open_state",
]
