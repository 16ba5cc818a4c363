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
    "TermsMismatch",
]


class RateQueueError(Exception):
    """Base class of every error raised by ratequeue."""


class ConfigurationError(RateQueueError, ValueError):
    """An argument, URL or stored setting is not acceptable.

    Raised at the boundary, before any state is touched or changed: a bad
    interval, name or timeout, an unknown URL scheme, a missing optional
    dependency, or an interval that differs from the one stored for the queue.
    """


class TermsMismatch(ConfigurationError):
    """A queue's stored interval, burst or ``max_running`` differs from the one asked for.

    The queue's record keeps the terms it was created with, so that shards
    running different code cannot split one rate in two. The message names
    the commands that change the stored value on purpose
    (``ratequeue set-interval URL NAME SECONDS``) or delete the record
    (``ratequeue reset URL NAME``); nothing is changed by the error itself.
    """

    def __init__(
        self, message: str, *, name: str = "", field: str = "", stored: float = 0, wanted: float = 0
    ) -> None:
        super().__init__(message)
        #: the queue name
        self.name = name
        #: which term differs: ``"interval"`` (seconds), ``"burst"`` or ``"max_running"``
        self.field = field
        #: the value stored for the queue
        self.stored = stored
        #: the value this caller asked for
        self.wanted = wanted
        #: the commands that change the stored value, for the state it came from ("" until known)
        self.way_out = ""

    def __reduce__(self) -> tuple[Any, ...]:
        attrs = {"name": self.name, "field": self.field, "stored": self.stored, "wanted": self.wanted}
        attrs["way_out"] = self.way_out
        return (_rebuild, (type(self), self.args, attrs))


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
