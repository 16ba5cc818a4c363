"""A function decorated with a Limiter: every call waits for its global turn.

``fetch`` stands for a call to a rate-limited service. Decorating it with
``@limiter`` makes each call run ``limiter.acquire()`` first, so callers do
not need to know about the limit. Eight threads make twelve calls between
them. Each call begins one interval after the previous one, even though every
call takes longer (0.12 s) than the interval (0.05 s), because the limiter
spaces the *starts* of calls and lets them overlap.

Run::

    python examples/decorator.py [STATE_URL]

Without a URL the state is a JSON file in a new temporary directory.
"""

from __future__ import annotations

import itertools
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import ratequeue

INTERVAL = 0.05  # seconds between the starts of two calls
CALLS = 12
WORKERS = 8


def run(url: str) -> int:
    limiter = ratequeue.Limiter(url, name="examples-decorator", interval=INTERVAL)
    began: list[float] = []
    lock = threading.Lock()
    t0 = time.monotonic()

    @limiter
    def fetch(item: int) -> str:
        """Pretend to call a service that allows one request per interval."""
        now = time.monotonic()
        with lock:
            began.append(now)
        print(f"fetch({item:>2}) began at {now - t0:6.3f} s in {threading.current_thread().name}")
        time.sleep(0.12)  # the work itself; it may outlast the interval
        return f"item {item}"

    print(f"{CALLS} calls from {WORKERS} threads, interval {INTERVAL * 1000:g} ms, state {url}")
    with ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="worker") as pool:
        results = list(pool.map(fetch, range(CALLS)))

    status = limiter.status()
    limiter.close()
    began.sort()
    gaps = [(later - earlier) * 1000 for earlier, later in itertools.pairwise(began)]
    average = (began[-1] - began[0]) * 1000 / (len(began) - 1)
    print()
    print(f"{len(results)} results, {results[0]!r} to {results[-1]!r}")
    print(f"the wrapper keeps the function's name and docstring: {fetch.__name__}: {fetch.__doc__}")
    print(
        f"gaps between calls: average {average:.3f} ms, median {statistics.median(gaps):.3f} ms, "
        f"smallest {min(gaps):.3f} ms (local clock, includes wake-up jitter)"
    )
    print(f"state: ticket {status.pos} is the latest started, next ticket {status.next_ticket}")
    return 0


def main() -> int:
    if len(sys.argv) > 1:
        return run(sys.argv[1])
    with tempfile.TemporaryDirectory() as directory:
        return run((Path(directory) / "state.json").as_uri())


if __name__ == "__main__":
    sys.exit(main())
