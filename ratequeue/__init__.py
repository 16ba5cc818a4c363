"""ratequeue: one start per interval, globally, in first-come order.

Many threads, processes and hosts share one rate through a small shared
state (a JSON file, memory, Redis, MongoDB or PostgreSQL)::

    import ratequeue

    limiter = ratequeue.Limiter(name="github", rate="10/second")
    with limiter:
        call_the_api()
"""

from __future__ import annotations

import logging

from .combined import all_of
from .core.jobs import Backoff, DeadLetter
from .core.operation import Operation, Terms, operation
from .core.shard import Turn
from .errors import (
    AcquireTimeout,
    ConfigurationError,
    QueueClosed,
    QueueFull,
    RateLimited,
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
from .settings import Settings
from .state import Snapshot, State, open_state

# What ``import ratequeue`` offers: the limiter and queue (thread API; ``ratequeue.aio``
# has the asyncio ones), their settings, what they return (Turn, Reservation, Status), what
# they report to an on_event hook (Event; ratequeue.prometheus has an exporter), the errors,
# and the state contract -- its opener and operations -- for tools that act on records directly.
# A library's loggers get a NullHandler (the logging HOWTO, "Configuring Logging for a Library"):
# the application decides where records go; without its configuration nothing reaches stderr
logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = [
    "AcquireTimeout",
    "Backoff",
    "ConfigurationError",
    "DeadLetter",
    "Event",
    "Limiter",
    "LimiterGroup",
    "Operation",
    "Queue",
    "QueueClosed",
    "QueueFull",
    "RateLimited",
    "Rate",
    "RateQueueError",
    "Reservation",
    "Settings",
    "Snapshot",
    "State",
    "StateCorrupted",
    "StateUnavailable",
    "Status",
    "Terms",
    "TermsMismatch",
    "Turn",
    "__version__",
    "all_of",
    "open_state",
    "operation",
    "parse_rate",
]

__version__ = "0.1.0"
