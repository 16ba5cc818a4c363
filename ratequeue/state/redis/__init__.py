"""``redis://`` and ``rediss://``: the protocol run atomically inside Redis, on its clock.

Each queue is one hash, ``PREFIX + name``, holding every field of its record
(``script.lua``'s header lists them), so every operation touches a single
key, on one hash slot: a Redis Cluster (``redis+cluster://``, or a ready
``RedisCluster`` client) runs it on the master holding its slot, redis-py's
cluster client following MOVED and ASK and loading the script where a node
answers NOSCRIPT. Every operation is one call of one Lua script, which reads
the server's ``TIME`` itself, so hosts whose clocks disagree still share one
rate; the script is sent by SHA and loaded again after NOSCRIPT.

A write with a keep time sets the key's TTL in the same script (``PEXPIRE``,
relative to its ``now``), so Redis deletes an idle queue's key by itself; a
write without one clears it (``PERSIST``). ``names`` lists keys with ``SCAN``.

:class:`RedisBackend` is the state, written once as flows; :class:`RedisState`
runs it with redis-py's client in the calling thread, :class:`AsyncRedisState`
with its asyncio client. A call is one ``EVALSHA`` packed by hand and sent
over one of the client's connections (:mod:`.lean`); clients that does not
suit (one connection, Sentinel, client-side caching, a connection class of
the user's own) go through redis-py's own ``Script`` calls.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import threading
from collections.abc import Callable
from typing import Any, ClassVar, Generic, TypeVar, Union
from urllib.parse import quote, urlencode

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.cluster
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.client import NEVER_DECODE
from redis.commands.core import AsyncScript, Script
from redis.exceptions import NoScriptError
from redis.retry import Retry

from ..._redact import redact, scrub, secrets_kept_out
from ...core.flow import Call, Flow, Sleep
from ...core.operation import Operation, Terms
from ...core.protocol import Answer
from ...errors import ConfigurationError, RateQueueError, StateCorrupted, StateUnavailable
from .._retries import RetryLog
from ..base import AsyncState, Clock, Snapshot, State, StateBase, split_options
from .codec import (
    PARSERS,
    READ_ARGUMENTS,
    READ_TERMS,
    SCRIPT,
    Parser,
    arguments,
    glob_escape,
    parse_snapshot,
    script_args,
)
from .freed import FreedListener, channel_of
from .lean import (
    BACKOFF_BASE,
    BACKOFF_CAP,
    RETRIES,
    AsyncLeanScripts,
    LeanCalls,
    LeanScripts,
    pool_where,
    retry_delay,
)

__all__ = ["AsyncRedisState", "RedisBackend", "RedisState"]

#: writes retried on a cluster after a connection failure, writes short of their replicas (WARNING)
_log = logging.getLogger("ratequeue.state.redis")

#: what makes redis-py hand a reply over as bytes, whatever the client's ``decode_responses``
_RAW: dict[str, Any] = {NEVER_DECODE: True}

#: the key prefix used unless one is given
DEFAULT_PREFIX = "ratequeue:"

#: seconds the clients ratequeue creates wait to connect, and for a reply (then a bounded retry, an error)
CONNECT_TIMEOUT = 5.0
SOCKET_TIMEOUT = 10.0
_TIMEOUTS: dict[str, Any] = {"socket_connect_timeout": CONNECT_TIMEOUT, "socket_timeout": SOCKET_TIMEOUT}

#: a redis-py client of either kind
Client = Union[redis.Redis, redis.asyncio.Redis]

#: the URL scheme of a Redis Cluster state (the client reaches it by ``redis://`` or ``rediss://``)
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


def is_cluster(client: object) -> bool:
    """Whether ``client`` is a redis-py cluster client (sync or asyncio)."""
    return isinstance(client, (redis.cluster.RedisCluster, redis.asyncio.cluster.RedisCluster))


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
    cluster: Any = client if is_cluster(client) else None
    pool: Any = client.connection_pool if cluster is None else cluster.nodes_manager
    kwargs = pool.connection_kwargs
    user, password = kwargs.get("username") or "", kwargs.get("password")
    auth = f"{quote(user, safe='')}:{quote(password, safe='')}@" if password else ""
    options: dict[str, Any] = {"prefix": prefix}
    if wait:
        options.update(wait=wait, wait_timeout=wait_timeout_ms)
    if cluster is not None:
        tls = kwargs.get("ssl") or "SSL" in str(kwargs.get("connection_class"))
        node = _first_node(cluster)
        return f"{'rediss' if tls else 'redis'}+cluster://{auth}{node.host}:{node.port}?{urlencode(options)}"
    if kwargs.get("path"):
        return f"unix://{auth}{kwargs['path']}?{urlencode({'db': kwargs.get('db', 0), **options})}"
    scheme = "rediss" if "SSL" in getattr(pool, "connection_class", type(None)).__name__ else "redis"
    host = f"{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}"
    return f"{scheme}://{auth}{host}/{kwargs.get('db', 0)}?{urlencode(options)}"


def _first_node(cluster: Any) -> Any:
    """A cluster client's default node, or its first seed (all an asyncio one knows before its first call)."""
    nodes = cluster.get_nodes() or list(cluster.nodes_manager.startup_nodes.values())
    return cluster.get_default_node() or nodes[0]


def _master_of(cluster: Any, key: str) -> tuple[str, int]:
    """The address of the master a cluster client sends ``key`` to."""
    node = cluster.get_node_from_key(key)
    return node.host, node.port


def where_of(client: Client) -> str:
    """``host:port`` (or the socket path) a client connects to; a cluster's first node."""
    if is_cluster(client):
        node = _first_node(client)
        return f"cluster {node.host}:{node.port}"
    return pool_where(client.connection_pool.connection_kwargs)


# ------------------------------------------------------------------ the states

C = TypeVar("C", redis.Redis, redis.asyncio.Redis)
R = TypeVar("R")
S = TypeVar("S", bound="RedisBackend[Any]")


class RedisBackend(StateBase, Generic[C]):
    """The Redis state, for both APIs: constructor, :meth:`from_url`, errors, every entry point as a flow."""

    _client_errors = (redis.RedisError, redis.exceptions.RedisClusterException)

    #: the client :meth:`from_url` makes, its retry, and the lean calls on it: each form's own
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
            that fewer replicas confirm within ``wait_timeout_ms`` logs a warning and its
            answer stands (it was made on the master). On a cluster, the pair
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
        #: hears of places freed elsewhere (made at the first watch), and what guards its making
        self._freed: FreedListener | None = None
        self._freed_guard = threading.Lock()

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
        with secrets_kept_out(url):
            try:
                client: Any
                if cluster is not None:
                    client = cls._cluster_class.from_url(f"{cluster}://{rest}", **_TIMEOUTS)
                else:
                    backoff = ExponentialBackoff(cap=BACKOFF_CAP, base=BACKOFF_BASE)
                    client = cls._client_class.from_url(
                        client_url,
                        retry=cls._retry_class(backoff, retries=RETRIES),
                        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
                        **_TIMEOUTS,
                    )
            except (ValueError, TypeError) as exc:
                what = "Redis" if cluster is None else "Redis Cluster"
                raise ConfigurationError(f"bad {what} URL {redact(url)!r}: {scrub(str(exc), url)}") from exc
            except (redis.exceptions.RedisClusterException, redis.RedisError) as exc:
                if cluster is None:
                    raise
                where = redact(url)
                message = scrub(str(exc), url)
                raise StateUnavailable(f"Redis Cluster at {where} is down: {message}", where=where) from exc
            return cls(client, prefix=prefix, url=url, wait=wait, wait_timeout_ms=wait_timeout_ms)

    @property
    def client(self) -> C:
        """The Redis client in use."""
        return self._client

    def key(self, name: str) -> str:
        """The Redis key holding queue ``name``."""
        return self._prefix + name

    def watch(self, name: str, freed: Callable[[], None]) -> Callable[[], None] | None:
        """As :meth:`ratequeue.state.State.watch`: by pub/sub, on the channel ``KEY#freed`` (:mod:`.freed`).

        ``None`` on a Redis Cluster (its waiters recheck every ``FULL_RECHECK_US``).
        """
        listener = self._freed_listener()
        return None if listener is None else listener.watch(channel_of(self._prefix + name), freed)

    def _freed_listener(self) -> FreedListener | None:
        """This process's listener for freed places, made at first use; ``None`` on a cluster."""
        listener = self._freed
        if listener is None or listener.pid != os.getpid():
            if is_cluster(self._client):
                return None
            with self._freed_guard:
                listener = self._freed
                if listener is None or listener.pid != os.getpid():
                    listener = self._freed = FreedListener(self._pubsub_maker(), self._where)
        return listener

    def _pubsub_maker(self) -> Callable[[], Any]:
        """What makes the listener's pub/sub connection: a thread-API ``PubSub``, unconnected."""
        raise NotImplementedError

    def _keys(self, pattern: str) -> Any:
        """The keys matching ``pattern`` (bytes), by ``SCAN`` (every master of a cluster); asyncio: async."""
        raise NotImplementedError

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

    def _execute_flow(self, op: Operation) -> Flow[Answer]:
        return self._script_flow(op.kind, op.name, op.terms, arguments(op), PARSERS[op.kind])

    def _read_flow(self, name: str) -> Flow[Snapshot]:
        return self._script_flow("read", name, READ_TERMS, READ_ARGUMENTS, parse_snapshot)

    def _script_flow(
        self, kind: str, name: str, terms: Terms, args: tuple[int | bytes, ...], parse: Parser[R]
    ) -> Flow[R]:
        """Run the script's ``kind`` on queue ``name``; its reply read by ``parse``, a parser of the codec."""
        key = self._prefix + name
        now_us = None if self._clock is None else self._clock()
        if self._lean is not None:
            reply = yield Call(self._lean, (self._lean.commands.packed(kind, key, terms, now_us, args),))
        elif self._wait and kind != "read":
            reply = yield from self._waited(key, script_args(kind, terms, now_us, args))
        else:
            reply = yield Call(self._script, ([key], script_args(kind, terms, now_us, args)))
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
        address = self._moved.get(key) or (None if cluster is None else _master_of(cluster, key))
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
                if address in self._node_clients:  # stop using it (it is closed with the state)
                    self._retired_clients.append(self._node_clients.pop(address))
                yield Call(cluster.exists, (key,))
                address, asking, loaded = _master_of(cluster, key), False, False
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

    def _reset_flow(self, name: str) -> Flow[bool]:
        return bool((yield Call(self._client.delete, (self._prefix + name,))))

    def _names_flow(self, prefix: str) -> Flow[list[str]]:
        """The names of the keys under the state's prefix that begin with ``prefix`` (``SCAN MATCH``).

        Keys Redis has expired are not listed; a key SCAN meets twice (the
        keyspace was rehashed meanwhile) is listed once. The keys are read
        as bytes and decoded as the client encodes names (a cluster's as
        UTF-8); a byte that does not decode becomes a lone surrogate
        (``\\xff`` is ``\\udcff``: PEP 383's ``surrogateescape``), so that
        a key another program wrote is listed, as no queue name can be.
        """
        pattern = glob_escape(self._prefix + prefix) + "*"
        keys = yield Call(self._keys, (pattern,))
        kwargs = {} if is_cluster(self._client) else self._client.connection_pool.connection_kwargs
        texts = (key.decode(kwargs.get("encoding", "utf-8"), "surrogateescape") for key in keys)
        return list({text[len(self._prefix) :] for text in texts})

    def _sweep_flow(self) -> Flow[int]:
        yield from ()
        return 0  # Redis deletes keys past their TTL itself


class RedisState(RedisBackend[redis.Redis], State):
    """Records kept in Redis hashes, changed only by a Lua script timed on the server's clock."""

    #: fair queues' operations run in the script too (protocol.enqueue, try_turn, enqueue_and_try)
    fair_queues = True

    _client_class = redis.Redis
    _cluster_class = redis.cluster.RedisCluster
    _retry_class = Retry
    _lean_class = LeanScripts

    def close(self) -> None:
        if self._freed is not None:
            self._freed.close()
        if self._lean is not None:
            self._lean.close()  # the kept connections go back to the pool first
        for node in [*self._node_clients.values(), *self._retired_clients]:
            node.close()
        self._client.close()

    def _pubsub_maker(self) -> Callable[[], Any]:
        return self._client.pubsub

    def _keys(self, pattern: str) -> list[Any]:
        client: Any = self._client
        return list(client.scan_iter(match=pattern, count=1000, **_RAW))


class AsyncRedisState(RedisBackend[redis.asyncio.Redis], AsyncState):
    """:class:`RedisState` on ``redis.asyncio``.

    Close it when done (``await state.close()``, or ``async with``).
    """

    #: as :attr:`RedisState.fair_queues`
    fair_queues = True

    _client_class = redis.asyncio.Redis
    _cluster_class = redis.asyncio.cluster.RedisCluster
    _retry_class = AsyncRetry
    _lean_class = AsyncLeanScripts

    #: the thread-API client the listener of freed places connects with (made with it)
    _listener_client: redis.Redis | None = None

    async def close(self) -> None:
        if self._freed is not None:
            await asyncio.to_thread(self._freed.close)
        if self._listener_client is not None:
            self._listener_client.close()
        lean: Any = self._lean
        if lean is not None:
            await lean.close()  # the kept connections go back to the pool first
        for node in [*self._node_clients.values(), *self._retired_clients]:
            await node.aclose()
        await self._client.aclose()

    def _pubsub_maker(self) -> Callable[[], Any]:
        # The listener is a thread (its messages reach the loop by the driver's from_any_thread):
        # it connects with a thread-API client made from the state's URL.
        client = self._listener_client = redis.Redis.from_url(split_url(self.url)[0], **_TIMEOUTS)
        return client.pubsub

    async def _keys(self, pattern: str) -> list[Any]:
        client: Any = self._client
        return [key async for key in client.scan_iter(match=pattern, count=1000, **_RAW)]
