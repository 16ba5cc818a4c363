"""Places freed elsewhere, heard by PostgreSQL's LISTEN/NOTIFY: what :meth:`PostgresBackend.watch` runs on.

A release that frees a live lease of a row found full within
``FULL_GRACE_US`` (and a start that leaves a place free then) calls
``pg_notify`` on the channel :func:`channel_of` the table and the queue
(``function.sql``); PostgreSQL delivers it when the call's transaction
commits. A state listens on one connection of its own (autocommit, opened
from the state's conninfo in the listener's thread), read by one daemon
thread, listening on the channels of the queues some shard of this process
waits on for a place; nothing else. While no shard waits, the thread blocks
on nothing but its wake-up pipe and the connection is closed: an idle state
makes no call and holds no extra connection.

The notification only hastens a waiter, which asks again within
``FULL_RECHECK_US`` anyway: a lost one, a connection that fails or a LISTEN
that comes late costs that much, never a wrong start. Errors are logged at
DEBUG and the connection is made again after a backoff.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Callable
from typing import Any

from psycopg import sql

from ..watchers import LINGER, Subscriptions

__all__ = ["CHANNEL_PREFIX", "LINGER", "FreedListener", "channel_of"]

_log = logging.getLogger("ratequeue.state.postgresql")

#: what begins the name of every channel of freed places (an md5 in hex follows: 48 bytes in all,
#: within PostgreSQL's 63 for an identifier)
CHANNEL_PREFIX = "ratequeue_freed_"


def channel_of(table: str, name: str) -> str:
    """The channel on which releases that free a place of queue ``name`` are told.

    ``table`` is the table's name as the function is created with it, quoted
    (``"ratequeue"``, ``"schema"."ratequeue"``): the function computes the
    same ``md5`` of ``table/name`` in UTF-8, so that tables and queues keep
    apart.
    """
    text = f"{table}/{name}".encode("utf-8", "surrogatepass")
    return CHANNEL_PREFIX + hashlib.md5(text, usedforsecurity=False).hexdigest()


class FreedListener(Subscriptions):
    """One LISTEN connection and its daemon thread, calling the watchers of the channels it hears on.

    ``connect`` opens a psycopg (thread API) connection in autocommit mode;
    it is called in the listener's thread, each time a connection is needed.
    """

    def __init__(self, connect: Callable[[], Any], where: str) -> None:
        super().__init__(f"ratequeue freed places {where}", f"PostgreSQL at {where}", _log)
        self._connect = connect

    def _open(self) -> Any:
        return self._connect()

    def _subscribe(self, connection: Any, channels: list[str]) -> None:
        for channel in channels:
            connection.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))

    def _unsubscribe(self, connection: Any, channels: list[str]) -> None:
        for channel in channels:
            connection.execute(sql.SQL("UNLISTEN {}").format(sql.Identifier(channel)))

    def _socket(self, connection: Any) -> Any:
        return connection.fileno()

    def _drain(self, connection: Any) -> None:
        """Read every notification the connection holds; call the watchers of each channel told."""
        rung = {notify.channel for notify in connection.notifies(timeout=0)}
        if rung:
            self._ring(sorted(rung))

    def _shut(self, connection: Any) -> None:
        if connection is not None:
            with contextlib.suppress(Exception):
                connection.close()
