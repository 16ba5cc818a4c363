"""``redis://`` for asyncio: the Redis state of :mod:`ratequeue.state.redis`, driven on ``redis.asyncio``.

Everything but the driving is shared with the synchronous state: the
script, the codec, the operations and the recovery of a failed call are
:mod:`ratequeue._flow` generators of :class:`~ratequeue.state.redis.RedisStateBase`
and :class:`~ratequeue.state.redis.LeanCalls`, carried out here by
:func:`~ratequeue._flow.arun`.
"""

from __future__ import annotations

from typing import Any, Protocol

import redis.asyncio
import redis.asyncio.cluster
from redis.asyncio.retry import Retry

from .._flow import arun
from ..protocol import Outcome, Taken
from ..state.base import Snapshot, Terms
from ..state.redis import LeanCalls, RedisStateBase
from .state import AsyncState

__all__ = ["AsyncLeanScripts", "AsyncRedisState"]


class AsyncConnection(Protocol):
    """What the lean calls use of a ``redis.asyncio`` connection."""

    async def send_packed_command(self, command: list[bytes]) -> None: ...
    async def send_command(self, *args: str) -> None: ...
    async def read_response(self) -> object: ...
    async def connect(self) -> None: ...
    async def disconnect(self, nowait: bool = False) -> None: ...
    def should_reconnect(self) -> bool: ...


class AsyncPool(Protocol):
    """What the lean calls use of a ``redis.asyncio`` connection pool."""

    #: the keyword arguments of the pool's connections (host, encoding, credentials, ...)
    connection_kwargs: dict[str, Any]

    async def get_connection(self, *args: str) -> AsyncConnection: ...
    async def release(self, connection: AsyncConnection) -> None: ...


class AsyncLeanScripts(LeanCalls[AsyncConnection]):
    """The lean calls on a ``redis.asyncio`` client (see :class:`~ratequeue.state.redis.LeanCalls`).

    :meth:`close` gives the kept connections back to the pool. (Giving one
    back to an asyncio pool takes an ``await``, so unlike the synchronous
    lean calls a state collected without being closed does not: its
    connections stay out of the pool until the client itself is closed.)
    """

    pool_types = (redis.asyncio.ConnectionPool, redis.asyncio.BlockingConnectionPool)
    connection_types = (
        redis.asyncio.Connection,
        redis.asyncio.SSLConnection,
        redis.asyncio.UnixDomainSocketConnection,
    )
    _pool: AsyncPool

    async def __call__(self, packed: list[bytes]) -> object:
        """Send ``packed`` and return the reply; raise redis-py's error when the call fails for good."""
        idle = bool(self._idle)
        if idle:
            connection = self._idle.pop()
        else:
            connection = await self._pool.get_connection(*self._get_args)
        try:
            await connection.send_packed_command(packed)
            reply = await connection.read_response()
        except BaseException as exc:
            return await arun(self._recover(connection, packed, exc, idle=idle))
        if not self._keep_idle(connection):
            await arun(self._give_back(connection))
        return reply

    async def close(self) -> None:
        """Give the connections kept between calls back to the pool."""
        while self._idle:
            await self._pool.release(self._idle.pop())

    async def _abandon(self, connection: AsyncConnection) -> None:
        await connection.disconnect(nowait=True)


class AsyncRedisState(RedisStateBase[redis.asyncio.Redis], AsyncState):
    """Records kept in Redis hashes, changed only by a Lua script, used from asyncio.

    Close the state when done with it (``await state.close()``, or
    ``async with``): that gives the connections its calls keep back to the
    client's pool, then closes the client.
    """

    _client_class = redis.asyncio.Redis
    _cluster_class = redis.asyncio.cluster.RedisCluster
    _retry_class = Retry
    _lean_class = AsyncLeanScripts
    _lean: AsyncLeanScripts | None

    async def close(self) -> None:
        if self._lean is not None:
            await self._lean.close()  # the kept connections go back to the pool first
        for node in [*self._node_clients.values(), *self._retired_clients]:
            await node.aclose()
        await self._client.aclose()

    async def _take(self, name: str, terms: Terms, cost: int) -> Taken:
        return await arun(self._take_flow(name, terms, cost))

    async def _try_start(self, name: str, terms: Terms, ticket: int, lead_us: int, cost: int) -> Outcome:
        return await arun(self._try_start_flow(name, terms, ticket, lead_us, cost))

    async def _take_and_try(self, name: str, terms: Terms, lead_us: int, cost: int) -> Outcome:
        return await arun(self._take_and_try_flow(name, terms, lead_us, cost))

    async def _retime(self, name: str, terms: Terms, ticket: int, lead_us: int) -> Outcome:
        return await arun(self._retime_flow(name, terms, ticket, lead_us))

    async def _set_paused(self, name: str, terms: Terms, paused: bool) -> bool:
        return await arun(self._set_paused_flow(name, terms, paused))

    async def _release(self, name: str, terms: Terms, ticket: int) -> bool:
        return await arun(self._release_flow(name, terms, ticket))

    async def _renew(self, name: str, terms: Terms, ticket: int) -> bool:
        return await arun(self._renew_flow(name, terms, ticket))

    async def _read(self, name: str) -> Snapshot:
        return await arun(self._read_flow(name))

    async def _cluster_keys(self, pattern: str) -> list[Any]:
        cluster: Any = self._client
        return [key async for key in cluster.scan_iter(match=pattern, count=1000)]

    async def _reset(self, name: str) -> bool:
        return await arun(self._reset_flow(name))

    async def _names(self, prefix: str) -> list[str]:
        return await arun(self._names_flow(prefix))

    async def _sweep(self) -> int:
        return 0  # Redis deletes keys past their TTL itself
