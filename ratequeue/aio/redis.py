"""``redis://`` for asyncio: the same Lua scripts as :mod:`ratequeue.state.redis`, on ``redis.asyncio``.

Calls take the same lean path as the synchronous state (:class:`AsyncLeanScripts`):
``EVALSHA`` packed by hand, sent over one of the client's connections, the
reply read by redis-py's parser.
"""

from __future__ import annotations

import asyncio
from typing import Any

import redis
import redis.asyncio
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from ..errors import ConfigurationError
from ..protocol import Outcome, Taken
from ..state.base import Clock, Snapshot
from ..state.redis import (
    BACKOFF_BASE,
    BACKOFF_CAP,
    CLIENT_OPTIONS,
    DEFAULT_PREFIX,
    RETRIES,
    SCRIPTS,
    ScriptCommands,
    get_connection_args,
    lean_pool,
    parse_outcome,
    parse_snapshot,
    parse_taken,
    register_scripts,
    retry_delay,
    split_url,
    unavailable,
    url_of,
    where_of,
)
from .state import AsyncState

__all__ = ["AsyncLeanScripts", "AsyncRedisState"]

#: the pools and connections the lean calls know; others use redis-py's own script calls
_POOLS: tuple[type, ...] = (redis.asyncio.ConnectionPool, redis.asyncio.BlockingConnectionPool)
_CONNECTIONS: tuple[type, ...] = (
    redis.asyncio.Connection,
    redis.asyncio.SSLConnection,
    redis.asyncio.UnixDomainSocketConnection,
)


class AsyncLeanScripts:
    """The scripts sent straight over a ``redis.asyncio`` client's connections.

    The asyncio twin of :class:`ratequeue.state.redis.LeanScripts`: the same
    packing, retries (at once, then with backoff; a failed reconnect ends
    the call) and NOSCRIPT handling. Connections are kept in a free list
    between calls, each call popping one, so concurrent tasks never share
    one; :meth:`close` gives them back to the pool. (Giving a connection
    back to an asyncio pool takes an ``await``, so unlike the synchronous
    twin a state collected without being closed does not: its connections
    stay out of the pool until the client itself is closed.)
    """

    def __init__(self, pool: Any, *, keep: bool = True) -> None:
        """Take connections from ``pool``; with ``keep``, keep them between calls."""
        self._pool = pool
        self._keep = keep
        self._commands = ScriptCommands(pool.connection_kwargs)
        self._get_args = get_connection_args(pool)
        self._reconnects = hasattr(pool.connection_class, "should_reconnect")
        self._idle: list[Any] = []

    @classmethod
    def of(cls, client: Any) -> AsyncLeanScripts | None:
        """Lean calls on ``client``'s pool, or ``None`` if it must use redis-py's own calls."""
        usable = lean_pool(client, _POOLS, _CONNECTIONS)
        return None if usable is None else cls(usable[0], keep=usable[1])

    async def __call__(
        self, script: str, key: str, interval: int, now: int | None, rest: tuple[int, ...]
    ) -> Any:
        """Run ``script`` on ``key``; raise redis-py's error when it fails for good."""
        packed = self._commands.packed(script, key, interval, now, rest)
        try:
            connection = self._idle.pop()
        except IndexError:
            connection = await self._pool.get_connection(*self._get_args)
        failures = 0
        try:
            while True:
                try:
                    await connection.send_packed_command(packed)
                    try:
                        reply = await connection.read_response()
                    except redis.exceptions.NoScriptError:
                        reply = await self._load_and_send(connection, script, packed)
                    break
                except (redis.ConnectionError, redis.TimeoutError):
                    await connection.disconnect()
                    failures += 1
                    if failures > RETRIES:
                        raise
                    await asyncio.sleep(retry_delay(failures))
                    await connection.connect()  # with the client's own retries; its failure ends the call
        except redis.ResponseError:
            await self._give_back(connection)  # an error answer, read in full: the connection is fine
            raise
        except BaseException:
            await connection.disconnect(nowait=True)  # an answer may still be on its way
            await self._give_back(connection)
            raise
        await self._give_back(connection)
        return reply

    async def close(self) -> None:
        """Give the connections kept between calls back to the pool."""
        while self._idle:
            await self._pool.release(self._idle.pop())

    @staticmethod
    async def _load_and_send(connection: Any, script: str, packed: bytes) -> Any:
        """Load ``script`` (the server answered NOSCRIPT) and send ``packed`` again."""
        await connection.send_command("SCRIPT", "LOAD", SCRIPTS[script])
        await connection.read_response()
        await connection.send_packed_command(packed)
        return await connection.read_response()

    async def _give_back(self, connection: Any) -> None:
        if not self._keep:
            await self._pool.release(connection)
            return
        if self._reconnects and connection.should_reconnect():
            await connection.disconnect()  # as the pool's release does: a maintenance notification asked
        self._idle.append(connection)


class AsyncRedisState(AsyncState):
    """Records kept in Redis hashes, changed only by Lua scripts, used from asyncio."""

    def __init__(
        self,
        client: redis.asyncio.Redis,
        *,
        prefix: str = DEFAULT_PREFIX,
        url: str | None = None,
        clock: Clock | None = None,
    ) -> None:
        """Use a ready ``redis.asyncio.Redis`` client (see :class:`ratequeue.state.redis.RedisState`).

        Close the state when done with it (``await state.close()``, or
        ``async with``): that gives the connections its calls keep back to
        the client's pool, then closes the client.
        """
        if not isinstance(prefix, str):
            raise ConfigurationError(f"prefix must be a string, got {type(prefix).__name__}")
        self._client = client
        self._prefix = prefix
        self._clock = clock
        self._where = where_of(client)
        self.url = url or url_of(client, prefix)
        #: the lean calls, or None where redis-py's own script calls are needed
        self._lean = AsyncLeanScripts.of(client)
        self._scripts = register_scripts(client) if self._lean is None else {}

    @classmethod
    def from_url(cls, url: str) -> AsyncRedisState:
        """Open a Redis URL, as :meth:`ratequeue.state.redis.RedisState.from_url` does."""
        client_url, prefix = split_url(url)
        try:
            client = redis.asyncio.Redis.from_url(
                client_url,
                retry=Retry(ExponentialBackoff(cap=BACKOFF_CAP, base=BACKOFF_BASE), retries=RETRIES),
                retry_on_error=[redis.ConnectionError, redis.TimeoutError],
                **CLIENT_OPTIONS,
            )
        except (ValueError, TypeError) as exc:
            raise ConfigurationError(f"bad Redis URL {url!r}: {exc}") from exc
        return cls(client, prefix=prefix, url=url)

    def key(self, name: str) -> str:
        """The Redis key holding queue ``name``."""
        return self._prefix + name

    async def close(self) -> None:
        if self._lean is not None:
            await self._lean.close()  # the kept connections go back to the pool first
        await self._client.aclose()

    async def _run(self, script: str, key: str, interval: int, *rest: int) -> Any:
        now = None if self._clock is None else self._clock()
        try:
            if self._lean is not None:
                return await self._lean(script, key, interval, now, rest)
            return await self._scripts[script](keys=[key], args=[interval, "" if now is None else now, *rest])
        except redis.RedisError as exc:
            raise unavailable(self._where, exc, key) from exc

    async def _take(self, name: str, interval: int) -> Taken:
        key = self._prefix + name
        return parse_taken(name, key, interval, await self._run("take", key, interval))

    async def _try_start(self, name: str, interval: int, ticket: int, lead: int) -> Outcome:
        key = self._prefix + name
        return parse_outcome(name, key, interval, await self._run("try_start", key, interval, ticket, lead))

    async def _take_and_try(self, name: str, interval: int, lead: int) -> Outcome:
        key = self._prefix + name
        return parse_outcome(name, key, interval, await self._run("take_and_try", key, interval, lead))

    async def _retime(self, name: str, interval: int, ticket: int, lead: int) -> Outcome:
        key = self._prefix + name
        return parse_outcome(name, key, interval, await self._run("retime", key, interval, ticket, lead))

    async def _read(self, name: str) -> Snapshot:
        key = self._prefix + name
        return parse_snapshot(key, await self._run("read", key, 0))

    async def _reset(self, name: str) -> bool:
        try:
            return bool(await self._client.delete(self.key(name)))
        except redis.RedisError as exc:
            raise unavailable(self._where, exc) from exc
