"""A strict rate-limit referee: an HTTP/1.1 service standing in for a third-party API with a hard limit.

It accepts a call only if the call *arrives* at least ``interval - tolerance``
seconds after the previously *accepted* call (no burst; ``tolerance`` is 0 by
default), and answers ``429 Too Many Requests`` otherwise (``200`` when it
accepts). Rejected calls do not move the reference point. Every arrival is
recorded: its time, whether it was accepted, and the caller's optional tag.

"Arrives" means what the service sees, not when a busy Python process gets
round to reading the bytes: on Linux every accepted socket has
``SO_TIMESTAMPNS`` set, and each read takes the kernel's receive timestamp
(``CLOCK_REALTIME``) from ``recvmsg``'s ancillary data. On loopback the kernel
stamps a segment as the sender hands it to the network stack. Where the
kernel gives no timestamp, the read's ``time.time()`` is used instead and
``/stats`` says so (``timestamps`` and ``fallback_stamped``). A request takes
the timestamp of the read that completed it. All requests read in one pass
of the (single-threaded ``selectors``) loop are decided in timestamp order,
so a referee that stalls does not invert the order of the calls it judges;
a call stamped earlier than the last accepted one is rejected.

Endpoints:

* ``GET /call[?who=TAG]`` (or ``POST``): ``200`` or ``429``, a tiny text body;
* ``GET /stats``: JSON ``{"interval", "tolerance", "accepted", "rejected",
  "arrivals": [[t, accepted, who], ...], "arrivals_ns", "clock",
  "timestamps", "kernel_stamped", "fallback_stamped"}``, ``t`` in seconds
  of ``CLOCK_REALTIME`` (``arrivals_ns``: the same in integer nanoseconds),
  arrivals in the order they were decided;
* ``POST /reset?interval=S&tolerance=S`` (or ``GET``; each parameter
  optional, the current value kept): clears every arrival and counter.

Connections are kept alive (HTTP/1.1 default; ``Connection: close`` is
honoured, HTTP/1.0 closes unless it asks for keep-alive). Request bodies
with ``Content-Length`` are read and ignored; a malformed request, or one
with ``Transfer-Encoding``, gets ``400`` and its connection is closed.

Run standalone::

    python bench/referee.py --interval 0.01 --tolerance 0 --port 8099

or from Python (the referee then runs in a separate process, so that the
caller's GIL does not disturb its timing)::

    with Referee(interval=0.01) as referee:
        client = RefereeClient(referee.url)
        client.call("p1")  # 200
        referee.stats().rejected
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import math
import os
import platform
import select
import selectors
import signal
import socket
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, NamedTuple
from urllib.parse import parse_qs, quote, urlsplit

__all__ = ["Arrival", "Referee", "RefereeClient", "RefereeStats", "serve"]

#: ``SO_TIMESTAMPNS`` (= ``SCM_TIMESTAMPNS``) in Linux's generic socket ABI; Python does not export it
_SO_TIMESTAMPNS = 35
#: architectures whose Linux socket ABI numbers the option differently
_OTHER_ABI = ("alpha", "parisc", "sparc", "mips")
#: bytes of the ancillary data ``recvmsg`` may return: one ``struct timespec`` (two 64-bit longs)
_CMSG_SPACE = socket.CMSG_SPACE(16) if hasattr(socket, "CMSG_SPACE") else 0
#: the longest request head accepted, in bytes
_MAX_HEAD = 64 * 1024
#: the longest request body accepted, in bytes
_MAX_BODY = 1024 * 1024
#: how often (s) the loop wakes up to check that the process that started it is alive
_WAKE = 0.5
#: the first line the referee prints on standard output once it listens
_READY = "referee listening on "


# --------------------------------------------------------------------------- the service


def _kernel_timestamps_possible() -> bool:
    """Whether this platform is one where ``SO_TIMESTAMPNS`` is option 35 (Linux, generic ABI)."""
    return sys.platform.startswith("linux") and not platform.machine().lower().startswith(_OTHER_ABI)


@dataclass(eq=False)
class _Connection:
    """One client connection: its buffers and state."""

    sock: socket.socket
    inbuf: bytearray = field(default_factory=bytearray)
    outbuf: bytearray = field(default_factory=bytearray)
    #: close once ``outbuf`` is sent (``Connection: close``, HTTP/1.0, a bad request, or EOF)
    close_after: bool = False
    #: no more requests are parsed from this connection (after a bad request or EOF)
    done_reading: bool = False
    closed: bool = False


@dataclass
class _Request:
    """A complete request read in this pass of the loop, with its arrival time (ns, CLOCK_REALTIME)."""

    t_ns: int
    conn: _Connection
    method: str = ""
    target: str = ""
    keep_alive: bool = True
    #: whether ``t_ns`` is the kernel's receive timestamp (else ``time.time()`` when read)
    kernel: bool = True
    #: why the request is malformed, if it is
    bad: str | None = None


_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    429: "Too Many Requests",
}


class _Service:
    """The referee's loop: one listening socket, keep-alive connections, decisions in timestamp order."""

    def __init__(self, host: str, port: int, interval: float, tolerance: float, parent: int | None) -> None:
        self.interval, self.tolerance = _check_settings(interval, tolerance)
        self.parent = parent
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.kernel = False
        self.why_not = "not Linux (generic socket ABI)"
        if _kernel_timestamps_possible():
            try:
                # set on the listener too: it enables kernel stamping before the first connection,
                # and accepted sockets inherit the flag (data sent before accept() is stamped)
                self.listener.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)
                self.kernel = True
            except OSError as exc:
                self.why_not = f"setsockopt(SO_TIMESTAMPNS) failed: {exc}"
        self.listener.bind((host, port))
        self.listener.listen(128)
        self.listener.setblocking(False)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ, None)
        self.connections: set[_Connection] = set()
        self._clear()

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.listener.getsockname()[:2]
        return str(host), int(port)

    def _clear(self) -> None:
        self.interval_ns = round(self.interval * 1e9)
        self.tolerance_ns = round(self.tolerance * 1e9)
        self.last_accepted_ns: int | None = None
        self.arrivals: list[tuple[int, bool, str | None]] = []
        self.accepted = 0
        self.rejected = 0
        self.kernel_stamped = 0
        self.fallback_stamped = 0

    # ------------------------------------------------------------------ loop

    def serve(self) -> None:
        """Serve until SIGTERM / SIGINT, or until the parent process (if given) is gone."""
        try:
            while True:
                events = self.selector.select(_WAKE)
                if self.parent is not None and os.getppid() != self.parent:
                    return
                pending: list[_Request] = []
                for key, mask in events:
                    if key.data is None:
                        self._accept()
                        continue
                    conn: _Connection = key.data
                    if mask & selectors.EVENT_READ:
                        self._read(conn, pending)
                    if mask & selectors.EVENT_WRITE:
                        self._flush(conn)
                pending.sort(key=lambda request: request.t_ns)  # stable: one connection's order is kept
                for request in pending:
                    self._handle(request)
                for conn in {request.conn for request in pending}:
                    self._flush(conn)
                for conn in [c for c in self.connections if c.done_reading and not c.outbuf]:
                    self._close(conn)
        finally:
            for conn in list(self.connections):
                self._close(conn)
            self.selector.close()
            self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # e.g. the client reset it already
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.kernel:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)
            conn = _Connection(sock)
            self.connections.add(conn)
            self.selector.register(sock, selectors.EVENT_READ, conn)

    def _read(self, conn: _Connection, pending: list[_Request]) -> None:
        try:
            if self.kernel:
                data, ancillary, _, _ = conn.sock.recvmsg(65536, _CMSG_SPACE)
            else:
                data, ancillary = conn.sock.recv(65536), []
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        t_ns = None
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == _SO_TIMESTAMPNS and len(payload) >= 16:
                seconds, nanoseconds = struct.unpack("qq", payload[:16])
                t_ns = seconds * 1_000_000_000 + nanoseconds
        if not data:  # the client closed its side: finish sending what it asked for, then close
            conn.done_reading = True
            conn.close_after = True
            conn.inbuf.clear()
            self._flush(conn)
            return
        kernel = t_ns is not None
        if t_ns is None:
            t_ns = time.time_ns()
        if conn.done_reading:
            return  # after a bad request or Connection: close, whatever follows is ignored
        conn.inbuf += data
        for request in self._parse(conn, t_ns):
            request.kernel = kernel
            pending.append(request)

    def _parse(self, conn: _Connection, t_ns: int) -> list[_Request]:
        """The complete requests in ``conn.inbuf`` (consumed), stopping after a malformed one."""
        requests: list[_Request] = []
        while not conn.done_reading:
            end = conn.inbuf.find(b"\r\n\r\n")
            if end < 0:
                if len(conn.inbuf) > _MAX_HEAD:
                    requests.append(self._bad(conn, t_ns, "request head too long"))
                break
            try:
                request, length = self._head(conn, t_ns, bytes(conn.inbuf[:end]).decode("latin-1"))
            except ValueError as exc:
                requests.append(self._bad(conn, t_ns, str(exc)))
                break
            if len(conn.inbuf) < end + 4 + length:
                break  # the body is not all here yet
            del conn.inbuf[: end + 4 + length]
            if not request.keep_alive:
                conn.done_reading = True
            requests.append(request)
        return requests

    @staticmethod
    def _head(conn: _Connection, t_ns: int, head: str) -> tuple[_Request, int]:
        """Parse a request head; return the request and its body's length. Raises ``ValueError``."""
        lines = head.split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[0].isalpha() or not parts[1].startswith("/"):
            raise ValueError(f"malformed request line {lines[0][:100]!r}")
        method, target, version = parts
        if version not in ("HTTP/1.1", "HTTP/1.0"):
            raise ValueError(f"unsupported protocol {version[:20]!r}")
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, colon, value = line.partition(":")
            if not colon or not name or name != name.strip():
                raise ValueError(f"malformed header line {line[:100]!r}")
            headers[name.lower()] = value.strip()
        if "transfer-encoding" in headers:
            raise ValueError("Transfer-Encoding is not supported; send Content-Length")
        length_text = headers.get("content-length", "0")
        if not length_text.isdigit() or int(length_text) > _MAX_BODY:
            raise ValueError(f"bad Content-Length {length_text[:30]!r}")
        tokens = {token.strip().lower() for token in headers.get("connection", "").split(",")}
        keep_alive = "close" not in tokens if version == "HTTP/1.1" else "keep-alive" in tokens
        return _Request(t_ns, conn, method, target, keep_alive), int(length_text)

    @staticmethod
    def _bad(conn: _Connection, t_ns: int, why: str) -> _Request:
        conn.done_reading = True
        conn.inbuf.clear()
        return _Request(t_ns, conn, keep_alive=False, bad=why)

    # ------------------------------------------------------------------ decisions

    def _handle(self, request: _Request) -> None:
        conn = request.conn
        if request.bad is not None:
            self._respond(conn, 400, request.bad + "\n", close=True)
            return
        parts = urlsplit(request.target)
        query = parse_qs(parts.query, keep_blank_values=True)
        close = not request.keep_alive
        if parts.path == "/call":
            if request.method not in ("GET", "POST"):
                self._respond(conn, 405, "use GET or POST\n", close=close)
                return
            who = query.get("who", [None])[-1]
            if request.kernel:
                self.kernel_stamped += 1
            else:
                self.fallback_stamped += 1
            accepted = self._decide(request.t_ns, who)
            self._respond(conn, 200 if accepted else 429, "ok\n" if accepted else "too soon\n", close=close)
        elif parts.path == "/stats":
            if request.method != "GET":
                self._respond(conn, 405, "use GET\n", close=close)
                return
            self._respond(conn, 200, json.dumps(self.stats()), close=close, kind="application/json")
        elif parts.path == "/reset":
            if request.method not in ("GET", "POST"):
                self._respond(conn, 405, "use POST or GET\n", close=close)
                return
            try:
                interval = float(query["interval"][-1]) if "interval" in query else self.interval
                tolerance = float(query["tolerance"][-1]) if "tolerance" in query else self.tolerance
                self.interval, self.tolerance = _check_settings(interval, tolerance)
            except ValueError as exc:
                self._respond(conn, 400, f"{exc}\n", close=close)
                return
            self._clear()
            body = json.dumps({"interval": self.interval, "tolerance": self.tolerance})
            self._respond(conn, 200, body, close=close, kind="application/json")
        else:
            self._respond(conn, 404, "endpoints: /call, /stats, /reset\n", close=close)

    def _decide(self, t_ns: int, who: str | None) -> bool:
        """Accept a call at ``t_ns`` iff it is ``interval - tolerance`` or more after the last accepted."""
        last = self.last_accepted_ns
        accepted = last is None or t_ns - last >= self.interval_ns - self.tolerance_ns
        if accepted:
            self.last_accepted_ns = t_ns
            self.accepted += 1
        else:
            self.rejected += 1
        self.arrivals.append((t_ns, accepted, who))
        return accepted

    def stats(self) -> dict[str, Any]:
        """The ``/stats`` document."""
        return {
            "interval": self.interval,
            "tolerance": self.tolerance,
            "accepted": self.accepted,
            "rejected": self.rejected,
            "arrivals": [[t / 1e9, accepted, who] for t, accepted, who in self.arrivals],
            "arrivals_ns": [t for t, _, _ in self.arrivals],
            "clock": "CLOCK_REALTIME",
            "timestamps": (
                "kernel receive timestamps (SO_TIMESTAMPNS)"
                if self.kernel
                else f"time.time() when read (no kernel timestamps: {self.why_not})"
            ),
            "kernel_stamped": self.kernel_stamped,
            "fallback_stamped": self.fallback_stamped,
        }

    # ------------------------------------------------------------------ output

    def _respond(self, conn: _Connection, status: int, body: str, *, close: bool, kind: str = "") -> None:
        payload = body.encode()
        head = (
            f"HTTP/1.1 {status} {_REASONS[status]}\r\n"
            f"Content-Type: {kind or 'text/plain; charset=utf-8'}\r\n"
            f"Content-Length: {len(payload)}\r\n"
            f"Connection: {'close' if close else 'keep-alive'}\r\n\r\n"
        )
        conn.outbuf += head.encode("latin-1") + payload
        if close:
            conn.close_after = True
            conn.done_reading = True

    def _flush(self, conn: _Connection) -> None:
        if conn.closed:
            return
        try:
            while conn.outbuf:
                sent = conn.sock.send(conn.outbuf)
                del conn.outbuf[:sent]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._close(conn)
            return
        if not conn.outbuf and conn.close_after:
            self._close(conn)
            return
        if conn.outbuf:  # wait until writable; stop watching reads once no more requests are wanted
            events = selectors.EVENT_WRITE | (0 if conn.done_reading else selectors.EVENT_READ)
        else:
            events = selectors.EVENT_READ
        with contextlib.suppress(KeyError, ValueError):
            if self.selector.get_key(conn.sock).events != events:
                self.selector.modify(conn.sock, events, conn)

    def _close(self, conn: _Connection) -> None:
        if conn.closed:
            return
        conn.closed = True
        self.connections.discard(conn)
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(conn.sock)
        conn.sock.close()


def _check_settings(interval: float, tolerance: float) -> tuple[float, float]:
    """``(interval, tolerance)`` if finite, ``interval > 0`` and ``tolerance >= 0``; else ``ValueError``."""
    if not (math.isfinite(interval) and interval > 0):
        raise ValueError(f"interval must be a positive number of seconds, got {interval!r}")
    if not (math.isfinite(tolerance) and tolerance >= 0):
        raise ValueError(f"tolerance must be zero or a positive number of seconds, got {tolerance!r}")
    return float(interval), float(tolerance)


class _Stop(Exception):
    """Raised by the SIGTERM handler to leave the loop."""


def _raise_stop(signum: int, frame: object) -> None:
    raise _Stop


def serve(
    interval: float,
    tolerance: float = 0.0,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    parent: int | None = None,
    announce: bool = True,
    verbose: bool = True,
) -> None:
    """Run a referee in this process until SIGTERM or SIGINT (or until process ``parent`` is gone).

    With ``announce``, prints ``referee listening on http://HOST:PORT`` (the
    port actually bound, when ``port`` is 0) as its first line of standard
    output once it accepts connections, and flushes it; with ``verbose``,
    says on standard error where its arrival times come from.
    """
    service = _Service(host, port, interval, tolerance, parent)
    bound_host, bound_port = service.address
    if announce:
        print(f"{_READY}http://{bound_host}:{bound_port}", flush=True)
    if verbose:
        print(f"timestamps: {service.stats()['timestamps']}", file=sys.stderr, flush=True)
    signal.signal(signal.SIGTERM, _raise_stop)
    with contextlib.suppress(_Stop, KeyboardInterrupt):
        service.serve()


# --------------------------------------------------------------------------- Python API


class Arrival(NamedTuple):
    """One call as the referee saw it."""

    #: when it arrived, seconds of CLOCK_REALTIME (``time.time()``'s clock)
    t: float
    #: whether it was answered 200 (else 429)
    accepted: bool
    #: the caller's ``who`` tag, if it gave one
    who: str | None
    #: the same instant in integer nanoseconds (exact; ``t`` is a float)
    t_ns: int


@dataclass(frozen=True)
class RefereeStats:
    """What a referee has recorded since it started or was last reset."""

    interval: float
    tolerance: float
    accepted: int
    rejected: int
    #: every call, in the order the referee decided them (their timestamp order)
    arrivals: list[Arrival]
    #: where the arrival times come from (kernel receive timestamps, or ``time.time()`` when read)
    timestamps: str
    #: calls stamped by the kernel, and calls stamped with ``time.time()`` instead
    kernel_stamped: int
    fallback_stamped: int

    @classmethod
    def from_json(cls, document: dict[str, Any]) -> RefereeStats:
        """Parse the ``/stats`` document."""
        times_ns = document.get("arrivals_ns") or [round(t * 1e9) for t, _, _ in document["arrivals"]]
        return cls(
            interval=float(document["interval"]),
            tolerance=float(document["tolerance"]),
            accepted=int(document["accepted"]),
            rejected=int(document["rejected"]),
            arrivals=[
                Arrival(float(t), bool(ok), who, int(t_ns))
                for (t, ok, who), t_ns in zip(document["arrivals"], times_ns, strict=True)
            ],
            timestamps=str(document["timestamps"]),
            kernel_stamped=int(document["kernel_stamped"]),
            fallback_stamped=int(document["fallback_stamped"]),
        )

    @property
    def kernel_timestamps(self) -> bool:
        """Whether every call was stamped by the kernel."""
        return self.fallback_stamped == 0


def _request(url: str, method: str, path: str, timeout: float = 10.0) -> tuple[int, bytes]:
    """One request on a fresh connection (for control calls, not for measured ones)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=timeout)
    try:
        conn.request(method, path, headers={"Connection": "close"})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


class Referee:
    """A referee in a process of its own, on a free port of 127.0.0.1.

    ``start()`` (or ``with Referee(...) as referee``) starts it and sets
    :attr:`url`; :meth:`stop` ends it. The process also ends by itself when
    the process that started it is gone.
    """

    def __init__(self, interval: float, tolerance: float = 0.0) -> None:
        """Refuse calls arriving less than ``interval - tolerance`` seconds after the last accepted one."""
        self.interval, self.tolerance = _check_settings(interval, tolerance)
        #: ``http://127.0.0.1:PORT`` once started
        self.url: str | None = None
        self._process: subprocess.Popen[str] | None = None

    def start(self, timeout: float = 30.0) -> str:
        """Start the referee process; return its URL once it accepts connections.

        Raises ``RuntimeError`` if it does not say it listens within ``timeout`` seconds.
        """
        if self._process is not None:
            raise RuntimeError("this referee is already started")
        command = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--interval",
            repr(self.interval),
            "--tolerance",
            repr(self.tolerance),
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--parent",
            str(os.getpid()),
            "--quiet",
        ]
        process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True, start_new_session=True
        )
        self._process = process
        assert process.stdout is not None
        ready, _, _ = select.select([process.stdout], [], [], timeout)
        line = process.stdout.readline() if ready else ""
        if not line.startswith(_READY):
            self.stop()
            raise RuntimeError(f"the referee did not start within {timeout} s (it said {line!r})")
        self.url = line[len(_READY) :].strip()
        return self.url

    @property
    def pid(self) -> int | None:
        """The referee process's id while it runs (to stop or inspect it), else ``None``."""
        return None if self._process is None else self._process.pid

    def _control(self, method: str, path: str) -> bytes:
        if self.url is None:
            raise RuntimeError("the referee is not started")
        status, body = _request(self.url, method, path)
        if status != 200:
            raise RuntimeError(f"{method} {path}: {status} {body.decode(errors='replace').strip()}")
        return body

    def stats(self) -> RefereeStats:
        """Everything recorded since the start or the last :meth:`reset`."""
        return RefereeStats.from_json(json.loads(self._control("GET", "/stats")))

    def reset(self, interval: float | None = None, tolerance: float | None = None) -> None:
        """Forget every arrival; from now on use ``interval`` and ``tolerance`` (when given)."""
        interval, tolerance = _check_settings(
            self.interval if interval is None else interval,
            self.tolerance if tolerance is None else tolerance,
        )
        self._control("POST", f"/reset?interval={interval!r}&tolerance={tolerance!r}")
        self.interval, self.tolerance = interval, tolerance

    def stop(self) -> None:
        """End the referee process (SIGTERM, then SIGKILL after 5 s). Does nothing if not running."""
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)
        if process.stdout is not None:
            process.stdout.close()

    def __enter__(self) -> Referee:
        if self._process is None:
            self.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class RefereeClient:
    """Calls a referee's ``/call`` over one kept-alive connection per process.

    Picklable: the connection is not pickled but opened lazily, and opened
    anew in a process other than the one that opened it (after a fork, in a
    Spark executor, in a worker that unpickled the client).
    """

    def __init__(self, url: str, timeout: float = 10.0) -> None:
        """A client of the referee at ``url`` (``http://HOST:PORT``); ``timeout`` bounds each call (s)."""
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname or not parts.port:
            raise ValueError(f"a referee URL is http://HOST:PORT, got {url!r}")
        self.url = url
        self.timeout = timeout
        self._conn: http.client.HTTPConnection | None = None
        self._pid = 0

    def __getstate__(self) -> dict[str, Any]:
        return {"url": self.url, "timeout": self.timeout}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["url"], state["timeout"])  # type: ignore[misc]

    def _connection(self) -> http.client.HTTPConnection:
        if self._conn is None or self._pid != os.getpid():
            parts = urlsplit(self.url)
            self._conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=self.timeout)
            self._pid = os.getpid()
        return self._conn

    def connect(self) -> None:
        """Open the connection now (no call is made), so that the first :meth:`call` does not pay for it."""
        conn = self._connection()
        if conn.sock is None:
            conn.connect()

    def call(self, who: str | None = None) -> int:
        """Call ``/call`` (tagged ``who``, if given) and return the HTTP status: 200 accepted, 429 refused.

        Retries once on a fresh connection if a kept-alive connection turns
        out to be closed before any answer came (the referee never closes an
        idle connection itself, so this is rare).
        """
        path = "/call" if who is None else f"/call?who={quote(who, safe='')}"
        for attempt in (0, 1):
            conn = self._connection()
            reused = conn.sock is not None
            try:
                conn.request("GET", path)
                response = conn.getresponse()
                response.read()
                return response.status
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                conn.close()
                if attempt or not reused:
                    raise
        raise AssertionError("unreachable")

    def send(self, who: str | None = None) -> None:
        """Write a ``/call`` request (tagged ``who``) and return at once; :meth:`answer` reads its status.

        For a caller that acts between its request leaving and the answer
        (ratequeue's ``Limiter.sent``). Not retried, unlike :meth:`call`.
        """
        path = "/call" if who is None else f"/call?who={quote(who, safe='')}"
        self._connection().request("GET", path)

    def answer(self) -> int:
        """The HTTP status of the request :meth:`send` wrote (its body read)."""
        conn = self._connection()
        response = conn.getresponse()
        response.read()
        return response.status

    def close(self) -> None:
        """Close this process's connection (a later call opens a new one)."""
        if self._conn is not None and self._pid == os.getpid():
            self._conn.close()
        self._conn = None


# --------------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--interval", type=float, required=True, help="seconds between accepted calls")
    parser.add_argument("--tolerance", type=float, default=0.0, help="seconds a call may come early (0)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (0: a free one)")
    parser.add_argument("--parent", type=int, help="exit when this process is no longer our parent")
    parser.add_argument("--quiet", action="store_true", help="do not say where arrival times come from")
    args = parser.parse_args(argv)
    try:
        _check_settings(args.interval, args.tolerance)
    except ValueError as exc:
        parser.error(str(exc))
    serve(
        args.interval,
        args.tolerance,
        host=args.host,
        port=args.port,
        parent=args.parent,
        verbose=not args.quiet,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
