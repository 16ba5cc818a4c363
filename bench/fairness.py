"""Fair queues against arrival order, in one run: a small tenant beside a big one, and many tenants.

Two measurements, each made with ``fair=True`` and without, in turns, on
the file state and Redis (a ``redis-server`` of its own, or ``--redis-url``):

* **big and small** (issue 30's walk-through): rate R; one process with
  ``--big-shards`` threads, each its own limiter (as that many worker
  processes would be), acquiring for tenant "big" in a loop; a second later
  another process acquires 5 times in a row for tenant "small". Printed:
  how long small's 5 turns took, the rate the fleet kept (of R), and the
  smallest begin gaps on the state's clock and at the begins (``acquire()``
  returning, on this host's monotonic clock, which every process shares).
* **many tenants**: ``--tenants`` tenants spread over ``--procs`` processes,
  each process one ``Queue`` keeping two jobs of each of its tenants queued,
  for ``--seconds``. Printed: the spread of the tenants' shares of the starts
  around the even share, and the CPU and state calls per start.

Run::

    python bench/fairness.py [--rate 20] [--big-shards 20] [--tenants 1000] [--procs 8]
        [--seconds 30] [--many-rate 500] [--hog 0]

``--hog N`` runs N busy loops beside (the load is printed).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import multiprocessing
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import redis_server

import ratequeue
from ratequeue.events import flush


def _hog(stop: Any) -> None:
    while not stop.is_set():
        pass


def _big(url: str, name: str, rate: float, fair: bool, shards: int, out: Any, stop: Any) -> None:
    options: dict[str, Any] = {"fair": True} if fair else {}
    begins: list[tuple[int, float]] = []
    lock = threading.Lock()

    def loop() -> None:
        limiter = ratequeue.Limiter(url, name=name, interval=1 / rate, **options)
        while not stop.is_set():
            turn = limiter.acquire(tenant="big" if fair else None)
            began = time.monotonic()
            with lock:
                begins.append((turn.start_us, began))
        limiter.close()

    threads = [threading.Thread(target=loop) for _ in range(shards)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    out.put(("big", begins))


def _small(url: str, name: str, rate: float, fair: bool, out: Any) -> None:
    options: dict[str, Any] = {"fair": True} if fair else {}
    limiter = ratequeue.Limiter(url, name=name, interval=1 / rate, **options)
    began = time.monotonic()
    begins = []
    for _ in range(5):
        turn = limiter.acquire(tenant="small" if fair else None)
        begins.append((turn.start_us, time.monotonic()))
    took = time.monotonic() - began
    limiter.close()
    out.put(("small", (took, begins, began)))


def big_and_small(url: str, rate: float, fair: bool, shards: int) -> dict[str, float]:
    context = multiprocessing.get_context("spawn")
    out, stop = context.Queue(), context.Event()
    name = f"bench-fair-{fair}-{time.time_ns()}"
    big = context.Process(target=_big, args=(url, name, rate, fair, shards, out, stop))
    big.start()
    time.sleep(1.0 + 0.5)  # the big process's start-up, then a second of its load
    small = context.Process(target=_small, args=(url, name, rate, fair, out))
    small.start()
    results = dict([out.get(timeout=120)])
    stop.set()
    results.update([out.get(timeout=120)])
    big.join()
    small.join()
    took, small_begins, first = results["small"]
    last = small_begins[-1][1]
    begins = sorted(results["big"] + small_begins)
    window = [b for b in begins if first <= b[1] <= last]
    interval_us = 1e6 / rate
    state_gaps = [b[0] - a[0] for a, b in itertools.pairwise(begins)]
    local = sorted(b[1] for b in begins)
    local_gaps = [b - a for a, b in itertools.pairwise(local)]
    return {
        "small_took": took,
        "rate_kept": (len(window) - 1) / (last - first) / rate if last > first else float("nan"),
        "state_gap_ms": min(state_gaps) / 1000,
        "begin_gap_ms": min(local_gaps) * 1000,
        "under": sum(gap < (interval_us - 500) / 1e6 for gap in local_gaps),
        "gaps": len(local_gaps),
    }


def _tenants_worker(
    url: str, name: str, rate: float, fair: bool, tenants: list[str], seconds: float, out: Any, go: Any
) -> None:
    calls = Counter[str]()
    options: dict[str, Any] = {"fair": True} if fair else {}
    queue = ratequeue.Queue(
        url, name=name, interval=1 / rate, on_event=lambda event: calls.update([event.kind]), **options
    )
    started = Counter[str]()
    lock = threading.Lock()
    go.wait()
    until = time.monotonic() + seconds

    def job(tenant: str) -> None:
        if time.monotonic() < until:
            with lock:
                started[tenant] += 1
            queue.add(job, tenant, tenant=tenant if fair else None)

    cpu = resource.getrusage(resource.RUSAGE_SELF)
    for tenant in tenants:
        for _ in range(2):
            queue.add(job, tenant, tenant=tenant if fair else None)
    time.sleep(seconds + 0.2)
    after = resource.getrusage(resource.RUSAGE_SELF)
    queue.close(cancel_pending=True)
    used = (after.ru_utime - cpu.ru_utime) + (after.ru_stime - cpu.ru_stime)
    flush(5.0)
    out.put((dict(started), used, calls["call"]))


def many_tenants(
    url: str, rate: float, fair: bool, tenants: int, procs: int, seconds: float
) -> dict[str, float]:
    context = multiprocessing.get_context("spawn")
    out, go = context.Queue(), context.Event()
    name = f"bench-tenants-{fair}-{time.time_ns()}"
    names = [f"tenant-{i}" for i in range(tenants)]
    workers = [
        context.Process(
            target=_tenants_worker, args=(url, name, rate, fair, names[p::procs], seconds, out, go)
        )
        for p in range(procs)
    ]
    for worker in workers:
        worker.start()
    time.sleep(2.0)  # the workers' start-up
    go.set()
    started: Counter[str] = Counter()
    cpu = calls = 0.0
    for _ in workers:
        counts, used, made = out.get(timeout=seconds + 120)
        started.update(counts)
        cpu += used
        calls += made
    for worker in workers:
        worker.join(60)
    total = sum(started.values())
    even = total / tenants
    shares = [started.get(tenant, 0) / even for tenant in names]
    return {
        "starts": total,
        "rate_kept": total / seconds / rate,
        "share_min": min(shares),
        "share_max": max(shares),
        "share_sd": statistics.pstdev(shares),
        "within_10": sum(0.9 <= share <= 1.1 for share in shares) / tenants,
        "cpu_us": cpu / total * 1e6 if total else float("nan"),
        "calls": calls / total if total else float("nan"),
    }


def _measure(url: str, state: str, args: argparse.Namespace) -> None:
    print(f"\n## big ({args.big_shards} shards) and small (5 acquires) at {args.rate:g}/s, {state} state")
    print(
        "| order | round | small's 5 turns | rate kept | smallest gap, state clock "
        "| smallest begin gap | begin gaps under I - 0.5 ms |"
    )
    print("|---|--:|--:|--:|--:|--:|--:|")
    for round_ in range(1, args.rounds + 1):
        for fair in (False, True):
            r = big_and_small(url, args.rate, fair, args.big_shards)
            print(
                f"| {'fair' if fair else 'arrival'} | {round_} | {r['small_took']:.2f} s "
                f"| {r['rate_kept']:.1%} | {r['state_gap_ms']:.3f} ms | {r['begin_gap_ms']:.3f} ms "
                f"| {r['under']:.0f} of {r['gaps']:.0f} |",
                flush=True,
            )
    if args.skip_many:
        return
    print(
        f"\n## {args.tenants} tenants over {args.procs} processes, {args.seconds:g} s at "
        f"{args.many_rate:g}/s, {state} state"
    )
    print(
        "| order | starts | rate kept | shares (of even) min / max / sd | within ±10 % "
        "| CPU per start | state calls per start |"
    )
    print("|---|--:|--:|--:|--:|--:|--:|")
    for fair in (False, True):
        r = many_tenants(url, args.many_rate, fair, args.tenants, args.procs, args.seconds)
        print(
            f"| {'fair' if fair else 'arrival'} | {r['starts']:.0f} | {r['rate_kept']:.1%} "
            f"| {r['share_min']:.2f} / {r['share_max']:.2f} / {r['share_sd']:.3f} "
            f"| {r['within_10']:.1%} | {r['cpu_us']:.0f} µs | {r['calls']:.2f} |",
            flush=True,
        )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--big-shards", type=int, default=20)
    parser.add_argument("--tenants", type=int, default=1000)
    parser.add_argument("--procs", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--many-rate", type=float, default=500.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--hog", type=int, default=0)
    parser.add_argument("--skip-many", action="store_true")
    parser.add_argument("--states", default="file,redis", help="of file, redis (file,redis)")
    parser.add_argument("--redis-url", help="use this Redis instead of starting one of our own")
    args = parser.parse_args()
    context = multiprocessing.get_context("spawn")
    stop = context.Event()
    hogs = [context.Process(target=_hog, args=(stop,)) for _ in range(args.hog)]
    for hog in hogs:
        hog.start()
    print(f"load before: {os.getloadavg()[0]:.2f}, busy loops: {args.hog}, cores: {os.cpu_count()}")
    try:
        for state in args.states.split(","):
            with contextlib.ExitStack() as stack:
                if state == "file":
                    directory = stack.enter_context(tempfile.TemporaryDirectory())
                    url = (Path(directory) / "state.json").as_uri()
                elif state == "redis":
                    url = stack.enter_context(redis_server(args.redis_url))
                else:
                    raise SystemExit(f"--states: {state!r} is not file or redis")
                _measure(url, state, args)
    finally:
        stop.set()
        for hog in hogs:
            hog.join()
    print(f"\nload after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
