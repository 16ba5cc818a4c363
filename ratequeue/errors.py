"""The exceptions ratequeue raises.

Every error derives from :class:`RateQueueError`. Where a built-in fits, the
error subclasses it too, so callers that already catch ``ValueError`` or
``TimeoutError`` keep working. All of them pickle with their context intact,
because they cross process and Spark executor boundaries: each takes its
message as its one positional argument and its context as keyword arguments
with defaults, so an exception's own pickling (``cls(*args)``, then its
``__dict__`` restored) brings every attribute back.
"""

from __future__ import annotations

__all__ = [
    "AcquireTimeout",
    "ConfigurationError",
    "QueueClosed",
    "QueueFull",
    "RateLimited",
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
        self,
        message: str,
        *,
        name: str = "",
        field: str = "",
        stored: float | None = None,
        wanted: float | None = None,
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


class _Located(RateQueueError):
    """An error of the state at a place it names: ``where``."""

    def __init__(self, message: str, *, where: str = "") -> None:
        super().__init__(message)
        #: the file path, host or key: for :class:`StateUnavailable` what could not be reached, for
        #: :class:`StateCorrupted` what holds the bad state
        self.where = where


class StateUnavailable(_Located, ConnectionError):
    """The state could not be reached (``where``: the file path or host); the original error is chained."""


class StateCorrupted(_Located):
    """The stored state cannot be parsed or has the wrong shape (``where``: the file path or key holding it).

    ratequeue never resets such state by itself. A bad record can be cleared
    with ``python -m ratequeue reset URL NAME``; a state file that cannot be
    read at all must be moved aside (the next operation creates a new one).
    """


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


class QueueClosed(RateQueueError, RuntimeError):
    """A job was added to a closed queue."""


class QueueFull(RateQueueError, RuntimeError):
    """A queue held ``max_waiting`` jobs: a new one was refused, or the oldest was dropped for it."""


class RateLimited(RateQueueError):
    """The service refused a call for its rate (an HTTP 429, or a 503 naming a wait).

    Raise it from a queue's job to have the whole queue held for
    ``retry_after`` seconds and the job tried again at its next turn without
    using a retry (docs/feedback.md). A queue also knows the HTTP errors of
    httpx, requests and aiohttp that carry such a response. ``retry_after``
    is ``None`` or seconds >= 0 (:class:`ConfigurationError` otherwise).
    """

    def __init__(self, message: str = "", *, retry_after: float | None = None, status: int = 429) -> None:
        if retry_after is not None and (
            isinstance(retry_after, bool)
            or not isinstance(retry_after, (int, float))
            or not 0 <= retry_after < float("inf")
        ):
            raise ConfigurationError(
                f"retry_after must be None or a number of seconds >= 0, got {retry_after!r}"
            )
        super().__init__(
            message
            or f"the service answered {status}"
            + (f" and asked for {retry_after:g} s" if retry_after is not None else "")
        )
        #: seconds the service asked to wait, if it said
        self.retry_after = retry_after
        #: the HTTP status the service answered
        self.status = status
