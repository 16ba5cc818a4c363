"""all_of: wait for a turn of several limiters at once (10 per second *and* 5000 per hour)."""

from __future__ import annotations

import time

from ._combined import all_of_flow
from ._flow import run
from ._limiting import Seconds
from .limiter import Limiter
from .shard import Turn

__all__ = ["all_of"]


def all_of(*limiters: Limiter, timeout: Seconds | None = None, cost: int = 1) -> list[Turn]:
    """Block until this caller has a turn of every one of ``limiters``, begun together; return them.

    The limits are waited for scarcest first, the same order for every
    caller (so callers never deadlock), and a turn made late by the wait for
    another is moved later on its state rather than begun late or thrown
    away; the rule in full is in docs/rates.md ("Several limits at once").
    The turns come back in the order the limiters were given.

    :param timeout: seconds to wait in all at most; ``None`` waits for ever.
    :param cost: what the call costs on each limiter (1 to the smallest burst).
    :raises AcquireTimeout: if a turn cannot come within ``timeout`` (turns
        already taken are then used by nobody: each costs its limit one start).
    """
    return run(all_of_flow(limiters, timeout, cost, time.monotonic))
