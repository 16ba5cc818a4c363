"""Begin gaps against a strict referee: do jobs begin, and reach the API, one interval apart?

``--procs`` worker processes (8) share one global rate R (``--rates``, 20
and 100 per second). Each takes its turns through a limiter and, right
after each turn is granted (``acquire`` returned), calls a strict
rate-limit referee over HTTP (``referee.py``: it answers 429 to any call
*arriving* less than 1/R after the last accepted one; ``--tolerance``, 0 by
default, relaxes that). Measured, in one run and on one machine:

* **ratequeue** -- ``Limiter(url, name=..., interval=1/R + margin, margin=0).acquire()``
  on the states of ``--states``: a Redis and a state file by default, and
  also a PostgreSQL (``postgresql``) and a MongoDB (``mongodb``). Each
  server is one of our own on a free loopback port, started as the tests
  start theirs (``tests/servers.py``) and stopped at the end: a
  ``redis-server``; a PostgreSQL cluster made by ``initdb`` in a temporary
  directory (trust auth, fsync off; run as the ``postgres`` user when we are
  root); and secantusdb's ``secantusd-py``, in memory, standing in for
  MongoDB (a MongoDB-compatible server written in Python: its figures are
  secantusdb's, not a real ``mongod``'s). ``--redis-url``,
  ``--postgresql-url`` and ``--mongodb-url`` use a server of yours instead;
* the peers of ``peers.py``, on the same Redis: pyrate-limiter (with its
  default 50 ms buffer and with ``buffer_ms=0``), limits, throttled-py
  (blocking, and with its own ``retry_after`` sleep), and "divide" (each
  process on its own schedule of R/procs per second, no shared state).

Every limiter is given the interval ``1/R + margin`` (``--margin``, 0.5 ms; ratequeue's own
margin, 0.3 ms a start by default, is turned off so that it gets this one only),
as closely as its API can say it: pyrate-limiter counts whole milliseconds
(rounded up), limits only has "N per moving 1 s window" (N = the whole
number of intervals in 1 s). The referee's interval is exactly 1/R.

For each limiter and rate: the referee's 429s; the achieved rate; the gaps
between consecutive *begins* across all processes (``time.monotonic()``
read right after ``acquire`` returned: one host, one clock): smallest,
0.1st and 1st percentile, median; for ratequeue, how late each job began
after its granted start (begin - ``Turn.local_start``); the workers' CPU
time per start (the limiter's; the referee calls' own CPU is not counted).
A second table shows the referee's side: arrival minus begin (the time a
call took to reach the referee, on CLOCK_REALTIME; the referee stamps
arrivals with the kernel's receive timestamps), and how many 429s came
although the two begins were a full 1/R apart (so were caused between the
begin and the arrival, not by the limiter's turns).

``--hog K`` runs K more processes doing ``while True: pass`` throughout, so
that the workers, Redis and the referee compete for the cores.

Run::

    python bench/begin_gaps.py --quick                 # a smoke run, about 20 s
    python bench/begin_gaps.py --hog 2                 # the full run, about 5 minutes on 2 cores
    python bench/begin_gaps.py --states redis,file,postgresql,mongodb   # every state
    python bench/begin_gaps.py --states postgresql,mongodb --peers '' --rates 50 --requests 100 --procs 4
    python bench/begin_gaps.py --rq-path /tmp/rq-before --json before.json   # an older checkout
    python bench/begin_gaps.py --plot bench/results    # CDFs of the lateness, one PNG per row

``--rq-path DIR`` puts DIR first on ``sys.path`` (and ``PYTHONPATH``) before
ratequeue is imported, here and in every worker, so an old checkout (say
``git worktree add /tmp/rq-before <commit>``) is measured; the output says
which files the workers imported. Only ratequeue's public API is used
(``Limiter``, ``acquire``, ``status``, ``Turn.local_start``), so any
version of it can be measured.
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
    # spawned workers get this sys.path from us; PYTHONPATH covers any other child
    sys.path.insert(0, RQ_PATH)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (RQ_PATH, os.environ.get("PYTHONPATH")) if p)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import peers  # noqa: E402
from _common import (  # noqa: E402
    Gate,
    Progress,
    add_common,
    busy_loops,
    checkout,
    gaps,
    machine,
    mongodb_server,
    ms,
    names,
    new_parser,
    num,
    numbers,
    percentile,
    postgresql_server,
    prepare_queue,
    print_machine,
    print_written,
    pyplot,
    redis_server,
    refuse_unknown,
    run_processes,
    table,
    unique_name,
    us,
    wall_minus_monotonic,
)
from referee import Referee, RefereeClient, RefereeStats  # noqa: E402

#: the peers of peers.py measured here (ratequeue itself is measured on each state)
PEERS = [p for p in peers.PEERS if p != "ratequeue"]
#: ratequeue, its workers telling it each request's send (``Limiter.sent``): ``--sent``
SENT = "ratequeue+sent"
#: the states ratequeue can be measured on (``--states``), and those measured by default
STATES = ["redis", "file", "postgresql", "mongodb"]
DEFAULT_STATES = ["redis", "file"]
#: how a state is named in the tables
STATE_NAMES = {"postgresql": "PostgreSQL", "mongodb": "MongoDB (secantusdb)"}


def state_name(state: str) -> str:
    """``state`` as the tables name it: ``redis``, ``file``, ``PostgreSQL``, ``MongoDB (secantusdb)``."""
    return STATE_NAMES.get(state, state)


# --------------------------------------------------------------------------- what a limiter is told


def limiter_interval(limiter: str, rate: float, margin: float) -> tuple[float, str]:
    """The interval (s) ``limiter`` runs at for target ``rate`` and ``margin``, and how it is told so.

    ``1/rate + margin`` wherever the limiter's API can say it; otherwise the
    nearest setting that is not faster.
    """
    wanted = 1 / rate + margin
    if limiter.startswith("pyrate-limiter"):
        whole_ms = math.ceil(wanted * 1000 - 1e-9)
        return whole_ms / 1000, f"Rate(1, {whole_ms}) ms"
    if limiter == "limits":
        per_second = math.floor(1 / wanted + 1e-9)
        return 1 / per_second, f"{per_second} per moving 1 s window"
    if limiter.startswith("throttled-py"):
        micro = round(wanted * 1e6)
        return micro / 1e6, f"GCRA, emission {micro / 1000:g} ms, burst 1"
    return wanted, f"{wanted * 1000:g} ms"


def _throttled(task: Task, own_sleep: bool) -> Callable[[float], Any]:
    """peers.py's throttled-py peer, with a quota of exactly ``task.interval`` (not whole per-second counts).

    throttled-py keeps whole seconds in its quota, so ``interval`` is said
    as ``round(interval * 1e6)`` seconds per million calls, burst 1.
    """
    from throttled import RateLimiterType, Throttled, rate_limiter, store

    micro = round(task.interval * 1e6)
    throttle = Throttled(
        key=task.key,
        using=RateLimiterType.GCRA.value,
        quota=rate_limiter.per_duration(timedelta(seconds=micro), 1_000_000, burst=1),
        store=store.RedisStore(server=task.url),
        timeout=None if own_sleep else task.give_up,
    )
    throttle.peek(task.key)  # connect

    def acquire(end: float) -> None:
        while True:
            result = throttle.limit()
            if not result.limited:
                return
            if time.monotonic() > end:
                raise TimeoutError
            if own_sleep:
                time.sleep(result.state.retry_after)

    return acquire


# --------------------------------------------------------------------------- workers


@dataclass(frozen=True)
class Task:
    """What one worker process does."""

    limiter: str
    state: str
    url: str
    key: str
    rate: float
    #: the limiter's interval (s), from :func:`limiter_interval`
    interval: float
    procs: int
    #: turns this process takes
    count: int
    #: seconds after the common start at which the process gives up
    give_up: float
    referee: str
    #: the divide peer's offset of its schedule, seconds
    phase: float = 0.0


def _acquirer(task: Task) -> Callable[[float], Any]:
    """``acquire(end)``: block until this process's next turn (``TimeoutError`` past ``end``)."""
    if task.limiter.startswith("ratequeue"):
        import ratequeue

        limiter = ratequeue.Limiter(task.url, name=task.key, interval=task.interval, margin=0)
        limiter.status()  # connect

        def acquire(end: float) -> Any:
            return limiter.acquire(timeout=max(0.0, end - time.monotonic()))

        acquire.sent = getattr(limiter, "sent", None)  # type: ignore[attr-defined]  (an older version: None)
        return acquire
    if task.limiter.startswith("throttled-py"):
        return _throttled(task, own_sleep=task.limiter.endswith("/sleep"))
    # peers.py's factories derive their setting from a rate: give them 1/interval
    job = peers.Job(
        task.limiter, task.url, task.key, 1 / task.interval, task.procs, task.count, task.give_up, task.phase
    )
    return peers.FACTORIES[task.limiter](job)


def source_hash(package: str | os.PathLike[str]) -> str:
    """A short hash of every ``.py`` file under ``package`` (a directory), names and contents."""
    root = Path(package)
    digest = hashlib.sha1()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:10]


def worker(index: int, task: Task, gate: Gate) -> dict[str, Any]:
    """One process: ``task.count`` turns, a referee call right after each; what it saw.

    ``begins``: ``time.monotonic()`` right after each ``acquire`` returned;
    ``planned``: the turn's ``Turn.local_start`` (ratequeue; NaN otherwise);
    ``state``: the turn's start on the state's clock (``Turn.start_us``, s; NaN if none);
    ``statuses``: the referee's answers, the calls tagged ``p{index}.{k}``.
    """
    import ratequeue

    acquire = _acquirer(task)
    client = RefereeClient(task.referee)
    client.connect()
    offset = wall_minus_monotonic()
    t0 = gate.wait()
    end = t0 + task.give_up
    begins: list[float] = []
    planned: list[float] = []
    state: list[float] = []
    statuses: list[int] = []
    timed_out = False
    calls_cpu = 0.0
    held = 0
    cpu = time.process_time()
    for k in range(task.count):
        try:
            turn = acquire(end)
        except TimeoutError:  # ratequeue's AcquireTimeout is one too
            timed_out = True
            break
        begin = time.monotonic()
        before_call = time.process_time()
        if task.limiter == SENT:  # the request written, then the limiter told, then the answer read
            client.send(f"p{index}.{k}")
            held += acquire.sent(turn)  # type: ignore[attr-defined]
            statuses.append(client.answer())
        else:
            statuses.append(client.call(f"p{index}.{k}"))
        calls_cpu += time.process_time() - before_call
        begins.append(begin)
        planned.append(float(turn.local_start) if turn is not None else math.nan)
        start_us = getattr(turn, "start_us", None)
        state.append(start_us / 1e6 if start_us is not None else math.nan)
        if begin > end:
            timed_out = True
            break
    cpu = time.process_time() - cpu - calls_cpu
    client.close()
    return {
        "begins": begins,
        "planned": planned,
        "state": state,
        "statuses": statuses,
        "cpu": cpu,
        "calls_cpu": calls_cpu,
        "held": held,
        "offset": offset,
        "timed_out": timed_out,
        "ratequeue_file": ratequeue.__file__,
        "ratequeue_source": source_hash(Path(ratequeue.__file__).parent),
    }


# --------------------------------------------------------------------------- one row


@dataclass
class Row:
    """One limiter on one state at one rate: what the workers and the referee saw (times in seconds)."""

    limiter: str
    state: str
    rate: float
    procs: int
    #: the limiter's interval and how it was told
    interval: float
    setting: str
    starts: int
    target: int
    timed_out: int
    #: 429s the workers were answered, and the referee's own count
    rejected: int
    referee_rejected: int
    other_statuses: int
    achieved: float
    gap_min: float
    gap_p01: float
    gap_p1: float
    gap_median: float
    late_p50: float
    late_p99: float
    late_max: float
    #: ratequeue: smallest gap between consecutive granted starts (``Turn.local_start``, all processes)
    planned_gap_min: float
    #: ratequeue: smallest gap between consecutive starts on the state's clock (``Turn.start_us``)
    state_gap_min: float
    #: ratequeue, on a state whose clock is this host's wall clock (file, a local Redis): the spread
    #: of ``Turn.local_start`` - the state start converted to ``time.monotonic()``, p99 - p1 and max - min
    mapping_spread_p98: float
    mapping_spread_max: float
    #: limiter CPU per start, all worker processes (referee calls excluded)
    cpu_per_start: float
    calls_cpu_per_call: float
    #: ``--sent`` rows: how many sends came later than ``max_late`` and held the queue
    held: int
    #: arrival at the referee minus begin
    transit_p50: float
    transit_p99: float
    transit_max: float
    #: smallest gap between consecutive arrivals (any), and between consecutive accepted ones
    arrival_gap_min: float
    accepted_gap_min: float
    #: 429s whose begin came a full 1/R or more after the begin of the last accepted call
    rejected_after_full_gap: int
    #: referee decisions that disagree with its own recorded arrival times (should be 0)
    referee_inconsistent: int
    #: consecutive decisions whose arrival times go backwards (read in different loop passes)
    referee_inversions: int
    kernel_stamped: int
    fallback_stamped: int
    load: tuple[float, float, float]
    seconds: float
    ratequeue_files: list[str]
    #: :func:`source_hash` of the ratequeue package the workers imported
    ratequeue_sources: list[str]
    #: per start, begin - Turn.local_start (ratequeue); the begin gaps; arrival - begin
    lateness: list[float] = field(default_factory=list, repr=False)
    begin_gaps: list[float] = field(default_factory=list, repr=False)
    transits: list[float] = field(default_factory=list, repr=False)


def _nan_percentile(values: list[float], p: float) -> float:
    return percentile(values, p) if values else math.nan


def analyse(
    task: Task, results: list[dict[str, Any]], stats: RefereeStats, seconds: float, setting: str
) -> Row:
    """Turn the workers' reports and the referee's record of one run into a :class:`Row`."""
    begins = sorted(t for r in results for t in r["begins"])
    begin_gaps = gaps(begins)
    span = begins[-1] - begins[0] if len(begins) > 1 else math.nan
    late = [
        b - p for r in results for b, p in zip(r["begins"], r["planned"], strict=True) if not math.isnan(p)
    ]
    planned_gaps = gaps([p for r in results for p in r["planned"] if not math.isnan(p)])
    state_gaps = gaps([t for r in results for t in r["state"] if not math.isnan(t)])
    mapping = [
        p - (t - r["offset"])
        for r in results
        for p, t in zip(r["planned"], r["state"], strict=True)
        if not (math.isnan(p) or math.isnan(t))
    ]
    statuses = [s for r in results for s in r["statuses"]]
    # every call, by tag: its begin (monotonic) and on CLOCK_REALTIME
    begin_of: dict[str, tuple[float, float]] = {}
    for i, r in enumerate(results):
        for k, b in enumerate(r["begins"]):
            begin_of[f"p{i}.{k}"] = (b, b + r["offset"])
    transits = [a.t_ns / 1e9 - begin_of[a.who][1] for a in stats.arrivals if a.who in begin_of]
    interval_ns = round(stats.interval * 1e9)
    tolerance_ns = round(stats.tolerance * 1e9)
    last: Any = None
    inconsistent = inversions = after_full_gap = 0
    previous_ns: int | None = None
    arrival_gaps: list[int] = []
    accepted_gaps: list[int] = []
    for a in stats.arrivals:
        if previous_ns is not None:
            arrival_gaps.append(a.t_ns - previous_ns)
            inversions += a.t_ns < previous_ns
        previous_ns = a.t_ns
        expected = last is None or a.t_ns - last.t_ns >= interval_ns - tolerance_ns
        inconsistent += expected != a.accepted
        if a.accepted:
            if last is not None:
                accepted_gaps.append(a.t_ns - last.t_ns)
            last = a
        elif last is not None and a.who in begin_of and last.who in begin_of:
            after_full_gap += begin_of[a.who][0] - begin_of[last.who][0] >= 1 / task.rate
    cpu = sum(r["cpu"] for r in results)
    return Row(
        limiter=task.limiter,
        state=task.state,
        rate=task.rate,
        procs=task.procs,
        interval=task.interval,
        setting=setting,
        starts=len(begins),
        target=task.count * task.procs,
        timed_out=sum(1 for r in results if r["timed_out"]),
        rejected=statuses.count(429),
        referee_rejected=stats.rejected,
        other_statuses=sum(1 for s in statuses if s not in (200, 429)),
        achieved=(len(begins) - 1) / span if span and span > 0 else math.nan,
        gap_min=min(begin_gaps) if begin_gaps else math.nan,
        gap_p01=_nan_percentile(begin_gaps, 0.1),
        gap_p1=_nan_percentile(begin_gaps, 1),
        gap_median=_nan_percentile(begin_gaps, 50),
        late_p50=_nan_percentile(late, 50),
        late_p99=_nan_percentile(late, 99),
        late_max=max(late) if late else math.nan,
        planned_gap_min=min(planned_gaps) if planned_gaps else math.nan,
        state_gap_min=min(state_gaps) if state_gaps else math.nan,
        mapping_spread_p98=percentile(mapping, 99) - percentile(mapping, 1) if mapping else math.nan,
        mapping_spread_max=max(mapping) - min(mapping) if mapping else math.nan,
        cpu_per_start=cpu / max(1, len(begins)),
        calls_cpu_per_call=sum(r["calls_cpu"] for r in results) / max(1, len(statuses)),
        held=sum(r.get("held", 0) for r in results),
        transit_p50=_nan_percentile(transits, 50),
        transit_p99=_nan_percentile(transits, 99),
        transit_max=max(transits) if transits else math.nan,
        arrival_gap_min=min(arrival_gaps) / 1e9 if arrival_gaps else math.nan,
        accepted_gap_min=min(accepted_gaps) / 1e9 if accepted_gaps else math.nan,
        rejected_after_full_gap=after_full_gap,
        referee_inconsistent=inconsistent,
        referee_inversions=inversions,
        kernel_stamped=stats.kernel_stamped,
        fallback_stamped=stats.fallback_stamped,
        load=os.getloadavg(),
        seconds=seconds,
        ratequeue_files=sorted({r["ratequeue_file"] for r in results}),
        ratequeue_sources=sorted({r["ratequeue_source"] for r in results}),
        lateness=late,
        begin_gaps=begin_gaps,
        transits=transits,
    )


def run_row(
    limiter: str,
    state: str,
    url: str,
    rate: float,
    args: argparse.Namespace,
    count: int,
    referee: Referee,
    progress: Progress,
    label: str,
) -> Row:
    """Run one limiter on one state at one rate: ``args.procs`` workers, ``count`` turns each."""
    interval, setting = limiter_interval(limiter, rate, args.margin)
    expected = count * args.procs / rate
    key = unique_name(f"begin-gaps-{limiter.replace('/', '-')}")
    rng = random.Random(args.seed)
    tasks = [
        Task(
            limiter=limiter,
            state=state,
            url=url,
            key=key,
            rate=rate,
            interval=interval,
            procs=args.procs,
            count=count,
            give_up=1.5 * expected + 5,
            referee=str(referee.url),
            phase=rng.uniform(0, args.procs * interval),
        )
        for _ in range(args.procs)
    ]
    if limiter.startswith("ratequeue"):  # the record (and Redis's scripts) made before the measurement
        prepare_queue(url, key, interval)
    started: list[float] = []

    def release(_: int) -> None:
        referee.reset(interval=1 / rate, tolerance=args.tolerance)
        started.append(time.monotonic())

    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(2.0):
            if started:
                progress.note(f"{label}: {time.monotonic() - started[0]:.0f} s of about {expected:.0f} s")

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        results = run_processes(worker, tasks, before_start=release, timeout=4 * expected + 120)
    finally:
        stop.set()
        ticker.join()
    seconds = time.monotonic() - started[0]
    return analyse(tasks[0], results, referee.stats(), seconds, setting)


# --------------------------------------------------------------------------- output


def _late(row: Row, value: float) -> str:
    return ms(value) if row.lateness else "–"  # noqa: RUF001


def report(rows: list[Row], args: argparse.Namespace) -> str:
    """The Markdown tables of a run, one pair per rate."""
    out = []
    for rate in sorted({r.rate for r in rows}):
        chosen = [r for r in rows if r.rate == rate]
        settings = "; ".join(
            f"{r.limiter} {r.setting}"
            for r in chosen
            if not r.limiter.startswith("ratequeue") and abs(r.interval - (1 / rate + args.margin)) > 1e-9
        )
        head = (
            f"**{args.procs} processes, R = {rate:g} starts/s.** Referee: interval exactly "
            f"{1000 / rate:g} ms, tolerance {args.tolerance * 1000:g} ms. Limiters: interval 1/R + margin "
            f"= {(1 / rate + args.margin) * 1000:g} ms, ratequeue and the peers alike"
            + (f" (as near as the API allows: {settings})" if settings else "")
            + ". Times in ms; begin = `time.monotonic()` right after `acquire` returned."
        )
        main_rows = [
            [
                r.limiter,
                state_name(r.state),
                f"{r.starts}/{r.target}" + (f" ({r.timed_out} gave up)" if r.timed_out else ""),
                r.rejected,
                f"{num(r.achieved, 1)} ({100 * r.achieved / rate:.1f} %)"
                if not math.isnan(r.achieved)
                else "—",
                ms(r.gap_min),
                ms(r.gap_p01),
                ms(r.gap_p1),
                ms(r.gap_median),
                _late(r, r.late_p50),
                _late(r, r.late_p99),
                _late(r, r.late_max),
                _late(r, r.planned_gap_min),
                us(r.cpu_per_start),
            ]
            for r in chosen
        ]
        referee_rows = [
            [
                r.limiter,
                state_name(r.state),
                r.referee_rejected,
                r.rejected_after_full_gap,
                ms(r.transit_p50),
                ms(r.transit_p99),
                ms(r.transit_max),
                ms(r.arrival_gap_min),
                ms(r.accepted_gap_min),
                f"{r.seconds:.1f}",
            ]
            for r in chosen
        ]
        out.append(
            head
            + "\n\n"
            + table(
                [
                    "limiter",
                    "state",
                    "starts",
                    "429s",
                    "achieved /s (of R)",
                    "begin gap min",
                    "p0.1",
                    "p1",
                    "median",
                    "lateness p50",
                    "p99",
                    "max",
                    "local_start gap min",
                    "CPU µs/start",
                ],
                main_rows,
                "ll" + "r" * 12,
            )
            + "\n\nLateness = begin - `Turn.local_start`; local_start gap min = the smallest gap between "
            "consecutive granted starts, as ratequeue mapped them to this host's clock.\n\n"
            "At the referee (arrival = kernel receive timestamp, CLOCK_REALTIME):\n\n"
            + table(
                [
                    "limiter",
                    "state",
                    "429s",
                    "429s after a begin gap ≥ 1/R",
                    "arrival - begin p50",
                    "p99",
                    "max",
                    "arrival gap min",
                    "accepted gap min",
                    "run s",
                ],
                referee_rows,
                "ll" + "r" * 8,
            )
        )
    notes = []
    for r in rows:
        if r.rejected != r.referee_rejected or r.other_statuses:
            notes.append(
                f"{r.limiter}/{r.state} at {r.rate:g}/s: workers saw {r.rejected} 429s and "
                f"{r.other_statuses} other non-200 answers, the referee counted {r.referee_rejected} 429s"
            )
        if r.referee_inconsistent:
            notes.append(
                f"{r.limiter}/{r.state} at {r.rate:g}/s: {r.referee_inconsistent} referee decisions "
                "disagree with its own arrival times"
            )
        if r.fallback_stamped:
            notes.append(
                f"{r.limiter}/{r.state} at {r.rate:g}/s: {r.fallback_stamped} calls stamped with time.time() "
                "when read, not by the kernel"
            )
        if r.referee_inversions:
            notes.append(
                f"{r.limiter}/{r.state} at {r.rate:g}/s: {r.referee_inversions} decisions on arrivals "
                "earlier than the one decided before (read in a later loop pass)"
            )
    plans = [
        f"{state_name(r.state)} at {r.rate:g}/s: smallest gap on the state's clock {ms(r.state_gap_min)}, "
        f"between `Turn.local_start`s {ms(r.planned_gap_min)}; spread of `local_start` - state start "
        f"(p99 - p1) {ms(r.mapping_spread_p98)}, (max - min) {ms(r.mapping_spread_max)}"
        for r in rows
        if r.limiter.startswith("ratequeue") and not math.isnan(r.state_gap_min)
    ]
    if plans:
        out.append(
            "ratequeue's plan (ms; the state start converted with this host's `time.time() - "
            "time.monotonic()`, right for a state file and for a server on this host, such as the ones "
            "this script starts; MongoDB's clock, `$$NOW`, counts whole milliseconds): "
            + "; ".join(plans)
            + "."
        )
    cpu = [f"{r.limiter}/{r.state} {us(r.calls_cpu_per_call)}" for r in rows if r.rate == rows[0].rate]
    out.append(
        "Referee self-check: "
        + (
            "; ".join(notes)
            if notes
            else "every decision agrees with its recorded arrival times, every "
            "call was stamped by the kernel, and the workers' 429 counts match the referee's"
        )
        + ".\n\nCPU µs/start is the workers' CPU time (all processes) per start, without the referee "
        "calls; those took " + ", ".join(cpu) + f" µs of CPU per call (at {rows[0].rate:g}/s)."
    )
    held = [f"{r.state} at {r.rate:g}/s {r.held} of {r.starts}" for r in rows if r.limiter == SENT]
    if held:
        out.append(
            f"`{SENT}`: sends later than `max_late` after their start, each holding the queue: "
            + "; ".join(held)
            + "."
        )
    return "\n\n".join(out)


def plot(rows: list[Row], directory: Path) -> list[Path]:
    """CDFs of the lateness (begin - ``Turn.local_start``), log x: a PNG per ratequeue row, one of all."""
    plt = pyplot()
    directory.mkdir(parents=True, exist_ok=True)
    floor_ms = 1e-3  # 1 µs: lateness at or below it is drawn there
    chosen = [r for r in rows if r.lateness]
    written = []

    def draw(ax: Any, row: Row, label: str) -> None:
        values = sorted(max(floor_ms, v * 1000) for v in row.lateness)
        n = len(values)
        ax.step(values, [(i + 1) / n for i in range(n)], where="post", label=label)

    for row in chosen:
        fig, ax = plt.subplots(figsize=(7, 4))
        draw(ax, row, f"{row.limiter}/{row.state}")
        ax.set_xscale("log")
        ax.set_xlabel("begin - Turn.local_start, ms (log; ≤ 1 µs drawn at 1 µs)")
        ax.set_ylabel("fraction of starts")
        ax.set_title(
            f"Lateness of begins: {row.limiter} on {row.state}, {row.procs} processes, {row.rate:g}/s"
        )
        ax.grid(True, which="both", alpha=0.3)
        fig.tight_layout()
        path = directory / f"begin-gaps-lateness-{row.state}-{row.rate:g}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    if chosen:
        fig, ax = plt.subplots(figsize=(7, 4))
        for row in chosen:
            draw(ax, row, f"{row.state}, {row.rate:g}/s")
        ax.set_xscale("log")
        ax.set_xlabel("begin - Turn.local_start, ms (log; ≤ 1 µs drawn at 1 µs)")
        ax.set_ylabel("fraction of starts")
        ax.set_title("Lateness of ratequeue's begins")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = directory / "begin-gaps-lateness.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written


def dump(rows: list[Row], args: argparse.Namespace, header: dict[str, Any], path: Path) -> None:
    """Write the rows (raw lateness, begin gaps and transits included) and the run's settings as JSON."""

    def clean(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, list | tuple):
            return [clean(v) for v in value]
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        return value

    document = {
        **header,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "rows": [clean(dataclasses.asdict(r)) for r in rows],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1))


# --------------------------------------------------------------------------- main


@contextlib.contextmanager
def _state_server(state: str, args: argparse.Namespace) -> Iterator[str]:
    """The URL of ``state``'s server: the one its ``--*-url`` names, else one of our own, stopped after."""
    if state == "redis":
        with redis_server(args.redis_url) as url:
            yield url
        return
    given = args.postgresql_url if state == "postgresql" else args.mongodb_url
    if given:
        yield given
        return
    with contextlib.ExitStack() as stack:
        try:
            url = stack.enter_context(postgresql_server() if state == "postgresql" else mongodb_server())
        except BaseException as exc:
            # tests/servers.py says "unavailable" with pytest's skip (or fail, under CI)
            if type(exc).__module__.startswith("_pytest"):
                raise SystemExit(f"{state_name(state)} could not start: {exc}") from None
            raise
        yield url


def main(argv: list[str] | None = None) -> int:
    parser = new_parser(__doc__)
    parser.add_argument(
        "--rates", default="20,100", help="global starts per second, comma-separated (20,100)"
    )
    parser.add_argument(
        "--requests",
        default="50,150",
        help="turns per process at each rate, comma-separated, one per rate or one for all (50,150)",
    )
    parser.add_argument("--procs", type=int, default=8, help="worker processes sharing the rate (8)")
    parser.add_argument(
        "--margin", type=float, default=0.0005, help="s added to 1/R for the limiters (0.0005)"
    )
    parser.add_argument("--tolerance", type=float, default=0.0, help="the referee's tolerance, s (0)")
    parser.add_argument("--hog", type=int, default=0, help="busy-loop processes running throughout (0)")
    parser.add_argument(
        "--states",
        default=",".join(DEFAULT_STATES),
        help=f"ratequeue's states, of {','.join(STATES)} ({','.join(DEFAULT_STATES)})",
    )
    parser.add_argument(
        "--postgresql-url", help="use this PostgreSQL instead of starting a cluster of our own (initdb)"
    )
    parser.add_argument(
        "--sent",
        action="store_true",
        help=f"also rows '{SENT}': each worker calls Limiter.sent(turn) once its request is written",
    )
    parser.add_argument("--peers", default=",".join(PEERS), help=f"which peers ({','.join(PEERS)}; '' none)")
    add_common(
        parser,
        mongodb_url=True,
        seed=True,
        quick="a smoke run: 4 processes, 15 turns each, at 100/s",
        plot="write lateness CDF PNGs into DIR",
        json="write the rows as JSON to FILE",
    )
    parser.add_argument(
        "--rq-path", metavar="DIR", help="import ratequeue from DIR (first on sys.path / PYTHONPATH)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.rates, args.requests, args.procs = "100", "15", 4
    rates = numbers(args.rates)
    counts = numbers(args.requests, int)
    if len(counts) == 1:
        counts *= len(rates)
    if len(counts) != len(rates):
        parser.error("--requests needs one value per rate, or one for all")
    states, chosen_peers = names(args.states), names(args.peers)
    refuse_unknown(parser, "states or peers", (set(states) - set(STATES)) | (set(chosen_peers) - set(PEERS)))
    if args.rq_path and not (Path(args.rq_path) / "ratequeue" / "__init__.py").is_file():
        parser.error(f"--rq-path {args.rq_path}: no ratequeue/__init__.py there")

    import ratequeue

    if args.sent and not hasattr(ratequeue.Limiter, "sent"):
        parser.error(f"--sent: the ratequeue at {Path(ratequeue.__file__).parent} has no Limiter.sent")
    source = checkout(ratequeue.__file__)
    started = time.monotonic()
    print_machine()
    print(
        f"ratequeue measured: {Path(ratequeue.__file__).parent} ({source}). "
        f"Load: {args.hog} busy-loop processes (`--hog`); {args.procs} worker processes per row.\n"
    )
    workdir = Path(tempfile.mkdtemp(prefix="ratequeue-begin-gaps-"))
    rows: list[Row] = []
    plan = [
        (rate, count, limiter, state)
        for rate, count in zip(rates, counts, strict=True)
        for limiter, state in [("ratequeue", s) for s in states]
        + [(SENT, s) for s in states if args.sent]
        + [(p, "redis") for p in chosen_peers]
    ]
    timestamps = ""
    try:
        with contextlib.ExitStack() as stack:
            # every server is stopped when the stack closes: at the end, on an error, on Ctrl-C
            urls = {
                state: stack.enter_context(_state_server(state, args))
                for state in dict.fromkeys(states + (["redis"] if chosen_peers else []))
                if state != "file"
            }
            referee = stack.enter_context(Referee(1 / rates[0], args.tolerance))
            stack.enter_context(busy_loops(args.hog))
            progress = Progress(len(plan), "begin-gaps")
            for rate, count, limiter, state in plan:
                label = f"{limiter}/{state} at {rate:g}/s"
                progress.note(label)
                url = f"file://{workdir / unique_name('state')}.json" if state == "file" else urls[state]
                rows.append(run_row(limiter, state, url, rate, args, count, referee, progress, label))
                progress.step(f"{label}: {rows[-1].rejected} 429s")
            progress.close()
            timestamps = referee.stats().timestamps
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    files = sorted({f for r in rows for f in r.ratequeue_files})
    sources = sorted({h for r in rows for h in r.ratequeue_sources})
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(report(rows, args))
    print(
        f"\nWorkers imported ratequeue from: {', '.join(files)} (hash of its .py files: "
        + (
            sources[0]
            if len(sources) == 1
            else "CHANGED DURING THE RUN: "
            + ", ".join(
                f"{r.limiter}/{r.state} at {r.rate:g}/s {'+'.join(r.ratequeue_sources)}" for r in rows
            )
        )
        + f"). Referee arrival times: {timestamps}. "
        f"Load average at the end: {load}. Wall time {time.monotonic() - started:.0f} s."
    )
    if args.json:
        header = {
            "machine": machine(),
            "ratequeue": source,
            "ratequeue_files": files,
            "ratequeue_sources": sources,
            "referee_timestamps": timestamps,
            "hog": args.hog,
        }
        dump(rows, args, header, args.json)
        print_written([args.json], before="\n")
    if args.plot:
        print_written(plot(rows, args.plot))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
