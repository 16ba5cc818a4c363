"""ratequeue: one start per interval, globally, in first-come order.

Many threads, processes and hosts share one rate through a small shared
state (a JSON file, memory, Redis or MongoDB)::

    import ratequeue

    limiter = ratequeue.Limiter(name="github", interval=0.1)
    with limiter:
        call_the_api()
"""

from __future__ import annotations

from .errors import (
    AcquireTimeout,
    ConfigurationError,
    QueueClosed,
    RateQueueError,
    StateCorrupted,
    StateUnavailable,
)
from .limiter import Limiter, Status
from .queue import Queue
from .shard import Turn
from .state import State, from_url

__all__ = [
    "AcquireTimeout",
    "ConfigurationError",
    "Limiter",
    "Queue",
    "QueueClosed",
    "RateQueueError",
    "State",
    "StateCorrupted",
    "StateUnavailable",
    "Status",
    "Turn",
    "__version__",
    "from_url",
]

__version__ = "0.1.0"
