"""Where the rate goes: the time lost between starts, sorted by its cause.

``--procs`` worker processes (8) call ``Limiter.acquire()`` back to back
for ``--seconds`` (15) on one queue of interval ``--interval-ms`` (10.5,
the limiter of ``begin_gaps.py`` at 100/s: 1/R + 0.5 ms; margin 0), beside
``--hogs`` busy loops (``while True: pass``, each in a session of its own, as
``begin_gaps.py --hog`` runs them; 0 and 2 by default), each job spending
``--work-us`` of CPU after its begin (0), on the
states of ``--states`` (the JSON file and Redis). With someone always
waiting, every gap between two consecutive starts should be exactly one
interval on the state's clock. The time beyond it is the loss, and each gap
is put down to what came before its start, from the limiter's own events
(``on_event``):

* **moved**: the start's caller woke more than ``max_late`` (0.3 ms) after
  it, so the start was moved later (G7: a late begin would come too close
  to the next one), by the lateness, the answer's way back and a wake-up;
* **moved twice**: late again after the first move;
* **given up**: a caller late after its moves gave its ticket up, and that
  slot went unused;
* **other**: nothing was moved or given up. Either the next ticket's
  holder asked for its start after its slot (it woke later than its lead),
  or the start before carried a doubt or an allowance (a state on another
  clock than the host's: its first answers bound that clock loosely, and
  the next start comes later by as much; docs/design.md "Doubt"). The
  events do not tell the two apart.

The table shows the achieved rate against the limiter's most (one start
per interval), the loss, its share per cause with the number of gaps and
their mean, and how late the late wake-ups were. Run::

    python bench/rate_loss.py                       # about two minutes
    python bench/rate_loss.py --quick               # a smoke run of a few seconds
    python bench/rate_loss.py --states file --hogs 0,1,2 --seconds 30

It starts its own ``redis-server`` on a free port (or uses
``--redis-url``) and keeps the state file in a temporary directory.
"""

from __future__ import annotations

import itertools
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _common import (
    Gate,
    Progress,
    add_common,
    busy_loops,
    chosen,
    new_parser,
    numbers,
    percentile,
    print_machine,
    run_processes,
    state_url,
    table,
    unique_name,
)

STATES = ("file", "redis", "postgresql", "mongodb")
#: the causes, in the order the table shows them
CAUSES = ("moved", "moved twice", "given up", "other")


@dataclass(frozen=True)
class Task:
    """What one worker does: acquire on ``url``'s queue ``name`` for ``seconds``."""

    url: str
    name: str
    interval: float
    seconds: float
    work: float


def worker(index: int, task: Task, gate: Gate) -> dict[str, Any]:
    """Acquire back to back; return each turn's ticket and start, and the late wake-ups seen."""
    import time

    import ratequeue

    late: list[tuple[int, str, float]] = []

    def heard(event: ratequeue.Event) -> None:
        if event.kind == "late" and event.ticket is not None:
            late.append((event.ticket, event.outcome or "", event.lateness or 0.0))

    limiter = ratequeue.Limiter(task.url, name=task.name, interval=task.interval, margin=0, on_event=heard)
    starts: list[tuple[int, int]] = []
    try:
        end = gate.wait() + task.seconds
        while time.monotonic() < end:
            turn = limiter.acquire()
            starts.append((turn.ticket, turn.start_us))
            done = time.process_time() + task.work
            while time.process_time() < done:  # the job's own CPU, as a request's would be
                pass
    finally:
        limiter.close()
    return {"starts": starts, "late": late}


@dataclass
class Row:
    """One state and load: the starts, the loss and its causes."""

    state: str
    hogs: int
    starts: int
    achieved: float
    most: float
    loss_s: float
    span_s: float
    by_cause: dict[str, tuple[int, float]]
    late_ms: list[float]


def analyse(state: str, hogs: int, interval: float, results: list[dict[str, Any]]) -> Row:
    """Sort every gap longer than the interval (by more than 20 µs) by its cause."""
    starts = sorted((s for r in results for s in r["starts"]), key=lambda s: s[1])
    outcomes: dict[int, list[str]] = {}
    late_ms = []
    for result in results:
        for ticket, outcome, lateness in result["late"]:
            outcomes.setdefault(ticket, []).append(outcome)
            late_ms.append(lateness * 1000)
    interval_us = round(interval * 1e6)
    lost: Counter[str] = Counter()
    count: Counter[str] = Counter()
    for (ticket_a, at_a), (ticket_b, at_b) in itertools.pairwise(starts):
        extra = at_b - at_a - interval_us
        if extra <= 20:
            continue
        if ticket_b - ticket_a > 1:
            cause = "given up"
        elif outcomes.get(ticket_b, []).count("moved") >= 2:
            cause = "moved twice"
        elif "moved" in outcomes.get(ticket_b, []):
            cause = "moved"
        else:
            cause = "other"
        lost[cause] += extra
        count[cause] += 1
    span_us = starts[-1][1] - starts[0][1] if len(starts) > 1 else 0
    span_s = span_us / 1e6
    return Row(
        state=state,
        hogs=hogs,
        starts=len(starts),
        achieved=(len(starts) - 1) / span_s if span_s else 0.0,
        most=1 / interval,
        loss_s=(span_us - interval_us * (len(starts) - 1)) / 1e6,
        span_s=span_s,
        by_cause={cause: (count[cause], lost[cause] / 1e6) for cause in CAUSES},
        late_ms=late_ms,
    )


def report(rows: list[Row], interval: float, procs: int, work_us: float) -> str:
    """The table of every row, and a line saying how to read it."""
    headers = ["state", "busy loops", "starts", "achieved /s (of the limiter's most)", "loss"]
    headers += [f"{cause}: gaps, share, mean ms" for cause in CAUSES]
    headers += ["late wake-ups p50 / p90 ms"]
    lines = []
    for row in rows:
        cells: list[object] = [
            row.state,
            row.hogs,
            row.starts,
            f"{row.achieved:.1f} ({100 * row.achieved / row.most:.1f} %)",
            f"{100 * row.loss_s / row.span_s:.2f} %" if row.span_s else "-",
        ]
        for cause in CAUSES:
            gaps, seconds = row.by_cause[cause]
            share = 100 * seconds / row.loss_s if row.loss_s > 0 else 0.0
            mean = 1000 * seconds / gaps if gaps else 0.0
            cells.append(f"{gaps}, {share:.0f} %, {mean:.2f}" if gaps else "0")
        if row.late_ms:
            cells.append(f"{percentile(row.late_ms, 50):.2f} / {percentile(row.late_ms, 90):.2f}")
        else:
            cells.append("-")
        lines.append(cells)
    head = (
        f"**{procs} processes back to back, limiter interval {interval * 1000:g} ms (margin 0), "
        f"{work_us:g} µs of CPU a job.** "
        "Loss = time between starts beyond one interval, as a share of the run; each cause's share "
        "is of the loss."
    )
    return head + "\n\n" + table(headers, lines, "llrrr" + "r" * (len(CAUSES) + 1))


def main(argv: list[str] | None = None) -> int:
    parser = new_parser(__doc__)
    parser.add_argument("--states", default="file,redis", help=f"comma-separated, of {', '.join(STATES)}")
    parser.add_argument("--hogs", default="0,2", help="busy-loop counts to run beside, comma-separated (0,2)")
    parser.add_argument("--procs", type=int, default=8, help="worker processes (8)")
    parser.add_argument("--interval-ms", type=float, default=10.5, help="the limiter's interval (10.5)")
    parser.add_argument("--seconds", type=float, default=15.0, help="seconds each row runs (15)")
    parser.add_argument(
        "--work-us",
        type=float,
        default=0.0,
        help="CPU time each job spends after its begin (0; begin_gaps.py's referee call takes about 400)",
    )
    add_common(parser, quick="a smoke run: 2 s a row", plot="(no plots: the table says it all)")
    args = parser.parse_args(argv)
    states = chosen(parser, args.states, STATES, "states")
    hog_counts = numbers(args.hogs, int)
    if (
        args.procs < 1
        or args.interval_ms <= 0
        or args.seconds <= 0
        or min(hog_counts) < 0
        or args.work_us < 0
    ):
        parser.error("--procs, --interval-ms and --seconds must be positive, --hogs and --work-us at least 0")
    seconds = 2.0 if args.quick else args.seconds
    interval = args.interval_ms / 1000
    print_machine()
    rows = []
    progress = Progress(len(states) * len(hog_counts), "rate-loss")
    with tempfile.TemporaryDirectory(prefix="ratequeue-rate-loss-") as directory:
        file_url = f"file://{Path(directory) / 'state.json'}"
        for state in states:
            with state_url(state, args, file_url) as url:
                for hogs in hog_counts:
                    progress.note(f"{state} beside {hogs} busy loops: {seconds:g} s")
                    task = Task(url, unique_name("rate-loss"), interval, seconds, args.work_us / 1e6)
                    with busy_loops(hogs):
                        results = run_processes(worker, [task] * args.procs)
                    rows.append(analyse(state, hogs, interval, results))
                    progress.step(f"{state} beside {hogs}: {100 * rows[-1].achieved / rows[-1].most:.1f} %")
    progress.close()
    print(report(rows, interval, args.procs, args.work_us))
    return 0


if __name__ == "__main__":
    sys.exit(main())
