"""Weighted shares across processes (issue 30): two tenants of weights 3 and 1, each in a process of its own.

Each process runs ``--shards`` threads, each with its own limiter (as that
many worker processes would), acquiring in a loop for its tenant on one fair
queue (``weights={"heavy": 3}``) at ``--rate`` for ``--seconds``. Printed per
state: each tenant's starts and share (3 : 1 is 75 % / 25 %), and the rate
kept, counted on the state's clock between the first and the last start of
the measured window (the first second is left out: the processes start up).

Run::

    python bench/weighted_shares.py [--rate 50] [--shards 6] [--seconds 10] [--states file,redis]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import state_url

import ratequeue

WEIGHTS = {"heavy": 3}


def _tenant(url: str, name: str, rate: float, tenant: str, shards: int, go: Any, stop: Any, out: Any) -> None:
    starts: list[int] = []
    lock = threading.Lock()

    def loop() -> None:
        limiter = ratequeue.Limiter(url, name=name, rate=f"{rate:g}/second", fair=True, weights=WEIGHTS)
        go.wait(60)
        while not stop.is_set():
            turn = limiter.acquire(tenant=tenant)
            with lock:
                starts.append(turn.start_us)
        limiter.close()

    threads = [threading.Thread(target=loop) for _ in range(shards)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    out.put((tenant, starts))


def run(url: str, rate: float, shards: int, seconds: float) -> dict[str, float]:
    """One run: each tenant's starts in the measured window, and the rate kept there."""
    context = multiprocessing.get_context("spawn")
    go, stop, out = context.Event(), context.Event(), context.Queue()
    name = f"bench-weighted-{time.time_ns()}"
    procs = [
        context.Process(target=_tenant, args=(url, name, rate, tenant, shards, go, stop, out))
        for tenant in ("heavy", "light")
    ]
    for proc in procs:
        proc.start()
    time.sleep(2.0)  # (both import ratequeue and open their limiters)
    go.set()
    time.sleep(seconds)
    stop.set()
    starts = dict(out.get(timeout=120) for _ in procs)
    for proc in procs:
        proc.join(60)
    first = min(min(found) for found in starts.values()) + 1_000_000  # leave the first second out
    window = {tenant: [s for s in found if s >= first] for tenant, found in starts.items()}
    every = sorted(s for found in window.values() for s in found)
    span = (every[-1] - every[0]) / 1e6
    return {
        "heavy": len(window["heavy"]),
        "light": len(window["light"]),
        "kept": 100 * (len(every) - 1) / span / rate,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=50.0)
    parser.add_argument("--shards", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--states", default="file,redis")
    parser.add_argument("--redis-url")
    args = parser.parse_args()
    print(f"# load {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    shards = f"{args.shards} shards per tenant, one process each"
    print(f"# rate {args.rate:g}/s, weights heavy 3 : light 1, {shards}")
    print()
    print("| state | heavy's starts | light's starts | heavy's share (75 % wanted) | rate kept |")
    print("|---|--:|--:|--:|--:|")
    for kind in args.states.split(","):
        with tempfile.TemporaryDirectory() as tmp, state_url(kind, args, f"file://{tmp}/state.json") as url:
            r = run(url, args.rate, args.shards, args.seconds)
            share = 100 * r["heavy"] / (r["heavy"] + r["light"])
            print(f"| {kind} | {r['heavy']:g} | {r['light']:g} | {share:.1f} % | {r['kept']:.1f} % |")
    print(f"\n# load {os.getloadavg()[0]:.2f} after")


if __name__ == "__main__":
    main()
