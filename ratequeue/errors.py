"""The exceptions ratequeue raises.

Every error derives from :class:`RateQueueError`. Where a built-in fits, the
error subclasses it too, so callers that already catch ``ValueError`` or
``TimeoutError`` keep working. All of them pickle with their context intact,
because they cross process and Spark executor boundaries.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "AcquireTimeout",
    "ConfigurationError",
    "QueueClosed",
    "QueueFull",
    "RateQueueError",
    "StateCorrupted",
    "StateUnavailable",
]


class RateQueueError(Exception):
    """Base class of every error raised by ratequeue."""


class ConfigurationError(RateQueueError, ValueError):
    """An argument, URL or stored setting is not acceptable.

    Raised at the boundary, before any state is touched or changed: a bad
    interval, name or timeout, an unknown URL scheme, a missing optional
    dependency, or an interval that differs from the one stored for the queue.
    """


class StateUnavailable(RateQueueError, ConnectionError):
    """The state could not be reached; the original error is chained."""

    def __init__(self, message: str, *, where: str = "") -> None:
        super().__init__(message)
        #: the file path or host that could not be reached
        self.where = where

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.args, {"where": self.where}))


class StateCorrupted(RateQueueError):
    """The stored state cannot be parsed or has the wrong shape.

    ratequeue never resets such state by itself. A bad record can be cleared
    with ``python -m ratequeue reset URL NAME``; a state file that cannot be
    read at all must be moved aside (the next operation creates a new one).
    """

    def __init__(self, message: str, *, where: str = "") -> None:
        super().__init__(message)
        #: the file path or key holding the bad state
        self.where = where

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.args, {"where": self.where}))


class AcquireTimeout(RateQueueError, TimeoutError):
    """The caller's turn could not come within its timeout.

    The ticket the caller held, if any, is kept by its shard for the next
    caller, so giving up costs the other shards at most one interval.
    """

    def __init__(self, message: str, *, name: str = "", timeout: float | None = None) -> None:
        super().__init__(message)
        #: the queue name
        self.name = name
        #: the timeout, in seconds, that passed
        self.timeout = timeout

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.args, {"name": self.name, "timeout": self.timeout}))


class QueueClosed(RateQueueError, RuntimeError):
    """A job was added to a closed queue."""


class QueueFull(RateQueueError, RuntimeError):
    """A queue held ``max_waiting`` jobs: a new one was refused, or the oldest was dropped for it."""


def _rebuild(cls: type[Exception], args: tuple[Any, ...], attrs: dict[str, Any]) -> Exception:
    error = cls.__new__(cls)
    Exception.__init__(error, *args)
    error.__dict__.update(attrs)
    return error
