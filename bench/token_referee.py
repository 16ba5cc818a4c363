"""A token referee: an HTTP service with a token budget, whose calls cost what they cost.

It keeps a token bucket of ``rate`` tokens per second and ``capacity``
tokens (200/s and 400 by default), full at each reset. Each call's actual
cost is drawn from a seeded distribution (uniform whole numbers from
``cost_min`` to ``cost_max``, 10 to 100 by default, whatever the caller
estimated), and charged when the call arrives: if the bucket holds it, the
call is accepted (``200``); if not, it is refused (``429`` with
``Retry-After``: the seconds until the bucket would hold it, rounded up to a
whole second as RFC 9110 writes it) and nothing is charged. Then the answer
waits a simulated latency (uniform, 50 to 250 ms by default), so that calls
overlap and finish out of order, and says what was charged::

    X-Tokens-Used: 57          (0 for a 429: a refused call is not charged)
    X-Tokens-Wanted: 57        (the cost drawn, charged or not)

Every arrival is recorded: its time on this host's ``time.time()``, its
status, its cost (as drawn), the caller's tag, the caller's estimate (the
``max`` query parameter; 0 if none) and the time the answer was sent, so that
the benchmark checks at the referee what the service saw.

Endpoints: ``GET /call?who=TAG&max=M``; ``GET /stats`` (JSON: ``arrivals``
``[[t, status, cost, who, estimate, answered], ...]``, ``started`` and the
settings); ``POST /reset?rate=200&capacity=400&costs=10,100&latency=0.05,0.25&seed=1``
(each optional).

Run standalone with ``python bench/token_referee.py --port 8099``, or from
Python (in a process of its own, so that the caller's GIL does not disturb it)::

    with TokenReferee() as referee:
        referee.reset()
        ... clients call referee.url + "/call" ...
        stats = referee.stats()
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing
import random
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["Arrival", "Settings", "TokenReferee", "TokenStats"]


@dataclass(frozen=True)
class Settings:
    """The referee's budget, its costs and its latency."""

    rate: float = 200.0  # tokens per second
    capacity: float = 400.0  # tokens: the bucket's size
    cost_min: int = 10
    cost_max: int = 100
    latency_min: float = 0.050  # seconds
    latency_max: float = 0.250
    seed: int = 1

    @property
    def mean_cost(self) -> float:
        return (self.cost_min + self.cost_max) / 2

    def query(self) -> str:
        return urllib.parse.urlencode(
            {
                "rate": self.rate,
                "capacity": self.capacity,
                "costs": f"{self.cost_min},{self.cost_max}",
                "latency": f"{self.latency_min},{self.latency_max}",
                "seed": self.seed,
            }
        )

    @classmethod
    def from_query(cls, query: dict[str, str]) -> Settings:
        default = cls()
        low, high = (int(x) for x in query.get("costs", f"{default.cost_min},{default.cost_max}").split(","))
        fast, slow = (
            float(x) for x in query.get("latency", f"{default.latency_min},{default.latency_max}").split(",")
        )
        return cls(
            float(query.get("rate", default.rate)),
            float(query.get("capacity", default.capacity)),
            low,
            high,
            fast,
            slow,
            int(query.get("seed", default.seed)),
        )


@dataclass(frozen=True)
class _Call:
    """One arrival as the book answered it."""

    status: int
    cost: int  # as drawn
    charged: int  # the cost, or 0 if refused
    retry_after: int  # whole seconds (0 if accepted)
    latency: float  # seconds to wait before answering
    index: int  # in the book's arrivals
    generation: int  # of the book (a reset starts a new one)


class _Book:
    """The referee's book: the bucket, the random draws, every arrival."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.generation = 0
        self.reset(Settings())

    def reset(self, settings: Settings) -> None:
        with self.lock:
            self.generation += 1
            self.settings = settings
            self.costs = random.Random(settings.seed)
            self.latencies = random.Random(settings.seed + 1_000_003)
            self.started = self.last = time.time()
            self.tokens = settings.capacity
            self.arrivals: list[list[Any]] = []

    def arrive(self, who: str, estimate: int) -> _Call:
        """Draw the call's cost and latency, charge it if the bucket holds it, record it."""
        with self.lock:
            s = self.settings
            now = time.time()
            self.tokens = min(s.capacity, self.tokens + (now - self.last) * s.rate)
            self.last = now
            cost = self.costs.randint(s.cost_min, s.cost_max)
            latency = self.latencies.uniform(s.latency_min, s.latency_max)
            if self.tokens >= cost:
                self.tokens -= cost
                status, charged, retry_after = 200, cost, 0
            else:
                status, charged = 429, 0
                retry_after = max(1, math.ceil((cost - self.tokens) / s.rate))
            self.arrivals.append([now, status, cost, who, estimate, None])
            return _Call(status, cost, charged, retry_after, latency, len(self.arrivals) - 1, self.generation)

    def answered(self, call: _Call) -> None:
        """Note when ``call``'s answer went out (unless the book was reset since)."""
        with self.lock:
            if call.generation == self.generation:
                self.arrivals[call.index][5] = time.time()

    def stats(self) -> dict[str, Any]:
        with self.lock:
            return {
                "started": self.started,
                "settings": dataclasses.asdict(self.settings),
                "arrivals": [list(a) for a in self.arrivals],
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
            call = self.book.arrive(query.get("who", ""), int(query.get("max", "0")))
            time.sleep(call.latency)
            headers = {"X-Tokens-Used": str(call.charged), "X-Tokens-Wanted": str(call.cost)}
            if call.status == 429:
                headers["Retry-After"] = str(call.retry_after)
            self.book.answered(call)
            self._answer(call.status, b"ok\n" if call.status == 200 else b"out of tokens\n", headers)
        elif url.path == "/stats":
            self._answer(200, json.dumps(self.book.stats()).encode(), {"Content-Type": "application/json"})
        elif url.path == "/reset":
            self.book.reset(Settings.from_query(query))
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


@dataclass(frozen=True)
class Arrival:
    """One call as the referee saw it (times on this host's ``time.time()``)."""

    t: float
    status: int
    cost: int  # as drawn: charged if the status is 200
    who: str
    estimate: int  # the caller's ``max`` (0 if none)
    answered: float | None  # when the answer went out (None: not yet when the stats were read)

    @property
    def charged(self) -> int:
        return self.cost if self.status == 200 else 0


@dataclass(frozen=True)
class TokenStats:
    """What the referee saw since its last reset."""

    started: float
    settings: Settings
    arrivals: list[Arrival]

    def charged(self, until: float) -> int:
        """Tokens charged to the calls that arrived before ``until``."""
        return sum(a.charged for a in self.arrivals if a.t < until)

    def accepted(self, until: float) -> int:
        return sum(1 for a in self.arrivals if a.status == 200 and a.t < until)

    @property
    def refused(self) -> int:
        """Calls refused (429), over the whole run."""
        return sum(1 for a in self.arrivals if a.status == 429)

    def excess(self, window: float, *, charged: bool = False) -> tuple[float, int, int]:
        """The most the arrivals in any window ``[t, t + window]`` cost beyond ``capacity + rate * window``.

        Each call at its drawn cost (what the callers asked for, refused
        calls included), or with ``charged`` at what the bucket charged (0
        for a refusal: never above 0, the bucket's own rule). Answers (that
        excess, and the window's first and last arrival, as indices into the
        arrivals in time order); the windows worth looking at start at an
        arrival.
        """
        ordered = sorted(self.arrivals, key=lambda a: a.t)
        limit = self.settings.capacity + self.settings.rate * window
        best, where, high, total = -math.inf, (0, -1), 0, 0
        for low, first in enumerate(ordered):
            while high < len(ordered) and ordered[high].t <= first.t + window:
                total += ordered[high].charged if charged else ordered[high].cost
                high += 1
            if total - limit > best:
                best, where = total - limit, (low, high - 1)
            total -= first.charged if charged else first.cost
        return best, where[0], where[1]


class TokenReferee:
    """A :mod:`token_referee` service in a process of its own, on a free loopback port."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        ready = ctx.Queue()
        self._process = ctx.Process(target=serve, args=(0, ready), daemon=True)
        self._process.start()
        self.port = ready.get(timeout=30)
        ready.close()
        ready.join_thread()
        self.url = f"http://127.0.0.1:{self.port}"

    def reset(self, settings: Settings | None = None) -> None:
        """Fill the bucket, restart the draws from their seed and clear the record."""
        query = (settings or Settings()).query()
        with urllib.request.urlopen(f"{self.url}/reset?{query}", data=b"", timeout=10):
            pass

    def stats(self) -> TokenStats:
        with urllib.request.urlopen(f"{self.url}/stats", timeout=30) as response:
            data = json.loads(response.read())
        settings = Settings(**data["settings"])
        arrivals = [Arrival(*arrival) for arrival in data["arrivals"]]
        return TokenStats(float(data["started"]), settings, arrivals)

    def close(self) -> None:
        self._process.kill()
        self._process.join(5)
        self._process.close()

    def __enter__(self) -> TokenReferee:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8099)
    args = parser.parse_args()
    serve(args.port)


if __name__ == "__main__":
    main()
