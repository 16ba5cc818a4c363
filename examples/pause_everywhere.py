"""Pause a queue in every process at once, and resume it: an incident at the service you call.

Two worker processes call a service at 20 starts a second through one
queue name. Once they have made ten calls, the parent pauses the whole queue, as an
operator would (``Limiter.pause_everywhere()``; from a shell:
``ratequeue pause URL NAME``): a flag in the queue's shared record, so no
process starts a job while it is set, whatever process set it. A second
later it resumes the queue (``ratequeue resume URL NAME``). The workers log
each start on the state's clock; the parent prints how many started before,
during and after the pause, and the longest gap, which is the pause.

Run::

    python examples/pause_everywhere.py [STATE_URL]

Without a URL the state is a JSON file in a new temporary directory.
"""

from __future__ import annotations

import itertools
import multiprocessing
import multiprocessing.synchronize
import sys
import tempfile
import time
from pathlib import Path

import ratequeue

NAME = "examples-pause"


def worker(url: str, log: str, stop: multiprocessing.synchronize.Event) -> None:
    """Call the service at its turns until told to stop; log each start (state clock, us)."""
    limiter = ratequeue.Limiter(url, name=NAME, rate="20/second")
    with open(log, "a", buffering=1) as out:
        while not stop.is_set():
            try:
                turn = limiter.acquire(timeout=2.0)
            except ratequeue.AcquireTimeout:  # paused: ask again
                continue
            out.write(f"{turn.start_us}\n")
    limiter.close()


def run(url: str, directory: Path) -> int:
    log = directory / "starts.log"
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    workers = [ctx.Process(target=worker, args=(url, str(log), stop)) for _ in range(2)]
    for child in workers:
        child.start()
    operator = ratequeue.Limiter(url, name=NAME, rate="20/second")
    deadline = time.monotonic() + 60
    while (not log.exists() or len(log.read_text().split()) < 10) and time.monotonic() < deadline:
        time.sleep(0.05)  # the workers are up and calling
    operator.pause_everywhere()  # every process stops starting jobs
    paused_at = operator.status().now
    time.sleep(1.0)
    resumed_at = operator.status().now
    operator.resume_everywhere()
    time.sleep(1.5)
    stop.set()
    for child in workers:
        child.join(60)
    operator.close()
    starts = sorted(int(line) / 1e6 for line in log.read_text().split())
    # a start granted just before the pause lies up to its lead after it (two round-trips and
    # a little; a loaded host's file state can take tens of ms), or a late one moved on (G7)
    during = [s for s in starts if paused_at + 0.1 < s <= resumed_at]
    before = [s for s in starts if s <= paused_at]
    after = [s for s in starts if s > resumed_at]
    gaps = [later - earlier for earlier, later in itertools.pairwise(starts)]
    gap, smallest = max(gaps), min(gaps)
    print(f"{len(before)} starts before the pause, {len(during)} during it, {len(after)} after the resume")
    print(f"longest gap {gap:.2f} s (the pause), smallest gap {smallest * 1000:.1f} ms (interval 50 ms)")
    return 0 if not during and before and after and smallest >= 0.05 - 1e-6 else 1


def main() -> int:
    with tempfile.TemporaryDirectory() as directory:
        url = sys.argv[1] if len(sys.argv) > 1 else (Path(directory) / "state.json").as_uri()
        return run(url, Path(directory))


if __name__ == "__main__":
    sys.exit(main())
