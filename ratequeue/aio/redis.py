"""``redis://`` for asyncio: the same Lua scripts as :mod:`ratequeue.state.redis`, on ``redis.asyncio``."""

from __future__ import annotations

from typing import Any

import redis
import redis.asyncio
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from ..errors import ConfigurationError
from ..protocol import Outcome, Taken
from ..state.base import Clock, Snapshot
from ..state.redis import (
    CLIENT_OPTIONS,
    DEFAULT_PREFIX,
    RETRIES,
    decode,
    parse_outcome,
    parse_snapshot,
    parse_taken,
    register_scripts,
    script_args,
    split_url,
    unavailable,
    url_of,
    where_of,
)
from .state import AsyncState

__all__ = ["AsyncRedisState"]


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
        """Use a ready ``redis.asyncio.Redis`` client (see :class:`ratequeue.state.redis.RedisState`)."""
        if not isinstance(prefix, str):
            raise ConfigurationError(f"prefix must be a string, got {type(prefix).__name__}")
        self._client = client
        self._prefix = prefix
        self._clock = clock
        self._where = where_of(client)
        self.url = url or url_of(client, prefix)
        self._scripts = register_scripts(client)

    @classmethod
    def from_url(cls, url: str) -> AsyncRedisState:
        """Open a Redis URL, as :meth:`ratequeue.state.redis.RedisState.from_url` does."""
        client_url, prefix = split_url(url)
        try:
            client = redis.asyncio.Redis.from_url(
                client_url,
                retry=Retry(ExponentialBackoff(cap=0.5, base=0.02), retries=RETRIES),
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
        await self._client.aclose()

    async def _run(self, script: str, name: str, args: list[Any]) -> list[Any]:
        try:
            return decode(await self._scripts[script](keys=[self.key(name)], args=args))
        except redis.RedisError as exc:
            raise unavailable(self._where, exc, self.key(name)) from exc

    async def _take(self, name: str, interval: int) -> Taken:
        reply = await self._run("take", name, script_args(interval, self._clock))
        return parse_taken(name, self.key(name), interval, reply)

    async def _try_start(self, name: str, interval: int, ticket: int, lead: int) -> Outcome:
        reply = await self._run("try_start", name, script_args(interval, self._clock, ticket, lead))
        return parse_outcome(name, self.key(name), interval, reply)

    async def _take_and_try(self, name: str, interval: int, lead: int) -> Outcome:
        reply = await self._run("take_and_try", name, script_args(interval, self._clock, lead))
        return parse_outcome(name, self.key(name), interval, reply)

    async def _retime(self, name: str, interval: int, ticket: int, lead: int) -> Outcome:
        reply = await self._run("retime", name, script_args(interval, self._clock, ticket, lead))
        return parse_outcome(name, self.key(name), interval, reply)

    async def _read(self, name: str) -> Snapshot:
        return parse_snapshot(self.key(name), await self._run("read", name, script_args(0, self._clock)))

    async def _reset(self, name: str) -> bool:
        try:
            return bool(await self._client.delete(self.key(name)))
        except redis.RedisError as exc:
            raise unavailable(self._where, exc) from exc
