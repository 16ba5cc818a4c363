"""One rate per customer: a LimiterGroup, and keys that go away once idle.

Three customers each get their own 20 starts per second; one customer's
callers never wait for another's. Each key's record is created on first use
and deleted by the state once the key has been idle ``keep`` seconds (here
0.2 s) past the moment forgetting it changes nothing, so keys seen once do
not stay.

Run::

    python examples/per_key.py [STATE_URL]

Without a URL the state is a JSON file in a new temporary directory.
"""

from __future__ import annotations

import itertools
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import ratequeue

CUSTOMERS = ["acme", "globex", "initech"]
CALLS = 4  # per customer


def run(url: str) -> int:
    group = ratequeue.LimiterGroup(url, name="examples-per-customer", rate="20/second", keep=0.2)
    starts: dict[str, list[int]] = defaultdict(list)
    lock = threading.Lock()

    def serve(customer: str) -> None:
        turn = group[customer].acquire(timeout=10)
        with lock:
            starts[customer].append(turn.start_us)

    threads = [threading.Thread(target=serve, args=(c,)) for c in CUSTOMERS for _ in range(CALLS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    smallest = min(b - a for times in starts.values() for a, b in itertools.pairwise(sorted(times)))
    for customer in CUSTOMERS:
        times = sorted(starts[customer])
        print(
            f"{customer:8} {len(times)} starts, "
            + " ".join(f"{(t - times[0]) / 1000:6.1f}" for t in times)
            + " ms"
        )
    print(f"smallest gap within one customer: {smallest / 1000:.3f} ms (state clock)")
    print(f"live keys: {', '.join(group.keys())}")
    # Wait for the keys to go: the keep time passes, then a sweep (Redis needs none) deletes them.
    deadline = time.monotonic() + 10
    while group.keys() and time.monotonic() < deadline:
        time.sleep(0.1)
        group.state.sweep()
    left = group.keys()
    print(f"after the keep time: {len(left)} live keys")
    group.close()
    return 0 if not left and smallest >= 50_000 else 1


def main() -> int:
    if len(sys.argv) > 1:
        return run(sys.argv[1])
    with tempfile.TemporaryDirectory() as directory:
        return run((Path(directory) / "state.json").as_uri())


if __name__ == "__main__":
    sys.exit(main())
