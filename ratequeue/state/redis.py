"""``redis://`` and ``rediss://``: the protocol run atomically inside Redis, on its clock.

Each queue is one hash (``PREFIX + name``: ``ticket``, ``pos``, ``at``,
``interval``, ``burst``, ``due``; a hash written before bursts lacks the last
two and reads as burst 1; ``paused`` is ``1`` while the queue is paused for
every shard, and absent otherwise; a queue with ``max_running`` also has
``max_running``, ``leases`` -- ``TICKET:EXPIRY`` pairs joined by commas --
and ``held``, absent until the queue was first found full), so every
operation touches a single key, on one hash slot: a Redis Cluster
(``redis+cluster://``, or a ready ``RedisCluster`` client) runs every
operation on the master that holds its queue's slot, redis-py's cluster
client following MOVED and ASK redirections and loading the script where a
node answers NOSCRIPT. Every
operation is one call of one Lua script (``redis.lua``), which reads the
server's ``TIME`` itself, so hosts whose clocks disagree still share one
rate. The script is sent by SHA and loaded again when the server answers
NOSCRIPT (after a restart or ``SCRIPT FLUSH``).

A write with a keep time (``keep_us``) sets the key's TTL in the same
script (``PEXPIRE``, relative to its ``now``), so Redis deletes an idle
queue's key by itself and :meth:`~ratequeue.state.State.sweep` has nothing
to do; a write without one clears the TTL (``PERSIST``).
:meth:`~ratequeue.state.State.names` lists the keys under the prefix with ``SCAN``.

This module holds what the synchronous and the asyncio states share,
written once: the codec (:mod:`ratequeue.state._redis_codec`) builds each
call and parses its reply; :class:`RedisStateBase` runs the operations as
:mod:`ratequeue._flow` generators; :class:`LeanCalls` sends the calls.
:class:`RedisState` and :class:`LeanScripts` are its synchronous drivers;
:mod:`ratequeue.aio.redis` has the asyncio ones.

A call is one ``EVALSHA``, packed by hand and sent over one of the client's
connections: redis-py connects, authenticates, speaks TLS and parses the
reply, while its per-command machinery, most of the CPU of a call, is
skipped. Clients it does not suit (one connection, Sentinel, client-side
caching, a connection class of the user's own) go through redis-py's own
``Script`` calls instead.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import weakref
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Generic, Protocol, TypeVar, Union
from urllib.parse import quote, urlencode

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.cluster
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.commands.core import AsyncScript, Script
from redis.exceptions import NoScriptError
from redis.retry import Retry

from .._flow import Call, Flow, Sleep, run
from .._redact import redact, scrub, secrets_kept_out
from ..errors import ConfigurationError, RateQueueError, StateCorrupted, StateUnavailable
from ..protocol import Outcome, Taken
from ._redis_codec import (
    READ_TERMS,
    SCRIPT,
    Commands,
    Operation,
    Parser,
    glob_escape,
    parse_changed,
    parse_live,
    parse_outcome,
    parse_snapshot,
    parse_taken,
    script_args,
)
from ._retries import RetryLog
from .base import Clock, Snapshot, State, StateBase, Terms, split_options

try:
    from redis.credentials import StreamingCredentialProvider
except ImportError:  # pragma: no cover - redis-py before 5.3: no re-authentication on release
    _STREAMING: tuple[type, ...] = ()
else:
    _STREAMING = (StreamingCredentialProvider,)

__all__ = ["LeanCalls", "LeanScripts", "RedisState", "RedisStateBase"]

#: calls retried after a connection failure (see :mod:`ratequeue.state._retries`), the script
#: loaded again (INFO), writes short of their replicas (WARNING)
_log = logging.getLogger("ratequeue.state.redis")

#: the key prefix used unless one is given
DEFAULT_PREFIX = "ratequeue:"

#: seconds the clients ratequeue creates wait to connect, and for a reply (then a bounded retry, an error)
CONNECT_TIMEOUT = 5.0
SOCKET_TIMEOUT = 10.0
#: how often a failed call (connection error or timeout) is retried before its error is raised
RETRIES = 8
#: the backoff between retries, as redis-py's ``ExponentialBackoff(cap=BACKOFF_CAP, base=BACKOFF_BASE)``
BACKOFF_BASE = 0.02
BACKOFF_CAP = 0.5

#: a redis-py client of either kind
Client = Union[redis.Redis, redis.asyncio.Redis]

#: a redis-py cluster client of either kind
ClusterClient = Union[redis.cluster.RedisCluster, redis.asyncio.cluster.RedisCluster]

#: the URL scheme of a Redis Cluster state (the client reaches it by ``redis://`` or ``rediss://``)
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


def is_cluster(client: object) -> bool:
    """Whether ``client`` is a redis-py cluster client (sync or asyncio)."""
    return isinstance(client, (redis.cluster.RedisCluster, redis.asyncio.cluster.RedisCluster))


def retry_delay(failures: int) -> float:
    """Seconds to wait before retrying a script call that has failed ``failures`` times.

    The first retry goes at once: a connection that sat idle may simply have
    been closed by the server (a restart, a timeout, ``CLIENT KILL``), and a
    fresh one is all it takes. Later ones back off as the client's own retry
    does (``ExponentialBackoff(cap=0.5, base=0.02)``: 0.04 s, 0.08 s, ... 0.5 s).
    """
    return 0.0 if failures <= 1 else min(BACKOFF_CAP, BACKOFF_BASE * 2 ** (failures - 1))


def split_url(url: str) -> tuple[str, str]:
    """``url`` without ratequeue's own options (``prefix``, ``wait``, ``wait_timeout``), and the prefix."""
    client_url, ours = split_options(url, "prefix", "wait", "wait_timeout")
    return client_url, ours.get("prefix", DEFAULT_PREFIX)


#: how many MOVED/ASK redirections a write with ``wait`` follows on a cluster before it gives up
#: (after the first two, with the backoff of a retry: some 3 s in all)
_REDIRECTS = 10

#: how long (ms) a write waits for its replicas by default, with ``wait``
DEFAULT_WAIT_TIMEOUT_MS = 1000
#: the longest ``wait_timeout`` (ms): half the socket timeout, so that a WAIT never times the
#: connection out (a call that times out is sent again, and its script would run twice)
MAX_WAIT_TIMEOUT_MS = int(SOCKET_TIMEOUT * 1000 / 2)


def wait_options(url: str) -> tuple[int, int]:
    """The ``wait`` (replicas, 0: none) and ``wait_timeout`` (ms) options of a Redis URL, checked."""
    _, ours = split_options(url, "wait", "wait_timeout")
    values = []
    for option, default, low, high in (
        ("wait", 0, 0, 1000),
        ("wait_timeout", DEFAULT_WAIT_TIMEOUT_MS, 1, MAX_WAIT_TIMEOUT_MS),
    ):
        text = ours.get(option, str(default))
        if not (text.isdigit() and low <= int(text) <= high):
            raise ConfigurationError(
                f"the Redis URL option {option} must be a whole number from {low} to {high}, got {text!r}"
            )
        values.append(int(text))
    return values[0], values[1]


def url_of(client: Client, prefix: str, wait: int = 0, wait_timeout_ms: int = 0) -> str:
    """A URL that reconnects as ``client`` does: host or socket, db, credentials, TLS, prefix, wait."""
    url = _plain_url_of(client, prefix)
    return f"{url}&{urlencode({'wait': wait, 'wait_timeout': wait_timeout_ms})}" if wait else url


def _plain_url_of(client: Client, prefix: str) -> str:
    if is_cluster(client):
        cluster: Any = client
        node = _first_node(cluster)
        kwargs = cluster.nodes_manager.connection_kwargs
        user, password = kwargs.get("username") or "", kwargs.get("password")
        auth = f"{quote(user, safe='')}:{quote(password, safe='')}@" if password else ""
        tls = kwargs.get("ssl") or "SSL" in str(kwargs.get("connection_class"))
        scheme = "rediss+cluster" if tls else "redis+cluster"
        return f"{scheme}://{auth}{node.host}:{node.port}?{urlencode({'prefix': prefix})}"
    pool = client.connection_pool
    kwargs = pool.connection_kwargs
    user, password = kwargs.get("username") or "", kwargs.get("password")
    auth = f"{quote(user, safe='')}:{quote(password, safe='')}@" if password else ""
    options = {"db": kwargs.get("db", 0), "prefix": prefix}
    if kwargs.get("path"):
        return f"unix://{auth}{kwargs['path']}?{urlencode(options)}"
    scheme = "rediss" if "SSL" in getattr(pool, "connection_class", type(None)).__name__ else "redis"
    host = f"{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}"
    return f"{scheme}://{auth}{host}/{options.pop('db')}?{urlencode(options)}"


def _first_node(cluster: Any) -> Any:
    """A cluster client's default node, or its first seed (all an asyncio one knows before its first call)."""
    nodes = cluster.get_nodes() or list(cluster.nodes_manager.startup_nodes.values())
    return cluster.get_default_node() or nodes[0]


def where_of(client: Client) -> str:
    """``host:port`` (or the socket path) a client connects to; a cluster's first node."""
    if is_cluster(client):
        cluster: Any = client
        node = _first_node(cluster)
        return f"cluster {node.host}:{node.port}"
    kwargs = client.connection_pool.connection_kwargs
    return str(kwargs.get("path") or f"{kwargs.get('host', '?')}:{kwargs.get('port', '?')}")


# ------------------------------------------------------------------ the lean call path


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


def lean_pool(
    client: object, pools: tuple[type, ...], connections: tuple[type, ...]
) -> tuple[Pool, bool] | None:
    """The pool lean calls may take ``client``'s connections from, and whether they may keep them.

    ``None`` when they must go through redis-py's own calls: a client bound
    to one connection, a pool or connection class other than redis-py's
    plain ones (Sentinel, a user's subclass), client-side caching. The
    connections may be kept between calls unless the pool must see each
    release: a streaming credential provider re-authenticates connections
    as they are released.
    """
    if getattr(client, "connection", None) is not None or getattr(client, "single_connection_client", False):
        return None  # bound to one connection (asyncio clients bind it on their first command)
    pool: Any = getattr(client, "connection_pool", None)
    if type(pool) not in pools or getattr(pool, "connection_class", None) not in connections:
        return None
    if getattr(pool, "cache", None) is not None:
        return None
    provider = pool.connection_kwargs.get("credential_provider")
    return pool, not isinstance(provider, _STREAMING)


def get_connection_args(pool: Pool) -> tuple[str, ...]:
    """What ``pool.get_connection`` needs: nothing, or a command name before redis-py 5.3."""
    try:
        parameter = inspect.signature(pool.get_connection).parameters.get("command_name")
    except (TypeError, ValueError):  # pragma: no cover - a signature Python cannot read
        return ()
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
    (:class:`LeanScripts`, :class:`ratequeue.aio.redis.AsyncLeanScripts`)
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
        self._where = str(kwargs.get("path") or f"{kwargs.get('host', '?')}:{kwargs.get('port', '?')}")
        #: the calls retried after a connection failure, logged
        self._retries = RetryLog(_log, "Redis", self._where)

    @classmethod
    def of(cls: type[L], client: Client) -> L | None:
        """Lean calls on ``client``'s pool, or ``None`` if it must use redis-py's (see :func:`lean_pool`)."""
        usable = lean_pool(client, cls.pool_types, cls.connection_types)
        return None if usable is None else cls(usable[0], keep=usable[1])

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


# ------------------------------------------------------------------ the states

C = TypeVar("C", redis.Redis, redis.asyncio.Redis)
R = TypeVar("R")
S = TypeVar("S", bound="RedisStateBase[Any]")


class RedisStateBase(StateBase, Generic[C]):
    """What :class:`RedisState` and :class:`~ratequeue.aio.redis.AsyncRedisState` share.

    The constructor and :meth:`from_url`, the error mapping, and every
    operation as a :mod:`ratequeue._flow` generator, which the drivers run
    with :func:`~ratequeue._flow.run` or :func:`~ratequeue._flow.arun`.
    """

    _driver_errors = (redis.RedisError, redis.exceptions.RedisClusterException)

    #: the client :meth:`from_url` makes, its retry, and the lean calls on it: each driver's own
    _client_class: ClassVar[type[redis.Redis] | type[redis.asyncio.Redis]]
    _cluster_class: ClassVar[type[redis.cluster.RedisCluster] | type[redis.asyncio.cluster.RedisCluster]]
    _retry_class: ClassVar[type[Retry] | type[AsyncRetry]]
    _lean_class: ClassVar[type[LeanCalls[Any]]]

    def __init__(
        self,
        client: C,
        *,
        prefix: str = DEFAULT_PREFIX,
        url: str | None = None,
        clock: Clock | None = None,
        wait: int = 0,
        wait_timeout_ms: int = DEFAULT_WAIT_TIMEOUT_MS,
    ) -> None:
        """Use a ready client: ``redis.Redis`` or ``redis.cluster.RedisCluster``; asyncio: theirs.

        :param prefix: put before every queue name to form its key.
        :param wait: after each write, wait until this many replicas have it (Redis ``WAIT``,
            sent with the script on the same connection); 0 (default) does not wait. A write
            that fewer replicas confirm within ``wait_timeout_ms`` raises
            :class:`StateUnavailable` (it was made on the master). On a cluster, the pair
            goes to the master holding the queue's slot, following MOVED and ASK.
        :param url: the URL to pickle limiters as (default: built from the client's host
            or socket, db, user, password and TLS; pass it when other options matter).
        :param clock: **for tests only**: a function returning ``now`` in whole
            microseconds, sent to every call in place of the server's ``TIME``.
        """
        if not isinstance(prefix, str):
            raise ConfigurationError(f"prefix must be a string, got {type(prefix).__name__}")
        #: replicas each write waits for, and for how long (ms)
        self._wait, self._wait_timeout_ms = wait, wait_timeout_ms
        #: with wait on a cluster: a plain client per master (host, port), for the script + WAIT pipeline,
        #: and the master a key was last MOVED to (the cluster client's own map is not refreshed)
        self._node_clients: dict[tuple[str, int], Any] = {}
        self._retired_clients: list[Any] = []
        self._moved: dict[str, tuple[str, int]] = {}
        self._client: C = client
        self._prefix = prefix
        self._clock = clock
        self._where = where_of(client)
        #: the writes with ``wait`` retried on a cluster after a connection failure, logged
        self._retries = RetryLog(_log, "Redis", self._where)
        self.url = url or url_of(client, prefix, wait, wait_timeout_ms)
        #: the lean calls, or None where redis-py's own script calls are needed (and with wait:
        #: the script and WAIT go together in a pipeline, on one connection)
        self._lean = None if wait else self._lean_class.of(client)
        #: the script as redis-py calls it, for clients the lean calls do not suit
        self._script: Script | AsyncScript = client.register_script(SCRIPT)

    @classmethod
    def from_url(cls: type[S], url: str) -> S:
        """Open ``redis://[[user]:password@]host[:port][/db][?prefix=P&...]``, ``rediss://`` or ``unix://``.

        Query options other than ``prefix`` go to the client's ``from_url``
        (``ssl_cert_reqs``, ``socket_timeout``, ...).
        """
        client_url, prefix = split_url(url)
        wait, wait_timeout_ms = wait_options(url)
        scheme, _, rest = client_url.partition("://")
        cluster = CLUSTER_SCHEMES.get(scheme.lower())
        retry = cls._retry_class(ExponentialBackoff(cap=BACKOFF_CAP, base=BACKOFF_BASE), retries=RETRIES)
        with secrets_kept_out(url):
            if cluster is not None:
                client = cls._open_cluster(f"{cluster}://{rest}", url)
                return cls(client, prefix=prefix, url=url, wait=wait, wait_timeout_ms=wait_timeout_ms)
            try:
                client = cls._client_class.from_url(
                    client_url,
                    retry=retry,
                    retry_on_error=[redis.ConnectionError, redis.TimeoutError],
                    socket_connect_timeout=CONNECT_TIMEOUT,
                    socket_timeout=SOCKET_TIMEOUT,
                )
            except (ValueError, TypeError) as exc:
                raise ConfigurationError(f"bad Redis URL {redact(url)!r}: {scrub(str(exc), url)}") from exc
            return cls(client, prefix=prefix, url=url, wait=wait, wait_timeout_ms=wait_timeout_ms)

    @classmethod
    def _open_cluster(cls, client_url: str, url: str) -> Any:
        """A cluster client for ``client_url`` (its seed node), with ratequeue's timeouts and retries."""
        try:
            return cls._cluster_class.from_url(
                client_url,
                socket_connect_timeout=CONNECT_TIMEOUT,
                socket_timeout=SOCKET_TIMEOUT,
            )
        except (ValueError, TypeError) as exc:
            message = scrub(str(exc), url)
            raise ConfigurationError(f"bad Redis Cluster URL {redact(url)!r}: {message}") from exc
        except (redis.exceptions.RedisClusterException, redis.RedisError) as exc:
            where = redact(url)
            message = scrub(str(exc), url)
            raise StateUnavailable(f"Redis Cluster at {where} is down: {message}", where=where) from exc

    @property
    def client(self) -> C:
        """The Redis client in use."""
        return self._client

    def key(self, name: str) -> str:
        """The Redis key holding queue ``name``."""
        return self._prefix + name

    @abstractmethod
    def _cluster_keys(self, pattern: str) -> Any:
        """The keys matching ``pattern`` on every master of a cluster (a coroutine on asyncio)."""

    def _error_for(self, exc: Exception, name: str) -> RateQueueError:
        where = self._where
        if isinstance(exc, redis.AuthenticationError):
            return StateUnavailable(f"Redis at {where} refused the credentials: {exc}", where=where)
        if isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
            return StateUnavailable(f"Redis at {where} is unreachable: {exc}", where=where)
        if isinstance(exc, redis.ResponseError) and "WRONGTYPE" in str(exc):  # (a pipeline prefixes it)
            key = self.key(name)
            return StateCorrupted(f"Redis key {key} is not a hash: {exc}", where=key)
        return StateUnavailable(f"Redis at {where} failed: {exc}", where=where)

    def _operation(
        self, op: Operation, name: str, terms: Terms, args: tuple[int, ...], parse: Parser[R]
    ) -> Flow[R]:
        """Run the script's ``op`` on queue ``name``; its reply read by ``parse``, a parser of the codec."""
        key = self._prefix + name
        now_us = None if self._clock is None else self._clock()
        if self._lean is not None:
            reply = yield Call(self._lean, (self._lean.commands.packed(op, key, terms, now_us, args),))
        elif self._wait and op != "read":
            reply = yield from self._waited(key, script_args(op, terms, now_us, args))
        else:
            reply = yield Call(self._script, ([key], script_args(op, terms, now_us, args)))
        return parse(reply, name, key, terms)

    def _waited(self, key: str, args: list[Any]) -> Flow[object]:
        """The script's reply, sent with ``WAIT`` in one pipeline (one connection, one round-trip).

        ``NOSCRIPT`` loads the script and sends the pair again. Fewer
        replicas than asked confirming within the timeout log a warning: the
        write was made on the master and its answer stands (raising would
        lose a start, and its lease, that the master keeps). On a cluster, a
        connection failure asks the cluster client to find the key's master
        again (it follows a failover) before the pair is sent again.
        """
        cluster: Any = self._client if is_cluster(self._client) else None
        if cluster is not None and not cluster.get_nodes():  # an asyncio client before its first call
            yield Call(cluster.initialize)
        address = self._moved.get(key)
        if address is None and cluster is not None:
            node = cluster.get_node_from_key(key)
            address = (node.host, node.port)
        asking = loaded = False
        failures = 0
        for redirects in range(_REDIRECTS):
            if redirects > 1:  # redirected back and forth: the masters' views are still settling
                yield Sleep(retry_delay(redirects))
            client: Any = self._client if address is None else self._node_client(address)
            pipe: Any = client.pipeline(transaction=False)
            if asking:  # the slot is moving: the key is on the importing master already
                pipe.execute_command("ASKING")
            pipe.evalsha(self._script.sha, 1, key, *args)
            pipe.execute_command("WAIT", self._wait, self._wait_timeout_ms)
            try:
                *_, reply, acked = yield Call(pipe.execute)
            except NoScriptError:
                if loaded:
                    raise
                loaded = True
                yield Call(client.script_load, (SCRIPT,))
                continue
            except (redis.ConnectionError, redis.TimeoutError) as failure:
                if cluster is None or redirects + 1 >= _REDIRECTS:
                    raise
                failures += 1
                where = f"{address[0]}:{address[1]}" if address else self._where
                self._retries.retrying(failure, failures, _REDIRECTS, where=where)
                # a failover? the cluster client finds the key's master again (it refreshes its map)
                self._moved.pop(key, None)
                self._forget_node_client(address)
                yield Call(cluster.exists, (key,))
                node = cluster.get_node_from_key(key)
                address, asking, loaded = (node.host, node.port), False, False
                continue
            except redis.exceptions.AskError as redirect:  # MOVED (a MovedError) or ASK
                if cluster is None:
                    raise
                asking = not isinstance(redirect, redis.exceptions.MovedError)
                address, loaded = redirect.node_addr, False
                if not asking:  # the slot has moved for good: this key's writes go there from now on
                    self._moved[key] = address
                continue
            if int(acked) < self._wait:  # made on the master: its answer stands, without the promise
                _log.warning(
                    "Redis at %s: a write reached %s of %d replicas within %d ms; a failover could lose it",
                    self._where,
                    acked,
                    self._wait,
                    self._wait_timeout_ms,
                )
            return reply
        raise StateUnavailable(
            f"Redis at {self._where}: a write was redirected {_REDIRECTS} times (a slot moving to and fro?)",
            where=self._where,
        )

    def _forget_node_client(self, address: tuple[str, int] | None) -> None:
        """Stop using the node client of ``address`` (it is closed with the state)."""
        if address is not None and address in self._node_clients:
            self._retired_clients.append(self._node_clients.pop(address))

    def _node_client(self, address: tuple[str, int]) -> Any:
        """A plain client of the cluster master at ``address`` (made once), with the cluster's settings."""
        client = self._node_clients.get(address)
        if client is None:
            cluster: Any = self._client
            settings = getattr(cluster, "connection_kwargs", None) or cluster.nodes_manager.connection_kwargs
            accepted = inspect.signature(self._client_class.__init__).parameters
            skipped = {"host", "port", "connection_pool", "retry", "cache", "cache_config"}
            kwargs = {key: value for key, value in settings.items() if key in accepted and key not in skipped}
            if "SSL" in getattr(settings.get("connection_class"), "__name__", ""):
                kwargs["ssl"] = True  # the cluster's TLS, which a plain client takes as ssl=True
            client = self._client_class(host=address[0], port=address[1], **kwargs)
            client = self._node_clients.setdefault(address, client)  # (a thread may have made one too)
        return client

    def _take_flow(self, name: str, terms: Terms, cost: int) -> Flow[Taken]:
        return self._operation("take", name, terms, (cost,), parse_taken)

    def _try_start_flow(self, name: str, terms: Terms, ticket: int, lead_us: int, cost: int) -> Flow[Outcome]:
        return self._operation("try_start", name, terms, (ticket, lead_us, cost), parse_outcome)

    def _take_and_try_flow(self, name: str, terms: Terms, lead_us: int, cost: int) -> Flow[Outcome]:
        return self._operation("take_and_try", name, terms, (lead_us, cost), parse_outcome)

    def _retime_flow(self, name: str, terms: Terms, ticket: int, lead_us: int) -> Flow[Outcome]:
        return self._operation("retime", name, terms, (ticket, lead_us), parse_outcome)

    def _set_paused_flow(self, name: str, terms: Terms, paused: bool) -> Flow[bool]:
        return self._operation("set_paused", name, terms, (int(paused),), parse_changed)

    def _release_flow(self, name: str, terms: Terms, ticket: int) -> Flow[bool]:
        return self._operation("release", name, terms, (ticket,), parse_live)

    def _renew_flow(self, name: str, terms: Terms, ticket: int) -> Flow[bool]:
        return self._operation("renew", name, terms, (ticket,), parse_live)

    def _read_flow(self, name: str) -> Flow[Snapshot]:
        return self._operation("read", name, READ_TERMS, (), parse_snapshot)

    def _reset_flow(self, name: str) -> Flow[bool]:
        return bool((yield Call(self._client.delete, (self._prefix + name,))))

    def _names_flow(self, prefix: str) -> Flow[list[str]]:
        """The names of the keys under the state's prefix that begin with ``prefix`` (``SCAN MATCH``).

        Keys Redis has expired are not listed; a key SCAN meets twice (the
        keyspace was rehashed meanwhile) is listed once.
        """
        pattern = glob_escape(self._prefix + prefix) + "*"
        found: set[str] = set()
        if is_cluster(self._client):  # every master's keys
            for key in (yield Call(self._cluster_keys, (pattern,))):
                text = key.decode() if isinstance(key, bytes) else str(key)
                found.add(text[len(self._prefix) :])
            return list(found)
        kwargs = self._client.connection_pool.connection_kwargs
        encoding, errors = kwargs.get("encoding", "utf-8"), kwargs.get("encoding_errors", "strict")
        scan = functools.partial(self._client.scan, match=pattern, count=1000)
        cursor: int | str = 0
        while True:
            cursor, keys = yield Call(scan, (cursor,))
            for key in keys:
                text = key.decode(encoding, errors) if isinstance(key, bytes) else str(key)
                found.add(text[len(self._prefix) :])
            if int(cursor) == 0:
                return list(found)


class RedisState(RedisStateBase[redis.Redis], State):
    """Records kept in Redis hashes, changed only by a Lua script timed on the server's clock."""

    _client_class = redis.Redis
    _cluster_class = redis.cluster.RedisCluster
    _retry_class = Retry
    _lean_class = LeanScripts
    _lean: LeanScripts | None

    def close(self) -> None:
        if self._lean is not None:
            self._lean.close()  # the kept connections go back to the pool first
        for node in [*self._node_clients.values(), *self._retired_clients]:
            node.close()
        self._client.close()

    def _take(self, name: str, terms: Terms, cost: int) -> Taken:
        return run(self._take_flow(name, terms, cost))

    def _try_start(self, name: str, terms: Terms, ticket: int, lead_us: int, cost: int) -> Outcome:
        return run(self._try_start_flow(name, terms, ticket, lead_us, cost))

    def _take_and_try(self, name: str, terms: Terms, lead_us: int, cost: int) -> Outcome:
        return run(self._take_and_try_flow(name, terms, lead_us, cost))

    def _retime(self, name: str, terms: Terms, ticket: int, lead_us: int) -> Outcome:
        return run(self._retime_flow(name, terms, ticket, lead_us))

    def _set_paused(self, name: str, terms: Terms, paused: bool) -> bool:
        return run(self._set_paused_flow(name, terms, paused))

    def _release(self, name: str, terms: Terms, ticket: int) -> bool:
        return run(self._release_flow(name, terms, ticket))

    def _renew(self, name: str, terms: Terms, ticket: int) -> bool:
        return run(self._renew_flow(name, terms, ticket))

    def _read(self, name: str) -> Snapshot:
        return run(self._read_flow(name))

    def _reset(self, name: str) -> bool:
        return run(self._reset_flow(name))

    def _names(self, prefix: str) -> list[str]:
        return run(self._names_flow(prefix))

    def _sweep(self) -> int:
        return 0  # Redis deletes keys past their TTL itself

    def _cluster_keys(self, pattern: str) -> list[Any]:
        cluster: Any = self._client
        return list(cluster.scan_iter(match=pattern, count=1000))
