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
from collections.abc import Callable
from typing import Any

from ..watchers import LINGER, Subscriptions

__all__ = ["CHANNEL_SUFFIX", "LINGER", "FreedListener", "channel_of"]

_log = logging.getLogger("ratequeue.state.redis")

#: what follows a record's key to name the channel of its freed places: a channel is never a
#: key (Redis keeps them apart), and the suffix tells one queue's channel from another's
CHANNEL_SUFFIX = "#freed"


def channel_of(key: str) -> str:
    """The pub/sub channel on which releases that free a place of the record at ``key`` are told."""
    return key + CHANNEL_SUFFIX


class FreedListener(Subscriptions):
    """One pub/sub connection and its daemon thread, calling the watchers of the channels it hears on.

    ``make_pubsub`` makes a redis-py (thread API) ``PubSub``, unconnected;
    it is called in the listener's thread, each time a connection is needed.
    """

    def __init__(self, make_pubsub: Callable[[], Any], where: str) -> None:
        super().__init__(f"ratequeue freed places {where}", f"Redis at {where}", _log)
        self._make_pubsub = make_pubsub

    def _open(self) -> Any:
        return self._make_pubsub()

    def _subscribe(self, connection: Any, channels: list[str]) -> None:
        connection.subscribe(*channels)

    def _unsubscribe(self, connection: Any, channels: list[str]) -> None:
        connection.unsubscribe(*channels)

    def _socket(self, connection: Any) -> Any:
        return getattr(getattr(connection, "connection", None), "_sock", None)

    def _drain(self, connection: Any) -> None:
        """Read every message the connection holds; call the watchers of each freed place's channel."""
        while True:
            message = connection.get_message(timeout=0.0)
            if message is None:
                return
            if message.get("type") != "message":
                continue
            channel = message["channel"]
            if isinstance(channel, bytes):
                channel = channel.decode("utf-8", "surrogateescape")
            self._ring((channel,))

    def _shut(self, connection: Any) -> None:
        if connection is not None:
            with contextlib.suppress(Exception):
                connection.close()
