"""A quota referee: an HTTP service whose quota the clients do not know, and which changes mid-run.

It counts calls in fixed windows (2 s by default) and allows ``rate * window``
calls in each; the rate follows a schedule of phases (by default 30/s, then
10/s, then 20/s, 6 s each, then the last phase for ever), counted from the
last reset. A call within the window's quota gets ``200``; one over it gets
``429`` with ``Retry-After`` (whole seconds to the window's end, rounded up,
as RFC 9110 writes it). Every answer publishes the window's state the way
Discord and GitHub do::

    X-RateLimit-Limit: 60
    X-RateLimit-Remaining: 12
    X-RateLimit-Reset-After: 0.734     (seconds to the window's end)

Every arrival is recorded (its time on this host's ``time.time()``, its
status, the caller's tag), so the benchmark checks at the referee what the
service saw: how many calls were refused, how much of the quota was used,
and whether any call came while a ``Retry-After`` it had answered was still
running.

Endpoints: ``GET /call[?who=TAG]``; ``GET /stats`` (JSON: ``arrivals``
``[[t, status, who, retry_after], ...]``, ``started``, ``window``,
``phases``); ``POST /reset?phases=30x6,10x6,20x6&window=2&headers=1`` (each
optional; ``headers=0``: a service that publishes no quota, only 429 with
``Retry-After``).

Run standalone with ``python bench/quota_referee.py --port 8098``, or from
Python (in a process of its own, so that the caller's GIL does not disturb it)::

    with QuotaReferee() as referee:
        referee.reset()
        ... clients call referee.url + "/call" ...
        stats = referee.stats()
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["DEFAULT_PHASES", "QuotaReferee", "QuotaStats", "parse_phases"]

#: (calls per second, seconds) of each phase
DEFAULT_PHASES = ((30.0, 6.0), (10.0, 6.0), (20.0, 6.0))
DEFAULT_WINDOW = 2.0


def parse_phases(text: str) -> tuple[tuple[float, float], ...]:
    """``"30x6,10x6"`` as ((30.0, 6.0), (10.0, 6.0)): rates per second, for seconds."""
    phases = []
    for part in text.split(","):
        rate, _, seconds = part.partition("x")
        phases.append((float(rate), float(seconds)))
    return tuple(phases)


class _Book:
    """The referee's count: windows from ``started``, the quota of each, every arrival."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reset(DEFAULT_PHASES, DEFAULT_WINDOW)

    def reset(self, phases: tuple[tuple[float, float], ...], window: float, headers: bool = True) -> None:
        with self.lock:
            self.phases, self.window, self.headers = phases, window, headers
            self.started = time.time()
            self.used: dict[int, int] = {}
            self.arrivals: list[list[Any]] = []

    def quota(self, index: int) -> int:
        """The calls window ``index`` allows: the rate of the phase it starts in, times the window."""
        start, elapsed = index * self.window, 0.0
        for rate, seconds in self.phases:
            if start < elapsed + seconds:
                return round(rate * self.window)
            elapsed += seconds
        return round(self.phases[-1][0] * self.window)

    def call(self, who: str) -> tuple[int, dict[str, str]]:
        with self.lock:
            now = time.time()
            index = int((now - self.started) // self.window)
            quota, used = self.quota(index), self.used.get(index, 0)
            left = (self.started + (index + 1) * self.window) - now
            retry_after = None
            if used < quota:
                used += 1
                self.used[index] = used
                status = 200
            else:
                status = 429
                retry_after = max(1, math.ceil(left))
            self.arrivals.append([now, status, who, retry_after])
        headers = {
            "X-RateLimit-Limit": str(quota),
            "X-RateLimit-Remaining": str(quota - used),
            "X-RateLimit-Reset-After": f"{math.ceil(left * 1000) / 1000:.3f}",  # (never before the end)
        }
        if not self.headers:  # a service that says nothing until it refuses
            headers = {}
        if retry_after is not None:
            headers["Retry-After"] = str(retry_after)
        return status, headers

    def stats(self) -> dict[str, Any]:
        with self.lock:
            return {
                "started": self.started,
                "window": self.window,
                "phases": self.phases,
                "arrivals": list(self.arrivals),
            }


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    book: _Book

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def _answer(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _route(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        query = dict(urllib.parse.parse_qsl(url.query))
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        if url.path == "/call":
            status, headers = self.book.call(query.get("who", ""))
            self._answer(status, b"ok\n" if status == 200 else b"slow down\n", headers)
        elif url.path == "/stats":
            self._answer(200, json.dumps(self.book.stats()).encode(), {"Content-Type": "application/json"})
        elif url.path == "/reset":
            phases = parse_phases(query["phases"]) if "phases" in query else DEFAULT_PHASES
            self.book.reset(
                phases, float(query.get("window", DEFAULT_WINDOW)), query.get("headers", "1") != "0"
            )
            self._answer(200, b"reset\n")
        else:
            self._answer(404, b"no such endpoint\n")

    do_GET = do_POST = _route


def serve(port: int, ready: Any = None) -> None:
    """Serve on 127.0.0.1:``port`` (0: a free one, told through ``ready``) until killed."""

    class Handler(_Handler):
        book = _Book()

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    if ready is not None:
        ready.put(server.server_address[1])
    server.serve_forever(poll_interval=0.05)


@dataclass
class QuotaStats:
    """What the referee saw over one run, from its reset to ``until`` (its ``time.time()``)."""

    arrivals: list[list[Any]]
    started: float
    window: float
    phases: tuple[tuple[float, float], ...]

    def allowed(self, until: float) -> int:
        """How many calls the quota allowed from the reset to ``until`` (whole windows, the last prorated)."""
        book = _Book.__new__(_Book)
        book.phases, book.window = self.phases, self.window
        total, index = 0.0, 0
        while self.started + index * self.window < until:
            part = min(1.0, (until - self.started - index * self.window) / self.window)
            total += book.quota(index) * part
            index += 1
        return round(total)

    def accepted(self, until: float) -> int:
        """Calls accepted before ``until``."""
        return sum(1 for arrival in self.arrivals if arrival[1] == 200 and arrival[0] < until)

    @property
    def refused(self) -> int:
        """Calls refused (429), over the whole run."""
        return sum(1 for arrival in self.arrivals if arrival[1] == 429)

    def early_calls(self) -> list[tuple[float, float]]:
        """Each call that came while an earlier ``Retry-After`` ran: (seconds after that 429, its wait)."""
        found, last = [], None
        for t, status, _, retry_after in self.arrivals:
            if last is not None and t < last[0] + last[1]:
                found.append((t - last[0], last[1]))
            ends_later = last is None or (retry_after is not None and t + retry_after > last[0] + last[1])
            if status == 429 and retry_after is not None and ends_later:
                last = (t, retry_after)
        return found


class QuotaReferee:
    """A :mod:`quota_referee` service in a process of its own, on a free loopback port."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        ready = ctx.Queue()
        self._process = ctx.Process(target=serve, args=(0, ready), daemon=True)
        self._process.start()
        self.port = ready.get(timeout=30)
        ready.close()
        ready.join_thread()
        self.url = f"http://127.0.0.1:{self.port}"

    def reset(
        self,
        phases: tuple[tuple[float, float], ...] = DEFAULT_PHASES,
        window: float = DEFAULT_WINDOW,
        headers: bool = True,
    ) -> None:
        """Clear every count; windows and phases start now. ``headers=False``: no X-RateLimit-* sent."""
        text = ",".join(f"{rate:g}x{seconds:g}" for rate, seconds in phases)
        query = urllib.parse.urlencode({"phases": text, "window": window, "headers": int(headers)})
        with urllib.request.urlopen(f"{self.url}/reset?{query}", data=b"", timeout=10):
            pass

    def stats(self) -> QuotaStats:
        with urllib.request.urlopen(f"{self.url}/stats", timeout=30) as response:
            data = json.loads(response.read())
        phases = tuple((float(r), float(s)) for r, s in data["phases"])
        return QuotaStats(data["arrivals"], data["started"], data["window"], phases)

    def close(self) -> None:
        self._process.kill()
        self._process.join(5)
        self._process.close()

    def __enter__(self) -> QuotaReferee:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8098)
    args = parser.parse_args()
    serve(args.port)


if __name__ == "__main__":
    main()
