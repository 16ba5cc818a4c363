"""ratequeue beside other Python rate limiters: the same work, the same Redis, the same run.

``--procs`` worker processes (8) share one global rate, first 100 and then
1000 starts per second, and make a fixed number of starts in all
(``--seconds`` worth at the target rate, split evenly between them). Each
limiter takes its turn in the way its documentation recommends for blocking,
distributed use:

* **ratequeue** -- ``Limiter(redis_url, name=..., interval=1/rate).acquire()``;
* **pyrate-limiter** -- a ``RedisBucket`` (sliding-window log) holding
  ``Rate(1, 1000/rate ms)``, ``Limiter(bucket).try_acquire(name)``, blocking
  (its default ``buffer_ms=50`` added to every wait); and
  **pyrate-limiter/buffer0**, the same with ``Limiter(bucket, buffer_ms=0)``;
* **limits** -- ``MovingWindowRateLimiter(RedisStorage(url))`` with
  ``RateLimitItemPerSecond(rate)`` (its finest window is one second):
  ``hit()``, and when refused, sleep until ``get_window_stats().reset_time``
  and hit again (limits has no blocking call);
* **throttled-py** -- ``Throttled(using=GCRA, quota=per_sec(rate, burst=1),
  store=RedisStore(url), timeout=...)``, ``limit()`` until not limited (its
  wait-and-retry sleeps at least 0.2 s between tries); and
  **throttled-py/sleep**, non-blocking ``limit()`` and a sleep of the
  ``retry_after`` it answers;
* **divide** -- no shared state: each process sleeps on its own schedule of
  ``rate / procs`` starts per second, from a random phase.

For each: the achieved rate, the largest number of starts in any window of
length 1/rate, the gaps between consecutive starts as the processes saw them
(``time.monotonic()`` just after the acquire returned; one host, one clock),
the CPU time of the worker processes per start, and the Redis traffic per
start: requests sent by redis-py (round-trips, counted in each process) and
commands run by the server (``INFO commandstats``, including the commands
inside Lua scripts), and the server's CPU per start.

Run::

    python bench/peers.py                       # about three minutes
    python bench/peers.py --quick               # a smoke run: 2 processes, 100/s, about 15 s
    python bench/peers.py --plot bench/results  # also write PNGs there
    python bench/peers.py --redis-url redis://127.0.0.1:6379/0  # an existing Redis (counts get mixed)

It starts its own ``redis-server`` on a free port unless given ``--redis-url``.
"""

from __future__ import annotations

import importlib.metadata
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from _common import (
    CountingState,
    Gate,
    Progress,
    RedisRoundTrips,
    RedisStats,
    Spacing,
    add_common,
    chosen,
    gaps,
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
    redis_client,
    redis_server,
    run_processes,
    table,
    unique_name,
    us,
    wall_minus_monotonic,
)

if TYPE_CHECKING:
    from ratequeue import Turn

#: the limiters compared, in the order they run and appear
PEERS = [
    "ratequeue",
    "pyrate-limiter",
    "pyrate-limiter/buffer0",
    "limits",
    "throttled-py",
    "throttled-py/sleep",
    "divide",
]

#: the distribution each peer comes from (for its version)
DISTRIBUTIONS = {
    "ratequeue": "ratequeue",
    "pyrate-limiter": "pyrate-limiter",
    "limits": "limits",
    "throttled-py": "throttled-py",
}


@dataclass(frozen=True)
class Job:
    """What one worker process does."""

    peer: str
    url: str
    key: str
    rate: float
    procs: int
    #: starts this process makes
    count: int
    #: seconds after the common start at which the process gives up
    give_up: float
    #: the divide peer's offset of its schedule, seconds
    phase: float = 0.0


def _ratequeue(job: Job) -> Callable[[float], Turn | None]:
    import ratequeue

    limiter = ratequeue.Limiter(CountingState(open_state(job.url)), name=job.key, interval=1 / job.rate)
    limiter.status()  # connect

    def acquire(end: float) -> Turn | None:
        return limiter.acquire(timeout=max(0.0, end - time.monotonic()))

    return acquire


def _pyrate(job: Job, buffer_ms: int | None = None) -> Callable[[float], Turn | None]:
    from pyrate_limiter import Limiter, Rate, RedisBucket
    from redis import ConnectionPool, Redis

    db = Redis(connection_pool=ConnectionPool.from_url(job.url))
    bucket = RedisBucket.init([Rate(1, max(1, round(1000 / job.rate)))], db, job.key)
    limiter = Limiter(bucket) if buffer_ms is None else Limiter(bucket, buffer_ms=buffer_ms)

    def acquire(end: float) -> Turn | None:
        if not limiter.try_acquire("bench", timeout=max(0.001, end - time.monotonic())):
            raise TimeoutError
        return None

    return acquire


def _limits(job: Job) -> Callable[[float], Turn | None]:
    from limits import RateLimitItemPerSecond
    from limits.storage import RedisStorage
    from limits.strategies import MovingWindowRateLimiter

    storage = RedisStorage(job.url)
    limiter = MovingWindowRateLimiter(storage)
    item = RateLimitItemPerSecond(round(job.rate), 1)
    storage.check()  # connect

    def acquire(end: float) -> Turn | None:
        while not limiter.hit(item, job.key):
            reset = limiter.get_window_stats(item, job.key).reset_time
            if time.monotonic() > end:
                raise TimeoutError
            time.sleep(max(0.0, reset - time.time()))
        return None

    return acquire


def _throttled(job: Job, own_sleep: bool = False) -> Callable[[float], Turn | None]:
    from throttled import RateLimiterType, Throttled, rate_limiter, store

    throttle = Throttled(
        key=job.key,
        using=RateLimiterType.GCRA.value,
        quota=rate_limiter.per_sec(round(job.rate), burst=1),
        store=store.RedisStore(server=job.url),
        timeout=None if own_sleep else job.give_up,
    )
    throttle.peek(job.key)  # connect

    def acquire(end: float) -> Turn | None:
        while True:
            result = throttle.limit()
            if not result.limited:
                return None
            if time.monotonic() > end:
                raise TimeoutError
            if own_sleep:
                time.sleep(result.state.retry_after)

    return acquire


def _divide(job: Job) -> Callable[[float], Turn | None]:
    period = job.procs / job.rate
    schedule: list[float] = []

    def acquire(end: float) -> Turn | None:
        if not schedule:
            schedule.append(time.monotonic() + job.phase)
        delay = schedule[0] - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        schedule[0] += period
        return None

    return acquire


FACTORIES: dict[str, Callable[[Job], Callable[[float], Turn | None]]] = {
    "ratequeue": _ratequeue,
    "pyrate-limiter": _pyrate,
    "pyrate-limiter/buffer0": lambda job: _pyrate(job, buffer_ms=0),
    "limits": _limits,
    "throttled-py": _throttled,
    "throttled-py/sleep": lambda job: _throttled(job, own_sleep=True),
    "divide": _divide,
}


def worker(index: int, job: Job, gate: Gate) -> dict[str, Any]:
    """One process: ``job.count`` starts through ``job.peer``; its start times, CPU and Redis requests.

    For ratequeue also each start on the state's clock, converted to this
    host's ``time.monotonic()`` (Redis ``TIME`` is this host's wall clock),
    and its ``Turn.local_start``.
    """
    RedisRoundTrips.install()
    acquire = FACTORIES[job.peer](job)
    offset = wall_minus_monotonic()
    t0 = gate.wait()
    end = t0 + job.give_up
    local: list[float] = []
    state: list[float] = []
    planned: list[float] = []
    requests, cpu = RedisRoundTrips.count, time.process_time()
    for _ in range(job.count):
        try:
            turn = acquire(end)
        except TimeoutError:  # ratequeue's AcquireTimeout is one too
            break
        local.append(time.monotonic())
        if turn is not None:
            state.append(turn.start_us / 1e6 - offset)
            planned.append(turn.local_start)
        if local[-1] > end:
            break
    return {
        "local": local,
        "state": state,
        "planned": planned,
        "cpu": time.process_time() - cpu,
        "requests": RedisRoundTrips.count - requests,
        "index": index,
    }


@dataclass
class Result:
    """One peer at one rate."""

    peer: str
    rate: float
    spacing: Spacing
    cpu: float
    requests: int
    server: RedisStats
    #: per process, its local start times
    timelines: list[list[float]]
    target: int
    #: ratequeue only: p99 of (job began - Turn.local_start), and p99 minus median of
    #: (Turn.local_start - the start on the state's clock converted to this host's clock)
    late_p99: float = math.nan
    mapping_p99: float = math.nan

    @property
    def starts(self) -> int:
        return self.spacing.starts


def run_one(
    url: str, peer: str, rate: float, procs: int, seconds: float, seed: int, local_redis: bool = True
) -> Result:
    """Run ``peer`` with ``procs`` processes at ``rate`` for about ``seconds``.

    ``local_redis``: the server runs on this host, so its clock is this host's.
    """
    per_process = max(1, round(rate * seconds / procs))
    rng = random.Random(seed)
    key = unique_name(f"peers-{peer}")
    give_up = 1.5 * seconds + 3
    jobs = [
        Job(peer, url, key, rate, procs, per_process, give_up, phase=rng.uniform(0, procs / rate))
        for _ in range(procs)
    ]
    client = redis_client(url)
    before: list[RedisStats] = []
    if peer == "ratequeue":  # create the record and load the scripts outside the measurement
        prepare_queue(url, key, 1 / rate)
    results = run_processes(worker, jobs, before_start=lambda _: before.append(RedisStats.read(client)))
    server = RedisStats.read(client).minus(before[0])
    client.close()
    local = [t for r in results for t in r["local"]]
    state = [t for r in results for t in r["state"]]
    late = [b - p for r in results for b, p in zip(r["local"], r["planned"], strict=False)]
    errors = [p - s for r in results for p, s in zip(r["planned"], r["state"], strict=True)]
    return Result(
        peer=peer,
        rate=rate,
        spacing=Spacing.of(local, 1 / rate, state or None),
        cpu=sum(r["cpu"] for r in results),
        requests=sum(r["requests"] for r in results),
        server=server,
        timelines=[r["local"] for r in results],
        target=per_process * procs,
        late_p99=percentile(late, 99),
        mapping_p99=percentile(errors, 99) - percentile(errors, 50) if local_redis else math.nan,
    )


def version(name: str) -> str:
    """The installed version of distribution ``name``."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def report(results: list[Result], procs: int) -> str:
    """The Markdown tables of a run."""
    out = []
    for rate in sorted({r.rate for r in results}):
        rows = []
        for r in (r for r in results if r.rate == rate):
            s = r.spacing
            n = max(1, s.starts)
            rows.append(
                [
                    r.peer,
                    f"{s.starts}/{r.target}",
                    num(s.rate, 1),
                    f"{100 * s.rate * (1 / rate):.1f} %" if not math.isnan(s.rate) else "—",
                    s.max_in_window,
                    s.local_under_half,
                    ms(s.local_min_gap),
                    ms(s.local_p1_gap),
                    ms(s.local_median_gap),
                    us(r.cpu / n, 0),
                    num(r.requests / n),
                    num(r.server.total / n),
                    us(r.server.cpu / n, 0),
                ]
            )
        out.append(
            f"**{procs} processes, {rate:g} starts/s** "
            f"(interval {1000 / rate:g} ms; gaps in ms on the local clock)\n\n"
            + table(
                [
                    "limiter",
                    "starts",
                    "achieved /s",
                    "of target",
                    "max in 1/rate window",
                    "gaps < ½/rate",
                    "min gap",
                    "p1 gap",
                    "median gap",
                    "client CPU µs/start",
                    "Redis requests/start",
                    "Redis commands/start",
                    "Redis CPU µs/start",
                ],
                rows,
            )
        )
    details = []
    for r in results:
        if r.server.total:
            details.append([r.peer, f"{r.rate:g}/s", r.server.breakdown(max(1, r.starts))])
    if details:
        out.append(
            "Redis commands per start, by command (`INFO commandstats`; commands run inside a Lua script are "
            "counted too):\n\n" + table(["limiter", "rate", "commands per start"], details, "lll")
        )
    states = [r for r in results if not math.isnan(r.spacing.state_min_gap)]
    if states:
        out.append(
            "ratequeue on the state's clock (Redis `TIME`): "
            + "; ".join(
                f"{r.rate:g}/s: smallest gap {ms(r.spacing.state_min_gap)} ms, "
                f"gaps under the interval: {r.spacing.state_under}, "
                f"wake-up lateness p99 {ms(r.late_p99)} ms, "
                f"`Turn.local_start` error p99 {ms(r.mapping_p99)} ms"
                for r in states
            )
            + "."
        )
    out.append(
        "Versions: "
        + ", ".join(f"{name} {version(name)}" for name in DISTRIBUTIONS.values())
        + f", redis-py {importlib.metadata.version('redis')}."
    )
    return "\n\n".join(out)


def plot(results: list[Result], directory: Path) -> list[Path]:
    """Gap histograms per limiter and rate, and a timeline of starts per process."""
    plt = pyplot()
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for rate in sorted({r.rate for r in results}):
        chosen = [r for r in results if r.rate == rate]
        interval_ms = 1000 / rate
        fig, axes = plt.subplots(len(chosen), 1, figsize=(8, 1.7 * len(chosen)), sharex=True, squeeze=False)
        for ax, r in zip(axes[:, 0], chosen, strict=True):
            local = sorted(t for line in r.timelines for t in line)
            gaps_ms = [g * 1000 for g in gaps(local)]
            top = 3 * interval_ms
            ax.hist([min(g, top) for g in gaps_ms], bins=120, range=(0, top), color="tab:blue")
            ax.axvline(interval_ms, color="tab:red", linewidth=1)
            ax.set_ylabel(r.peer, rotation=0, ha="right", va="center")
            ax.set_yscale("log")
        axes[-1, 0].set_xlabel(f"gap between consecutive starts, ms (red: the interval, {interval_ms:g} ms)")
        fig.suptitle(f"Gaps at {rate:g} starts/s, all processes (log count; the last bin holds larger gaps)")
        fig.tight_layout()
        path = directory / f"peers-gaps-{rate:g}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)

        fig, axes = plt.subplots(len(chosen), 1, figsize=(8, 1.5 * len(chosen)), sharex=True, squeeze=False)
        for ax, r in zip(axes[:, 0], chosen, strict=True):
            first = min((line[0] for line in r.timelines if line), default=0.0)
            begin = first + 1.0  # past the first second, when every process is running
            for i, line in enumerate(r.timelines):
                xs = [t - begin for t in line if begin <= t < begin + 1.2]
                ax.scatter(xs, [i] * len(xs), s=10, marker="|", linewidths=0.6)
            ax.set_ylabel(r.peer, rotation=0, ha="right", va="center")
            ax.set_yticks([])
            ax.set_ylim(-1, len(r.timelines))
        axes[-1, 0].set_xlabel("seconds, from 1 s after the first start; one row per process")
        fig.suptitle(f"Starts per process at {rate:g} starts/s")
        fig.tight_layout()
        path = directory / f"peers-timeline-{rate:g}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = new_parser(__doc__)
    parser.add_argument("--rates", default="100,1000", help="global starts per second, comma-separated")
    parser.add_argument("--procs", type=int, default=8, help="worker processes sharing the rate (8)")
    parser.add_argument(
        "--seconds", type=float, default=6.0, help="starts worth this many seconds at the rate (6)"
    )
    parser.add_argument("--peers", default=",".join(PEERS), help=f"which limiters ({','.join(PEERS)})")
    add_common(
        parser,
        redis_url="use this Redis instead of starting one (its counts may mix)",
        seed=True,
        quick="a smoke run: 2 processes, 100/s, 0.5 s per limiter",
        plot="write PNG plots into DIR",
    )
    args = parser.parse_args(argv)
    seconds = 0.5 if args.quick else args.seconds
    rates = [100.0] if args.quick else numbers(args.rates)
    procs = 2 if args.quick else args.procs
    peers = chosen(parser, args.peers, PEERS, "peers")
    print_machine()
    results: list[Result] = []
    with redis_server(args.redis_url) as url:
        progress = Progress(len(rates) * len(peers), "peers")
        for rate in rates:
            for peer in peers:
                progress.note(f"{peer} at {rate:g}/s")
                results.append(
                    run_one(url, peer, rate, procs, seconds, args.seed, local_redis=not args.redis_url)
                )
                progress.step(f"{peer} at {rate:g}/s done")
        progress.close()
    print(report(results, procs))
    if args.plot:
        print_written(plot(results, args.plot), before="\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
