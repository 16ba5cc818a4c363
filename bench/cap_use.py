"""How busy a cap keeps its places when the jobs run in many processes (``max_running``).

8 processes (``--processes``) share one queue with ``max_running=3``
(``--cap``) and an interval of 1 ms, which never holds a start back; each
runs its share of 320 jobs (``--jobs``), each sleeping a uniformly drawn 10
to 40 ms (``--job-ms``) between its turn and its release. A place freed in
one process is wanted by waiters in the others: it reaches them at once
where the state tells of freed places (``State.watch``: Redis pub/sub, the
file state's inotify doorbells, PostgreSQL's LISTEN/NOTIFY), else at their
next recheck (100 ms).

Reported per state: the place use, (sum of the jobs' durations) / (cap x
wall time), the wall time from the first begin to the last end, the starts
per second, and the most jobs seen running at once (never above the cap).

    python bench/cap_use.py                        # file and Redis (a redis-server of its own)
    python bench/cap_use.py --before /tmp/base     # an older checkout timed beside, same servers
    python bench/cap_use.py --states file,redis,postgresql   # and a PostgreSQL of its own (initdb)

``--before DIR`` runs this script again with ``--rq-path DIR`` (DIR first on
``sys.path``, so that its workers import that checkout's ratequeue).
"""

from __future__ import annotations

import os
import sys


def _rq_path(argv: list[str]) -> str | None:
    """The ``--rq-path`` value in ``argv``, read before anything imports ratequeue."""
    for i, arg in enumerate(argv):
        if arg == "--rq-path" and i + 1 < len(argv):
            return os.path.abspath(argv[i + 1])
        if arg.startswith("--rq-path="):
            return os.path.abspath(arg.split("=", 1)[1])
    return None


RQ_PATH = _rq_path(sys.argv[1:])
if RQ_PATH and (not sys.path or sys.path[0] != RQ_PATH):
    sys.path.insert(0, RQ_PATH)  # spawned workers get this sys.path from us
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (RQ_PATH, os.environ.get("PYTHONPATH")) if p)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import multiprocessing  # noqa: E402
import random  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import _common  # noqa: E402

#: seconds between two starts: far below the jobs' length, so that only the cap holds a start back
INTERVAL = 0.001
#: the longest any wait of a run may take before it is declared broken
WAIT = 300.0
STATES = ("file", "redis", "postgresql")
#: the states run unless --states says
DEFAULT_STATES = ("file", "redis")


def worker(
    url: str, name: str, cap: int, jobs: int, job_ms: tuple[float, float], seed: int, go: Any, out: Any
) -> None:
    """One process: ``jobs`` turns, each a sleep of ``job_ms`` drawn uniformly; reports the spans."""
    from ratequeue import Limiter

    try:
        limiter = Limiter(url, name=name, interval=INTERVAL, max_running=cap)
        draw = random.Random(seed)
        spans = []
        go.wait(WAIT)
        for _ in range(jobs):
            turn = limiter.acquire(timeout=WAIT)
            begin = time.monotonic()
            time.sleep(draw.uniform(*job_ms) / 1000)
            end = time.monotonic()
            limiter.release(turn)
            spans.append((begin, end))
        limiter.close()
        out.put(("spans", spans))
    except BaseException as exc:
        out.put(("error", repr(exc)))
        raise


def peak(spans: list[tuple[float, float]]) -> int:
    """The most spans that overlap at any moment."""
    events = sorted([(begin, 1) for begin, _ in spans] + [(end, -1) for _, end in spans])
    running = most = 0
    for _, change in events:
        running += change
        most = max(most, running)
    return most


def run(url: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """One run on the state at ``url``: its figures."""
    context = multiprocessing.get_context("spawn")
    go, out = context.Barrier(args.processes + 1), context.Queue()
    name = f"cap-use-{time.time_ns()}"
    shares = [args.jobs // args.processes + (i < args.jobs % args.processes) for i in range(args.processes)]
    workers = [
        context.Process(
            target=worker, args=(url, name, args.cap, share, tuple(args.job_ms), seed * 1000 + i, go, out)
        )
        for i, share in enumerate(shares)
    ]
    for process in workers:
        process.start()
    spans: list[tuple[float, float]] = []
    try:
        go.wait(WAIT)
        for _ in workers:
            kind, value = out.get(timeout=WAIT)
            if kind == "error":
                raise SystemExit(f"a worker failed: {value}")
            spans.extend(value)
    finally:
        for process in workers:
            process.join(WAIT)
            if process.is_alive():
                process.kill()
    wall = max(end for _, end in spans) - min(begin for begin, _ in spans)
    busy = sum(end - begin for begin, end in spans)
    return {
        "use": busy / (args.cap * wall),
        "wall": wall,
        "starts_per_s": len(spans) / wall,
        "peak": peak(spans),
        "jobs": len(spans),
    }


def measure(args: argparse.Namespace, redis_url: str, postgresql_url: str) -> dict[str, list[dict[str, Any]]]:
    """Every run on every state asked for."""
    results: dict[str, list[dict[str, Any]]] = {}
    for state in args.states:
        for index in range(args.runs):
            if state == "file":
                directory = tempfile.mkdtemp(prefix="ratequeue-cap-use-")
                url = (Path(directory) / "state.json").as_uri()
            elif state == "postgresql":
                # (a table per process: the checkout run beside has a function of its own)
                url = f"{postgresql_url}?table=cap_use_{os.getpid()}"
            else:
                url = f"{redis_url}?prefix=cap-use:"
            results.setdefault(state, []).append(run(url, args, seed=index))
    return results


def before(args: argparse.Namespace, redis_url: str, postgresql_url: str) -> dict[str, list[dict[str, Any]]]:
    """The same runs with the checkout at ``--before``, in a process of its own."""
    with tempfile.NamedTemporaryFile(suffix=".json") as written:
        command = [
            sys.executable,
            __file__,
            "--rq-path",
            args.before,
            "--json",
            written.name,
            "--redis-url",
            redis_url,
            # (a checkout older than the PostgreSQL runs knows no --postgresql-url)
            *(["--postgresql-url", postgresql_url] if "postgresql" in args.states else []),
            "--states",
            ",".join(args.states),
            "--runs",
            str(args.runs),
            "--processes",
            str(args.processes),
            "--cap",
            str(args.cap),
            "--jobs",
            str(args.jobs),
            "--job-ms",
            *map(str, args.job_ms),
        ]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        loaded: dict[str, list[dict[str, Any]]] = json.loads(Path(written.name).read_text())
        return loaded


def median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def table(rows: dict[str, dict[str, list[dict[str, Any]]]], args: argparse.Namespace) -> str:
    """The figures as a Markdown table: a row per checkout and state (medians of the runs)."""
    lines = [
        f"{args.processes} processes, max_running={args.cap}, {args.jobs} jobs of "
        f"{args.job_ms[0]:g}-{args.job_ms[1]:g} ms (uniform), interval {INTERVAL * 1000:g} ms; "
        f"median of {args.runs} run(s)",
        "",
        "| checkout | state | place use | (lowest-highest) | wall (s) | starts/s | most running |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for checkout, results in rows.items():
        for state, runs in results.items():
            lines.append(
                f"| {checkout} | {state} | {median([r['use'] for r in runs]):.1%} "
                f"| {min(r['use'] for r in runs):.1%}-{max(r['use'] for r in runs):.1%} "
                f"| {median([r['wall'] for r in runs]):.2f} "
                f"| {median([r['starts_per_s'] for r in runs]):.1f} "
                f"| {max(r['peak'] for r in runs)} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--states", default=",".join(DEFAULT_STATES), help="comma-separated: file, redis, postgresql"
    )
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--cap", type=int, default=3, help="max_running")
    parser.add_argument("--jobs", type=int, default=320, help="jobs in all, shared by the processes")
    parser.add_argument("--job-ms", type=float, nargs=2, default=[10.0, 40.0], metavar=("LOW", "HIGH"))
    parser.add_argument("--runs", type=int, default=1, help="runs per state (the median is shown)")
    parser.add_argument("--redis-url", help="a Redis to use (default: a redis-server of its own)")
    parser.add_argument("--postgresql-url", help="a PostgreSQL to use (default: a cluster of its own)")
    parser.add_argument("--before", metavar="DIR", help="time the checkout at DIR beside this one")
    parser.add_argument("--rq-path", metavar="DIR", help="import ratequeue from DIR (first on sys.path)")
    parser.add_argument("--json", help="write the figures here as JSON")
    args = parser.parse_args()
    args.states = [state for state in args.states.split(",") if state]
    unknown = set(args.states) - set(STATES)
    if unknown:
        parser.error(f"unknown states: {', '.join(sorted(unknown))}")
    with contextlib.ExitStack() as servers:
        redis_url = servers.enter_context(
            _common.redis_server(args.redis_url if "redis" in args.states else "unused")
        )
        postgresql_url = args.postgresql_url or "unused"
        if "postgresql" in args.states and not args.postgresql_url:
            postgresql_url = servers.enter_context(_common.postgresql_server())
        rows: dict[str, dict[str, list[dict[str, Any]]]] = {}
        if args.before:
            rows[f"before ({Path(args.before).name})"] = before(args, redis_url, postgresql_url)
        this = "this checkout" if not args.rq_path else args.rq_path
        rows[this] = results = measure(args, redis_url, postgresql_url)
    if args.json:
        Path(args.json).write_text(json.dumps(results))
    _common.print_machine()
    print(table(rows, args))


if __name__ == "__main__":
    main()
