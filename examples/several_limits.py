"""Two limits at once: "20 per second" and "10 per second, up to 3 at once".

``ratequeue.all_of`` waits for a turn of each, scarcest first (the same
order for every caller, so no deadlock), and moves a turn that the wait for
another made late instead of beginning it late or wasting it. Two threads
call it with the limits in opposite orders; a turn is given up only when
the other thread started on that limit before it could be moved.

Run::

    python examples/several_limits.py [STATE_URL]

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

CALLS = 5  # per thread


def run(url: str) -> int:
    fast = ratequeue.Limiter(url, name="examples-fast", rate="20/second")
    slow = ratequeue.Limiter(url, name="examples-slow", rate="10/second")
    begins: list[float] = []
    starts: dict[str, list[int]] = {"fast": [], "slow": []}
    late = 0.0
    lock = threading.Lock()

    def caller(limiters: tuple[ratequeue.Limiter, ratequeue.Limiter]) -> None:
        nonlocal late
        for _ in range(CALLS):
            turns = ratequeue.all_of(*limiters, timeout=10)  # the turns in the order given
            begin = time.monotonic()
            with lock:
                begins.append(begin)
                for limiter, turn in zip(limiters, turns, strict=True):
                    starts["fast" if limiter is fast else "slow"].append(turn.start_us)
                    late = max(late, begin - turn.local_start)

    threads = [threading.Thread(target=caller, args=(pair,)) for pair in ((fast, slow), (slow, fast))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wasted, smallest_gaps = 0, []
    for name, limiter in (("fast", fast), ("slow", slow)):
        record = limiter.state.read(limiter.name).record
        handed_out = record.pos if record else 0
        wasted += handed_out - len(starts[name])
        smallest = min(b - a for a, b in itertools.pairwise(sorted(starts[name])))
        smallest_gaps.append(smallest >= round(limiter.interval * 1_000_000))
        print(f"{name}: {handed_out} starts for {len(begins)} calls, smallest gap {smallest / 1000:.3f} ms")
    print(
        f"{len(begins)} calls, none deadlocked; turns given up: {wasted}; each call began at most "
        f"{late * 1000:.3f} ms after its turns' starts"
    )
    fast.close()
    slow.close()
    return 0 if all(smallest_gaps) and len(begins) == 2 * CALLS else 1


def main() -> int:
    if len(sys.argv) > 1:
        return run(sys.argv[1])
    with tempfile.TemporaryDirectory() as directory:
        return run((Path(directory) / "state.json").as_uri())


if __name__ == "__main__":
    sys.exit(main())
