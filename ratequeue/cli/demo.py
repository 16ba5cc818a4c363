"""``ratequeue demo``: several processes share one rate; every start shown live, then a summary.

Two kinds of gap are shown. A **state-clock gap** lies between two starts as
the state recorded them: the promise (G1) is that none is under the
interval, and the exit status says whether that held. A **begin gap** lies
between two moments at which ``acquire()`` returned, each read with
``time.monotonic()`` by its worker right after (every worker runs on this
host, so their monotonic clocks agree): what a called service feels. Each
begin comes at most ``max_late`` (0.3 ms) after its start (G7), so begin
gaps a little under the interval are normal; one under ``interval -
max_late`` is flagged. The OS may delay a process after ``acquire()``
returns, so such gaps are reported, not counted as failures.
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import multiprocessing
import os
import queue as queue_module
import secrets
import signal
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import closing, contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any, TextIO

from .._redact import redact, scrub
from ..core.protocol import US
from ..core.shard import DEFAULT_MAX_LATE
from ..errors import ConfigurationError
from ..limiter import Limiter
from ..settings import Settings, positive_int
from . import plot
from .common import handling, opened_state, plural, say, stopped_by_signals

__all__ = ["MAX_PROCESSES", "run"]

#: the beginning of the fresh queue name a demo uses unless given ``--name``
NAME_PREFIX = "ratequeue-demo-"

#: the most processes a demo starts (each is an interpreter of its own)
MAX_PROCESSES = 64


@dataclass
class Seen:
    """What the parent has heard from the workers so far."""

    #: state-clock starts (us), sorted: reports of different processes may arrive out of order
    starts: list[int] = field(default_factory=list)
    #: begins (``time.monotonic()`` of this host, s), sorted
    begins: list[float] = field(default_factory=list)
    #: (process, begin) of every start, in the order reported, for the plot
    timeline: list[tuple[int, float]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    #: the highest ticket that started: with a fresh queue, the tickets handed out for the starts
    highest_ticket: int = 0


def run(args: argparse.Namespace, out: TextIO) -> int:
    """Run the demo as ``args`` says; its exit status (docs/cli.md)."""
    # everything is checked before anything is printed or changed
    processes = positive_int("--processes", args.processes)
    if processes > MAX_PROCESSES:
        each = "each is an interpreter of its own"
        raise ConfigurationError(f"--processes must be at most {MAX_PROCESSES} ({each}), got {processes}")
    jobs = positive_int("--jobs", args.jobs)
    given = args.name is not None
    if args.reset and not given:
        fresh = "without --name the demo uses a fresh name and resets nothing"
        raise ConfigurationError(f"--reset resets the queue named with --name; {fresh}")
    settings = Settings.checked(args.name if given else f"{NAME_PREFIX}{secrets.token_hex(4)}", args.interval)
    name, interval = settings.name, settings.interval
    if args.plot is not None:
        plot.check(args.plot)
    with stopped_by_signals(), opened_state(args.url) as state:
        if state.url.startswith("memory:"):
            need = "the demo needs a state its processes share"
            raise ConfigurationError(f"memory:// lives inside one process; {need}")
        if state.read(name).record is not None:
            if not args.reset:
                raise ConfigurationError(
                    f"queue {name!r} already has a record in {redact(state.url)}: the demo would reset it, "
                    f"and shards using it with other terms would then fail; leave out --name (the demo "
                    f"then uses a fresh name), or give --reset to reset queue {name!r} anyway"
                )
            state.reset(name)  # on purpose (--reset): a fresh record, with this demo's interval
        starts = f"{plural(processes, 'process')} x {plural(jobs, 'start')}"
        kept = f"(queue {name!r}, {'kept' if given else 'deleted'} at the end)"
        say(out, f"{starts}, one start every {interval * 1000:g} ms, through {redact(state.url)} {kept}")
        try:
            seen = _run_workers(state.url, settings, processes, jobs, args.quiet, out)
        finally:
            if not given:
                state.reset(name)  # the demo's own fresh queue: leave nothing behind
        status = _summary(seen, processes * jobs, settings.terms.interval_us, out, fresh=not given)
        if args.plot is not None:
            try:
                plot.draw_demo(
                    args.plot,
                    seen.timeline,
                    seen.starts,
                    interval,
                    begin_bound(settings.terms.interval_us) / US,
                )
            except OSError as exc:
                raise ConfigurationError(f"--plot {args.plot!r}: cannot write it: {exc}") from exc
            say(out, f"plot: {args.plot}")
    return status


def _run_workers(url: str, settings: Settings, processes: int, jobs: int, quiet: bool, out: TextIO) -> Seen:
    """Start the workers and show each start as its report arrives, until every worker is done.

    Returns what was heard from them.
    """
    name, interval, interval_us = settings.name, settings.interval, settings.terms.interval_us
    total = processes * jobs
    context = multiprocessing.get_context("spawn")
    reports: Any = context.Queue()
    parent = os.getpid()
    seen = Seen()
    workers = [
        context.Process(target=_worker, args=(url, name, interval, jobs, index, reports, parent), daemon=True)
        for index in range(1, processes + 1)
    ]
    try:
        with _sigint_held():  # inherited by the workers: Ctrl-C reaches this process only
            for worker in workers:
                worker.start()
        finished = 0
        wait = max(30.0, 10 * interval)
        while finished < processes:
            try:
                index, ticket, start, begin, error = reports.get(timeout=wait)
            except queue_module.Empty:
                seen.failures.append(f"no report for {wait:g} s; giving up")
                break
            if ticket is None:
                finished += 1
                if error:
                    seen.failures.append(f"process {index}: {scrub(error, url)}")
                continue
            # a start or a begin that arrives after a later one changes the gap of the later one's
            # line, shown already: the summary counts the gaps as they finally are
            late_start, state_gap = _insert(seen.starts, start)
            late_begin, begin_gap = _insert(seen.begins, begin)
            seen.timeline.append((index, begin))
            seen.highest_ticket = max(seen.highest_ticket, ticket)
            if not quiet:
                place = f"[{len(seen.starts):>{len(str(total))}}/{total}] process {index}  ticket {ticket:>6}"
                say(out, _line(place, state_gap, begin_gap, interval_us, late_start or late_begin))
        for worker in workers:
            worker.join(timeout=5)
    finally:
        for worker in workers:  # interrupted, or a worker hung: stop them before leaving
            if worker.is_alive():
                worker.terminate()
        for worker in workers:
            if worker.pid is not None:
                worker.join(timeout=5)
    return seen


def _insert(values: list[Any], value: Any) -> tuple[bool, Any]:
    """Insert ``value`` into sorted ``values``; whether a later one is there, the gap to the one before."""
    place = bisect.bisect(values, value)
    values.insert(place, value)
    return place < len(values) - 1, None if place == 0 else value - values[place - 1]


def begin_margin(interval_us: int) -> int:
    """The margin (us) the demo's limiters add to each start: ``max_late`` where the lateness is checked."""
    max_late_us = round(DEFAULT_MAX_LATE * US)
    return max_late_us if interval_us >= 4 * max_late_us else 0


def begin_bound(interval_us: int) -> float:
    """The smallest begin gap G7 promises (us): the interval less ``max_late``, where that is checked.

    Each begin comes at most ``max_late`` after its start, so two begins lie
    at least ``interval - max_late`` apart; for intervals under ``4 *
    max_late`` the check is off and the bound is the interval itself.
    """
    max_late_us = DEFAULT_MAX_LATE * US
    return interval_us - max_late_us if interval_us >= 4 * max_late_us else interval_us


def _line(place: str, state_gap: int | None, begin_gap: float | None, interval_us: int, late: bool) -> str:
    """One live line: the start's ``place`` (its count, process and ticket), state-clock gap and begin gap.

    ``late``: its start or its begin was reported after a later one (reports of
    different processes may arrive out of order).
    """
    state = "-" if state_gap is None else f"{state_gap / 1000:.3f}"
    begin = "-" if begin_gap is None else f"{begin_gap * 1000:.3f}"
    flags = ""
    if state_gap is not None and state_gap < interval_us:
        flags += "  STATE-CLOCK GAP UNDER THE INTERVAL"
    if begin_gap is not None and begin_gap * US < begin_bound(interval_us):
        flags += "  (BEGIN GAP UNDER INTERVAL - MAX_LATE)"
    if late:
        flags += "  (reported after a later start)"
    return f"{place}  state-clock gap {state:>9} ms  begin gap {begin:>9} ms{flags}"


def _summary(seen: Seen, total: int, interval_us: int, out: TextIO, fresh: bool = True) -> int:
    """Print the summary; the exit status: 0 if no state-clock gap was under the interval, nothing failed
    and every start came; else 1. Begin gaps are reported only."""
    starts = seen.starts
    state_gaps = [later - earlier for earlier, later in itertools.pairwise(starts)]
    begin_gaps = [(later - earlier) * US for earlier, later in itertools.pairwise(seen.begins)]
    under = sum(1 for gap in state_gaps if gap < interval_us)
    bound = begin_bound(interval_us)
    past_bound = sum(1 for gap in begin_gaps if gap < bound)
    say(out, "")
    if state_gaps:
        span = (starts[-1] - starts[0]) / US
        rate = len(state_gaps) / span if span > 0 else float("inf")
        target = US / interval_us
        versus = f"rate {rate:.2f}/s of {target:.2f}/s target ({100 * rate / target:.1f} %"
        margin_us = begin_margin(interval_us)
        if margin_us:  # (each start moves the next by the margin: the rate it leaves, at most)
            kept = 100 * interval_us / (interval_us + margin_us)
            versus += f"; the {margin_us / 1000:g} ms margin a start keeps {kept:.1f} %"
        versus += ")"
        say(out, f"summary: {len(starts)}/{total} starts in {span:.3f} s (state clock), {versus}")
        say(out, f"  state-clock gaps: {_spread(state_gaps, interval_us)}")
        say(out, f"  begin gaps:       {_begin_spread(begin_gaps, interval_us, bound, past_bound)}")
    else:
        say(out, f"summary: {len(starts)}/{total} starts")
    passed = seen.highest_ticket - len(starts)
    if passed > 0 and fresh:
        say(
            out,
            f"  tickets:          {seen.highest_ticket} handed out for {len(starts)} starts: "
            f"{plural(passed, 'ticket')} passed (a turn given up for a late wake-up, G7, or a ticket "
            "its caller left); each caller took a new one, none was lost",
        )
    say(out, *(f"failure: {failure}" for failure in seen.failures))
    problems = []
    if under:
        problems.append(f"{plural(under, 'state-clock gap')} under the interval")
    if seen.failures:
        problems.append(plural(len(seen.failures), "failure"))
    if len(starts) < total:
        problems.append(f"{total - len(starts)} of {plural(total, 'start')} missing")
    say(out, f"result: {'FAILED: ' + ', '.join(problems) if problems else 'ok'}")
    return 1 if problems else 0


def _spread(gaps: Sequence[float], interval_us: int) -> str:
    """The smallest and median of ``gaps`` (us), in ms, and how many are under the interval."""
    under = sum(1 for gap in gaps if gap < interval_us)
    median = statistics.median(gaps)
    return f"smallest {min(gaps) / 1000:.3f} ms, median {median / 1000:.3f} ms, under the interval: {under}"


def _begin_spread(gaps: Sequence[float], interval_us: int, bound: float, past_bound: int) -> str:
    """The begin gaps' smallest and median, in words a newcomer reads right: a gap a little under the
    interval is a process waking some microseconds late (normal); G7 keeps them above ``bound``."""
    under = sum(1 for gap in gaps if gap < interval_us)
    median = statistics.median(gaps)
    where = f"smallest {min(gaps) / 1000:.3f} ms, median {median / 1000:.3f} ms"
    little = f"{under} a little under the interval (a process woke a few µs late: normal)"
    if not past_bound:
        return f"{where}; {little}, none under {bound / 1000:.3f} ms (interval - max_late: kept, G7)"
    return (
        f"{where}; {little}, {past_bound} under {bound / 1000:.3f} ms (interval - max_late): the OS "
        "delayed a process after its turn began, reported, not a failure"
    )


@contextmanager
def _sigint_held() -> Iterator[None]:
    """Hold SIGINT back meanwhile; processes started meanwhile inherit that, and never see it.

    A terminal sends Ctrl-C to its whole foreground process group: the
    workers would each raise KeyboardInterrupt, with a traceback, even while
    starting up. A signal mask is inherited across exec, so a worker starts
    with SIGINT blocked (and ignores it first thing); this process gets a
    Ctrl-C that came meanwhile once the mask is lifted, and ends the workers
    itself. Without ``pthread_sigmask`` (Windows) SIGINT is ignored meanwhile.
    """
    if not hasattr(signal, "pthread_sigmask"):
        with handling([signal.SIGINT], signal.SIG_IGN):
            yield
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _worker(url: str, name: str, interval: float, jobs: int, index: int, reports: Any, parent: int) -> None:
    """One demo process: ``jobs`` acquires; each reported with its state-clock start and its begin.

    It stops early once ``parent`` (the demo's process, which ends it when
    interrupted) is gone without ending it: killed, say, with SIGKILL. On
    Linux the kernel sends it SIGTERM then (``PR_SET_PDEATHSIG``); elsewhere,
    or if that fails, its check of ``os.getppid()`` between acquires does it,
    later.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and ends this process
    if sys.platform.startswith("linux"):
        with suppress(OSError, AttributeError):
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # 1: PR_SET_PDEATHSIG
    error = ""
    try:
        with closing(Limiter(url, name=name, interval=interval)) as limiter:
            for _ in range(jobs):
                if os.getppid() != parent:  # the parent is gone: nobody reads the reports
                    reports.cancel_join_thread()  # leave without flushing them into a pipe nobody reads
                    return
                turn = limiter.acquire()
                # the begin: the moment the caller begins, on this host's clock
                reports.put((index, turn.ticket, turn.start_us, time.monotonic(), ""))
    except Exception as exc:  # reported to the parent, which fails the demo
        error = f"{type(exc).__name__}: {exc}"
    reports.put((index, None, None, None, error))
