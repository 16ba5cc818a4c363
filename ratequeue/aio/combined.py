"""aio.all_of: the asyncio twin of :func:`ratequeue.all_of`."""

from __future__ import annotations

import time

from ..combined import all_of_flow
from ..core.flow import arun
from ..core.shard import Turn
from ..settings import Seconds
from .limiter import Limiter

__all__ = ["all_of"]


async def all_of(*limiters: Limiter, timeout: Seconds | None = None, cost: int = 1) -> list[Turn]:
    """Wait for a turn of each of ``limiters``, begun together (see :func:`ratequeue.all_of`)."""
    return await arun(all_of_flow(limiters, timeout, cost, time.monotonic))
