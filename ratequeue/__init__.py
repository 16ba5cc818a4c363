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
from .limiter import Limiter, Reservation, Status
from .queue import Queue
from .shard import Turn
from .state import Snapshot, State
from .state import from_url as open_state

#: the older name of :func:`open_state`, kept working
from_url = open_state

# What ``import ratequeue`` offers: the limiter and queue (thread API; ``ratequeue.aio``
# has the asyncio ones), what they return (Turn, Reservation, Status), the errors, and
# the state contract with its opener for tools that read or reset records directly.
__all__ = [
    "AcquireTimeout",
    "ConfigurationError",
    "Limiter",
    "Queue",
    "QueueClosed",
    "RateQueueError",
    "Reservation",
    "Snapshot",
    "State",
    "StateCorrupted",
    "StateUnavailable",
    "Status",
    "Turn",
    "__version__",
    "from_url",
    "open_state",
]

__version__ = "0.1.0"
