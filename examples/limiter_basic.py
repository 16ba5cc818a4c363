"""Several threads share one Limiter: one start per interval, in turn.

Four threads each call ``limiter.acquire()`` five times. Each call returns at
its global turn as a ``ratequeue.Turn``. The script prints every start as it
happens, with the gap since the previous start on the state's clock
(``Turn.start_us``, whole microseconds). On that clock ratequeue guarantees
gaps of at least the interval. The summary also shows the gaps as the threads
saw them on their own clock, where wake-up jitter adds a little noise.

Run::

    python examples/limiter_basic.py [STATE_URL]

Without a URL the state is a JSON file in a new temporary directory. Pass
``memory://`` or ``file:///tmp/rq.json`` to use another state.
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

INTERVAL = 0.05  # seconds between two starts
THREADS = 4
CALLS_PER_THREAD = 5


def run(url: str) -> int:
    limiter = ratequeue.Limiter(url, name="examples-limiter-basic", interval=INTERVAL)
    print(f"{THREADS} threads x {CALLS_PER_THREAD} calls, interval {INTERVAL * 1000:g} ms, state {url}")

    lock = threading.Lock()
    starts: list[int] = []  # Turn.start_us: state clock, microseconds
    seen: list[float] = []  # time.monotonic() right after acquire() returned
    latest: int | None = None  # the latest start printed so far

    def worker(index: int) -> None:
        nonlocal latest
        for _ in range(CALLS_PER_THREAD):
            turn = limiter.acquire()  # blocks until this call's global turn
            woke = time.monotonic()
            with lock:
                starts.append(turn.start_us)
                seen.append(woke)
                gap = "" if latest is None else f"gap {(turn.start_us - latest) / 1000:7.3f} ms"
                latest = turn.start_us if latest is None else max(latest, turn.start_us)
                print(f"thread {index}  ticket {turn.ticket:>4}  {gap}")

    with ThreadPoolExecutor(max_workers=THREADS) as pool:
        for future in [pool.submit(worker, index) for index in range(1, THREADS + 1)]:
            future.result()  # re-raises what a thread raised
    limiter.close()

    starts.sort()
    seen.sort()
    gaps = [later - earlier for earlier, later in itertools.pairwise(starts)]
    seen_gaps = [later - earlier for earlier, later in itertools.pairwise(seen)]
    under = sum(1 for gap in gaps if gap < round(INTERVAL * 1_000_000))
    print()
    print(
        f"state clock: {len(starts)} starts, smallest gap {min(gaps) / 1000:.3f} ms, "
        f"median {statistics.median(gaps) / 1000:.3f} ms, gaps under the interval: {under}"
    )
    print(
        f"seen by the threads: smallest gap {min(seen_gaps) * 1000:.3f} ms, "
        f"median {statistics.median(seen_gaps) * 1000:.3f} ms (includes wake-up jitter)"
    )
    return 0 if under == 0 else 1


def main() -> int:
    if len(sys.argv) > 1:
        return run(sys.argv[1])
    with tempfile.TemporaryDirectory() as directory:
        return run((Path(directory) / "state.json").as_uri())


if __name__ == "__main__":
    sys.exit(main())
