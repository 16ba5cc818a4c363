"""Bursts: the starts of a bursty queue as they fall.

A queue with a rate and a burst ``B`` (``ratequeue.Limiter(url, name=...,
rate="50/second", burst=B)``) lets up to ``B`` starts come at once after an
idle spell, then one per interval ``I``. What it guarantees, on the state's
clock: any ``k`` consecutive starts span at least ``(k - B)`` intervals, so
every window of length ``w`` holds at most ``B + w / I`` starts.

For every burst (1 and 10) and every state (the JSON file, Redis, MongoDB),
the queue is created, its scripts loaded, and then left idle long enough for
the whole burst to come back. Then ``--procs`` worker processes are released
together (a barrier) and each acquires ``--turns`` turns back to back. Each
start is recorded twice: its ``Turn.start_us`` on the state's clock (the
file: the host's wall clock; Redis: ``TIME``; MongoDB: ``$$NOW``, whole
milliseconds) and ``time.monotonic()`` just after ``acquire`` returned, when
the job really begins. The table shows, per state and burst:

* the starts, and how many fell in the first interval after the first one
  (state clock; and, beside it, how many jobs began in the first interval
  after the first began, on the local clock);
* the most starts in any window of one interval and of five intervals,
  against the bound ``B + w / I``;
* the smallest gap after the burst (between the starts past the first
  ``B``: one interval when the queue is kept busy), and the rate past the
  burst, ``(starts - B) / (last start - first start)``, against the target
  (which it reaches when ``B`` starts come at once and then one per
  interval, and which the guarantee keeps it from passing);
* the violations of the bound: windows ``[t_i, t_j]`` between two starts,
  of any length, holding more than ``B + (t_j - t_i) / I`` starts (``0`` is
  the guarantee; it is counted, not asserted);
* the state calls per start, the retimes (a granted start moved later
  because its job would have begun more than ``max_late`` after it) and the
  *passed* answers (a ticket that can no longer start: a turn given up, and
  with it a place in the burst). ``--max-late none`` turns that check off.

With ``--plot DIR`` it draws ``burst-timeline.png``: one row per burst and
one column per state, each start a dot on the cumulative count of starts
(coloured by process) against the bound line ``B + t / I``.

Run::

    python bench/bursts.py                         # about half a minute
    python bench/bursts.py --quick                 # a smoke run
    python bench/bursts.py --states redis --bursts 1,5,20 --rate 100/second
    python bench/bursts.py --max-late none         # no lateness check in the limiters
    python bench/bursts.py --plot bench/results    # also write the PNG there

It starts its own ``redis-server`` and ``secantusd-py`` on free ports (or uses
``--redis-url`` / ``--mongodb-url``) and keeps state files in a temporary
directory. secantusd-py is a MongoDB-compatible server written in Python.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _common import (
    CountingState,
    Gate,
    Progress,
    add_common,
    chosen,
    gaps,
    machine,
    ms,
    new_parser,
    num,
    numbers,
    open_state,
    print_machine,
    print_written,
    pyplot,
    run_processes,
    state_url,
    table,
    unique_name,
)

from ratequeue.core.shard import DEFAULT_MAX_LATE
from ratequeue.rates import parse_rate

STATES = ["file", "redis", "mongodb"]
BURSTS = [1, 10]
#: the windows, in intervals, whose most crowded instance the table shows
WINDOWS = [1, 5]
#: the idle spell before the workers are released, beyond the ``B`` intervals the burst needs
IDLE_MARGIN = 0.1


@dataclass(frozen=True)
class Job:
    """One round of one worker: ``turns`` acquires, back to back, on queue ``name``."""

    url: str
    name: str
    interval: float
    burst: int
    turns: int
    #: the limiters' ``max_late`` (s), or ``None`` to turn the lateness check off
    max_late: float | None = DEFAULT_MAX_LATE


def worker(index: int, jobs: list[Job], gate: Gate) -> list[dict[str, Any]]:
    """One process: every round in ``jobs``; per round its (start_us, begin) pairs and its state calls."""
    import ratequeue

    out = []
    for job in jobs:
        state = CountingState(open_state(job.url))
        limiter = ratequeue.Limiter(
            state, name=job.name, interval=job.interval, burst=job.burst, max_late=job.max_late
        )
        limiter.status()  # connect before the barrier
        state.log.clear()
        gate.wait()
        starts = []
        for _ in range(job.turns):
            turn = limiter.acquire(timeout=60)
            starts.append((turn.start_us, time.monotonic()))
        limiter.close()
        state.close()
        out.append({"starts": starts, "calls": dict(state.log.calls), "answers": dict(state.log.answers)})
    return out


def prepare(url: str, name: str, interval: float, burst: int) -> None:
    """Create queue ``name``'s record and load its scripts, then leave it idle until the burst is back.

    ``burst + 1`` acquires: the first ``burst`` start at once (``take_and_try``),
    the last waits once (``try_start``), so Redis has loaded both scripts
    before the measured round. The idle spell after them is long enough for
    the whole burst to come back.
    """
    import ratequeue

    limiter = ratequeue.Limiter(url, name=name, interval=interval, burst=burst)
    try:
        for _ in range(burst + 1):
            limiter.acquire(timeout=60)
    finally:
        limiter.close()
    time.sleep((burst + 1) * interval + IDLE_MARGIN)


@dataclass
class Result:
    """One state and burst: every start, on the state's clock and as the jobs began."""

    state: str
    burst: int
    interval: float
    #: (start on the state's clock in µs, local begin in s, process), in the order of the starts
    starts: list[tuple[int, float, int]]
    #: the state operations the workers called, and the answers they got (started, wait, passed)
    calls: dict[str, int] = dataclasses.field(default_factory=dict)
    answers: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def interval_us(self) -> int:
        return round(self.interval * 1e6)

    @property
    def state_times(self) -> list[int]:
        return [s[0] for s in self.starts]

    def in_first_interval(self) -> int:
        """Starts less than one interval after the first, on the state's clock."""
        times = self.state_times
        return sum(1 for t in times if t - times[0] < self.interval_us)

    def begun_in_first_interval(self) -> int:
        """Jobs that began less than one interval after the first began, on the local clock."""
        begins = sorted(s[1] for s in self.starts)
        return sum(1 for t in begins if t - begins[0] < self.interval)

    def most_in_window(self, intervals: int) -> int:
        """The most starts in any closed window ``[t, t + intervals * I]`` (state clock)."""
        times, width = self.state_times, intervals * self.interval_us
        best, high = 0, 0
        for low, t in enumerate(times):
            high = max(high, low)
            while high + 1 < len(times) and times[high + 1] - t <= width:
                high += 1
            best = max(best, high - low + 1)
        return best

    def bound(self, intervals: int) -> int:
        """The most starts the guarantee allows in a window of ``intervals`` intervals: ``B + w / I``."""
        return self.burst + intervals

    def violations(self) -> int:
        """Pairs of starts ``i < j`` whose window ``[t_i, t_j]`` holds more than ``B + (t_j - t_i) / I``.

        The same as ``j - i + 1`` consecutive starts spanning less than
        ``(j - i + 1 - B)`` intervals; exact, in whole microseconds.
        """
        times, step = self.state_times, self.interval_us
        return sum(
            1
            for i in range(len(times))
            for j in range(i + 1, len(times))
            if (j - i + 1 - self.burst) * step > times[j] - times[i]
        )

    def steady_min_gap(self) -> float:
        """The smallest gap between consecutive starts past the first ``B`` (s); NaN if fewer than two."""
        times = self.state_times[self.burst :]
        return min(gaps(times), default=math.nan) / 1e6

    def steady_rate(self) -> float:
        """The rate past the burst: ``(starts - B) / (last - first)`` per second, on the state's clock.

        A queue that keeps its promise exactly (``B`` starts at once, then one
        per interval) gives the target; the guarantee keeps it from going
        above; starts lost or delayed bring it below. NaN without a span.
        """
        times = self.state_times
        span = (times[-1] - times[0]) / 1e6 if len(times) > 1 else 0.0
        return (len(times) - self.burst) / span if span > 0 else math.nan

    def summary(self) -> dict[str, Any]:
        """The table's figures, for ``--json``."""
        return {
            "in_first_interval": self.in_first_interval(),
            "begun_in_first_interval": self.begun_in_first_interval(),
            "most_in_window": {str(w): self.most_in_window(w) for w in WINDOWS},
            "bound": {str(w): self.bound(w) for w in WINDOWS},
            "steady_min_gap": self.steady_min_gap(),
            "steady_rate": self.steady_rate(),
            "violations": self.violations(),
        }


def run_state(
    state: str,
    base: str,
    bursts: list[int],
    interval: float,
    procs: int,
    turns: int,
    max_late: float | None = DEFAULT_MAX_LATE,
) -> list[Result]:
    """Every burst on one state, one round each, with one set of worker processes."""
    names = [unique_name(f"bursts-{burst}") for burst in bursts]
    # a fresh file per round for the file state
    urls = [f"{base}/{name}.json" for name in names] if state == "file" else [base] * len(bursts)
    jobs = [
        Job(url, name, interval, b, turns, max_late) for url, name, b in zip(urls, names, bursts, strict=True)
    ]
    results = run_processes(
        worker,
        [jobs] * procs,
        rounds=len(jobs),
        before_start=lambda k: prepare(urls[k], names[k], interval, bursts[k]),
    )
    out = []
    for k, burst in enumerate(bursts):
        parts = [rounds[k] for rounds in results]
        starts = sorted(
            (start_us, begin, process)
            for process, part in enumerate(parts)
            for start_us, begin in part["starts"]
        )
        out.append(
            Result(
                state,
                burst,
                interval,
                starts,
                add(p["calls"] for p in parts),
                add(p["answers"] for p in parts),
            )
        )
    return out


def add(counts: Iterable[dict[str, int]]) -> dict[str, int]:
    """The sum of some counts, key by key."""
    total: dict[str, int] = {}
    for count in counts:
        for key, value in count.items():
            total[key] = total.get(key, 0) + value
    return total


def report(results: list[Result], procs: int, turns: int, max_late: float | None = DEFAULT_MAX_LATE) -> str:
    """The Markdown table of a run."""
    rows = []
    for r in results:
        rate = r.steady_rate()
        rows.append(
            [
                r.state,
                r.burst,
                len(r.starts),
                r.in_first_interval(),
                r.begun_in_first_interval(),
                *(f"{r.most_in_window(w)} / {r.bound(w)}" for w in WINDOWS),
                ms(r.steady_min_gap(), 2),
                num(rate, 1),
                f"{100 * rate * r.interval:.1f} %" if not math.isnan(rate) else "—",
                r.violations(),
                num(sum(r.calls.values()) / max(1, len(r.starts))),
                r.calls.get("retime", 0),
                r.answers.get("passed", 0),
            ]
        )
    interval = results[0].interval if results else math.nan
    headers = [
        "state",
        "B",
        "starts",
        "in first interval",
        "begun in first interval (local)",
        *(f"most in {w} interval{'s' if w > 1 else ''} / bound" for w in WINDOWS),
        "smallest gap after the burst, ms",
        "rate past the burst /s",
        "of target",
        "bound violations",
        "state calls/start",
        "retimes",
        "passed",
    ]
    return (
        f"{procs} processes released together after an idle spell, {turns} turns each, interval "
        f"{interval * 1e3:g} ms ({1 / interval:g}/s), `max_late` "
        f"{'off' if max_late is None else f'{max_late * 1e3:g} ms'}. "
        "On the state's clock unless marked *local*: "
        "*in first interval* counts the starts less than one interval after the first; "
        "*most in w / bound* is the most starts in any window `[t, t + w]` against `B + w / I`; "
        "*after the burst*: between the starts past the first `B`; *rate past the burst*: "
        "`(starts - B) / (last start - first start)`, the target when the queue gives exactly "
        "`B` starts at once and then one per interval; *bound violations* "
        "counts the windows between two starts, of any length, holding more than `B + w / I` "
        "(the guarantee: 0). *retimes*: calls moving a granted start later because its job was "
        "about to begin more than `max_late` after it; *passed*: answers telling a job its ticket "
        "can no longer start (a turn given up, its place in the burst lost).\n\n" + table(headers, rows)
    )


def plot(
    results: list[Result], procs: int, directory: Path, max_late: float | None = DEFAULT_MAX_LATE
) -> list[Path]:
    """One row per burst, one column per state: the cumulative count of starts against ``B + t / I``."""
    plt = pyplot()
    directory.mkdir(parents=True, exist_ok=True)
    bursts = list(dict.fromkeys(r.burst for r in results))
    states = list(dict.fromkeys(r.state for r in results))
    fig, axes = plt.subplots(
        len(bursts), len(states), figsize=(4.2 * len(states) + 0.8, 3.2 * len(bursts) + 0.6), squeeze=False
    )
    colours = plt.get_cmap("tab10")
    span = max((r.state_times[-1] - r.state_times[0]) / 1e3 for r in results if r.starts)
    top = max(len(r.starts) for r in results)
    for row, burst in enumerate(bursts):
        for column, state in enumerate(states):
            ax = axes[row][column]
            r = next((r for r in results if r.burst == burst and r.state == state), None)
            if r is None or not r.starts:
                ax.set_visible(False)
                continue
            first = r.state_times[0]
            t = [(s - first) / 1e3 for s in r.state_times]
            count = list(range(1, len(t) + 1))
            ax.step(t, count, where="post", color="0.6", linewidth=1, zorder=1)
            for process in range(procs):
                mine = [(x, c) for x, c, s in zip(t, count, r.starts, strict=True) if s[2] == process]
                xs = [x for x, _ in mine]
                ax.scatter(xs, [c for _, c in mine], s=12, color=colours(process), zorder=3)
                # and a tick per start under the curve, in the same colour
                ax.plot(xs, [-0.04 * top] * len(xs), "|", color=colours(process), markersize=7)
            line = [0.0, span * 1.03]
            ax.plot(
                line,
                [burst + x / (r.interval * 1e3) for x in line],
                "--",
                color="black",
                linewidth=1,
                label=f"bound {burst} + t / {r.interval * 1e3:g} ms",
                zorder=2,
            )
            ax.set_xlim(-0.025 * span, span * 1.03)
            ax.set_ylim(-0.08 * top, top * 1.08)
            ax.grid(alpha=0.3)
            n = r.in_first_interval()
            ax.set_title(
                f"{state}, B = {burst}: {n} start{'s' if n != 1 else ''} in the first interval, "
                f"{r.answers.get('passed', 0)} passed",
                fontsize=9,
            )
            if row == len(bursts) - 1:
                ax.set_xlabel("time since the first start, ms (state clock)")
            if column == 0:
                ax.set_ylabel("starts so far")
            ax.legend(fontsize=8, loc="upper left")
    handles = [
        plt.Line2D([], [], marker="o", linestyle="", color=colours(p), label=f"process {p + 1}")
        for p in range(procs)
    ]
    fig.legend(handles=handles, loc="lower center", ncol=procs, fontsize=8, frameon=False)
    interval = results[0].interval
    late = "off" if max_late is None else f"{max_late * 1e3:g} ms"
    fig.suptitle(
        f"Starts of a bursty queue at {1 / interval:g}/s: {procs} processes released together "
        f"after an idle spell (max_late {late})",
        fontsize=11,
    )
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    path = directory / "burst-timeline.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return [path]


def dump(results: list[Result], args: argparse.Namespace, path: Path) -> None:
    """Write every start and the table's figures, with the run's settings, as JSON."""

    def clean(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, list | tuple):
            return [clean(v) for v in value]
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        return value

    document = {
        "machine": machine(),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "results": [clean({**dataclasses.asdict(r), **r.summary()}) for r in results],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1))


def main(argv: list[str] | None = None) -> int:
    parser = new_parser(__doc__)
    parser.add_argument("--states", default=",".join(STATES), help="states to run on (file,redis,mongodb)")
    parser.add_argument("--bursts", default=",".join(map(str, BURSTS)), help="bursts B (1,10)")
    parser.add_argument("--rate", default="50/second", help="the queue's rate (50/second)")
    parser.add_argument("--procs", type=int, default=4, help="worker processes (4)")
    parser.add_argument("--turns", type=int, default=15, help="turns each process acquires (15)")
    parser.add_argument(
        "--max-late",
        default=f"{DEFAULT_MAX_LATE * 1e3:g}",
        metavar="MS",
        help=f"the limiters' max_late in ms, or 'none' for no lateness check ({DEFAULT_MAX_LATE * 1e3:g})",
    )
    add_common(
        parser,
        mongodb_url=True,
        quick="a smoke run: 5 turns per process",
        plot="write burst-timeline.png into DIR",
        json="write every start and the table's figures as JSON to FILE",
    )
    args = parser.parse_args(argv)
    states = chosen(parser, args.states, STATES, "states")
    bursts: list[int] = numbers(args.bursts, int)
    if not bursts or min(bursts) < 1:
        parser.error("--bursts takes whole numbers >= 1")
    if args.procs < 1 or args.turns < 1:
        parser.error("--procs and --turns must be at least 1")
    interval = parse_rate(args.rate).interval
    turns = 5 if args.quick else args.turns
    try:
        max_late = None if args.max_late.strip().lower() == "none" else float(args.max_late) / 1e3
    except ValueError:
        parser.error(f"--max-late takes milliseconds or 'none', got {args.max_late!r}")
    print_machine()
    results: list[Result] = []
    progress = Progress(len(states), "bursts")
    with tempfile.TemporaryDirectory(prefix="ratequeue-bursts-") as tmp:
        for state in states:
            progress.note(f"{state}: starting, bursts {','.join(map(str, bursts))}")
            with state_url(state, args, f"file://{tmp}") as url:
                results += run_state(state, url, bursts, interval, args.procs, turns, max_late)
            progress.step(f"{state} done")
    progress.close()
    print(report(results, args.procs, turns, max_late))
    if args.plot:
        print_written(plot(results, args.procs, args.plot, max_late))
    if args.json:
        dump(results, args, args.json)
        print_written([args.json])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
