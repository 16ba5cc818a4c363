"""Several processes share one rate through a state file.

Each worker process builds its own ``Limiter`` with the same state and queue
name, and calls ``acquire()`` a few times. The processes share nothing but
the state file, yet their starts are spaced one interval apart on the state's
clock (for a file, the host's wall clock) and come in ticket order. The
parent collects every start and prints them in order with their gaps.

Run::

    python examples/multi_process.py [STATE_URL | default]

Without an argument the state is a JSON file in a new temporary directory.
``default`` uses the per-user default state file, which any other program on
this host using the same queue name shares. A ``memory://`` state cannot be
used: it lives inside one process.
"""

from __future__ import annotations

import itertools
import multiprocessing
import sys
import tempfile
from pathlib import Path

import ratequeue

INTERVAL = 0.05  # seconds between two starts, across all processes
PROCESSES = 3
CALLS_PER_PROCESS = 5
NAME = "examples-multi-process"


def worker(url: str | None, index: int) -> list[tuple[int, int, int]]:
    """Acquire CALLS_PER_PROCESS turns; return (start_us, ticket, process index) for each."""
    limiter = ratequeue.Limiter(url, name=NAME, interval=INTERVAL)
    turns = [limiter.acquire() for _ in range(CALLS_PER_PROCESS)]
    limiter.close()
    return [(turn.start_us, turn.ticket, index) for turn in turns]


def run(url: str | None) -> int:
    with ratequeue.open_state(url) as state:  # None: the per-user default file
        where = state.url
    if where.startswith("memory:"):
        print("a memory:// state lives inside one process; give a file:// URL", file=sys.stderr)
        return 2
    print(f"{PROCESSES} processes x {CALLS_PER_PROCESS} calls, interval {INTERVAL * 1000:g} ms, {where}")
    # "spawn" starts fresh interpreters, as on macOS and Windows: the workers
    # share nothing with this process but the state's URL
    context = multiprocessing.get_context("spawn")
    with context.Pool(PROCESSES) as pool:
        results = pool.starmap(worker, [(url, index) for index in range(1, PROCESSES + 1)])

    starts = sorted(itertools.chain.from_iterable(results))  # by start time
    interval_us = round(INTERVAL * 1_000_000)
    gaps: list[int] = []
    previous: int | None = None
    for start, ticket, index in starts:
        gap = "" if previous is None else f"gap {(start - previous) / 1000:7.3f} ms"
        if previous is not None:
            gaps.append(start - previous)
        previous = start
        print(f"process {index}  ticket {ticket:>5}  {gap}")
    under = sum(1 for gap in gaps if gap < interval_us)
    tickets = [ticket for _, ticket, _ in starts]
    in_order = tickets == sorted(tickets)
    print()
    print(
        f"{len(starts)} starts from {PROCESSES} processes, smallest gap {min(gaps) / 1000:.3f} ms "
        f"(state clock), gaps under the interval: {under}, "
        f"tickets in start order: {'yes' if in_order else 'NO'}"
    )
    return 0 if under == 0 and in_order else 1


def main() -> int:
    if len(sys.argv) > 1:
        return run(None if sys.argv[1] == "default" else sys.argv[1])
    with tempfile.TemporaryDirectory() as directory:
        return run((Path(directory) / "state.json").as_uri())


if __name__ == "__main__":
    sys.exit(main())
