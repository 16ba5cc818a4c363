"""A rate as an API publishes it, with a burst: "20 per second, up to 5 at once".

Ten threads ask for a turn at the same moment after the queue has been
idle: five start at once (the burst), the others one interval (50 ms) apart.
Then a call of cost 3, and ``try_acquire``, which never waits.

Run::

    python examples/rates_and_bursts.py [STATE_URL]

Without a URL the state is a JSON file in a new temporary directory.
"""

from __future__ import annotations

import itertools
import sys
import tempfile
import threading
from pathlib import Path

import ratequeue

RATE = "20/second"  # one start every 50 ms
BURST = 5
CALLERS = 10


def run(url: str) -> int:
    limiter = ratequeue.Limiter(url, name="examples-bursts", rate=RATE, burst=BURST)
    interval_us = round(limiter.interval * 1_000_000)
    barrier = threading.Barrier(CALLERS)
    turns: list[ratequeue.Turn] = []

    def caller() -> None:
        barrier.wait()
        turns.append(limiter.acquire(timeout=10))

    threads = [threading.Thread(target=caller) for _ in range(CALLERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    starts = sorted(turn.start_us for turn in turns)
    for turn in sorted(turns, key=lambda t: t.start_us):
        print(
            f"ticket {turn.ticket:>3}  starts at {(turn.start_us - starts[0]) / 1000:7.3f} ms (state clock)"
        )
    at_once = sum(1 for start in starts if start - starts[0] < interval_us)
    # the promise: any k consecutive starts span at least (k - BURST) intervals
    broken = sum(
        1
        for i, j in itertools.combinations(range(len(starts)), 2)
        if starts[j] - starts[i] < (j - i + 1 - BURST) * interval_us
    )
    print(f"{len(starts)} starts, {at_once} in the first interval, windows over the bound: {broken}")

    limiter.close()

    # Costs: a batch of 3 uses three starts' worth of a "20 per second, up to 3 at once" limit.
    batches = ratequeue.Limiter(url, name="examples-batches", rate=RATE, burst=3)
    batch = batches.acquire(cost=3)  # the whole burst at once
    single = batches.acquire()  # one unit comes back an interval later
    pair = batches.acquire(cost=2)  # two more units: two intervals after that
    # consecutive starts of total cost C span at least (C - burst) intervals: 1 -> 1, 2 -> 3
    print(
        f"cost 3, then 1, then 2: the 1 starts {(single.start_us - batch.start_us) / interval_us:g} and "
        f"the 2 {(pair.start_us - batch.start_us) / interval_us:g} intervals after the 3"
    )
    print(f"try_acquire right after: {'a turn' if batches.try_acquire() else 'None (no turn free, no wait)'}")
    batches.close()
    return 0 if broken == 0 else 1


def main() -> int:
    if len(sys.argv) > 1:
        return run(sys.argv[1])
    with tempfile.TemporaryDirectory() as directory:
        return run((Path(directory) / "state.json").as_uri())


if __name__ == "__main__":
    sys.exit(main())
