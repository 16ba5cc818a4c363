"""A stand-in for a rate-limited HTTP API: records when each call arrives, answers 429 if too soon.

:class:`ApiService` is a tiny standard-library HTTP server on 127.0.0.1 at a
free port, run in a background thread. ``GET /call?key=K`` is the rate-limited
call. The service notes the moment each call arrives (``time.monotonic()``,
when it accepts the connection) and answers **429 Too Many Requests** if that
is sooner than ``interval`` (less ``tolerance``) after the previous call it
accepted, else **200** with ``{"key": K}``. It is a strict third-party API
as its clients see it, and it measures the spacing of calls where it
matters, after every delay on the way, not on the state's clock.

The Spark example (``spark_api_calls.py``) and the tests import it. Run on its
own, it shows the difference a limiter makes::

    python examples/api_service.py [STATE_URL]

It sends eight calls back-to-back (all but the first get 429), then eight
through a ``Limiter`` with the service's interval (all get 200). The default
state is ``memory://``: the calls come from this one process.

**Tolerance.** A limiter spaces the *starts* of turns, on the state's clock,
at least ``interval`` apart; a call then reaches the service a little after
its turn began: the worker wakes up, connects and sends it. These delays
vary from call to call, usually by a fraction of a millisecond, so the gaps
the service sees scatter around the interval, about half of them a little
under it. ``tolerance`` lets the service accept a call that comes that much
early; it is zero unless given. On a host whose CPUs are busy with other
work, a call can be delayed by several milliseconds, and the next one then
comes that much early. Against a real API, give the limiter an interval a
little above the API's limit instead (a margin of a few percent).
"""

from __future__ import annotations

import dataclasses
import http.client
import itertools
import json
import statistics
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

__all__ = ["ApiService", "Arrival", "Summary", "call"]


@dataclasses.dataclass(frozen=True)
class Arrival:
    """One call as the service received it."""

    #: ``time.monotonic()`` when the call arrived (the rule's clock)
    at: float
    #: ``time.time()`` at the same moment, to compare with a state clock on this host (Redis ``TIME``)
    wall: float
    #: the call's ``key`` query parameter (the caller's row id)
    key: str
    #: the status answered: 200, or 429 if the call came too soon
    status: int


@dataclasses.dataclass(frozen=True)
class Summary:
    """What the service saw, in one line's worth of numbers."""

    requests: int
    accepted: int
    #: requests answered 429
    rejected: int
    #: the interval the service was given, in seconds
    interval: float
    #: how much sooner than ``interval`` a call may come and still be accepted, in seconds
    tolerance: float
    #: gaps between consecutive calls, in milliseconds (all calls, in the order received)
    gaps_ms: tuple[float, ...]

    @property
    def smallest_gap_ms(self) -> float | None:
        return min(self.gaps_ms) if self.gaps_ms else None

    @property
    def median_gap_ms(self) -> float | None:
        return statistics.median(self.gaps_ms) if self.gaps_ms else None

    @property
    def gaps_under_interval(self) -> int:
        """Gaps shorter than the interval itself (jitter included)."""
        return sum(1 for gap in self.gaps_ms if gap < self.interval * 1000)

    @property
    def gaps_under_limit(self) -> int:
        """Gaps shorter than the interval less the tolerance: calls the service refuses."""
        return sum(1 for gap in self.gaps_ms if gap < (self.interval - self.tolerance) * 1000)

    def line(self) -> str:
        if not self.gaps_ms:
            gaps = "no gaps"
        else:
            gaps = (
                f"smallest gap {self.smallest_gap_ms:.3f} ms, median gap {self.median_gap_ms:.3f} ms, "
                f"gaps under {self.interval * 1000:g} ms: {self.gaps_under_interval}"
            )
            if self.tolerance:
                limit = (self.interval - self.tolerance) * 1000
                gaps += f", under {limit:g} ms (interval - tolerance): {self.gaps_under_limit}"
        return (
            f"service saw {self.requests} requests, {self.accepted} accepted, "
            f"{self.rejected} answered 429; {gaps}"
        )


class ApiService:
    """A rate-limited HTTP service on ``127.0.0.1`` at a free port, served from a background thread.

    A call arrives when the service accepts its connection: the server's
    accepting thread reads ``time.monotonic()`` and decides 200 or 429 there,
    one connection after another, before a handler thread is started for it.
    So the times are those at which calls reached the service, in that
    order, free of the service's own thread start-up and request parsing.
    Clients make one call per connection (HTTP/1.0). Use it as a context
    manager, or call :meth:`start` and :meth:`stop`.
    """

    def __init__(self, interval: float, *, tolerance: float = 0.0) -> None:
        """
        :param interval: the smallest time (s) the service accepts between two calls.
        :param tolerance: seconds by which a call may come sooner than ``interval``
            and still be accepted (see the module's docstring); 0 by default.
        """
        self.interval = interval
        self.tolerance = tolerance
        self._lock = threading.Lock()
        self._arrivals: list[Arrival] = []
        self._pending: dict[int, int] = {}  # id(connection) -> index in _arrivals
        self._last_accepted: float | None = None
        self._server = _Server(self)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The base URL, ``http://127.0.0.1:PORT``."""
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> ApiService:
        self._thread = threading.Thread(target=self._server.serve_forever, name="api-service", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> ApiService:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def arrivals(self) -> list[Arrival]:
        """Every call received so far, in the order received."""
        with self._lock:
            return list(self._arrivals)

    def summary(self) -> Summary:
        arrivals = self.arrivals()
        accepted = sum(1 for a in arrivals if a.status == 200)
        gaps = tuple((b.at - a.at) * 1000 for a, b in itertools.pairwise(arrivals))
        return Summary(len(arrivals), accepted, len(arrivals) - accepted, self.interval, self.tolerance, gaps)

    def _arrive(self, connection: object) -> None:
        """A call arrives on ``connection`` now: decide its status (in the accepting thread)."""
        now, wall = time.monotonic(), time.time()
        with self._lock:
            last = self._last_accepted
            status = 429 if last is not None and now - last < self.interval - self.tolerance else 200
            if status == 200:
                self._last_accepted = now
            self._pending[id(connection)] = len(self._arrivals)
            self._arrivals.append(Arrival(now, wall, "", status))

    def _answer(self, connection: object, key: str) -> int:
        """Note the ``key`` of the call on ``connection``; return the status decided on its arrival."""
        with self._lock:
            index = self._pending.pop(id(connection))
            arrival = self._arrivals[index] = dataclasses.replace(self._arrivals[index], key=key)
        return arrival.status


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, service: ApiService) -> None:
        self.service = service
        super().__init__(("127.0.0.1", 0), _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        self.service._arrive(request)  # in the accepting thread, before the handler's thread starts
        super().process_request(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    # HTTP/1.0 (the default): one call per connection, closed after the answer
    server: _Server

    def do_GET(self) -> None:
        parts = urlsplit(self.path)
        key = parse_qs(parts.query).get("key", [""])[-1]
        status = self.server.service._answer(self.request, key)
        if parts.path != "/call":
            self.send_error(404)
            return
        body = json.dumps({"key": key} if status == 200 else {"error": "too many requests"}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # quiet


def call(base_url: str, key: object, timeout: float = 10.0) -> int:
    """Call the service's ``/call`` with ``key`` on a new connection; return the HTTP status (200 or 429)."""
    parts = urlsplit(base_url)
    connection = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=timeout)
    try:
        connection.request("GET", f"/call?key={key}")
        response = connection.getresponse()
        response.read()
        return int(response.status)
    finally:
        connection.close()


def main() -> int:
    import ratequeue

    url = sys.argv[1] if len(sys.argv) > 1 else "memory://"
    interval, tolerance = 0.05, 0.005
    calls = 8
    with ApiService(interval, tolerance=tolerance) as service:
        print(
            f"service: one call per {interval * 1000:g} ms, {tolerance * 1000:g} ms tolerance, {service.url}"
        )
        burst = [call(service.url, f"burst-{i}") for i in range(calls)]
        print(f"{calls} calls back-to-back:     statuses {burst}")
        limiter = ratequeue.Limiter(url, name="examples-api-service", interval=interval)
        time.sleep(interval)  # let the burst's last accepted call age by one interval
        paced = []
        for i in range(calls):
            limiter.acquire()
            paced.append(call(service.url, f"paced-{i}"))
        limiter.close()
        print(f"{calls} calls through a limiter: statuses {paced}")
        times = [a.at for a in service.arrivals() if a.key.startswith("paced-")]
        gaps = [(b - a) * 1000 for a, b in itertools.pairwise(times)]
        print(
            f"gaps between them at the service: smallest {min(gaps):.3f} ms, "
            f"median {statistics.median(gaps):.3f} ms"
        )
    return 0 if all(status == 200 for status in paced) else 1


if __name__ == "__main__":
    sys.exit(main())
