"""A published rate used as written (issue 31, item 1): refused or not, with and without the margin.

``--procs`` processes share ``rate="R/second"`` (default 10/s) through one
state and call a referee service as soon as each ``acquire()`` returns,
``--calls`` calls each. The referee (``bench/referee.py``) stamps each
arrival with the kernel's receive time and judges it twice:

* **strict**: refused if it came less than ``1/R`` after the last accepted
  call (tolerance 0);
* **sliding window**: refused if R calls arrived in the second before it
  (counted over the same arrivals, every one of which a sliding-window
  service would have let through while none was refused).

Each state runs twice in one go: with the default margin (``max_late``, 0.3
ms a start) and with ``margin=0`` (the rate exactly as written, as before
the margin). Printed: refusals of each kind, the rate kept (calls per
second between the first and the last arrival, of R), and the smallest
arrival gap.

Run::

    python bench/published_rate.py [--rate 10] [--procs 8] [--calls 15] [--states file,redis] [--hog 0]
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import busy_loops, state_url
from referee import Referee, RefereeClient

import ratequeue


def _caller(
    url: str, name: str, rate: str, referee: str, calls: int, who: str, margin: float | None, go: Any
) -> None:
    client = RefereeClient(referee)
    client.connect()
    limiter = ratequeue.Limiter(url, name=name, rate=rate, margin=margin)
    try:
        go.wait(60)
        for _ in range(calls):
            limiter.acquire()
            client.call(who)
    finally:
        limiter.close()


def run(url: str, name: str, rate: float, procs: int, calls: int, margin: float | None) -> dict[str, float]:
    """One run: the refusals of each kind, the rate kept (of ``rate``) and the smallest gap (ms)."""
    context = multiprocessing.get_context("spawn")
    go = context.Event()
    with Referee(interval=1 / rate) as referee:
        workers = [
            context.Process(
                target=_caller, args=(url, name, f"{rate:g}/second", referee.url, calls, f"p{i}", margin, go)
            )
            for i in range(procs)
        ]
        for worker in workers:
            worker.start()
        time.sleep(1.0 + 0.2 * procs)  # (they import ratequeue and connect meanwhile)
        go.set()
        for worker in workers:
            worker.join(600)
        stats = referee.stats()
    arrivals = sorted(arrival.t_ns for arrival in stats.arrivals)
    count = round(rate)
    crowded = sum(1 for i in range(len(arrivals) - count) if arrivals[i + count] - arrivals[i] < 10**9)
    span = (arrivals[-1] - arrivals[0]) / 1e9
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    return {
        "strict": stats.rejected,
        "sliding": crowded,
        "calls": len(arrivals),
        "kept": 100 * (len(arrivals) - 1) / span / rate,
        "smallest": min(gaps) / 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=10.0)
    parser.add_argument("--procs", type=int, default=8)
    parser.add_argument("--calls", type=int, default=15)
    parser.add_argument("--states", default="file,redis")
    parser.add_argument("--redis-url")
    parser.add_argument("--hog", type=int, default=0, help="busy loops run beside")
    args = parser.parse_args()
    print(f"# load {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores, {args.hog} busy loop(s) beside")
    print(f"# {args.procs} processes x {args.calls} calls at rate={args.rate:g}/second, one referee per run")
    print()
    print(
        "| state | margin | calls | refused (strict) | refused (sliding window) | rate kept | smallest gap |"
    )
    print("|---|---|--:|--:|--:|--:|--:|")
    with busy_loops(args.hog):
        for kind in args.states.split(","):
            with (
                tempfile.TemporaryDirectory() as tmp,
                state_url(kind, args, f"file://{tmp}/state.json") as url,
            ):
                for margin, said in ((None, "0.3 ms (default)"), (0.0, "0 (as before)")):
                    name = f"published-{kind}-{said[0]}-{time.monotonic_ns()}"
                    r = run(url, name, args.rate, args.procs, args.calls, margin)
                    print(
                        f"| {kind} | {said} | {r['calls']:g} | {r['strict']:g} | {r['sliding']:g} "
                        f"| {r['kept']:.1f} % | {r['smallest']:.3f} ms |"
                    )
    print(f"\n# load {os.getloadavg()[0]:.2f} after")


if __name__ == "__main__":
    main()
