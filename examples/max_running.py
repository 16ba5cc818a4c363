"""A cap on running jobs across processes: an API that allows 50 requests a second, 2 at a time.

Three worker processes send 8 slow requests each through one limiter
name with ``rate="50/second"`` and ``max_running=2``. Each request holds
its place from its turn until the end of its ``with`` block, so no more
than two requests run at once across all three processes, while starts
stay 20 ms apart. Every process appends when each request begins and ends
to a shared log; the parent reads it and prints the most that ever ran at
once, as the API would count them.

Then a worker takes a place and is killed (SIGKILL) while its request
runs: it never gives the place back, so its lease (1 s here) has to run
out first. The parent times how long the place stays taken.

Run::

    python examples/max_running.py [STATE_URL]

Without a URL the state is a JSON file in a new temporary directory.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.synchronize
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

import ratequeue

NAME = "examples-max-running"
LEASE = 1.0


def worker(url: str, seed: int, log: str) -> None:
    """Send 8 requests of 30-90 ms, each inside the limiter; log their begins and ends."""
    rng = random.Random(seed)
    limiter = ratequeue.Limiter(url, name=NAME, rate="50/second", max_running=2, lease=LEASE)
    with open(log, "a", buffering=1) as out:
        for request in range(8):
            with limiter:  # waits for a turn *and* a place; the place is given back on exit
                out.write(f"begin {seed}.{request} {time.monotonic()!r}\n")
                time.sleep(rng.uniform(0.03, 0.09))  # the request runs
                out.write(f"end {seed}.{request} {time.monotonic()!r}\n")
    limiter.close()


def hold_until_killed(url: str, ready: multiprocessing.synchronize.Event) -> None:
    """Take a place and keep it (its lease renewed in the background) until killed."""
    limiter = ratequeue.Limiter(url, name=NAME + "-kill", rate="50/second", max_running=1, lease=LEASE)
    limiter.acquire()
    ready.set()
    time.sleep(3600)


def most_at_once(log: Path) -> tuple[int, int]:
    """How many requests the log shows, and the most that ran at once."""
    events = []
    for line in log.read_text().splitlines():
        kind, _, at = line.split()
        events.append((float(at), 1 if kind == "begin" else -1))
    running = most = 0
    for _, change in sorted(events):
        running += change
        most = max(most, running)
    return len(events) // 2, most


def run(url: str, directory: Path) -> int:
    log = directory / "requests.log"
    ctx = multiprocessing.get_context("spawn")
    workers = [ctx.Process(target=worker, args=(url, seed, str(log))) for seed in range(3)]
    for process in workers:
        process.start()
    for process in workers:
        process.join(60)
    requests, most = most_at_once(log)
    print(f"{requests} requests from 3 processes, at most {most} running at once (max_running=2)")

    ready = ctx.Event()
    holder = ctx.Process(target=hold_until_killed, args=(url, ready))
    holder.start()
    ready.wait(60)
    os.kill(holder.pid, signal.SIGKILL)  # type: ignore[arg-type]
    killed = time.monotonic()
    holder.join(60)
    limiter = ratequeue.Limiter(url, name=NAME + "-kill", rate="50/second", max_running=1, lease=LEASE)
    with limiter:
        waited = time.monotonic() - killed
    limiter.close()
    print(f"a killed holder's place came back after {waited:.2f} s (lease {LEASE:g} s)")
    return 0 if most <= 2 and requests == 24 and waited <= LEASE + 0.5 else 1


def main() -> int:
    with tempfile.TemporaryDirectory() as directory:
        url = sys.argv[1] if len(sys.argv) > 1 else (Path(directory) / "state.json").as_uri()
        return run(url, Path(directory))


if __name__ == "__main__":
    sys.exit(main())
