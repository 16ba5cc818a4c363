"""ratequeue for asyncio: the same names, arguments and guarantees, as coroutines.

::

    from ratequeue import aio

    limiter = aio.Limiter("redis://localhost", name="github", interval=0.1)
    async with limiter:
        await call_the_api()

Redis and MongoDB use their drivers' asyncio clients; the memory and file
states run in a thread.
"""

from __future__ import annotations

from ..events import Event
from .combined import all_of
from .group import LimiterGroup
from .limiter import Limiter, Reservation
from .queue import Queue
from .state import AsyncState, ThreadedState
from .state import from_url as open_state

#: the older name of :func:`open_state`, kept working
from_url = open_state

__all__ = [
    "AsyncState",
    "Event",
    "Limiter",
    "LimiterGroup",
    "Queue",
    "Reservation",
    "ThreadedState",
    "all_of",
    "from_url",
    "open_state",
]
