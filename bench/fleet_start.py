"""Fleet starts: the begin gaps of many processes' first turns, when they all start at once.

A deploy starts every worker of a fleet at the same moment, and each one's
first call to the state comes back late on a busy host. ``--procs``
processes (8) share one queue on a Redis of their own; each connects, then,
released together, takes ``--turns`` turns (3), noting ``time.monotonic()``
when each ``acquire()`` returns (one host, one clock). That is one round;
every round uses a fresh queue, so every round is a fleet start. For each
round the smallest gap between two consecutive begins is noted, and how late
the fleet's first begin truly was: its start on the state's clock, mapped
to this host's ``time.monotonic()`` with ``time.time() - time.monotonic()``
(right for a Redis on this host), against the moment its ``acquire()``
returned. The calls each process's first ``acquire()`` made are counted
where the limiter makes them.

``--compare DIR`` measures a second checkout in the same run, its rounds in
blocks alternating with this checkout's (``--block`` rounds each), so that
both see the same machine. ``--hog K`` runs K busy-loop processes
throughout.

Run::

    python bench/fleet_start.py --quick                        # a smoke run, about 15 s
    python bench/fleet_start.py --hog 2                        # 40 rounds, about 2 minutes
    python bench/fleet_start.py --hog 2 --compare /tmp/rq-before   # this checkout against an older one
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from _common import (
    CountingState,
    Gate,
    Progress,
    add_common,
    busy_loops,
    checkout,
    gaps,
    ms,
    new_parser,
    open_state,
    percentile,
    print_machine,
    redis_server,
    run_processes,
    table,
    wall_minus_monotonic,
)


@dataclass(frozen=True)
class Task:
    """What one worker process does: ``rounds`` fleet starts of ``turns`` turns each."""

    url: str
    interval: float
    rounds: int
    turns: int
    #: a prefix that makes every round's queue name new
    tag: str


def worker(index: int, task: Task, gate: Gate) -> dict[str, Any]:
    """One process: per round, a new limiter, connected, then ``task.turns`` turns from the gate."""
    import ratequeue

    offset = wall_minus_monotonic()
    rounds = []
    for k in range(task.rounds):
        state = CountingState(open_state(task.url))
        limiter = ratequeue.Limiter(state, name=f"{task.tag}-{k}", interval=task.interval)
        limiter.status()  # connect: the first acquire's calls are the protocol's, not a connect
        state.log.clear()
        gate.wait()
        turns = []
        first_calls = 0
        for j in range(task.turns):
            turn = limiter.acquire()
            begin = time.monotonic()
            if j == 0:
                first_calls = state.log.total
            turns.append((turn.start_us, begin))
        rounds.append({"turns": turns, "first_calls": first_calls})
        limiter.close()  # the queue is deleted by the parent: others may still be taking turns
        state.close()
    package = Path(ratequeue.__file__).parent
    digest = hashlib.sha1(b"".join(p.read_bytes() for p in sorted(package.rglob("*.py")))).hexdigest()[:10]
    return {"offset": offset, "rounds": rounds, "ratequeue": str(package), "source": digest}


def forget(url: str, tag: str) -> None:
    """Delete the queues whose names start with ``tag`` (on a Redis given by ``--redis-url``, too)."""
    state = open_state(url)
    try:
        for name in state.names(prefix=tag):
            state.reset(name)
    finally:
        state.close()


@dataclass
class Round:
    """One fleet start: every process's turns, merged."""

    version: str
    #: the smallest gap (s) between two consecutive begins of the round, and between which turns
    min_gap: float
    #: how late (s) the round's first begin was after its start, by the true clock
    first_lateness: float
    #: calls of each process's first acquire, summed, and of the process that began first
    first_calls: int
    leader_calls: int


def merge(version: str, results: list[dict[str, Any]], k: int) -> Round:
    """Round ``k`` of every worker's ``results``, as one :class:`Round`."""
    begins: list[tuple[float, float, int]] = []  # (begin, true lateness, calls of that process's first)
    for result in results:
        one = result["rounds"][k]
        for j, (start_us, begin) in enumerate(one["turns"]):
            lateness = begin - (start_us / 1e6 - result["offset"])
            begins.append((begin, lateness, one["first_calls"] if j == 0 else -1))
    begins.sort()
    leader = begins[0]
    return Round(
        version=version,
        min_gap=min(gaps([b[0] for b in begins])),
        first_lateness=leader[1],
        first_calls=sum(r["rounds"][k]["first_calls"] for r in results),
        leader_calls=leader[2],
    )


def summary(rounds: list[Round], interval: float, procs: int, max_late: float) -> list[str]:
    """One table row of ``rounds`` (one version)."""
    mins = [r.min_gap for r in rounds]
    late = [r.first_lateness for r in rounds]
    return [
        rounds[0].version,
        str(len(rounds)),
        ms(min(mins)),
        ms(percentile(mins, 10)),
        ms(percentile(mins, 50)),
        str(sum(m < interval - max_late for m in mins)),
        str(sum(m < interval - 0.0005 for m in mins)),
        ms(percentile(late, 50)),
        ms(percentile(late, 90)),
        ms(max(late)),
        f"{sum(r.first_calls for r in rounds) / (len(rounds) * procs):.2f}",
        f"{sum(r.leader_calls for r in rounds) / len(rounds):.2f}",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = new_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=40, help="fleet starts per checkout (40)")
    parser.add_argument("--block", type=int, default=10, help="rounds in a row of one checkout (10)")
    parser.add_argument("--procs", type=int, default=8, help="worker processes (8)")
    parser.add_argument("--turns", type=int, default=3, help="turns per process per round (3)")
    parser.add_argument("--interval", type=float, default=0.0105, help="the queue's interval, s (0.0105)")
    parser.add_argument("--hog", type=int, default=0, help="busy-loop processes running throughout (0)")
    parser.add_argument("--compare", metavar="DIR", help="also measure the ratequeue checkout in DIR")
    add_common(
        parser, quick="a smoke run: 4 rounds of 4 processes", plot="(no plots)", json="write the rounds here"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.block, args.procs = 4, 2, 4
    if min(args.rounds, args.block, args.procs, args.turns) < 1 or args.procs < 2 or not args.interval > 0:
        parser.error("--rounds, --block and --turns must be at least 1, --procs at least 2, --interval > 0")
    if args.compare and not (Path(args.compare) / "ratequeue" / "__init__.py").is_file():
        parser.error(f"--compare {args.compare}: no ratequeue/__init__.py there")

    import ratequeue
    from ratequeue.core.shard import DEFAULT_MAX_LATE

    here = str(Path(ratequeue.__file__).resolve().parent.parent)
    versions: dict[str, str | None] = {"this checkout": None}
    if args.compare:
        versions["--compare"] = str(Path(args.compare).resolve())
    print_machine()
    compared = f"; --compare: {checkout(args.compare)}" if args.compare else ""
    print(f"this checkout: {checkout(here)}{compared}")
    print(f"Load: {args.hog} busy-loop processes (`--hog`).\n")
    blocks = [min(args.block, args.rounds - b) for b in range(0, args.rounds, args.block)]
    progress = Progress(len(blocks) * len(versions), "fleet-start")
    rounds: list[Round] = []
    sources: dict[str, set[str]] = {v: set() for v in versions}
    started = time.monotonic()
    with busy_loops(args.hog), redis_server(args.redis_url) as url:
        for b, size in enumerate(blocks):
            for version, path in versions.items():
                progress.note(f"{version}: rounds {sum(blocks[:b]) + 1}-{sum(blocks[: b + 1])}")
                if path is not None:
                    sys.path.insert(0, path)  # spawned workers import ratequeue from there
                try:
                    task = Task(url, args.interval, size, args.turns, f"fleet-{time.monotonic_ns()}")
                    results = run_processes(worker, [task] * args.procs, rounds=size)
                finally:
                    if path is not None:
                        sys.path.remove(path)
                sources[version].update(f"{r['ratequeue']} ({r['source']})" for r in results)
                forget(url, task.tag)
                rounds += [merge(version, results, k) for k in range(size)]
                progress.step()
    progress.close()

    interval, max_late = args.interval, DEFAULT_MAX_LATE
    print(
        f"**{args.procs} processes released together, {args.turns} turns each, a fresh queue every round;"
        f" interval {ms(interval)} ms, max_late {ms(max_late)} ms.** Times in ms.\n"
    )
    headers = [
        "checkout", "rounds", "min begin gap: min", "p10", "median",
        f"rounds < I - {ms(max_late, 1)}", "rounds < I - 0.5",
        "first begin's true lateness p50", "p90", "max",
        "calls of a first acquire", "of the first to begin",
    ]  # fmt: skip
    rows = [summary([r for r in rounds if r.version == v], interval, args.procs, max_late) for v in versions]
    print(table(headers, rows))
    print(
        "\nmin begin gap: per round, the smallest gap between consecutive begins (`time.monotonic()` when "
        "`acquire()` returned, all processes). The first begin's true lateness: its start on the state's "
        "clock mapped to this host's clock, to when its `acquire()` returned."
    )
    for version, seen in sources.items():
        print(f"{version} imported ratequeue from: {', '.join(sorted(seen))}")
    print(f"Wall time {time.monotonic() - started:.0f} s.")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rounds], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
