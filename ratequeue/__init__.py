"""ratequeue: one start per interval, globally, in first-come order.

Many threads, processes and hosts share one rate through a small shared
state (a JSON file, memory, Redis or MongoDB)::

    import ratequeue

    limiter = ratequeue.Limiter(name="github", rate="10/second")
    with limiter:
        call_the_api()
"""

from __future__ import annotations

from ._jobs import Backoff, DeadLetter
from .combined import all_of
from .errors import (
    AcquireTimeout,
    ConfigurationError,
    QueueClosed,
    QueueFull,
    RateQueueError,
    StateCorrupted,
    StateUnavailable,
    TermsMismatch,
)
from .events import Event
from .group import LimiterGroup
from .limiter import Limiter, Reservation, Status
from .queue import Queue
from .rates import Rate, parse_rate
from .shard import Turn
from .state import Snapshot, State
from .state import from_url as open_state

#: the older name of :func:`open_state`, kept working
from_url = open_state

# What ``import ratequeue`` offers: the limiter and queue (thread API; ``ratequeue.aio``
# has the asyncio ones), what they return (Turn, Reservation, Status), what they report to an
# on_event hook (Event; ratequeue.prometheus has an exporter), the errors, and
# the state contract with its opener for tools that read or reset records directly.
__all__ = [
    "AcquireTimeout",
    "Backoff",
    "ConfigurationError",
    "DeadLetter",
    "Event",
    "Limiter",
    "LimiterGroup",
    "Queue",
    "QueueClosed",
    "QueueFull",
    "Rate",
    "RateQueueError",
    "Reservation",
    "Snapshot",
    "State",
    "StateCorrupted",
    "StateUnavailable",
    "Status",
    "TermsMismatch",
    "Turn",
    "__version__",
    "all_of",
    "from_url",
    "open_state",
    "parse_rate",
]

__version__ = "0.1.0"
