"""One provider's limit, many tenants: a fair limiter gives each tenant with waiters its turn.

A SaaS calls one API (20 calls per second, for everyone) for its
customers. Customer "big" has 8 workers calling in a loop; a second later
customer "small" makes 5 calls, one after another. Served in the order
callers came, each of small's calls would wait behind big's 8 waiting
calls: about 0.4 s each. With ``fair=True`` the tenants take turns: each of
small's calls waits behind one of big's at most, about 0.1 s. Every start is
still 50 ms after the one before, whoever's it is.

Run::

    python examples/fair_tenants.py [STATE_URL]

Without a URL the state is a JSON file in a new temporary directory.
"""

from __future__ import annotations

import itertools
import sys
import tempfile
import threading
import time
from pathlib import Path

import ratequeue

BIG_WORKERS = 8
SMALL_CALLS = 5


def run(url: str, fair: bool) -> tuple[float, int]:
    """Small's 5 calls beside big's 8 workers: how long they took, and the smallest gap of all starts (us)."""
    name = "examples-fair" if fair else "examples-unfair"
    options = {"fair": True} if fair else {}
    starts: list[int] = []
    lock = threading.Lock()
    stop = threading.Event()

    def big_worker() -> None:
        # each worker its own limiter: a shard, as a worker process would have
        limiter = ratequeue.Limiter(url, name=name, rate="20/second", **options)  # type: ignore[arg-type]
        while not stop.is_set():
            turn = limiter.acquire(tenant="big" if fair else None)
            with lock:
                starts.append(turn.start_us)
        limiter.close()

    workers = [threading.Thread(target=big_worker) for _ in range(BIG_WORKERS)]
    for worker in workers:
        worker.start()
    time.sleep(1.0)
    small = ratequeue.Limiter(url, name=name, rate="20/second", **options)  # type: ignore[arg-type]
    began = time.monotonic()
    for _ in range(SMALL_CALLS):
        turn = small.acquire(tenant="small" if fair else None)
        with lock:
            starts.append(turn.start_us)
    took = time.monotonic() - began
    if fair:
        print(f"tenants waiting (waiters, weight): {small.status().tenants}")
    small.close()
    stop.set()
    for worker in workers:
        worker.join()
    smallest = min(b - a for a, b in itertools.pairwise(sorted(starts)))
    return took, smallest


def main() -> int:
    with tempfile.TemporaryDirectory() as directory:
        url = sys.argv[1] if len(sys.argv) > 1 else (Path(directory) / "state.json").as_uri()
        unfair_took, unfair_gap = run(url, fair=False)
        print(f"in arrival order: small's {SMALL_CALLS} calls took {unfair_took:.2f} s")
        fair_took, fair_gap = run(url, fair=True)
        print(f"fair=True:        small's {SMALL_CALLS} calls took {fair_took:.2f} s")
        smallest = min(unfair_gap, fair_gap)
        print(f"smallest gap between any two starts: {smallest / 1000:.3f} ms (state clock; interval 50 ms)")
        return 0 if fair_took < unfair_took and smallest >= 50_000 else 1


if __name__ == "__main__":
    sys.exit(main())
