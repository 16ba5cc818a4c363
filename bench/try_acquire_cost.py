"""What failed tries cost the callers that wait (issue 31, item 3), on the file state and Redis.

One process acquires in a loop at ``--interval`` for ``--seconds``; another
makes ``--tries`` ``try_acquire()`` calls spread over that time, each from a
fresh limiter closed at once (as short-lived callers do: a CLI, a request
handler). Printed per state: the worker's starts alone and beside the tries,
what the tries cost it (the starts lost), and how many tries won a turn.

Before ``try_take``, each try that got no turn kept a ticket nobody would
start: every caller behind it waited one interval more.

Run::

    python bench/try_acquire_cost.py [--interval 0.02] [--seconds 3] [--tries 40] [--states file,redis]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import state_url

import ratequeue


def _worker(url: str, name: str, interval: float, seconds: float, go: Any, out: Any) -> None:
    limiter = ratequeue.Limiter(url, name=name, interval=interval)
    try:
        go.wait()
        end = time.monotonic() + seconds
        starts = 0
        while time.monotonic() < end:
            limiter.acquire()
            starts += 1
        out.put(starts)
    finally:
        limiter.close()


def _tries(url: str, name: str, interval: float, seconds: float, tries: int, go: Any, out: Any) -> None:
    go.wait()
    won = 0
    begin = time.monotonic()
    for index in range(tries):
        time.sleep(max(0.0, begin + seconds * index / tries - time.monotonic()))
        limiter = ratequeue.Limiter(url, name=name, interval=interval)
        try:
            won += limiter.try_acquire() is not None
        finally:
            limiter.close()
    out.put(won)


def run(url: str, name: str, interval: float, seconds: float, tries: int) -> tuple[int, int]:
    """The worker's starts, and the tries' turns (``tries=0``: the worker alone)."""
    context = multiprocessing.get_context("spawn")
    go, starts, won = context.Event(), context.Queue(), context.Queue()
    worker = context.Process(target=_worker, args=(url, name, interval, seconds, go, starts))
    procs = [worker]
    if tries:
        procs.append(context.Process(target=_tries, args=(url, name, interval, seconds, tries, go, won)))
    for proc in procs:
        proc.start()
    time.sleep(1.0)  # (both have imported ratequeue and opened the state)
    go.set()
    result = starts.get(timeout=60), (won.get(timeout=60) if tries else 0)
    for proc in procs:
        proc.join(30)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interval", type=float, default=0.02)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--tries", type=int, default=40)
    parser.add_argument("--states", default="file,redis")
    parser.add_argument("--redis-url")
    args = parser.parse_args()
    print(f"# load {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; ratequeue from {ratequeue.__file__}")
    tries = f"{args.tries} tries from fresh limiters"
    print(f"# interval {args.interval * 1000:g} ms, {args.seconds:g} s, {tries}")
    print()
    print("| state | worker alone | worker beside the tries | starts lost | tries that won a turn |")
    print("|---|--:|--:|--:|--:|")
    for kind in args.states.split(","):
        with tempfile.TemporaryDirectory() as tmp, state_url(kind, args, f"file://{tmp}/state.json") as url:
            alone, _ = run(url, f"alone-{kind}", args.interval, args.seconds, 0)
            beside, won = run(url, f"beside-{kind}", args.interval, args.seconds, args.tries)
        print(f"| {kind} | {alone} | {beside} | {alone - beside} | {won} of {args.tries} |")
    print(f"\n# load {os.getloadavg()[0]:.2f} after")


if __name__ == "__main__":
    main()
