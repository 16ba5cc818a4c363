"""``redis://`` and ``rediss://``: the protocol run atomically inside Redis, on its clock.

Each queue is one hash (``PREFIX + name``: ``ticket``, ``pos``, ``at``,
``interval``), so every operation touches a single key (ready for Redis
Cluster, though ``RedisCluster`` clients are not supported yet). Each
operation is one Lua script that reads the server's ``TIME`` itself, so hosts
whose clocks disagree still share one rate. Scripts are
sent by SHA and re-loaded when the server answers NOSCRIPT (after a restart
or ``SCRIPT FLUSH``).
"""

from __future__ import annotations

import os
import time
from typing import Any
from urllib.parse import quote, urlencode

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

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


def split_url(url: str) -> tuple[str, str]:
    """``url`` without ratequeue's own ``prefix`` option, and that prefix."""
    client_url, ours = split_options(url, "prefix")
    return client_url, ours.get("prefix", DEFAULT_PREFIX)


#: connection settings of the clients ratequeue creates: a short bounded retry, then an error
CLIENT_OPTIONS: dict[str, Any] = {"socket_connect_timeout": 5, "socket_timeout": 10}
RETRIES = 8


def script_args(interval: int, clock: Clock | None, *rest: int) -> list[Any]:
    """The ARGV of a script: the interval, the test clock's ``now`` (or ""), then ``rest``."""
    return [interval, "" if clock is None else clock(), *rest]


def decode(reply: list[Any]) -> list[Any]:
    """A script's reply with bytes turned into text."""
    return [item.decode() if isinstance(item, bytes) else item for item in reply]


def parse_taken(name: str, key: str, interval: int, reply: list[Any]) -> Taken:
    """The answer of TAKE_SCRIPT."""
    _raise_for(name, key, interval, reply)
    return Taken(ticket=int(reply[1]), pos=int(reply[2]), at=int(reply[3]), now=int(reply[4]))


def parse_outcome(name: str, key: str, interval: int, reply: list[Any]) -> Outcome:
    """The answer of TRY_START_SCRIPT or TAKE_AND_TRY_SCRIPT."""
    _raise_for(name, key, interval, reply)
    kind, ticket, value, now = reply[0], int(reply[1]), int(reply[2]), int(reply[3])
    if kind == "started":
        return Started(ticket=ticket, start=value, now=now)
    if kind == "wait":
        return Wait(ticket=ticket, slot=value, now=now)
    return Passed(ticket=ticket, pos=value, now=now)


def parse_snapshot(key: str, reply: list[Any]) -> Snapshot:
    """The answer of READ_SCRIPT."""
    now, *fields = reply
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
    scripts = {
        "take": TAKE_SCRIPT,
        "try_start": TRY_START_SCRIPT,
        "take_and_try": TAKE_AND_TRY_SCRIPT,
        "retime": RETIME_SCRIPT,
        "read": READ_SCRIPT,
    }
    return {name: client.register_script(text) for name, text in scripts.items()}


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


def _raise_for(name: str, key: str, interval: int, reply: list[Any]) -> None:
    if reply[0] == "mismatch":
        try:
            stored = int(reply[1])
        except (TypeError, ValueError) as exc:
            raise StateCorrupted(f"Redis hash {key} has interval={reply[1]!r}", where=key) from exc
        check_interval_matches(name, stored, interval)
    if reply[0] == "corrupt":
        raise StateCorrupted(f"Redis hash {key} has {reply[1]}={reply[2]!r}; want a whole number", where=key)


def pack_command(*parts: bytes | str | int) -> list[bytes]:
    """One command in RESP, ready for ``Connection.send_packed_command``.

    redis-py's own packer handles every argument type and encoding option;
    the scripts' arguments are only names, numbers and "", and packing them
    here costs a fraction of the CPU.
    """
    chunks = [b"*%d\r\n" % len(parts)]
    for part in parts:
        data = part if isinstance(part, bytes) else str(part).encode()
        chunks.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return [b"".join(chunks)]


class LeanScripts:
    """The scripts sent straight over a pooled connection: EVALSHA packed by hand, one reply read.

    redis-py's ``Script`` call goes through the client's command machinery
    (argument packing, retry wrapper, response callbacks), which was most of
    the CPU of a start. This keeps redis-py's connections, handshake, TLS and
    reply parser, and does the rest itself: a connection error or timeout is
    retried with backoff on a fresh connection, as the client's own retry
    does; NOSCRIPT (after a restart or SCRIPT FLUSH) loads the script and
    sends it again. Connections taken from the client's pool are kept in a
    free list of its own between calls (taking one from redis-py's pool
    costs as much as the call's own packing and parsing); after a fork the
    child takes fresh ones, as redis-py's pool does.
    """

    def __init__(self, client: redis.Redis, scripts: dict[str, Any]) -> None:
        self._client = client
        self._pool = client.connection_pool
        self._scripts = scripts
        self._idle: list[Any] = []
        self._pid = os.getpid()

    def _take(self) -> Any:
        if self._pid != os.getpid():  # forked: the parent's sockets are not ours
            self._idle, self._pid = [], os.getpid()
        try:
            return self._idle.pop()  # atomic under the GIL: no two threads get one connection
        except IndexError:
            return self._pool.get_connection()

    def __call__(self, script: str, key: str, args: list[Any]) -> Any:
        """Run ``script`` on ``key`` with ``args``; raise redis-py's errors when it fails for good."""
        registered = self._scripts[script]
        packed = pack_command(b"EVALSHA", registered.sha, 1, key, *args)
        delay = 0.02
        for attempt in range(RETRIES + 1):
            connection = self._take()
            try:
                connection.send_packed_command(packed)
                reply = connection.read_response()
            except redis.exceptions.NoScriptError:
                self._idle.append(connection)
                self._client.script_load(registered.script)
            except (redis.ConnectionError, redis.TimeoutError):
                connection.disconnect()
                self._pool.release(connection)
                if attempt == RETRIES:
                    raise
                time.sleep(delay)
                delay = min(delay * 2, 0.5)
            except redis.ResponseError:
                self._idle.append(connection)  # an error answer, read in full: the connection is fine
                raise
            except BaseException:
                connection.disconnect()  # an answer may still be on its way: never reuse it
                self._pool.release(connection)
                raise
            else:
                self._idle.append(connection)
                return reply
        raise redis.ConnectionError(f"no answer after {RETRIES + 1} attempts")  # pragma: no cover


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
        self._scripts = register_scripts(client)
        # a single-connection client has no pool to take connections from
        self._lean = LeanScripts(client, self._scripts) if client.connection is None else None

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
                retry=Retry(ExponentialBackoff(cap=0.5, base=0.02), retries=RETRIES),
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
        self._client.close()  # also disconnects the connections the lean calls keep

    def _run(self, script: str, name: str, args: list[Any]) -> list[Any]:
        try:
            if self._lean is not None:
                return decode(self._lean(script, self.key(name), args))
            return decode(self._scripts[script](keys=[self.key(name)], args=args))
        except redis.RedisError as exc:
            raise unavailable(self._where, exc, self.key(name)) from exc

    def _take(self, name: str, interval: int) -> Taken:
        reply = self._run("take", name, script_args(interval, self._clock))
        return parse_taken(name, self.key(name), interval, reply)

    def _try_start(self, name: str, interval: int, ticket: int, lead: int) -> Outcome:
        reply = self._run("try_start", name, script_args(interval, self._clock, ticket, lead))
        return parse_outcome(name, self.key(name), interval, reply)

    def _take_and_try(self, name: str, interval: int, lead: int) -> Outcome:
        reply = self._run("take_and_try", name, script_args(interval, self._clock, lead))
        return parse_outcome(name, self.key(name), interval, reply)

    def _retime(self, name: str, interval: int, ticket: int, lead: int) -> Outcome:
        reply = self._run("retime", name, script_args(interval, self._clock, ticket, lead))
        return parse_outcome(name, self.key(name), interval, reply)

    def _read(self, name: str) -> Snapshot:
        return parse_snapshot(self.key(name), self._run("read", name, script_args(0, self._clock)))

    def _reset(self, name: str) -> bool:
        try:
            return bool(self._client.delete(self.key(name)))
        except redis.RedisError as exc:
            raise unavailable(self._where, exc) from exc
