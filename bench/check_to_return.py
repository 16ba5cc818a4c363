"""From the lateness check to the return: where do late begins come from on a busy host?

ratequeue checks how late a turn is at the last moment before ``acquire()``
returns (G7: a turn more than ``max_late`` late is moved, not begun). What a
service sees is later still: the moment the caller's code runs after the
return. This tells the two apart. ``--procs`` processes (8) take ``--turns``
turns each (150) through one queue at ``--interval`` (10.5 ms); each notes
``time.monotonic()`` when ``acquire()`` returns, and an ``on_event`` hook
notes each ``start`` event's ``lateness``, which the limiter measures at its
check. Per state (``--states``: file, redis), with ``--hog K`` busy loops:

* begin gaps (across all processes, one host, one clock) shorter than
  ``interval - 0.5 ms``, and how many of them follow a begin that was on
  time at the check (within ``max_late``) but late when ``acquire()``
  returned: the process was descheduled in between, after the limiter's
  last decision;
* begins more than 1 ms late when ``acquire()`` returned, and how many of
  them were that late at the check;
* lateness at the check and at the return (p99 / max).

The hook costs each start an event put on a queue and a reporter thread's
wake-up, so the load differs slightly from ``begin_gaps.py``'s.

Run::

    python bench/check_to_return.py --hog 2      # about 1 minute
    python bench/check_to_return.py --quick      # a smoke run
"""

from __future__ import annotations

import itertools
import sys
import tempfile
import time
from dataclasses import dataclass

from _common import (
    Gate,
    Progress,
    add_common,
    busy_loops,
    chosen,
    gaps,
    ms,
    new_parser,
    percentile,
    print_machine,
    run_processes,
    state_url,
    table,
)

STATES = ("file", "redis")
#: one begin: (ticket, time.monotonic() when acquire() returned, lateness then, lateness at the check)
Begin = tuple[int, float, float, float | None]


@dataclass(frozen=True)
class Task:
    """What one worker does: ``turns`` turns of queue ``name`` on ``url`` at ``interval``."""

    url: str
    name: str
    interval: float
    turns: int


def worker(index: int, task: Task, gate: Gate) -> list[Begin]:
    """One process's turns: (ticket, begin, lateness at the return, lateness at the check)."""
    import ratequeue

    checked: dict[int, float] = {}

    def note(event: ratequeue.Event) -> None:
        if event.kind == "start" and event.ticket is not None and event.lateness is not None:
            checked[event.ticket] = event.lateness

    limiter = ratequeue.Limiter(task.url, name=task.name, interval=task.interval, on_event=note)
    limiter.status()  # connected before the gate
    gate.wait()
    returned = []
    for _ in range(task.turns):
        turn = limiter.acquire()
        begin = time.monotonic()
        returned.append((turn.ticket, begin, begin - turn.local_start))
    limiter.close()  # the reporter thread has handed every event to the hook once this returns
    return [(ticket, begin, late, checked.get(ticket)) for ticket, begin, late in returned]


def row(state: str, begins: list[Begin], interval: float, max_late: float) -> list[str]:
    """One table row: ``begins`` of every process, merged."""
    begins.sort(key=lambda b: b[1])
    short = [(a, b) for a, b in itertools.pairwise(begins) if b[1] - a[1] < interval - 0.0005]
    after_check = sum(1 for a, _ in short if a[3] is not None and a[3] <= max_late and a[2] > max_late)
    late = [b for b in begins if b[2] > 0.001]
    at_check = [b[3] for b in begins if b[3] is not None]
    at_return = [b[2] for b in begins]
    return [
        state,
        str(len(begins)),
        ms(min(gaps([b[1] for b in begins]))),
        str(len(short)),
        str(after_check),
        str(len(late)),
        str(sum(1 for b in late if b[3] is not None and b[3] > 0.001)),
        f"{ms(percentile(at_check, 99))} / {ms(max(at_check))}",
        f"{ms(percentile(at_return, 99))} / {ms(max(at_return))}",
        f"{len(at_check)}/{len(begins)}",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = new_parser(__doc__)
    parser.add_argument("--states", default=",".join(STATES), help="comma-separated: file, redis (both)")
    parser.add_argument("--procs", type=int, default=8, help="worker processes (8)")
    parser.add_argument("--turns", type=int, default=150, help="turns per process (150)")
    parser.add_argument("--interval", type=float, default=0.0105, help="the queue's interval, s (0.0105)")
    parser.add_argument("--hog", type=int, default=0, help="busy-loop processes running throughout (0)")
    add_common(parser, quick="a smoke run: 4 processes, 20 turns each", plot="(no plots)")
    args = parser.parse_args(argv)
    if args.quick:
        args.procs, args.turns = 4, 20
    states = chosen(parser, args.states, STATES, "--states")
    if args.procs < 2 or args.turns < 2 or not args.interval > 0:
        parser.error("--procs and --turns must be at least 2, --interval > 0")

    from ratequeue.core.shard import DEFAULT_MAX_LATE

    print_machine()
    print(f"Load: {args.hog} busy-loop processes (`--hog`); {args.procs} worker processes per row.\n")
    progress = Progress(len(states), "check-to-return")
    rows = []
    started = time.monotonic()
    with busy_loops(args.hog), tempfile.TemporaryDirectory() as directory:
        for state in states:
            progress.note(state)
            with state_url(state, args, f"file://{directory}/state.json") as url:
                task = Task(url, f"check-{time.monotonic_ns()}", args.interval, args.turns)
                results = run_processes(worker, [task] * args.procs)
            rows.append(row(state, [b for part in results for b in part], args.interval, DEFAULT_MAX_LATE))
            progress.step()
    progress.close()
    interval, max_late = args.interval, DEFAULT_MAX_LATE
    print(
        f"**{args.procs} processes, {args.turns} turns each, interval {ms(interval)} ms, max_late "
        f"{ms(max_late)} ms.** Times in ms; lateness = `time.monotonic()` - `Turn.local_start`, at the "
        "limiter's check (the `start` event) and when `acquire()` returned.\n"
    )
    headers = [
        "state", "begins", "begin gap min", "gaps < I - 0.5", "of them after a begin on time at the check",
        "begins > 1 ms late at return", "of them > 1 ms late at the check",
        "lateness at the check p99 / max", "at the return p99 / max", "start events seen",
    ]  # fmt: skip
    print(table(headers, rows))
    print(f"\nWall time {time.monotonic() - started:.0f} s.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
