"""Events overhead: what ``on_event`` and DEBUG logging cost a caller, against the code before them.

Two measures, each run on three versions of ratequeue, each in a process of
its own (``PYTHONPATH``):

* ``this checkout``: the work tree this script is in;
* ``131b393``: the parent of the commit that added logging and ``on_event``
  (no event, no log line: the baseline);
* ``0b39d2c``: that commit, whose hook ran in the acquire path, holding the
  limiter's lock, between the lateness check and the begin.

The old versions are extracted with ``git archive COMMIT ratequeue | tar -x``
into a temporary directory (``--no-old`` skips them).

**Idle acquire.** One limiter whose interval (1 µs) has always passed, so
every ``acquire()`` finds the queue idle: one state call and a begin, the
cheapest acquire there is, where a fixed cost shows the most. On
``memory://`` (the library's own cost) and a state file. Variants:

* ``none``: ``on_event=None``, the default;
* ``no-op``: ``on_event=`` a function that does nothing;
* ``prometheus``: ``on_event=ratequeue.prometheus.PrometheusMetrics`` on a
  registry of its own;
* ``debug log``: ``on_event=None`` and the ``ratequeue`` logger at DEBUG into
  a handler that formats every record (time, name, level, message) into a
  ``StringIO``.

Caller CPU is the acquiring thread's (``time.thread_time``): what the
caller's path costs. Process CPU adds every other thread's -- ratequeue's
reporter thread, which runs the hook since events are delivered off the
acquire path -- up to the delivery of the last event. Wall is the caller's
elapsed time per acquire.

**Paced acquires.** ``--threads`` threads share one limiter on
``memory://`` with a realistic interval (2 ms) and ``max_late`` on (0.3 ms,
the default): a begin's lateness is ``time.monotonic()`` right after
``acquire()`` returns minus the turn's ``local_start`` (what G7 bounds), and
the gaps are those between consecutive begins as the threads saw them.
Variants ``none``, ``prometheus``, ``debug log``, and ``slow hook``: a
hook that sleeps 2 ms on the start of every odd ticket (the review's case:
in ``0b39d2c`` it ran between the lateness check and the begin, holding the
limiter's lock).

The versions and variants take turns in rounds, so a change of the machine's
load during the run falls on all of them alike; idle figures are the median
round, paced figures pool every round's begins. Compare within one run: the
absolute numbers follow the machine and its load (printed first and last).

Run::

    python bench/events_overhead.py              # about a minute
    python bench/events_overhead.py --quick      # a few seconds
"""

from __future__ import annotations

import argparse
import gc
import io
import itertools
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

IDLE_VARIANTS = ("none", "no-op", "prometheus", "debug log")
PACED_VARIANTS = ("none", "prometheus", "debug log", "slow hook")
#: the paced run's interval (s)
PACED_INTERVAL = 0.002
#: the default max_late (s) of every version measured
MAX_LATE = 0.0003
#: the old versions: (commit, what it is)
OLD = (("131b393", "before events"), ("0b39d2c", "hook in the path"))
ROOT = Path(__file__).resolve().parent.parent
LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


# --------------------------------------------------------------------------- the worker (one version)


def _setup(variant: str) -> tuple[Any, Callable[[], None]]:
    """The ``on_event`` hook of ``variant``, and what undoes its logging setup."""
    logger = logging.getLogger("ratequeue")
    if variant == "no-op":
        return (lambda event: None), lambda: None
    if variant == "prometheus":
        from prometheus_client import CollectorRegistry

        from ratequeue.prometheus import PrometheusMetrics

        return PrometheusMetrics(CollectorRegistry()), lambda: None
    if variant == "slow hook":  # the review's case: 2 ms asleep on the start of every odd ticket

        def slow(event: Any) -> None:
            if event.kind == "start" and (event.ticket or 0) % 2:
                time.sleep(0.002)

        return slow, lambda: None
    if variant == "debug log":
        handler = logging.StreamHandler(io.StringIO())
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        level, propagate = logger.level, logger.propagate
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
        logger.propagate = False

        def undo() -> None:
            logger.removeHandler(handler)
            logger.setLevel(level)
            logger.propagate = propagate

        return None, undo
    return None, lambda: None


def _limiter(url: str, name: str, interval: float, hook: Any) -> Any:
    import ratequeue

    extra = {"on_event": hook} if hook is not None else {}
    return ratequeue.Limiter(url, name=name, interval=interval, **extra)


def _delivered() -> None:
    """Wait until the events reported so far reached their hooks (this checkout has a reporter)."""
    try:
        from ratequeue.events import flush
    except ImportError:  # 131b393, 0b39d2c: delivered in the path already
        return
    flush(10.0)


def idle_round(url: str, variant: str, index: int, acquires: int) -> dict[str, float]:
    """Per acquire: caller CPU, process CPU (up to the last event's delivery) and wall seconds."""
    hook, undo = _setup(variant)
    limiter = _limiter(url, f"bench-events-{variant.replace(' ', '-')}-{index}", 1e-6, hook)
    try:
        for _ in range(min(50, acquires)):  # warm up: the record exists, the lead has settled
            limiter.acquire()
        _delivered()
        gc.collect()
        cpu, process, wall = time.thread_time(), time.process_time(), time.perf_counter()
        for _ in range(acquires):
            limiter.acquire()
        elapsed, caller = time.perf_counter() - wall, time.thread_time() - cpu
        _delivered()
        total = time.process_time() - process
        return {"cpu": caller / acquires, "process": total / acquires, "wall": elapsed / acquires}
    finally:
        undo()
        limiter.close()


def paced_round(variant: str, index: int, threads: int, acquires: int) -> dict[str, list[float]]:
    """The lateness of every begin (s) and the begin times, ``threads`` threads sharing one limiter."""
    hook, undo = _setup(variant)
    name = f"bench-events-paced-{variant.replace(' ', '-')}-{index}-{os.getpid()}"
    limiter = _limiter(f"memory://{name}", name, PACED_INTERVAL, hook)
    lateness: list[float] = []
    begins: list[float] = []
    start = threading.Barrier(threads)

    def worker() -> None:
        start.wait()
        for _ in range(acquires):
            turn = limiter.acquire()
            now = time.monotonic()
            lateness.append(now - turn.local_start)
            begins.append(now)

    try:
        limiter.acquire()  # the record exists, the lead has settled a little
        running = [threading.Thread(target=worker) for _ in range(threads)]
        for thread in running:
            thread.start()
        for thread in running:
            thread.join()
        _delivered()
    finally:
        undo()
        limiter.close()
    return {"lateness": lateness, "begins": begins}


def worker_main(task: dict[str, Any]) -> None:
    """Run one round of every variant this version has, taking turns; print the results as JSON."""
    import inspect

    import ratequeue

    hooks = "on_event" in inspect.signature(ratequeue.Limiter).parameters
    out: dict[str, Any] = {"ratequeue": str(Path(ratequeue.__file__).parent), "idle": {}, "paced": {}}
    for state, url, acquires in task["idle"]:
        for variant in IDLE_VARIANTS:
            if not hooks and variant != "none":
                continue  # 131b393: no hook, and no log line to format
            out["idle"][f"{state}/{variant}"] = idle_round(url, variant, task["index"], acquires)
    for variant in PACED_VARIANTS:
        if not hooks and variant != "none":
            continue
        out["paced"][variant] = paced_round(variant, task["index"], task["threads"], task["paced"])
    print(json.dumps(out))


# --------------------------------------------------------------------------- the driver


def extract(commit: str, directory: Path) -> Path:
    """``ratequeue/`` at ``commit`` of this checkout, extracted into ``directory/commit``."""
    target = directory / commit
    target.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", commit, "ratequeue"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
    return target


def run_worker(path: Path, task: dict[str, Any]) -> dict[str, Any]:
    """One worker process with ``path`` first on ``PYTHONPATH``; its results."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(path), env.get("PYTHONPATH")) if p)
    done = subprocess.run(
        [sys.executable, __file__, "--worker", json.dumps(task)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"the worker for {path} failed:\n{done.stderr}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    if Path(result["ratequeue"]).resolve() != (path / "ratequeue").resolve():
        raise SystemExit(f"the worker imported ratequeue from {result['ratequeue']}, not {path}")
    return result


def pct(values: list[float], p: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker_main(json.loads(sys.argv[2]))
        return
    from _common import checkout, print_machine, table

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--acquires", type=int, default=2000, help="idle acquires per round on memory")
    parser.add_argument("--file-acquires", type=int, default=300, help="idle acquires per round on a file")
    parser.add_argument("--paced", type=int, default=150, help="paced acquires per thread per round")
    parser.add_argument("--threads", type=int, default=3, help="threads sharing the paced limiter")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (default 5)")
    parser.add_argument("--no-old", action="store_true", help="measure this checkout only")
    parser.add_argument("--quick", action="store_true", help="a smoke run of a few seconds")
    args = parser.parse_args()
    if args.quick:
        args.acquires, args.file_acquires, args.paced, args.rounds = 300, 50, 40, 2
    print_machine()
    print(f"this checkout: {checkout(ROOT)}\n")
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch)
        versions = [("this checkout", ROOT)]
        if not args.no_old:
            versions += [(f"{commit} ({what})", extract(commit, directory)) for commit, what in OLD]
        idle: dict[tuple[str, str], list[dict[str, float]]] = {}
        paced: dict[tuple[str, str], dict[str, list[float]]] = {}
        for index in range(args.rounds):
            for version, path in versions:
                state_file = (directory / f"state-{index}-{version.split()[0]}.json").as_uri()
                task = {
                    "index": index,
                    "idle": [
                        ("memory", "memory://bench-events", args.acquires),
                        ("file", state_file, args.file_acquires),
                    ],
                    "paced": args.paced,
                    "threads": args.threads,
                }
                result = run_worker(path, task)
                for key, figures in result["idle"].items():
                    idle.setdefault((version, key), []).append(figures)
                for variant, samples in result["paced"].items():
                    pooled = paced.setdefault((version, variant), {"lateness": [], "gaps": []})
                    pooled["lateness"] += samples["lateness"]
                    begins = sorted(samples["begins"])
                    pooled["gaps"] += [b - a for a, b in itertools.pairwise(begins)]
                print(f"round {index + 1}/{args.rounds}: {version} done", file=sys.stderr)

    base = {
        state: statistics.median(r["wall"] for r in idle["this checkout", f"{state}/none"])
        for state in ("memory", "file")
    }
    rows: list[tuple[object, ...]] = []
    for (version, key), rounds in idle.items():
        state, variant = key.split("/")
        cpu = statistics.median(r["cpu"] for r in rounds)
        process = statistics.median(r["process"] for r in rounds)
        wall = statistics.median(r["wall"] for r in rounds)
        rows.append(
            (
                state,
                version,
                variant,
                f"{cpu * 1e6:.2f}",
                f"{process * 1e6:.2f}",
                f"{wall * 1e6:.2f}",
                f"{wall / base[state]:.3f}",
            )
        )
    rows.sort(key=lambda row: (row[0] != "memory", row[1] != "this checkout", row[1]))
    print(
        f"Idle acquire, median of {args.rounds} rounds (µs per acquire; wall ratio against this "
        f"checkout's 'none' on the same state):\n"
    )
    headers = ["state", "version", "variant", "caller CPU", "process CPU", "wall", "wall ratio"]
    print(table(headers, rows, "lllrrrr"))
    short = PACED_INTERVAL - MAX_LATE
    print(
        f"\nPaced: {args.threads} threads, interval {PACED_INTERVAL * 1e3:g} ms, "
        f"max_late {MAX_LATE * 1e3:g} ms, "
        f"{args.paced} acquires per thread per round, {args.rounds} rounds pooled. Lateness: after "
        f"acquire() returned, past the turn's local_start (µs). Short gaps: begins closer than "
        f"interval - max_late = {short * 1e3:g} ms.\n"
    )
    rows = []
    for (version, variant), pooled in paced.items():
        late, spaces = pooled["lateness"], pooled["gaps"]
        under = sum(gap < short for gap in spaces)
        rows.append(
            (
                version,
                variant,
                len(late),
                f"{pct(late, 50) * 1e6:.0f}",
                f"{pct(late, 99) * 1e6:.0f}",
                f"{max(late) * 1e6:.0f}",
                f"{min(spaces) * 1e3:.3f}",
                f"{pct(spaces, 1) * 1e3:.3f}",
                f"{under} ({100 * under / len(spaces):.1f} %)",
            )
        )
    rows.sort(key=lambda row: (row[0] != "this checkout", row[0], PACED_VARIANTS.index(str(row[1]))))
    headers = [
        "version",
        "variant",
        "begins",
        "late p50",
        "late p99",
        "late max",
        "min gap ms",
        "p1 gap ms",
        "short gaps",
    ]
    print(table(headers, rows, "llrrrrrrr"))
    with open("/proc/loadavg") if Path("/proc/loadavg").exists() else io.StringIO("?") as load:
        print(f"\nload average at the end: {load.read().strip()}")


if __name__ == "__main__":
    main()
