"""Places freed elsewhere, heard over Redis pub/sub: what :meth:`RedisBackend.watch` runs on.

A release that frees a live lease of a record found full within
``FULL_GRACE_US`` publishes an empty message on the channel
:func:`channel_of` its key (``script.lua``). A state listens on one pub/sub
connection of its own, read by one daemon thread, subscribed to the channels
of the queues some shard of this process waits on for a place; nothing else.
While no shard waits, the thread blocks on nothing but its wake-up pipe and
the connection is closed: an idle state makes no call.

The message only hastens a waiter, which asks again within
``FULL_RECHECK_US`` anyway: a lost message, a connection that fails or a
subscription that comes late costs that much, never a wrong start. Errors
are logged at DEBUG and the connection is made again after a backoff.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import time
from collections.abc import Callable
from typing import Any

from ..watchers import Watchers

__all__ = ["CHANNEL_SUFFIX", "FreedListener", "channel_of"]

_log = logging.getLogger("ratequeue.state.redis")

#: what follows a record's key to name the channel of its freed places: a channel is never a
#: key (Redis keeps them apart), and the suffix tells one queue's channel from another's
CHANNEL_SUFFIX = "#freed"

#: seconds a channel stays subscribed after its last watcher left: a shard that waits for a
#: place after each job keeps one subscription rather than making one per wait (each made
#: anew could miss a release sent before it is in place)
LINGER = 1.0

#: the first and the longest wait (s) before a failed connection is made again
BACKOFF_FIRST = 0.1
BACKOFF_CAP = 5.0


def channel_of(key: str) -> str:
    """The pub/sub channel on which releases that free a place of the record at ``key`` are told."""
    return key + CHANNEL_SUFFIX


class FreedListener(Watchers):
    """One pub/sub connection and its daemon thread, calling the watchers of the channels it hears on.

    ``make_pubsub`` makes a redis-py (thread API) ``PubSub``, unconnected;
    it is called in the listener's thread, each time a connection is needed.
    """

    def __init__(self, make_pubsub: Callable[[], Any], where: str) -> None:
        super().__init__(f"ratequeue freed places {where}")
        self._make_pubsub = make_pubsub
        self._where = where
        #: when the channels left without watchers were left (they linger, subscribed, for LINGER s)
        self._left_at: dict[str, float] = {}

    def _first(self, name: str) -> bool:
        self._left_at.pop(name, None)
        return True  # the thread subscribes

    def _left(self, name: str) -> bool:
        self._left_at[name] = time.monotonic()
        return True  # the thread unsubscribes, once it has lingered

    def wanted(self) -> set[str]:
        """The channels to be subscribed now: those watched, and those left under :data:`LINGER` s ago."""
        with self._lock:
            return self._wanted(time.monotonic())[0]

    def _wanted(self, now: float) -> tuple[set[str], float | None]:
        """The channels wanted at ``now`` (holding the lock), and when the next lingering one expires."""
        for channel, left in list(self._left_at.items()):
            if now - left >= LINGER:
                del self._left_at[channel]
        expiry = min((left + LINGER for left in self._left_at.values()), default=None)
        return set(self._watchers) | set(self._left_at), expiry

    def _run(self) -> None:
        """The thread: keep the subscriptions as wanted, hand messages to the watchers, survive errors."""
        pubsub: Any = None
        subscribed: set[str] = set()
        failures = 0
        retry_at = 0.0
        while True:
            now = time.monotonic()
            with self._lock:
                if self._closed:
                    break
                wanted, expiry = self._wanted(now)
            timeout = None if expiry is None else max(0.0, expiry - now)
            try:
                if now < retry_at:
                    timeout = retry_at - now
                elif wanted != subscribed:
                    if not wanted:
                        _close(pubsub)  # unsubscribes all at once
                        pubsub, subscribed = None, set()
                    else:
                        if pubsub is None:
                            pubsub = self._make_pubsub()
                        if wanted - subscribed:
                            pubsub.subscribe(*sorted(wanted - subscribed))
                            failures = 0  # connected
                        if subscribed - wanted:
                            pubsub.unsubscribe(*sorted(subscribed - wanted))
                        subscribed = wanted
                sock = _socket_of(pubsub) if pubsub is not None and now >= retry_at else None
                if pubsub is not None and now >= retry_at and sock is None:
                    timeout = 0.05  # no socket to wait on (an unusual connection class): poll
                readable, _, _ = select.select(
                    [self._wake_read] if sock is None else [self._wake_read, sock], [], [], timeout
                )
                if self._wake_read in readable:
                    os.read(self._wake_read, 4096)
                if pubsub is not None and now >= retry_at and (sock is None or sock in readable):
                    self._drain(pubsub)
            except Exception as exc:  # the waiters ask again within FULL_RECHECK_US meanwhile
                failures += 1
                delay = min(BACKOFF_FIRST * 2 ** (failures - 1), BACKOFF_CAP)
                _log.debug(
                    "Redis at %s: listening for freed places failed (%s); again in %.1f s",
                    self._where,
                    exc,
                    delay,
                )
                _close(pubsub)
                pubsub, subscribed = None, set()
                retry_at = time.monotonic() + delay
        _close(pubsub)

    def _drain(self, pubsub: Any) -> None:
        """Read every message the connection holds; call the watchers of each freed place's channel."""
        while True:
            message = pubsub.get_message(timeout=0.0)
            if message is None:
                return
            if message.get("type") != "message":
                continue
            channel = message["channel"]
            if isinstance(channel, bytes):
                channel = channel.decode("utf-8", "surrogateescape")
            self._ring((channel,))


def _socket_of(pubsub: Any) -> Any:
    """The socket of ``pubsub``'s connection, to wait on; ``None`` if it has none to show."""
    return getattr(getattr(pubsub, "connection", None), "_sock", None)


def _close(pubsub: Any) -> None:
    if pubsub is not None:
        with contextlib.suppress(Exception):
            pubsub.close()
