"""Overhead: what one ``acquire()`` costs, idle and contended, next to the floor of each state.

**Floor**, measured first in the same run with the same clients: the
cheapest thing a state can do per call --

* Redis: ``PING`` and ``EVALSHA`` of the script ``return 1`` (redis-py, the
  client ratequeue's ``RedisState`` makes);
* MongoDB: the ``ping`` command, and the simplest atomic update, a
  ``findAndModify`` with ``$inc`` (pymongo);
* the file: one locked read-write of a small file (``flock`` on the lock file, read,
  write a temporary file, ``os.replace``), as the file state does it.

**Idle acquire**: one process, a limiter whose interval (1 µs) has always
passed, ``acquire()`` back to back: every call finds the queue idle. Per
acquire: state calls (counted by a proxy around the real state), requests
the client sent (redis-py requests counted in the process; pymongo commands
counted by a command listener), commands the Redis server ran (``INFO
commandstats``, including those inside the Lua script), CPU time, and the
latency percentiles. ``memory://`` shows the library's own cost without I/O.

**Contended acquire**: ``--procs`` processes (4) call ``acquire()`` back to
back on one queue for ``--seconds``, so callers always wait. Per start: the
same counts, the answers (WAIT, PASSED), CPU time of all the workers, the
latency of single state calls, and the Redis server's CPU time.

Run::

    python bench/overhead.py                        # about a minute
    python bench/overhead.py --quick                # a smoke run of a few seconds
    python bench/overhead.py --backends redis --acquires 10000
    python bench/overhead.py --plot bench/results   # also write a PNG there

It starts its own ``redis-server``, a Redis Cluster of three masters, a
PostgreSQL (initdb in a temporary directory, fsync off) and ``secantusd-py``
on free ports (or uses ``--redis-url`` / ``--mongodb-url``; then the server
counts include others' traffic) and keeps state files in a temporary directory. secantusd-py is a
MongoDB-compatible server written in Python, far slower than MongoDB: its
latencies say more about secantusd-py than about ratequeue.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import (
    CountingState,
    Gate,
    MongoCommands,
    Progress,
    RedisRoundTrips,
    RedisStats,
    add_backends,
    add_common,
    chosen,
    new_parser,
    num,
    open_state,
    percentile,
    prepare_queue,
    print_machine,
    print_written,
    pyplot,
    redis_client,
    run_processes,
    state_url,
    table,
    unique_name,
    us,
)

BACKENDS = ["memory", "file", "redis", "redis-cluster", "mongodb", "postgresql"]
#: idle acquires (and floor operations) per state
ACQUIRES = {
    "memory": 20000,
    "file": 3000,
    "redis": 3000,
    "redis-cluster": 2000,
    "mongodb": 500,
    "postgresql": 2000,
}
#: the interval (ms) of the contended run per state: one each state sustains with 4 processes
CONTENDED_MS = {"file": 5.0, "redis": 5.0, "redis-cluster": 5.0, "mongodb": 20.0, "postgresql": 5.0}


@dataclass
class Floor:
    """One floor operation of one state."""

    backend: str
    operation: str
    latencies: list[float]
    cpu: float
    #: the state's cheapest call, back to back: what an idle acquire is compared with
    primary: bool = False
    #: seconds slept before each call (0: back to back)
    sleep: float = 0.0

    @property
    def per_op_cpu(self) -> float:
        return self.cpu / max(1, len(self.latencies))


@dataclass
class Measured:
    """Counts of a run of acquires (idle: one process; contended: all of them)."""

    backend: str
    mode: str
    starts: int
    calls: dict[str, int]
    answers: dict[str, int]
    requests: int
    cpu: float
    latencies: list[float] = field(default_factory=list)
    call_latencies: list[float] = field(default_factory=list)
    server: RedisStats | None = None
    #: MongoDB commands the client sent, by name
    mongo: dict[str, int] = field(default_factory=dict)
    procs: int = 1
    interval: float = 0.0

    def per_start(self, value: float) -> float:
        return value / max(1, self.starts)


def _timed(n: int, op: Callable[[], Any], sleep: float = 0.0) -> tuple[list[float], float]:
    """Run ``op`` ``n`` times, each after ``sleep`` seconds; its latencies, and the CPU time of the loop.

    The CPU time includes the sleeps' own (a waiting acquire pays them too).
    """
    latencies = []
    cpu = time.process_time()
    for _ in range(n):
        if sleep:
            time.sleep(sleep)
        started = time.perf_counter()
        op()
        latencies.append(time.perf_counter() - started)
    return latencies, time.process_time() - cpu


#: a floor operation: its name, the call, and whether it is the state's cheapest call
FloorOp = tuple[str, Callable[[], Any], bool]


@contextlib.contextmanager
def floor_ops(backend: str, url: str) -> Iterator[list[FloorOp]]:
    """The floor operations of ``backend``, with their clients open."""
    if backend == "redis":
        from ratequeue.state.redis import RedisState

        client = RedisState.from_url(url).client
        sha = client.script_load("return 1")
        try:
            yield [("PING", client.ping, False), ("EVALSHA 'return 1'", lambda: client.evalsha(sha, 0), True)]
        finally:
            client.close()
    elif backend == "mongodb":
        state: Any = open_state(url)
        admin = state.collection.database.client.admin
        collection = state.collection.database["floor"]

        def increment() -> None:
            collection.find_one_and_update({"_id": "floor"}, {"$inc": {"n": 1}}, upsert=True)

        try:
            yield [
                ("ping", lambda: admin.command("ping"), True),
                ("findAndModify {$inc: 1}", increment, False),
            ]
        finally:
            state.close()
    elif backend == "file":
        from ratequeue.state.file import LockFile

        path = Path(url.removeprefix("file://")).with_name("floor.json")
        path.write_bytes(b"{}" + b" " * 200)
        lock = LockFile.of(f"{path}.lock")
        tmp = path.with_name(".floor.tmp")

        def locked_read_write() -> None:
            lock.acquire(30.0)
            try:
                data = path.read_bytes()
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                try:
                    os.write(fd, data)
                finally:
                    os.close(fd)
                os.replace(tmp, path)
            finally:
                lock.release()

        yield [("locked read-write", locked_read_write, True)]
    elif backend == "postgresql":
        import psycopg

        with psycopg.connect(url, autocommit=True) as connection:
            yield [("SELECT 1", lambda: connection.execute("SELECT 1").fetchone(), True)]
    elif backend == "redis-cluster":
        cluster: Any = open_state(url)
        client = cluster.client
        try:
            yield [("PING (cluster client)", lambda: client.ping(), True)]
        finally:
            cluster.close()
    else:
        yield []


def idle_and_floor(
    backend: str, url: str, n: int, sleep: float, rounds: int = 10
) -> tuple[list[Floor], Measured]:
    """``n`` idle acquires in this process, and ``n`` of each floor operation, interleaved.

    The acquires and the floor calls run in ``rounds`` alternating blocks,
    so that both see the same machine. Then the state's cheapest call runs
    again, each time after a ``sleep`` (the contended case's floor).
    """
    import ratequeue

    listener = MongoCommands()
    state = CountingState(open_state(url, mongo_listener=listener))
    limiter = ratequeue.Limiter(state, name=unique_name("idle"), interval=1e-6)
    stats = redis_client(url) if backend == "redis" else None
    latencies: list[float] = []
    cpu = 0.0
    requests = 0
    server = RedisStats({}, 0.0)
    with floor_ops(backend, url) as ops:
        for _ in range(50):  # warm up: connections, scripts, the record
            limiter.acquire()
            for _, op, _ in ops:
                op()
        state.log.clear()
        listener.names.clear()
        timings: dict[str, tuple[list[float], float]] = {name: ([], 0.0) for name, _, _ in ops}
        block = max(1, n // rounds)
        for _ in range(rounds):
            for name, op, _ in ops:
                lats, spent = _timed(block, op)
                timings[name][0].extend(lats)
                timings[name] = (timings[name][0], timings[name][1] + spent)
            before = RedisStats.read(stats) if stats else None
            counted = RedisRoundTrips.count if backend == "redis" else listener.count
            lats, spent = _timed(block, limiter.acquire)
            requests += (RedisRoundTrips.count if backend == "redis" else listener.count) - counted
            latencies.extend(lats)
            cpu += spent
            if stats and before:
                server = server.plus(RedisStats.read(stats).minus(before))
        mongo = dict(listener.names)
        floors = [Floor(backend, name, *timings[name], primary=primary) for name, _, primary in ops]
        for name, op, primary in ops:
            if primary:
                label = f"{name} after a {sleep * 1e3:g} ms sleep"
                floors.append(Floor(backend, label, *_timed(min(n, 200), op, sleep), sleep=sleep))
    if stats:
        stats.close()
    state.close()
    measured = Measured(
        backend=backend,
        mode="idle",
        starts=len(latencies),
        calls=dict(state.log.calls),
        answers=dict(state.log.answers),
        requests=requests,
        cpu=cpu,
        latencies=latencies,
        call_latencies=list(state.log.durations),
        server=server if stats else None,
        mongo=mongo,
    )
    return floors, measured


@dataclass(frozen=True)
class Job:
    """A contended worker: acquire back to back on ``name`` for ``seconds``."""

    url: str
    name: str
    interval: float
    seconds: float


def worker(index: int, job: Job, gate: Gate) -> dict[str, Any]:
    """One contended process; its counts."""
    import ratequeue

    RedisRoundTrips.install()
    listener = MongoCommands()
    state = CountingState(open_state(job.url, mongo_listener=listener))
    limiter = ratequeue.Limiter(state, name=job.name, interval=job.interval)
    limiter.status()  # connect
    state.log.clear()
    t0 = gate.wait()
    requests, commands = RedisRoundTrips.count, listener.count
    listener.names.clear()
    cpu = time.process_time()
    starts = 0
    while True:
        remaining = t0 + job.seconds - time.monotonic()
        if remaining <= 0:
            break
        try:
            limiter.acquire(timeout=remaining)
        except ratequeue.AcquireTimeout:
            break
        starts += 1
    result = {
        "starts": starts,
        "cpu": time.process_time() - cpu,
        "calls": dict(state.log.calls),
        "answers": dict(state.log.answers),
        "durations": list(state.log.durations),
        "requests": RedisRoundTrips.count - requests,
        "commands": listener.count - commands,
        "mongo": dict(listener.names),
    }
    state.close()
    return result


def contended(backend: str, url: str, procs: int, interval: float, seconds: float) -> Measured:
    """``procs`` processes acquiring back to back on one queue for ``seconds``."""
    name = unique_name("contended")
    prepare_queue(url, name, interval)
    stats = redis_client(url) if backend == "redis" else None
    before: list[RedisStats] = []

    def reset(_: int) -> None:
        if stats:
            before.append(RedisStats.read(stats))

    results = run_processes(worker, [Job(url, name, interval, seconds)] * procs, before_start=reset)
    server = None
    if stats:
        server = RedisStats.read(stats).minus(before[0])
        stats.close()
    calls: dict[str, int] = {}
    answers: dict[str, int] = {}
    mongo: dict[str, int] = {}
    for r in results:
        for total, part in ((calls, r["calls"]), (answers, r["answers"]), (mongo, r["mongo"])):
            for key, value in part.items():
                total[key] = total.get(key, 0) + value
    return Measured(
        backend=backend,
        mode="contended",
        starts=sum(r["starts"] for r in results),
        calls=calls,
        answers=answers,
        requests=sum(r["requests"] if backend == "redis" else r["commands"] for r in results),
        cpu=sum(r["cpu"] for r in results),
        call_latencies=[d for r in results for d in r["durations"]],
        server=server,
        mongo=mongo,
        procs=procs,
        interval=interval,
    )


def _requests(m: Measured) -> str:
    return num(m.per_start(m.requests)) if m.backend in ("redis", "mongodb") else "—"


def _server(m: Measured) -> str:
    return num(m.per_start(m.server.total)) if m.server else "—"


def report(floor: list[Floor], idles: list[Measured], busy: list[Measured]) -> str:
    """The Markdown tables of a run."""
    out = []
    rows = [
        [
            f.backend,
            f.operation,
            len(f.latencies),
            us(percentile(f.latencies, 50)),
            us(percentile(f.latencies, 99)),
            us(f.per_op_cpu),
        ]
        for f in floor
    ]
    out.append(
        "**Floor**: the cheapest call each state allows, same clients, same run (µs).\n\n"
        + table(["state", "operation", "calls", "p50", "p99", "CPU/op"], rows, "llrrrr")
    )
    main_floor = {f.backend: f for f in floor if f.primary}
    slept_floor = {f.backend: f for f in floor if f.sleep}
    rows = []
    for m in idles:
        f = main_floor.get(m.backend)
        p50 = percentile(m.latencies, 50)
        rows.append(
            [
                m.backend,
                m.starts,
                num(m.per_start(sum(m.calls.values()))),
                _requests(m),
                _server(m),
                us(m.per_start(m.cpu)),
                us(p50),
                us(percentile(m.latencies, 90)),
                us(percentile(m.latencies, 99)),
                us(percentile(f.latencies, 50)) if f else "—",
                f"{p50 / percentile(f.latencies, 50):.1f}x" if f else "—",
            ]
        )
    out.append(
        "**Idle acquire** (one process, the queue always idle; latencies in µs; requests: sent by the "
        "client; server commands: Redis `INFO commandstats`, Lua-internal commands included).\n\n"
        + table(
            [
                "state",
                "acquires",
                "state calls/acquire",
                "requests/acquire",
                "server commands/acquire",
                "CPU µs/acquire",
                "p50",
                "p90",
                "p99",
                "floor p50",
                "p50 / floor",
            ],
            rows,
        )
    )
    if busy:
        rows = []
        for m in busy:
            rows.append(
                [
                    m.backend,
                    m.procs,
                    f"{m.interval * 1e3:g}",
                    m.starts,
                    num(m.per_start(sum(m.calls.values()))),
                    num(m.per_start(m.calls.get("take_and_try", 0))),
                    num(m.per_start(m.calls.get("try_start", 0))),
                    num(m.per_start(m.answers.get("wait", 0))),
                    num(m.per_start(m.answers.get("passed", 0))),
                    _requests(m),
                    _server(m),
                    us(m.per_start(m.cpu)),
                    us(percentile(m.call_latencies, 50)),
                    us(percentile(m.call_latencies, 99)),
                    us(m.per_start(m.server.cpu)) if m.server else "—",
                    us(2 * slept_floor[m.backend].per_op_cpu) if m.backend in slept_floor else "—",
                ]
            )
        out.append(
            "**Contended acquire** (every process calls `acquire()` back to back; per start; state-call "
            "latencies in µs; CPU floor: twice the floor call made after a sleep of the interval, as a "
            "contended start makes two calls, each after a sleep).\n\n"
            + table(
                [
                    "state",
                    "procs",
                    "interval ms",
                    "starts",
                    "state calls/start",
                    "take_and_try",
                    "try_start",
                    "WAIT answers",
                    "PASSED answers",
                    "requests/start",
                    "server commands/start",
                    "CPU µs/start",
                    "state call p50",
                    "state call p99",
                    "Redis CPU µs/start",
                    "CPU floor µs/start",
                ],
                rows,
            )
        )
    breakdown = []
    for m in [*idles, *busy]:
        if m.server:
            breakdown.append([m.backend, m.mode, m.server.breakdown(max(1, m.starts))])
        elif m.mongo:
            per = ", ".join(f"{name} {count / max(1, m.starts):.2f}" for name, count in m.mongo.items())
            breakdown.append([m.backend, m.mode, per])
    if breakdown:
        out.append(
            "Commands per start, by command: for Redis as the server counted them (`time`, `hmget` and "
            "`hset` run inside the scripts), for MongoDB as the client sent them:\n\n"
            + table(["state", "mode", "commands per start"], breakdown, "lll")
        )
    return "\n\n".join(out)


def plot(floor: list[Floor], idles: list[Measured], directory: Path) -> list[Path]:
    """Idle acquire latency against the back-to-back floor calls, per state."""
    plt = pyplot()
    directory.mkdir(parents=True, exist_ok=True)
    bars: list[tuple[str, list[float]]] = []
    for m in idles:
        bars.append((f"{m.backend}: acquire()", m.latencies))
        bars += [
            (f"{f.backend}: {f.operation}", f.latencies)
            for f in floor
            if f.backend == m.backend and not f.sleep
        ]
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(bars) + 1))
    ys = list(range(len(bars)))[::-1]
    ax.barh([y + 0.2 for y in ys], [percentile(b[1], 50) * 1e6 for b in bars], height=0.4, label="p50")
    ax.barh([y - 0.2 for y in ys], [percentile(b[1], 99) * 1e6 for b in bars], height=0.4, label="p99")
    ax.set_yticks(ys)
    ax.set_yticklabels([b[0] for b in bars], fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("µs")
    ax.set_title("Idle acquire latency, and the floor calls of each state")
    ax.legend()
    fig.tight_layout()
    path = directory / "overhead-latency.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return [path]


def main(argv: list[str] | None = None) -> int:
    parser = new_parser(__doc__)
    add_backends(parser, BACKENDS, "states (memory,file,redis,redis-cluster,mongodb,postgresql)")
    parser.add_argument("--acquires", type=int, help="idle acquires per state (default: 20000 memory, "
                        "3000 file and Redis, 500 MongoDB)")  # fmt: skip
    parser.add_argument("--procs", type=int, default=4, help="processes of the contended run (4)")
    parser.add_argument("--seconds", type=float, default=3.0, help="seconds of the contended run (3)")
    parser.add_argument(
        "--interval-ms", type=float, help="interval of the contended run (default: 5 file, Redis; 20 MongoDB)"
    )
    add_common(
        parser,
        mongodb_url=True,
        quick="a smoke run: a tenth of the acquires, 0.5 s",
        plot="write a PNG plot into DIR",
    )
    args = parser.parse_args(argv)
    backends = chosen(parser, args.backends, BACKENDS, "backends")
    seconds = 0.5 if args.quick else args.seconds
    RedisRoundTrips.install()
    print_machine()
    floor: list[Floor] = []
    idles: list[Measured] = []
    busy: list[Measured] = []
    steps = sum(2 if b in CONTENDED_MS else 1 for b in backends)
    progress = Progress(steps, "overhead")
    with tempfile.TemporaryDirectory(prefix="ratequeue-overhead-") as tmp:
        for backend in backends:
            n = args.acquires or ACQUIRES[backend]
            if args.quick:
                n = max(50, n // 10)
            with state_url(backend, args, f"file://{tmp}/overhead.json") as url:
                progress.note(f"{backend}: {n} idle acquires and floor calls")
                interval = (args.interval_ms or CONTENDED_MS.get(backend, 5.0)) / 1e3
                floors, measured = idle_and_floor(backend, url, n, interval)
                floor += floors
                idles.append(measured)
                progress.step(f"{backend}: idle and floor done")
                if backend in CONTENDED_MS:
                    progress.note(f"{backend}: {args.procs} processes contending for {seconds:g} s")
                    busy.append(contended(backend, url, args.procs, interval, seconds))
                    progress.step(f"{backend}: contended done")
    progress.close()
    print(report(floor, idles, busy))
    if args.plot:
        print_written(plot(floor, idles, args.plot))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
