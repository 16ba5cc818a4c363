"""A cap per tenant: at most 2 of one customer's slow calls run at once, fleet-wide, under one fair rate.

A SaaS calls one API (20 calls per second, for everyone) for its
customers, and the API also allows each customer at most 2 calls in flight.
Customer "big" has 6 workers making slow calls (0.3 s) in a loop; customer
"small" makes 5 quick calls, one after another. ``tenant_max_running=2``
keeps big at 2 calls running at once, across every worker (each worker's
limiter is a shard, as a worker process's would be); big's other workers
wait at its cap without holding a turn of the fair queue, so small's calls
do not wait behind them.

Run::

    python examples/tenant_caps.py [STATE_URL]

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

BIG_WORKERS = 6
SMALL_CALLS = 5
CAP = 2


def main() -> int:
    with tempfile.TemporaryDirectory() as directory:
        url = sys.argv[1] if len(sys.argv) > 1 else (Path(directory) / "state.json").as_uri()
        options = {"rate": "20/second", "fair": True, "tenant_max_running": CAP}
        running = {"big": 0, "small": 0}
        peak = {"big": 0, "small": 0}
        starts: list[int] = []
        lock = threading.Lock()
        stop = threading.Event()

        def call(limiter: ratequeue.Limiter, tenant: str, seconds: float) -> None:
            with lock:  # (counted after the turn and before its release: never fewer than ran)
                running[tenant] += 1
                peak[tenant] = max(peak[tenant], running[tenant])
            time.sleep(seconds)  # the API call
            with lock:
                running[tenant] -= 1

        def big_worker() -> None:
            limiter = ratequeue.Limiter(url, name="examples-caps", **options)  # type: ignore[arg-type]
            while not stop.is_set():
                turn = limiter.acquire(tenant="big")
                try:
                    with lock:
                        starts.append(turn.start_us)
                    call(limiter, "big", 0.3)
                finally:
                    limiter.release(turn)  # its tenant's place goes back
            limiter.close()

        workers = [threading.Thread(target=big_worker) for _ in range(BIG_WORKERS)]
        for worker in workers:
            worker.start()
        time.sleep(0.5)
        small = ratequeue.Limiter(url, name="examples-caps", **options)  # type: ignore[arg-type]

        @small(tenant="small")  # the decorator releases the place when the call returns
        def small_call() -> None:
            call(small, "small", 0.01)

        began = time.monotonic()
        for _ in range(SMALL_CALLS):
            small_call()
        took = time.monotonic() - began
        cap_queue = [name for name in small.state.names("examples-caps:") if name.endswith(":big")]
        small.close()
        stop.set()
        for worker in workers:
            worker.join()
        smallest = min(b - a for a, b in itertools.pairwise(sorted(starts)))
        print(
            f"big:   at most {peak['big']} calls running at once "
            f"(tenant_max_running={CAP}, {BIG_WORKERS} workers)"
        )
        print(f"small: {SMALL_CALLS} calls took {took:.2f} s beside big's workers")
        print(f"big's places are held in the queue {cap_queue}")
        print(f"smallest gap between big's starts: {smallest / 1000:.3f} ms (state clock; interval 50 ms)")
        return 0 if peak["big"] == CAP and smallest >= 50_000 else 1


if __name__ == "__main__":
    sys.exit(main())
