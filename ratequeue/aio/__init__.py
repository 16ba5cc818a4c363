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

from .limiter import Limiter
from .queue import Queue
from .state import AsyncState, ThreadedState, from_url

__all__ = ["AsyncState", "Limiter", "Queue", "ThreadedState", "from_url"]
