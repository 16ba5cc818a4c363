"""The lean call path: the script sent straight over a redis-py client's connections.

redis-py's ``Script`` call runs through the client's command machinery
(argument packing, retry wrapper, hooks, the pool's checks), most of the CPU
a call costs. :class:`LeanCalls` keeps what redis-py does well -- connecting,
AUTH/HELLO, TLS, unix sockets, the reply parser -- and does the rest itself.
The recovery of a failed call is written once, as a flow (:meth:`LeanCalls._recover`);
:class:`LeanScripts` and :class:`AsyncLeanScripts` are its synchronous and
asyncio drivers.
"""

from __future__ import annotations

import inspect
import logging
import os
import weakref
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Generic, Protocol, TypeVar, Union

import redis
import redis.asyncio
from redis.exceptions import NoScriptError

from ...core.flow import Call, Flow, Sleep, arun, run
from .._retries import RetryLog
from .codec import SCRIPT, Commands

try:
    from redis.credentials import StreamingCredentialProvider
except ImportError:  # pragma: no cover - redis-py before 5.3: no re-authentication on release
    _STREAMING: tuple[type, ...] = ()
else:
    _STREAMING = (StreamingCredentialProvider,)

__all__ = [
    "BACKOFF_BASE",
    "BACKOFF_CAP",
    "RETRIES",
    "AsyncLeanScripts",
    "LeanCalls",
    "LeanScripts",
    "pool_where",
    "retry_delay",
]

#: calls retried after a connection failure, the script loaded again (INFO)
_log = logging.getLogger("ratequeue.state.redis")

#: how often a failed call (connection error or timeout) is retried before its error is raised
RETRIES = 8
#: the backoff between retries, as redis-py's ``ExponentialBackoff(cap=BACKOFF_CAP, base=BACKOFF_BASE)``
BACKOFF_BASE = 0.02
BACKOFF_CAP = 0.5

#: a redis-py client of either kind
Client = Union[redis.Redis, redis.asyncio.Redis]


def retry_delay(failures: int) -> float:
    """Seconds to wait before retrying a call that has failed ``failures`` times.

    The first retry goes at once: a connection that sat idle may simply have
    been closed by the server (a restart, a timeout, ``CLIENT KILL``), and a
    fresh one is all it takes. Later ones back off as the client's own retry
    does (``ExponentialBackoff(cap=0.5, base=0.02)``: 0.04 s, 0.08 s, ... 0.5 s).
    """
    return 0.0 if failures <= 1 else min(BACKOFF_CAP, BACKOFF_BASE * 2 ** (failures - 1))


def pool_where(kwargs: dict[str, Any]) -> str:
    """``host:port`` (or the socket path) the connections of a pool with ``kwargs`` reach, for messages."""
    return str(kwargs.get("path") or f"{kwargs.get('host', '?')}:{kwargs.get('port', '?')}")


class Connection(Protocol):
    """What the lean calls use of a redis-py connection (an asyncio one's methods return awaitables)."""

    def send_packed_command(self, command: list[bytes]) -> object: ...
    def send_command(self, *args: str) -> object: ...
    def read_response(self) -> object: ...
    def connect(self) -> object: ...
    def disconnect(self) -> object: ...
    def should_reconnect(self) -> bool: ...


class Pool(Protocol):
    """What the lean calls use of a redis-py connection pool, synchronous or asyncio."""

    #: the keyword arguments of the pool's connections (host, encoding, credentials, ...)
    connection_kwargs: dict[str, Any]

    def get_connection(self, *args: str) -> Any:
        """A connection, or (asyncio) an awaitable of one."""

    def release(self, connection: Any) -> object: ...


def get_connection_args(pool: Pool) -> tuple[str, ...]:
    """What ``pool.get_connection`` needs: nothing, or a command name before redis-py 5.3."""
    parameter = inspect.signature(pool.get_connection).parameters.get("command_name")
    return ("EVALSHA",) if parameter is not None and parameter.default is inspect.Parameter.empty else ()


K = TypeVar("K", bound=Connection)
L = TypeVar("L", bound="LeanCalls[Any]")


class LeanCalls(ABC, Generic[K]):
    """The script sent straight over a client's connections: EVALSHA packed by hand, one reply read.

    redis-py's ``Script`` call runs through the client's command machinery
    (argument packing, retry wrapper, observability hooks, the pool's
    checks), most of the CPU a call costs. This keeps what redis-py does
    well -- connecting, AUTH/HELLO, TLS, unix sockets, the reply parser for
    the protocol the connection negotiated -- and does the rest itself:

    * a connection error or timeout disconnects the connection and retries
      (at once, then with backoff; :data:`RETRIES` times at most); a
      reconnect that fails after the client's own retries ends the call;
    * NOSCRIPT (after a restart or ``SCRIPT FLUSH``) loads the script on the
      same connection and sends the call again;
    * connections are kept in a free list of their own between calls (taking
      one from redis-py's pool and releasing it costs as much as the call's
      own packing and parsing): each call pops one, so no two threads or
      tasks share one.

    The decisions are written once, here: :meth:`_recover` is the flow a
    call takes after its first attempt failed. The drivers
    (:class:`LeanScripts`, :class:`AsyncLeanScripts`)
    supply ``__call__`` -- the first attempt, inline, as the common case
    costs no flow -- and how to take, give back and abandon a connection.
    """

    #: the pool and connection classes the lean calls know; others use redis-py's calls
    pool_types: ClassVar[tuple[type, ...]]
    connection_types: ClassVar[tuple[type, ...]]

    def __init__(self, pool: Pool, *, keep: bool = True) -> None:
        """Take connections from ``pool``; with ``keep``, keep them between calls."""
        self._pool = pool
        self._keep = keep
        kwargs = pool.connection_kwargs
        #: packs the calls, encoding keys as the client does
        self.commands = Commands(kwargs.get("encoding", "utf-8"), kwargs.get("encoding_errors", "strict"))
        self._get_args = get_connection_args(pool)
        #: whether connections may be marked for a reconnect (RESP3 maintenance notifications, redis-py 7+)
        self._reconnects = hasattr(getattr(pool, "connection_class", None), "should_reconnect")
        self._idle: list[K] = []
        #: where the calls go, for log lines (``host:port`` or the socket path)
        self._where = pool_where(kwargs)
        #: the calls retried after a connection failure, logged
        self._retries = RetryLog(_log, "Redis", self._where)

    @classmethod
    def of(cls: type[L], client: Client) -> L | None:
        """Lean calls on ``client``'s pool, keeping its connections between calls if they may.

        ``None`` when they must go through redis-py's own calls: a client bound
        to one connection (an asyncio one binds it at its first command), a
        pool or connection class other than redis-py's plain ones (Sentinel, a
        user's subclass), client-side caching. The connections may be kept
        between calls unless the pool must see each release: a streaming
        credential provider re-authenticates connections as they are released.
        """
        pool: Any = getattr(client, "connection_pool", None)
        if (
            getattr(client, "connection", None) is not None
            or getattr(client, "single_connection_client", False)
            or type(pool) not in cls.pool_types
            or getattr(pool, "connection_class", None) not in cls.connection_types
            or getattr(pool, "cache", None) is not None
        ):
            return None
        provider = pool.connection_kwargs.get("credential_provider")
        return cls(pool, keep=not isinstance(provider, _STREAMING))

    @abstractmethod
    def close(self) -> object:
        """Give the connections kept between calls back to the pool (asyncio: a coroutine)."""

    @abstractmethod
    def __call__(self, packed: list[bytes]) -> object:
        """Send ``packed`` and return the reply (asyncio: a coroutine); raise redis-py's error."""

    @abstractmethod
    def _abandon(self, connection: K) -> object:
        """Close ``connection`` at once: an answer may still be on its way, so its socket is never reused."""

    def _keep_idle(self, connection: K) -> bool:
        """Put ``connection`` in the free list if nothing more is needed; whether it did."""
        if self._keep and not (self._reconnects and connection.should_reconnect()):
            self._idle.append(connection)
            return True
        return False

    def _give_back(self, connection: K) -> Flow[None]:
        """Give ``connection`` back after a call: to the free list, or to the pool."""
        if self._keep_idle(connection):
            return
        if self._keep:  # a maintenance notification asked for a reconnect: as the pool's release does
            yield Call(connection.disconnect)
            self._idle.append(connection)
        else:
            yield Call(self._pool.release, (connection,))

    def _recover(
        self, connection: K, packed: list[bytes], failure: BaseException, *, idle: bool = False
    ) -> Flow[object]:
        """The rest of a call whose first attempt on ``connection`` failed with ``failure``: its reply.

        ``idle``: ``connection`` came from the free list, where the server (its
        ``timeout``, a ``CLIENT KILL``) or the network (a NAT's idle timeout)
        may have closed it: its first retry is routine (see :class:`RetryLog`).
        """
        failures = 0
        loaded = False  # whether the script was loaded on this connection since it (re)connected
        try:
            while True:
                load = False
                if isinstance(failure, NoScriptError) and not loaded:
                    load = loaded = True
                    _log.info(
                        "Redis at %s answered NOSCRIPT (restarted, or SCRIPT FLUSH): loading it", self._where
                    )
                elif isinstance(failure, (redis.ConnectionError, redis.TimeoutError)) and failures < RETRIES:
                    yield Call(connection.disconnect)
                    failures += 1
                    loaded = False
                    self._retries.retrying(failure, failures, RETRIES, idle=idle)
                    yield Sleep(retry_delay(failures))
                    yield Call(connection.connect)  # with the client's own retries; its failure ends the call
                else:
                    raise failure
                try:
                    if load:
                        yield Call(connection.send_command, ("SCRIPT", "LOAD", SCRIPT))
                        yield Call(connection.read_response)
                    yield Call(connection.send_packed_command, (packed,))
                    reply = yield Call(connection.read_response)
                    break
                except (NoScriptError, redis.ConnectionError, redis.TimeoutError) as exc:
                    failure = exc
        except redis.ResponseError:
            yield from self._give_back(connection)  # an error answer, read in full: the connection is fine
            raise
        except BaseException as exc:
            if isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
                self._retries.gave_up(exc, failures + 1)  # out of retries, or the reconnect failed
            yield Call(self._abandon, (connection,))
            yield from self._give_back(connection)
            raise
        if failures:
            _log.info("Redis at %s answered again after %d retried failure(s)", self._where, failures)
        yield from self._give_back(connection)
        return reply


def _release_all(pool: Pool, idle: list[Connection]) -> None:
    while idle:
        pool.release(idle.pop())


class LeanScripts(LeanCalls[Connection]):
    """The lean calls on a synchronous client (see :class:`LeanCalls`).

    After a fork the child takes fresh connections; :meth:`close`, or the
    garbage collector, gives the kept ones back to the pool.
    """

    pool_types = (redis.ConnectionPool, redis.BlockingConnectionPool)
    connection_types = (redis.Connection, redis.SSLConnection, redis.UnixDomainSocketConnection)

    def __init__(self, pool: Pool, *, keep: bool = True) -> None:
        super().__init__(pool, keep=keep)
        self._pid = os.getpid()
        self._finalizer = weakref.finalize(self, _release_all, pool, self._idle)
        self._finalizer.atexit = False

    def __call__(self, packed: list[bytes]) -> object:
        """Send ``packed`` and return the reply; raise redis-py's error when the call fails for good."""
        connection, idle = self._connection()
        try:
            connection.send_packed_command(packed)
            reply = connection.read_response()
        except BaseException as exc:
            return run(self._recover(connection, packed, exc, idle=idle))
        if not self._keep_idle(connection):
            run(self._give_back(connection))
        return reply

    def close(self) -> None:
        """Give the connections kept between calls back to the pool."""
        _release_all(self._pool, self._idle)

    def _connection(self) -> tuple[Connection, bool]:
        """A connection for a call, and whether it was kept idle since an earlier one."""
        if self._pid != os.getpid():  # forked: the parent's sockets are not ours
            self._idle.clear()
            self._pid = os.getpid()
        try:
            return self._idle.pop(), True  # atomic: no two threads get one connection
        except IndexError:
            connection: Connection = self._pool.get_connection(*self._get_args)
            return connection, False

    def _abandon(self, connection: Connection) -> None:
        connection.disconnect()


class AsyncLeanScripts(LeanCalls[Any]):
    """The lean calls on a ``redis.asyncio`` client.

    :meth:`close` gives the kept connections back to the pool (giving one
    back takes an ``await``, so a state collected unclosed keeps them out of
    the pool until the client itself is closed).
    """

    pool_types = (redis.asyncio.ConnectionPool, redis.asyncio.BlockingConnectionPool)
    connection_types = (
        redis.asyncio.Connection,
        redis.asyncio.SSLConnection,
        redis.asyncio.UnixDomainSocketConnection,
    )

    async def __call__(self, packed: list[bytes]) -> object:
        """Send ``packed`` and return the reply; raise redis-py's error when the call fails for good."""
        idle = bool(self._idle)
        connection = self._idle.pop() if idle else await self._pool.get_connection(*self._get_args)
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
            pool: Any = self._pool
            await pool.release(self._idle.pop())

    async def _abandon(self, connection: Any) -> None:
        await connection.disconnect(nowait=True)
