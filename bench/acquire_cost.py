"""The library's own cost per ``acquire()``: this checkout beside an older one, timed in turns.

Measured in fresh processes that import ratequeue from each checkout, the
two checkouts taking turns (their order alternating round by round), so a
change of the machine's load falls on both alike:

* **idle acquire**, µs per call: one thread, a queue whose interval (1 µs)
  has always passed, ``acquire()`` back to back (the best of three batches
  per round), on ``memory://`` (the library alone, no I/O), ``file://`` and
  a Redis of our own; and the CPU time (user + system) per call, the least of
  the three batches;
* **contended CPU per start** on Redis: ``--procs`` processes (4) call
  ``acquire()`` back to back on one queue (interval 5 ms) for ``--seconds``;
  the CPU time (user + system) of all of them divided by their starts.

The peers' in-memory limiters are timed in the same run, for scale (one
thread, a limit that never refuses): limits' fixed window, throttled-py's
GCRA, pyrate-limiter's in-memory bucket -- each where installed.

Each figure is the median over ``--rounds`` (5); the table gives the ratio
``this / before``. Run::

    python bench/acquire_cost.py --before /tmp/rq-before   # about two minutes
    python bench/acquire_cost.py --quick                   # this checkout alone, a smoke run
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Progress, busy_loops, checkout, machine, new_parser, redis_server, table

ROOT = Path(__file__).resolve().parent.parent

#: run in a fresh process with PYTHONPATH set to one checkout: prints {state: µs per idle acquire,
#: "cpu " + state: CPU µs (user + system) per idle acquire}
IDLE = """
import json, sys, time
import ratequeue
urls, n = json.loads(sys.argv[1]), int(sys.argv[2])
out = {"from": ratequeue.__file__}
for key, url in urls.items():
    limiter = ratequeue.Limiter(url, name="cost-" + str(time.monotonic_ns()), interval=1e-6)
    for _ in range(n // 10):
        limiter.acquire()
    best, cpu = float("inf"), float("inf")
    for _ in range(3):
        started, used = time.perf_counter(), time.process_time()
        for _ in range(n):
            limiter.acquire()
        best = min(best, (time.perf_counter() - started) / n * 1e6)
        cpu = min(cpu, (time.process_time() - used) / n * 1e6)
    out[key] = best
    out["cpu " + key] = cpu
    limiter.close()
print(json.dumps(out))
"""

#: one contending worker: acquires back to back until a wall-clock deadline; prints starts and CPU seconds
CONTENDER = """
import json, sys, time
import ratequeue
url, name, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
limiter = ratequeue.Limiter(url, name=name, interval=0.005)
limiter.acquire()
cpu, starts, end = time.process_time(), 0, time.monotonic() + seconds
while time.monotonic() < end:
    limiter.acquire()
    starts += 1
print(json.dumps([starts, time.process_time() - cpu]))
limiter.close()
"""

#: the peers, in this interpreter's packages: {peer: µs per allowed call}
PEERS = """
import json, time
out = {}
def timed(call, n=20000):
    for _ in range(n // 10):
        call()
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        for _ in range(n):
            call()
        best = min(best, (time.perf_counter() - started) / n * 1e6)
    return best
try:
    from limits import RateLimitItemPerSecond, storage, strategies
    limiter = strategies.FixedWindowRateLimiter(storage.MemoryStorage())
    item = RateLimitItemPerSecond(10**9)
    out["limits, fixed window"] = timed(lambda: limiter.hit(item, "k"))
except ImportError:
    pass
try:
    from throttled import RateLimiterType, Throttled, rate_limiter, store
    throttle = Throttled(key="k", using=RateLimiterType.GCRA.value,
                         quota=rate_limiter.per_sec(10**9, burst=10**9), store=store.MemoryStore())
    out["throttled-py, GCRA"] = timed(lambda: throttle.limit())
except ImportError:
    pass
try:
    from pyrate_limiter import Duration, Limiter, Rate
    bucket_limiter = Limiter(Rate(10**9, Duration.SECOND))
    out["pyrate-limiter, in-memory bucket"] = timed(lambda: bucket_limiter.try_acquire("k"))
except ImportError:
    pass
print(json.dumps(out))
"""


def run(code: str, tree: Path | None, *args: str) -> object:
    """Run ``code`` in a fresh interpreter importing ratequeue from ``tree``; its printed JSON."""
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=tree or tempfile.gettempdir(),  # ("python -c" puts its working directory first on sys.path)
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    if done.returncode != 0:
        raise SystemExit(f"a measuring process failed ({tree}):\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def contended_cpu(tree: Path, url: str, procs: int, seconds: float) -> float:
    """CPU seconds per start of ``procs`` processes contending on one Redis queue for ``seconds``."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    name = f"contend-{os.getpid()}-{tree.name}-{os.urandom(4).hex()}"
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", CONTENDER, url, name, str(seconds)],
            cwd=tree,
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(procs)
    ]
    results = [json.loads(worker.communicate(timeout=seconds + 120)[0]) for worker in workers]
    if any(worker.returncode for worker in workers):
        raise SystemExit(f"a contending process failed ({tree})")
    starts = sum(r[0] for r in results)
    return sum(r[1] for r in results) / max(1, starts)


def main(argv: list[str] | None = None) -> int:
    parser = new_parser(__doc__)
    parser.add_argument(
        "--before", type=Path, metavar="DIR", help="an older checkout to time beside this one"
    )
    parser.add_argument("--rounds", type=int, default=5, help="rounds, each timing every checkout once (5)")
    parser.add_argument(
        "--acquires", type=int, default=20000, help="idle acquires per batch on memory:// (20000)"
    )
    parser.add_argument("--procs", type=int, default=4, help="processes of the contended run (4)")
    parser.add_argument("--seconds", type=float, default=3.0, help="seconds of each contended run (3)")
    parser.add_argument(
        "--busy", type=int, default=0, help="busy-loop processes loading the cores meanwhile (0)"
    )
    parser.add_argument("--redis-url", help="use this Redis instead of starting one")
    parser.add_argument("--quick", action="store_true", help="one round, fewer acquires, 0.5 s of contention")
    args = parser.parse_args(argv)
    if args.before is not None and not (args.before / "ratequeue" / "__init__.py").is_file():
        parser.error(f"--before {args.before}: no ratequeue/ there")
    rounds, n, seconds = (1, 2000, 0.5) if args.quick else (args.rounds, args.acquires, args.seconds)
    trees = [("this", ROOT)] + ([("before", args.before)] if args.before else [])
    print(machine())
    for label, tree in trees:
        print(f"- {label}: {checkout(tree)}")
    rows: dict[str, dict[str, list[float]]] = {label: {} for label, _ in trees}
    peers: dict[str, list[float]] = {}
    progress = Progress(rounds * (len(trees) + 1), "acquire cost")
    with busy_loops(args.busy), redis_server(args.redis_url) as redis_url, \
            tempfile.TemporaryDirectory(prefix="ratequeue-cost-") as tmp:  # fmt: skip
        for round_ in range(rounds):
            order = trees if round_ % 2 == 0 else trees[::-1]
            for label, tree in order:
                progress.note(f"round {round_ + 1}: {label}")
                urls = {
                    "memory://": "memory://cost",
                    "file://": f"file://{tmp}/{label}.json",
                    "Redis": redis_url,
                }
                counts = {"memory://": n, "file://": max(200, n // 10), "Redis": max(200, n // 10)}
                for key, url in urls.items():
                    idle = run(IDLE, tree, json.dumps({key: url}), str(counts[key]))
                    if not idle["from"].startswith(str(tree.resolve())):  # type: ignore[index]
                        raise SystemExit(f"{label}: ratequeue came from {idle['from']}, not {tree}")  # type: ignore[index]
                    rows[label].setdefault(f"idle acquire, {key} (µs)", []).append(idle[key])  # type: ignore[index]
                    rows[label].setdefault(f"CPU per idle acquire, {key} (µs)", []).append(  # type: ignore[index]
                        idle["cpu " + key]  # type: ignore[index]
                    )
                cpu = contended_cpu(tree, redis_url, args.procs, seconds)
                rows[label].setdefault(f"CPU per contended start, Redis, {args.procs} procs (µs)", []).append(
                    cpu * 1e6
                )
                progress.step()
            for peer, cost in run(PEERS, None).items():  # type: ignore[attr-defined]
                peers.setdefault(peer, []).append(cost)
            progress.step()
    progress.close()
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"\n{rounds} round(s); medians; {args.busy} busy loop(s); load average now {load}\n")
    headers = ["measure", "this"] + (["before", "this / before"] if args.before else [])
    table_rows = []
    for measure, values in rows["this"].items():
        row: list[object] = [measure, f"{statistics.median(values):.1f}"]
        if args.before:
            old = statistics.median(rows["before"][measure])
            row += [f"{old:.1f}", f"{statistics.median(values) / old:.2f}"]
        table_rows.append(row)
    for peer, values in peers.items():
        table_rows.append(
            [f"peer: {peer} (µs)", f"{statistics.median(values):.1f}"] + (["", ""] if args.before else [])
        )
    print(table(headers, table_rows, "l" + "r" * (len(headers) - 1)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
