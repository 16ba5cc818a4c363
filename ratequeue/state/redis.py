"""``redis://`` and ``rediss://``: the protocol run atomically inside Redis, on its clock.

Each queue is one hash (``PREFIX + name``: ``ticket``, ``pos``, ``at``,
``interval``), so every operation touches a single key (ready for Redis
Cluster, though ``RedisCluster`` clients are not supported yet). Each
operation is one Lua script that reads the server's ``TIME`` itself, so hosts
whose clocks disagree still share one rate. Scripts are
sent by SHA and re-loaded when the server answers NOSCRIPT (after a restart
or ``SCRIPT FLUSH``).

A call is one ``EVALSHA``, packed by hand and sent over one of the client's
connections (:class:`LeanScripts`): redis-py connects, authenticates,
speaks TLS and parses the reply, while its per-command machinery, most of
the CPU of a call, is skipped. Clients it does not suit (one connection,
Sentinel, client-side caching, a connection class of the user's own) go
through redis-py's own ``Script`` calls instead.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import time
import weakref
from collections.abc import Callable
from typing import Any, NoReturn
from urllib.parse import quote, urlencode

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

try:
    from redis.credentials import StreamingCredentialProvider as _STREAMING
except ImportError:  # pragma: no cover - redis-py before 5.3: no re-authentication on release
    _STREAMING = None  # type: ignore[assignment, misc]

from ..errors import ConfigurationError, StateCorrupted, StateUnavailable
from ..protocol import NEVER, Outcome, Passed, Record, Started, Taken, Wait
from .base import MAX_US, Clock, Snapshot, State, check_interval_matches, check_record, split_options

__all__ = ["RedisState"]

#: the key prefix used unless one is given
DEFAULT_PREFIX = "ratequeue:"

# Reads the clock into `now`: the server's TIME, or ARGV[2] when a test fixes it.
_CLOCK = """
local now
if ARGV[2] == "" then
  local t = redis.call("TIME")
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
else
  now = tonumber(ARGV[2])
end
"""

# Shared head of every script. Reads the record into locals and the clock into `now`.
# KEYS[1]  the queue's hash
# ARGV[1]  the interval (us) the caller expects (a new record gets it)
# ARGV[2]  "" to read the server's TIME, or a fixed `now` in us (tests only)
# Returns early {"mismatch", stored interval} or {"corrupt", field} without writing.
_HEAD = (
    _CLOCK
    + """
local fields = redis.call("HMGET", KEYS[1], "ticket", "pos", "at", "interval")
local ticket, pos, at, interval
if fields[1] == false and fields[2] == false and fields[3] == false and fields[4] == false then
  ticket, pos, at, interval = 1, 0, __NEVER__, tonumber(ARGV[1])
else
  ticket, pos = tonumber(fields[1]), tonumber(fields[2])
  at, interval = tonumber(fields[3]), tonumber(fields[4])
  local names = {"ticket", "pos", "at", "interval"}
  local values = {ticket, pos, at, interval}
  for i = 1, 4 do
    if values[i] == nil or values[i] ~= math.floor(values[i]) then
      return {"corrupt", names[i], tostring(fields[i])}
    end
  end
  if not (0 <= pos and pos < ticket and ticket < __LIMIT__ and interval > 0 and interval < __LIMIT__
          and at >= __NEVER__ and at < __LIMIT__) then
    return {"corrupt", "ticket/pos/at/interval", table.concat(fields, "/")}
  end
  if interval ~= tonumber(ARGV[1]) then return {"mismatch", fields[4]} end
end
local function save()
  redis.call("HSET", KEYS[1], "ticket", string.format("%.0f", ticket), "pos", string.format("%.0f", pos),
    "at", string.format("%.0f", at), "interval", string.format("%.0f", interval))
end
local function take()
  local last = ticket - 1
  if last > pos and at + (last - pos) * interval + interval <= now then
    pos = last
  end
  local t = ticket
  ticket = ticket + 1
  return t
end
local function try_start(t, lead)
  if pos >= t or t >= ticket then return {"passed", t, pos, now} end
  local slot = at + (t - pos) * interval
  if now + lead >= slot then
    local start = math.max(slot, now)
    pos, at = t, start
    return {"started", t, start, now}
  end
  return {"wait", t, slot, now}
end
local function retime(t, lead)
  if pos ~= t or t >= ticket then return {"passed", t, pos, now} end
  at = math.max(at, now + lead)
  return {"started", t, at, now}
end
""".replace("__NEVER__", str(NEVER)).replace("__LIMIT__", str(MAX_US))
)

#: take: ARGV as in _HEAD. Returns {"taken", ticket, pos, at, now}.
TAKE_SCRIPT = (
    _HEAD
    + """
local t = take()
save()
return {"taken", t, pos, at, now}
"""
)

#: try_start: ARGV[3] the ticket, ARGV[4] the lead (us). Returns {kind, ticket, value, now}.
TRY_START_SCRIPT = (
    _HEAD
    + """
local answer = try_start(tonumber(ARGV[3]), tonumber(ARGV[4]))
save()
return answer
"""
)

#: take_and_try: ARGV[3] the lead (us). Returns {kind, ticket, value, now}.
TAKE_AND_TRY_SCRIPT = (
    _HEAD
    + """
local answer = try_start(take(), tonumber(ARGV[3]))
save()
return answer
"""
)

#: retime: ARGV[3] the ticket, ARGV[4] the lead (us). Returns {kind, ticket, value, now}.
RETIME_SCRIPT = (
    _HEAD
    + """
local answer = retime(tonumber(ARGV[3]), tonumber(ARGV[4]))
save()
return answer
"""
)

#: read: KEYS[1] the hash, ARGV[1] "" (test `now` in ARGV[2]). Returns {now, ticket, pos, at, interval}
#: with false for missing fields; never writes.
READ_SCRIPT = (
    _CLOCK
    + """
local fields = redis.call("HMGET", KEYS[1], "ticket", "pos", "at", "interval")
return {string.format("%.0f", now), fields[1], fields[2], fields[3], fields[4]}
"""
)


#: every script by the operation it runs
SCRIPTS: dict[str, str] = {
    "take": TAKE_SCRIPT,
    "try_start": TRY_START_SCRIPT,
    "take_and_try": TAKE_AND_TRY_SCRIPT,
    "retime": RETIME_SCRIPT,
    "read": READ_SCRIPT,
}

#: the SHA1 Redis knows each script by (EVALSHA)
SHAS: dict[str, str] = {name: hashlib.sha1(text.encode()).hexdigest() for name, text in SCRIPTS.items()}


def split_url(url: str) -> tuple[str, str]:
    """``url`` without ratequeue's own ``prefix`` option, and that prefix."""
    client_url, ours = split_options(url, "prefix")
    return client_url, ours.get("prefix", DEFAULT_PREFIX)


#: connection settings of the clients ratequeue creates: a short bounded retry, then an error
CLIENT_OPTIONS: dict[str, Any] = {"socket_connect_timeout": 5, "socket_timeout": 10}
#: how often a failed call (connection error or timeout) is retried before its error is raised
RETRIES = 8
#: the backoff between retries, as redis-py's ``ExponentialBackoff(cap=BACKOFF_CAP, base=BACKOFF_BASE)``
BACKOFF_BASE = 0.02
BACKOFF_CAP = 0.5


def retry_delay(failures: int) -> float:
    """Seconds to wait before retrying a script call that has failed ``failures`` times.

    The first retry goes at once: a connection that sat idle may simply have
    been closed by the server (a restart, a timeout, ``CLIENT KILL``), and a
    fresh one is all it takes. Later ones back off as the client's own retry
    does (``ExponentialBackoff(cap=0.5, base=0.02)``: 0.04 s, 0.08 s, ... 0.5 s).
    """
    return 0.0 if failures <= 1 else min(BACKOFF_CAP, BACKOFF_BASE * 2 ** (failures - 1))


def decode(reply: list[Any]) -> list[Any]:
    """A script's reply with bytes turned into text."""
    return [item.decode() if isinstance(item, bytes) else item for item in reply]


#: the answers of the try_start, take_and_try and retime scripts, as bytes or as text
#: (a client made with ``decode_responses=True``); the three take (ticket, value, now)
_OUTCOMES: dict[Any, Callable[[int, int, int], Outcome]] = {
    kind: cls
    for name, cls in (("started", Started), ("wait", Wait), ("passed", Passed))
    for kind in (name, name.encode())
}


def parse_taken(name: str, key: str, interval: int, reply: list[Any]) -> Taken:
    """The answer of TAKE_SCRIPT: ``{"taken", ticket, pos, at, now}``."""
    if reply[0] not in (b"taken", "taken"):
        _raise_for(name, key, interval, reply)
    return Taken(ticket=int(reply[1]), pos=int(reply[2]), at=int(reply[3]), now=int(reply[4]))


def parse_outcome(name: str, key: str, interval: int, reply: list[Any]) -> Outcome:
    """The answer of TRY_START, TAKE_AND_TRY or RETIME_SCRIPT: ``{kind, ticket, value, now}``."""
    make = _OUTCOMES.get(reply[0])
    if make is None:
        _raise_for(name, key, interval, reply)
    return make(int(reply[1]), int(reply[2]), int(reply[3]))


def parse_snapshot(key: str, reply: list[Any]) -> Snapshot:
    """The answer of READ_SCRIPT."""
    now, *fields = decode(reply)
    if all(field is None for field in fields):
        return Snapshot(record=None, now=int(now))
    try:
        values = dict(zip(("ticket", "pos", "at", "interval"), [int(f) for f in fields], strict=True))
    except (TypeError, ValueError) as exc:
        raise StateCorrupted(f"Redis hash {key} holds {fields!r}; want whole numbers", where=key) from exc
    record: Record = check_record(values, where=key)
    return Snapshot(record=record, now=int(now))


def unavailable(where: str, exc: Exception, key: str = "") -> StateUnavailable | StateCorrupted:
    """The error raised when Redis at ``where`` fails with ``exc`` (on ``key``)."""
    if isinstance(exc, redis.AuthenticationError):
        return StateUnavailable(f"Redis at {where} refused the credentials: {exc}", where=where)
    if isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
        return StateUnavailable(f"Redis at {where} is unreachable: {exc}", where=where)
    if isinstance(exc, redis.ResponseError) and str(exc).startswith("WRONGTYPE") and key:
        return StateCorrupted(f"Redis key {key} is not a hash: {exc}", where=key)
    return StateUnavailable(f"Redis at {where} failed: {exc}", where=where)


def register_scripts(client: Any) -> dict[str, Any]:
    """The scripts, registered with ``client`` (sent by SHA, re-loaded on NOSCRIPT)."""
    return {name: client.register_script(text) for name, text in SCRIPTS.items()}


def url_of(client: Any, prefix: str) -> str:
    """A URL that reconnects as ``client`` does: host or socket, db, credentials, TLS, prefix."""
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


def where_of(client: Any) -> str:
    """``host:port`` (or the socket path) a client connects to."""
    kwargs = client.connection_pool.connection_kwargs
    return str(kwargs.get("path") or f"{kwargs.get('host', '?')}:{kwargs.get('port', '?')}")


def _raise_for(name: str, key: str, interval: int, reply: list[Any]) -> NoReturn:
    reply = decode(reply)
    if reply[0] == "mismatch":
        try:
            stored = int(reply[1])
        except (TypeError, ValueError) as exc:
            raise StateCorrupted(f"Redis hash {key} has interval={reply[1]!r}", where=key) from exc
        check_interval_matches(name, stored, interval)
    if reply[0] == "corrupt":
        raise StateCorrupted(f"Redis hash {key} has {reply[1]}={reply[2]!r}; want a whole number", where=key)
    raise StateCorrupted(f"a ratequeue script on Redis hash {key} answered {reply!r}", where=key)


# ------------------------------------------------------------------ the lean call path

#: ARGV[2] when the script reads the server's clock: an empty bulk string
_SERVER_CLOCK = b"$0\r\n\r\n"


def _bulk(value: int) -> bytes:
    """``value`` as a RESP bulk string."""
    data = b"%d" % value
    return b"$%d\r\n%b\r\n" % (len(data), data)


class ScriptCommands:
    """``EVALSHA sha 1 key interval now ...`` in RESP, packed by hand.

    redis-py's packer handles every argument type and encoding option; the
    scripts' arguments are only a key and whole numbers, and the head of each
    command (script, key, interval) is the same call after call, so it is
    packed once and kept (for up to :attr:`MAX_HEADS` of them).
    """

    #: heads kept before the cache starts over (names are few; this bounds a process that makes many)
    MAX_HEADS = 1024

    def __init__(self, connection_kwargs: dict[str, Any]) -> None:
        """Encode keys as the client does (``encoding``, ``encoding_errors``)."""
        self._encoding = connection_kwargs.get("encoding", "utf-8")
        self._errors = connection_kwargs.get("encoding_errors", "strict")
        self._heads: dict[tuple[str, str, int], bytes] = {}

    def packed(self, script: str, key: str, interval: int, now: int | None, rest: tuple[int, ...]) -> bytes:
        """The command running ``script`` on ``key``: ARGV is ``interval``, ``now`` ("" if None), ``rest``."""
        head = self._heads.get((script, key, interval))
        if head is None:
            head = self._head(script, key, interval, len(rest))
        head += _SERVER_CLOCK if now is None else _bulk(now)
        for value in rest:
            head += _bulk(value)
        return head

    def _head(self, script: str, key: str, interval: int, more: int) -> bytes:
        encoded = key.encode(self._encoding, self._errors)
        head = b"*%d\r\n$7\r\nEVALSHA\r\n$40\r\n%b\r\n$1\r\n1\r\n$%d\r\n%b\r\n%b" % (
            6 + more,
            SHAS[script].encode(),
            len(encoded),
            encoded,
            _bulk(interval),
        )
        if len(self._heads) >= self.MAX_HEADS:
            self._heads.clear()
        self._heads[(script, key, interval)] = head
        return head


#: the pools and connections the lean calls know; others (Sentinel, cluster, a subclass) use redis-py's calls
_POOLS: tuple[type, ...] = (redis.ConnectionPool, redis.BlockingConnectionPool)
_CONNECTIONS: tuple[type, ...] = (redis.Connection, redis.SSLConnection, redis.UnixDomainSocketConnection)


def lean_pool(client: Any, pools: tuple[type, ...], connections: tuple[type, ...]) -> tuple[Any, bool] | None:
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
    return pool, not (_STREAMING is not None and isinstance(provider, _STREAMING))


def get_connection_args(pool: Any) -> tuple[str, ...]:
    """What ``pool.get_connection`` needs: nothing, or a command name before redis-py 5.3."""
    try:
        parameter = inspect.signature(pool.get_connection).parameters.get("command_name")
    except (TypeError, ValueError):  # pragma: no cover - a signature Python cannot read
        return ()
    return ("EVALSHA",) if parameter is not None and parameter.default is inspect.Parameter.empty else ()


def _release_all(pool: Any, idle: list[Any]) -> None:
    while idle:
        pool.release(idle.pop())


class LeanScripts:
    """The scripts sent straight over the client's connections: EVALSHA packed by hand, one reply read.

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
    * connections are kept in a free list of its own between calls (taking
      one from redis-py's pool and releasing it costs as much as the call's
      own packing and parsing): each call pops one, so no two threads share
      one; after a fork the child takes fresh ones; :meth:`close`, or the
      garbage collector, gives them back to the pool.
    """

    def __init__(self, pool: Any, *, keep: bool = True) -> None:
        """Take connections from ``pool``; with ``keep``, keep them between calls."""
        self._pool = pool
        self._keep = keep
        self._commands = ScriptCommands(pool.connection_kwargs)
        self._get_args = get_connection_args(pool)
        #: whether connections may be marked for a reconnect (RESP3 maintenance notifications, redis-py 7+)
        self._reconnects = hasattr(pool.connection_class, "should_reconnect")
        self._idle: list[Any] = []
        self._pid = os.getpid()
        self._finalizer = weakref.finalize(self, _release_all, pool, self._idle)
        self._finalizer.atexit = False

    @classmethod
    def of(cls, client: Any) -> LeanScripts | None:
        """Lean calls on ``client``'s pool, or ``None`` if it must use redis-py's (see :func:`lean_pool`)."""
        usable = lean_pool(client, _POOLS, _CONNECTIONS)
        return None if usable is None else cls(usable[0], keep=usable[1])

    def __call__(self, script: str, key: str, interval: int, now: int | None, rest: tuple[int, ...]) -> Any:
        """Run ``script`` on ``key``; raise redis-py's error when it fails for good."""
        packed = [self._commands.packed(script, key, interval, now, rest)]
        connection = self._take()
        failures = 0
        try:
            while True:
                try:
                    connection.send_packed_command(packed)
                    try:
                        reply = connection.read_response()
                    except redis.exceptions.NoScriptError:
                        reply = self._load_and_send(connection, script, packed)
                    break
                except (redis.ConnectionError, redis.TimeoutError):
                    connection.disconnect()
                    failures += 1
                    if failures > RETRIES:
                        raise
                    time.sleep(retry_delay(failures))
                    connection.connect()  # with the client's own retries; its failure ends the call
        except redis.ResponseError:
            self._give_back(connection)  # an error answer, read in full: the connection is fine
            raise
        except BaseException:
            connection.disconnect()  # an answer may still be on its way: never reuse the socket
            self._give_back(connection)
            raise
        self._give_back(connection)
        return reply

    def close(self) -> None:
        """Give the connections kept between calls back to the pool."""
        _release_all(self._pool, self._idle)

    @staticmethod
    def _load_and_send(connection: Any, script: str, packed: list[bytes]) -> Any:
        """Load ``script`` (the server answered NOSCRIPT) and send ``packed`` again."""
        connection.send_command("SCRIPT", "LOAD", SCRIPTS[script])
        connection.read_response()
        connection.send_packed_command(packed)
        return connection.read_response()

    def _take(self) -> Any:
        if self._pid != os.getpid():  # forked: the parent's sockets are not ours
            self._idle.clear()
            self._pid = os.getpid()
        try:
            return self._idle.pop()  # atomic: no two threads get one connection
        except IndexError:
            return self._pool.get_connection(*self._get_args)

    def _give_back(self, connection: Any) -> None:
        if not self._keep:
            self._pool.release(connection)
            return
        if self._reconnects and connection.should_reconnect():
            connection.disconnect()  # as the pool's release does: a maintenance notification asked for it
        self._idle.append(connection)


class RedisState(State):
    """Records kept in Redis hashes, changed only by Lua scripts timed on the server's clock."""

    def __init__(
        self,
        client: redis.Redis,
        *,
        prefix: str = DEFAULT_PREFIX,
        url: str | None = None,
        clock: Clock | None = None,
    ) -> None:
        """Use a ready ``redis.Redis`` client.

        :param prefix: put before every queue name to form its key.
        :param url: the URL to pickle limiters as (default: built from the client's host
            or socket, db, user, password and TLS; pass it when other options matter).
        :param clock: **for tests only**: a function returning ``now`` in whole
            microseconds, sent to every script in place of the server's ``TIME``.
        """
        if not isinstance(prefix, str):
            raise ConfigurationError(f"prefix must be a string, got {type(prefix).__name__}")
        self._client = client
        self._prefix = prefix
        self._clock = clock
        self._where = where_of(client)
        self.url = url or url_of(client, prefix)
        #: the lean calls, or None where redis-py's own script calls are needed
        self._lean = LeanScripts.of(client)
        self._scripts = register_scripts(client) if self._lean is None else {}

    @classmethod
    def from_url(cls, url: str) -> RedisState:
        """Open ``redis://[[user]:password@]host[:port][/db][?prefix=P&...]``, ``rediss://`` or ``unix://``.

        Query options other than ``prefix`` go to ``redis.Redis.from_url``
        (``ssl_cert_reqs``, ``socket_timeout``, ...).
        """
        client_url, prefix = split_url(url)
        try:
            client = redis.Redis.from_url(
                client_url,
                retry=Retry(ExponentialBackoff(cap=BACKOFF_CAP, base=BACKOFF_BASE), retries=RETRIES),
                retry_on_error=[redis.ConnectionError, redis.TimeoutError],
                **CLIENT_OPTIONS,
            )
        except (ValueError, TypeError) as exc:
            raise ConfigurationError(f"bad Redis URL {url!r}: {exc}") from exc
        return cls(client, prefix=prefix, url=url)

    @property
    def client(self) -> redis.Redis:
        """The Redis client in use."""
        return self._client

    def key(self, name: str) -> str:
        """The Redis key holding queue ``name``."""
        return self._prefix + name

    def close(self) -> None:
        if self._lean is not None:
            self._lean.close()  # the kept connections go back to the pool first
        self._client.close()

    def _run(self, script: str, key: str, interval: int, *rest: int) -> Any:
        now = None if self._clock is None else self._clock()
        try:
            if self._lean is not None:
                return self._lean(script, key, interval, now, rest)
            return self._scripts[script](keys=[key], args=[interval, "" if now is None else now, *rest])
        except redis.RedisError as exc:
            raise unavailable(self._where, exc, key) from exc

    def _take(self, name: str, interval: int) -> Taken:
        key = self._prefix + name
        return parse_taken(name, key, interval, self._run("take", key, interval))

    def _try_start(self, name: str, interval: int, ticket: int, lead: int) -> Outcome:
        key = self._prefix + name
        return parse_outcome(name, key, interval, self._run("try_start", key, interval, ticket, lead))

    def _take_and_try(self, name: str, interval: int, lead: int) -> Outcome:
        key = self._prefix + name
        return parse_outcome(name, key, interval, self._run("take_and_try", key, interval, lead))

    def _retime(self, name: str, interval: int, ticket: int, lead: int) -> Outcome:
        key = self._prefix + name
        return parse_outcome(name, key, interval, self._run("retime", key, interval, ticket, lead))

    def _read(self, name: str) -> Snapshot:
        key = self._prefix + name
        return parse_snapshot(key, self._run("read", key, 0))

    def _reset(self, name: str) -> bool:
        try:
            return bool(self._client.delete(self.key(name)))
        except redis.RedisError as exc:
            raise unavailable(self._where, exc) from exc
