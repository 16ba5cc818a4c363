"""Three threads call a service through ratequeue's httpx transport; the service's headers hold them all.

The service (an in-process stand-in, ``httpx.MockTransport``) allows 5 calls
per half-second window and says so on every answer (``X-RateLimit-Remaining``,
``X-RateLimit-Reset-After``), refusing a 6th with 429. The limiter is set to
20/s, four times too fast; the answer that says "0 left" holds every thread
(and would hold every process sharing the state) until the window ends.

    python examples/http_feedback.py
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

import ratequeue
import ratequeue.httpx

WINDOW, QUOTA = 0.5, 5


class Service:
    """Counts calls in fixed windows; answers as a rate-limited API does."""

    def __init__(self) -> None:
        self.started, self.refused = time.monotonic(), 0
        #: calls answered 200 in each window, by the window's number
        self.used: dict[int, int] = {}
        self.lock = threading.Lock()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        with self.lock:
            now = time.monotonic() - self.started
            window = int(now // WINDOW)
            used = self.used.get(window, 0)
            left = (window + 1) * WINDOW - now
            headers = {"X-RateLimit-Limit": str(QUOTA), "X-RateLimit-Reset-After": f"{left + 0.0005:.3f}"}
            if used >= QUOTA:
                self.refused += 1
                return httpx.Response(
                    429, headers={**headers, "X-RateLimit-Remaining": "0", "Retry-After": "1"}
                )
            self.used[window] = used + 1
            return httpx.Response(200, headers={**headers, "X-RateLimit-Remaining": str(QUOTA - used - 1)})


def main() -> None:
    service = Service()
    limiter = ratequeue.Limiter(name="http-feedback-example", rate="20/second")
    transport = ratequeue.httpx.Transport(limiter, httpx.MockTransport(service))
    with httpx.Client(transport=transport) as client, ThreadPoolExecutor(3) as pool:
        statuses = list(
            pool.map(lambda i: client.get(f"https://api.example/items/{i}").status_code, range(15))
        )
    limiter.close()
    windows = sorted(service.used.items())
    print(f"{statuses.count(200)} of {len(statuses)} calls answered 200, {service.refused} refused (429)")
    print("calls per window:", " ".join(str(count) for _, count in windows))


if __name__ == "__main__":
    main()
