"""The ``ratequeue`` command (also ``python -m ratequeue``).

``demo`` starts several processes that share one rate and shows their starts
live; ``status`` and ``reset`` inspect and clear a queue's shared record;
``pause`` and ``resume`` stop and restart a queue's starts in every shard at
once (the pause flag in its record); ``keys`` lists the queues that have one
(the live keys of a limiter group).
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import multiprocessing
import queue as queue_module
import statistics
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from . import __version__, _validate
from ._redact import redact, scrub
from .errors import ConfigurationError, RateQueueError
from .limiter import Limiter
from .protocol import NEVER, US, live_leases
from .state import State, from_url
from .state.memory import MemoryState

__all__ = ["main"]

#: what the command line accepts for "the per-user default state file"
DEFAULT_URL = "default"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the process exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args, sys.stdout))
    except RateQueueError as exc:
        # every error redacts the URLs it quotes; the URL given is scrubbed again, to be sure
        print(f"ratequeue: error: {scrub(str(exc), args.url)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ratequeue: interrupted", file=sys.stderr)
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ratequeue", description="One start per interval, globally, in first-come order."
    )
    parser.add_argument("--version", action="version", version=f"ratequeue {__version__}")
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    demo = commands.add_parser(
        "demo",
        help="run several processes sharing one rate and show their starts",
        description="Start several processes that share one rate through one state, show every "
        "start as it happens, and summarise the gaps between starts.",
    )
    demo.add_argument("--processes", type=int, default=4, help="processes to start (default 4)")
    demo.add_argument("--jobs", type=int, default=25, help="acquires per process (default 25)")
    demo.add_argument("--interval", type=float, default=0.05, help="seconds between starts (default 0.05)")
    demo.add_argument("--url", default=DEFAULT_URL, help="state URL (default: the per-user state file)")
    demo.add_argument("--name", default="ratequeue-demo", help="queue name (default ratequeue-demo)")
    demo.add_argument("--quiet", action="store_true", help="print only the summary")
    demo.set_defaults(run=_demo)

    status = commands.add_parser("status", help="show a queue's shared record")
    status.add_argument("url", metavar="URL", help=f"state URL, or {DEFAULT_URL!r} for the per-user file")
    status.add_argument("name", metavar="NAME", help="queue name")
    status.set_defaults(run=_status)

    keys = commands.add_parser(
        "keys",
        help="list the queue names that have a record (a group's live keys: PREFIX = 'GROUP:')",
        description="List, sorted, the names of the queues that have a record in the state and begin "
        "with PREFIX. A LimiterGroup named G keeps key K as queue 'G:K', so PREFIX 'G:' lists its live keys.",
    )
    keys.add_argument("url", metavar="URL", help=f"state URL, or {DEFAULT_URL!r} for the per-user file")
    keys.add_argument(
        "prefix", metavar="PREFIX", nargs="?", default="", help="beginning of the names (default: all)"
    )
    keys.set_defaults(run=_keys)

    for verb, paused in (("pause", True), ("resume", False)):
        command = commands.add_parser(
            verb,
            help=(
                "pause a queue everywhere: no shard, in any process, starts a job until resumed"
                if paused
                else "resume a queue paused everywhere"
            ),
            description=(
                "Set the pause flag in the queue's shared record: no shard starts a job while it is "
                "set (waiting shards ask again once a second), and tickets held meanwhile keep their "
                "places. The stored interval and burst are used; --interval (and --burst) are needed "
                "only to create the record of a queue that has none, paused."
                if paused
                else "Clear the pause flag in the queue's shared record: every waiting shard starts "
                "again within about a second, at the rate. A queue without a record is not paused."
            ),
        )
        command.add_argument(
            "url", metavar="URL", help=f"state URL, or {DEFAULT_URL!r} for the per-user file"
        )
        command.add_argument("name", metavar="NAME", help="queue name")
        command.add_argument(
            "--interval",
            type=float,
            metavar="SECONDS",
            help="the queue's interval, to create a missing record (else the stored one; it must match)",
        )
        command.add_argument(
            "--burst", type=int, metavar="N", help="the queue's burst, to create a missing record (default 1)"
        )
        command.set_defaults(run=_pause if paused else _resume)

    reset = commands.add_parser("reset", help="delete a queue's shared record")
    reset.add_argument("url", metavar="URL", help=f"state URL, or {DEFAULT_URL!r} for the per-user file")
    reset.add_argument("name", metavar="NAME", help="queue name")
    reset.set_defaults(run=_reset)
    return parser


def _open(url: str) -> State:
    return from_url(None if url == DEFAULT_URL else url)


def _status(args: argparse.Namespace, out: TextIO) -> int:
    with _open(args.url) as state:
        snapshot = state.read(_validate.name(args.name))
        print(f"state:      {redact(state.url)}", file=out)
        print(f"queue:      {args.name}", file=out)
        record = snapshot.record
        if record is None:
            print("record:     none (no ticket handed out yet)", file=out)
            return 0
        print(f"interval:   {record.interval / US:g} s", file=out)
        print(f"burst:      {record.burst}", file=out)
        print(f"tickets:    {record.ticket - 1} handed out, {record.pos} is the latest started", file=out)
        if record.at == NEVER:
            print("last start: never", file=out)
        else:
            ago = (snapshot.now - record.at) / US
            print(f"last start: {ago:.3f} s ago (state clock)", file=out)
        waiting = record.ticket - 1 - record.pos
        print(f"unstarted:  {waiting} ticket(s) handed out and not started", file=out)
        print(f"paused everywhere: {'yes' if record.paused else 'no'}", file=out)
        if record.max_running:
            running = len(live_leases(record, snapshot.now))
            print(f"running:    {running} of at most {record.max_running} (live leases)", file=out)
    return 0


def _pause(args: argparse.Namespace, out: TextIO) -> int:
    return _set_paused(args, out, True)


def _resume(args: argparse.Namespace, out: TextIO) -> int:
    return _set_paused(args, out, False)


def _set_paused(args: argparse.Namespace, out: TextIO, paused: bool) -> int:
    """Set or clear the pause flag of queue ``args.name``, with the stored terms if it has a record."""
    name = _validate.name(args.name)
    interval_us = None if args.interval is None else _validate.interval_us(_validate.interval(args.interval))
    burst = None if args.burst is None else _validate.burst(args.burst)
    with _open(args.url) as state:
        where = redact(state.url)
        record = state.read(name).record
        if record is None and not paused:
            print(f"no record for queue {name!r} in {where}: it is not paused", file=out)
            return 0
        if record is None and interval_us is None:
            raise ConfigurationError(
                f"queue {name!r} has no record in {where} yet: give --interval (and --burst, if not 1) "
                f"to create it paused"
            )
        # given terms must match a stored record (set_paused says so); left out, the stored ones apply
        interval = interval_us if interval_us is not None else record.interval if record else 0
        burst = burst if burst is not None else record.burst if record else 1
        # a stored cap on running jobs is kept (the pause takes no lease: any lease length will do)
        cap = {"max_running": record.max_running, "lease_us": 1} if record and record.max_running else {}
        changed = state.set_paused(name, interval, paused, burst=burst, **cap)
        now = state.read(name).now
    verb = "paused" if paused else "resumed"
    if changed:
        print(f"{verb} queue {name!r} everywhere in {where}", file=out)
    else:
        print(f"queue {name!r} in {where} was {'paused already' if paused else 'not paused'}", file=out)
    print(f"state clock: {now} us", file=out)
    return 0


def _keys(args: argparse.Namespace, out: TextIO) -> int:
    with _open(args.url) as state:
        names = state.names(args.prefix)
    for name in names:
        print(name, file=out)
    print(f"{len(names)} queue(s) with a record beginning with {args.prefix!r}", file=sys.stderr)
    return 0


def _reset(args: argparse.Namespace, out: TextIO) -> int:
    with _open(args.url) as state:
        existed = state.reset(_validate.name(args.name))
        print(
            f"{'reset' if existed else 'no record for'} queue {args.name!r} in {redact(state.url)}", file=out
        )
    return 0


def _demo(args: argparse.Namespace, out: TextIO) -> int:
    processes = _validate.positive_int("--processes", args.processes)
    jobs = _validate.positive_int("--jobs", args.jobs)
    interval = _validate.interval(args.interval)
    name = _validate.name(args.name)
    with _open(args.url) as state:
        if isinstance(state, MemoryState):
            raise ConfigurationError(
                "memory:// lives inside one process; the demo needs a state its processes share"
            )
        url = state.url
        state.reset(name)  # a fresh record, with this demo's interval
    total = processes * jobs
    print(
        f"{processes} processes x {jobs} starts, one start every {interval * 1000:g} ms, "
        f"through {redact(url)} (queue {name!r})",
        file=out,
    )
    context = multiprocessing.get_context("spawn")
    reports: Any = context.Queue()
    workers = [
        context.Process(target=_demo_worker, args=(url, name, interval, jobs, index, reports), daemon=True)
        for index in range(1, processes + 1)
    ]
    for worker in workers:
        worker.start()
    starts: list[int] = []  # kept sorted: reports from different processes may arrive out of order
    failures: list[str] = []
    finished = 0
    wait = max(30.0, 10 * interval)
    while finished < processes:
        try:
            index, ticket, start, error = reports.get(timeout=wait)
        except queue_module.Empty:
            failures.append(f"no report for {wait:g} s; giving up")
            break
        if ticket is None:
            finished += 1
            if error:
                failures.append(f"process {index}: {scrub(error, url)}")
            continue
        place = bisect.bisect(starts, start)
        late = place < len(starts)
        starts.insert(place, start)
        if not args.quiet:
            gap = "" if place == 0 else f"gap {(start - starts[place - 1]) / 1000:8.3f} ms"
            flag = "  UNDER INTERVAL" if place and start - starts[place - 1] < interval * US else ""
            note = "  (reported after a later start)" if late else ""
            progress = f"[{len(starts):>{len(str(total))}}/{total}]"
            print(f"{progress} process {index}  ticket {ticket:>6}  {gap}{flag}{note}", file=out)
    for worker in workers:
        worker.join(timeout=5)
    return _summary(starts, total, interval, failures, out)


def _summary(starts: list[int], total: int, interval: float, failures: list[str], out: TextIO) -> int:
    starts = sorted(starts)
    gaps = [later - earlier for earlier, later in itertools.pairwise(starts)]
    interval_us = _validate.interval_us(interval)
    under = sum(1 for gap in gaps if gap < interval_us)
    print(file=out)
    if gaps:
        span = (starts[-1] - starts[0]) / US
        rate = len(gaps) / span if span > 0 else float("inf")
        target = 1 / interval
        print(
            f"summary: {len(starts)}/{total} starts, smallest gap {min(gaps) / 1000:.3f} ms, "
            f"median gap {statistics.median(gaps) / 1000:.3f} ms, "
            f"rate {rate:.2f}/s of {target:.2f}/s target ({100 * rate / target:.1f} %), "
            f"gaps under the interval: {under}",
            file=out,
        )
    else:
        print(f"summary: {len(starts)}/{total} starts", file=out)
    for failure in failures:
        print(f"failure: {failure}", file=out)
    return 0 if under == 0 and not failures and len(starts) == total else 1


def _demo_worker(url: str, name: str, interval: float, jobs: int, index: int, reports: Any) -> None:
    error = ""
    try:
        limiter = Limiter(url, name=name, interval=interval)
        for _ in range(jobs):
            turn = limiter.acquire()
            reports.put((index, turn.ticket, turn.start_us, ""))
        limiter.close()
    except Exception as exc:  # reported to the parent, which fails the demo
        error = f"{type(exc).__name__}: {exc}"
    finally:
        reports.put((index, None, None, error))
