"""Rate sweep: how close ratequeue comes to one start per interval, interval by interval, state by state.

For every state (the JSON file, Redis, MongoDB), every interval (10, 5, 2, 1,
0.5 and 0.2 ms) and 1 and 4 worker processes, the workers call
``Limiter.acquire()`` back to back for ``--seconds`` (so someone always
waits), and each start is recorded twice: its ``Turn.start_us`` on the
state's clock (the file: the host's wall clock; Redis: ``TIME``; MongoDB:
``$$NOW``, whole milliseconds), and ``time.monotonic()`` just after
``acquire`` returned, which is when the job really begins (one host, one
clock for every process). The table shows:

* the achieved rate against the target, on the state's clock;
* the state-clock gaps under the interval (guarantee G1: always 0) and the
  smallest state-clock gap;
* the gaps the jobs saw: smallest, 1st percentile and median;
* the 99th percentile of the wake-up lateness (the job's local begin minus
  ``Turn.local_start``), which is what makes a local gap shorter than the
  interval;
* state calls per start (1 means every acquire was one round-trip) and CPU
  time of the workers per start.

The last table gives the smallest interval each state sustains at 95 % of
its target or better.

Run::

    python bench/rate_sweep.py                        # about two minutes
    python bench/rate_sweep.py --quick                # a smoke run of a few seconds
    python bench/rate_sweep.py --backends redis --procs 4 --intervals 1,0.5
    python bench/rate_sweep.py --plot bench/results   # also write PNGs there

It starts its own ``redis-server`` and ``secantusd-py`` on free ports (or uses
``--redis-url`` / ``--mongodb-url``) and keeps state files in a temporary
directory. secantusd-py is a MongoDB-compatible server written in Python: its
numbers say more about secantusd-py than about MongoDB.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _common import (
    CountingState,
    Gate,
    Progress,
    Spacing,
    add_backends,
    add_common,
    chosen,
    ms,
    new_parser,
    num,
    numbers,
    open_state,
    percentile,
    prepare_queue,
    print_machine,
    print_written,
    pyplot,
    run_processes,
    state_url,
    table,
    unique_name,
    us,
    wall_minus_monotonic,
)

BACKENDS = ["floor", "file", "redis", "redis-cluster", "mongodb", "postgresql"]
#: the pseudo-state of the floor rows: a schedule, no state at all
FLOOR = "floor"
INTERVALS_MS = [10, 5, 2, 1, 0.5, 0.2]
PROCS = [1, 4]
#: the share of the target rate a state must reach to "sustain" an interval
SUSTAINED = 0.95


@dataclass(frozen=True)
class Job:
    """One round of one worker: acquire back to back on queue ``name`` for ``seconds``."""

    url: str
    name: str
    interval: float
    seconds: float
    procs: int
    #: the limiter's fixed lead in seconds, or None for the adaptive one
    lead: float | None = None


def worker(index: int, jobs: list[Job], gate: Gate) -> list[dict[str, Any]]:
    """One process: every round in ``jobs``; per round its starts, state calls and CPU time."""
    import ratequeue

    out = []
    states: dict[str, CountingState] = {}
    for job in jobs:
        if job.url == FLOOR:
            out.append(_floor(index, job, gate))
            continue
        if job.url not in states:
            states[job.url] = CountingState(open_state(job.url))
        state = states[job.url]
        limiter = ratequeue.Limiter(state, name=job.name, interval=job.interval, lead=job.lead)
        limiter.status()  # connect
        state.log.clear()
        offset = wall_minus_monotonic()
        t0 = gate.wait()
        end = t0 + job.seconds
        cpu = time.process_time()
        starts: list[tuple[int, float, float]] = []
        while True:
            remaining = end - time.monotonic()
            if remaining <= 0:
                break
            try:
                turn = limiter.acquire(timeout=remaining)
            except ratequeue.AcquireTimeout:
                break
            starts.append((turn.start_us, time.monotonic(), turn.local_start))
        out.append(
            {
                "starts": starts,
                "cpu": time.process_time() - cpu,
                "calls": dict(state.log.calls),
                "answers": dict(state.log.answers),
                "offset": offset,
            }
        )
    for state in states.values():
        state.close()
    return out


def _floor(index: int, job: Job, gate: Gate) -> dict[str, Any]:
    """The floor: no state, each process sleeps to its own slots of one global schedule.

    Process ``index`` of ``procs`` begins at slots ``index``, ``index + procs``,
    ... of the schedule ``t0 + k * interval``: the spacing a perfect
    coordinator with free round-trips would give, so its local gaps show the
    wake-up jitter of ``time.sleep`` on this machine under this load.
    """
    t0 = gate.wait()
    cpu = time.process_time()
    starts: list[tuple[int, float, float]] = []
    k = index
    while True:
        slot = t0 + k * job.interval
        if slot > t0 + job.seconds:
            break
        delay = slot - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        starts.append((round((slot - t0) * 1e6), time.monotonic(), slot))
        k += job.procs
    return {"starts": starts, "cpu": time.process_time() - cpu, "calls": {}, "answers": {}, "offset": None}


@dataclass
class Result:
    """One state, interval and number of processes."""

    backend: str
    procs: int
    interval: float
    spacing: Spacing
    state_rate: float
    late_p99: float
    #: how far ``Turn.local_start`` strays from the start on this host's clock: p99 minus median
    mapping_p99: float
    calls: dict[str, int]
    answers: dict[str, int]
    cpu: float

    @property
    def ratio(self) -> float:
        return self.state_rate * self.interval

    @property
    def starts(self) -> int:
        return self.spacing.starts


def combine(
    backend: str, procs: int, interval: float, rounds: list[dict[str, Any]], host_clock: bool
) -> Result:
    """The result of one round, from every process's part of it.

    ``host_clock``: the state's clock is this host's wall clock (the file, a
    Redis on this host), so ``Turn.local_start`` can be checked against it.
    """
    starts = [s for r in rounds for s in r["starts"]]
    errors = [
        local_start - (start_us / 1e6 - r["offset"])
        for r in rounds
        if host_clock and r["offset"] is not None
        for start_us, _, local_start in r["starts"]
    ]
    state_times = sorted(s[0] / 1e6 for s in starts)
    local = [s[1] for s in starts]
    span = state_times[-1] - state_times[0] if len(state_times) > 1 else math.nan
    calls: dict[str, int] = {}
    answers: dict[str, int] = {}
    for r in rounds:
        for key, value in r["calls"].items():
            calls[key] = calls.get(key, 0) + value
        for key, value in r["answers"].items():
            answers[key] = answers.get(key, 0) + value
    spacing = Spacing.of(local, interval, state_times)
    return Result(
        backend=backend,
        procs=procs,
        interval=interval,
        spacing=spacing,
        # the floor's "state" times are its schedule: its rate is the one the jobs saw
        state_rate=spacing.rate if backend == FLOOR else (len(state_times) - 1) / span if span else math.nan,
        late_p99=percentile([s[1] - s[2] for s in starts], 99),
        mapping_p99=percentile(errors, 99) - percentile(errors, 50),
        calls=calls,
        answers=answers,
        cpu=sum(r["cpu"] for r in rounds),
    )


def backend_url(backend: str, args: argparse.Namespace, tmp: Path) -> contextlib.AbstractContextManager[str]:
    """A state URL for ``backend``: a server of our own (or the one given), or a directory for files."""
    if backend == FLOOR:
        return contextlib.nullcontext(FLOOR)
    return state_url(backend, args, f"file://{tmp}")


def sweep(
    backend: str,
    base: str,
    procs: int,
    intervals: list[float],
    seconds: float,
    lead: float | None = None,
    local_redis: bool = True,
) -> list[Result]:
    """Every interval for one state and number of processes, with one set of worker processes."""
    names = [unique_name(f"sweep-{procs}p-{i * 1e3:g}ms") for i in intervals]
    # a fresh file per round for the file state
    urls = [f"{base}/{name}.json" for name in names] if backend == "file" else [base] * len(intervals)
    jobs = [
        Job(url, name, i, seconds, procs, lead) for url, name, i in zip(urls, names, intervals, strict=True)
    ]

    def prepare(k: int) -> None:
        if backend != FLOOR:
            prepare_queue(urls[k], names[k], intervals[k])

    results = run_processes(worker, [jobs] * procs, rounds=len(jobs), before_start=prepare)
    host_clock = backend == "file" or (backend == "redis" and local_redis)
    return [
        combine(backend, procs, interval, [r[k] for r in results], host_clock)
        for k, interval in enumerate(intervals)
    ]


def report(results: list[Result]) -> str:
    """The Markdown tables of a sweep."""
    rows = []
    for r in results:
        s = r.spacing
        n = max(1, s.starts)
        rows.append(
            [
                r.backend,
                r.procs,
                f"{r.interval * 1e3:g}",
                s.starts,
                num(r.state_rate, 0),
                f"{100 * r.ratio:.1f} %" if not math.isnan(r.ratio) else "—",
                s.state_under,
                ms(s.state_min_gap),
                ms(s.local_min_gap),
                ms(s.local_p1_gap),
                ms(s.local_median_gap),
                ms(r.late_p99),
                ms(r.mapping_p99),
                num(sum(r.calls.values()) / n),
                num(r.answers.get("passed", 0) / n),
                us(r.cpu / n),
            ]
        )
    main = table(
        [
            "state",
            "procs",
            "interval ms",
            "starts",
            "achieved /s",
            "of target",
            "state gaps < interval",
            "state min gap",
            "local min gap",
            "local p1 gap",
            "local median gap",
            "late p99",
            "local_start error p99",
            "state calls/start",
            "passed/start",
            "CPU µs/start",
        ],
        rows,
        "l" + "r" * 15,
    )
    sustained = []
    for backend in dict.fromkeys(r.backend for r in results):
        for procs in sorted({r.procs for r in results if r.backend == backend}):
            ok = [r for r in results if r.backend == backend and r.procs == procs and r.ratio >= SUSTAINED]
            best = min(ok, key=lambda r: r.interval) if ok else None
            sustained.append(
                [
                    backend,
                    procs,
                    f"{best.interval * 1e3:g} ms" if best else "none of those tried",
                    f"{best.state_rate:.0f}/s ({100 * best.ratio:.1f} %)" if best else "—",
                ]
            )
    summary = table(["state", "procs", "smallest interval at ≥ 95 %", "achieved there"], sustained, "lrrr")
    return (
        "Gaps and lateness in ms. *state* gaps are on the state's clock, *local* gaps on "
        "`time.monotonic()` when each job began.\n\n" + main + "\n\n" + summary
    )


def plot(results: list[Result], directory: Path) -> list[Path]:
    """Achieved share of the target, and the 1st-percentile local gap, against the interval."""
    plt = pyplot()
    directory.mkdir(parents=True, exist_ok=True)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for backend in dict.fromkeys(r.backend for r in results):
        for procs in sorted({r.procs for r in results if r.backend == backend}):
            chosen = sorted(
                (r for r in results if r.backend == backend and r.procs == procs), key=lambda r: r.interval
            )
            style = {
                "marker": "o",
                "linestyle": "-" if procs > 1 else "--",
                "color": "grey" if backend == FLOOR else None,
                "label": f"{backend}, {procs} proc{'s' if procs > 1 else ''}",
            }
            if backend != FLOOR:
                left.plot([r.interval * 1e3 for r in chosen], [100 * r.ratio for r in chosen], **style)
            # spacing is judged where the rate is sustained: elsewhere the gaps are simply long
            kept = [r for r in chosen if backend == FLOOR or r.ratio >= SUSTAINED]
            right.plot(
                [r.interval * 1e3 for r in kept],
                [100 * r.spacing.local_p1_gap / r.interval for r in kept],
                **style,
            )
    left.axhline(100 * SUSTAINED, color="grey", linewidth=0.8)
    left.set_ylabel("achieved rate, % of target (grey line: 95 %)")
    left.set_ylim(0, 105)
    right.set_ylabel("1st-percentile local gap, % of the interval")
    right.set_title("where ≥ 95 % of the rate is reached", fontsize=9)
    right.set_ylim(0, 105)
    for ax in (left, right):
        ax.set_xscale("log")
        ax.set_xlabel("interval, ms")
        ax.legend(fontsize=7)
    fig.suptitle("Rate sweep (floor: processes sleeping to a shared schedule, no state)")
    fig.tight_layout()
    path = directory / "rate-sweep.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return [path]


def main(argv: list[str] | None = None) -> int:
    parser = new_parser(__doc__)
    add_backends(parser, BACKENDS, "states to sweep (floor,file,redis,redis-cluster,mongodb,postgresql)")
    parser.add_argument(
        "--intervals", default=",".join(f"{i:g}" for i in INTERVALS_MS), help="intervals in ms (10,...,0.2)"
    )
    parser.add_argument("--procs", default=",".join(map(str, PROCS)), help="numbers of processes (1,4)")
    parser.add_argument("--seconds", type=float, default=1.5, help="seconds per interval (1.5)")
    parser.add_argument(
        "--lead-ms", type=float, help="give every limiter this fixed lead (default: the adaptive lead)"
    )
    add_common(
        parser,
        mongodb_url=True,
        quick="a smoke run: intervals 10 and 1 ms, 0.3 s each",
        plot="write PNG plots into DIR",
    )
    args = parser.parse_args(argv)
    backends = chosen(parser, args.backends, BACKENDS, "backends")
    intervals = [x / 1e3 for x in numbers("10,1" if args.quick else args.intervals)]
    procs_list = numbers(args.procs, int)
    seconds = 0.3 if args.quick else args.seconds
    print_machine()
    results: list[Result] = []
    progress = Progress(len(backends) * len(procs_list), "rate sweep")
    with tempfile.TemporaryDirectory(prefix="ratequeue-sweep-") as tmp:
        for backend in backends:
            with backend_url(backend, args, Path(tmp)) as url:
                for procs in procs_list:
                    progress.note(f"{backend}, {procs} processes, {len(intervals)} intervals")
                    lead = None if args.lead_ms is None else args.lead_ms / 1e3
                    results += sweep(
                        backend, url, procs, intervals, seconds, lead, local_redis=not args.redis_url
                    )
                    progress.step(f"{backend}, {procs} processes done")
    progress.close()
    print(report(results))
    if args.plot:
        print_written(plot(results, args.plot))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
