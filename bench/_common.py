"""Shared helpers of the benchmarks in ``bench/``.

Not a benchmark itself. It holds what ``overhead.py``, ``rate_sweep.py``,
``peers.py`` and ``begin_gaps.py`` share:

* servers of their own on free loopback ports (``redis-server`` from PATH,
  ``secantusd-py``), started by the tests' code (``tests/servers.py``), or a
  URL the user gives;
* the options they all have (``--redis-url``, ``--quick``, ``--plot``, ...),
  the parsing of comma-separated lists, and the first lines of their output:
  the machine and its load;
* a counting proxy around a real ratequeue state, and a count of the Redis
  round-trips redis-py makes, so that calls are counted where they are made;
* ``INFO commandstats`` / ``INFO cpu`` of a Redis server;
* worker processes started with the ``spawn`` context, released together;
* a progress bar on stderr, Markdown tables, percentiles, gap statistics, and
  a note of the machine and its load.

Run the benchmarks as scripts (``python bench/overhead.py``): each imports
this module from its own directory, and this module imports ``tests`` from
the checkout it is in.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import multiprocessing
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO, cast

from ratequeue.state import Snapshot, State

if TYPE_CHECKING:  # only named in annotations: an older checkout (begin_gaps.py --rq-path) may lack them
    from ratequeue.core.operation import Operation
    from ratequeue.core.protocol import Answer

# --------------------------------------------------------------------------- servers

#: the checkout this file is in, whose ``tests/servers.py`` starts the servers
ROOT = Path(__file__).resolve().parent.parent
# First on sys.path only for this import: ``begin_gaps.py --rq-path`` puts another checkout (with a
# ``tests`` of its own) first, and ratequeue must still come from where it came from before.
sys.path.insert(0, str(ROOT))
try:
    from tests import servers
finally:
    sys.path.remove(str(ROOT))


@contextlib.contextmanager
def _server(name: str, command: Callable[[int, Path], list[str]]) -> Iterator[int]:
    """Run ``command(port, workdir)`` as a :class:`tests.servers.Server` on a free port; yield the port.

    Its working directory (and log) is a temporary directory, removed after.
    """
    workdir = Path(tempfile.mkdtemp(prefix=f"ratequeue-bench-{name}-"))
    port = servers.free_port()
    try:
        with servers.running(servers.Server(name, command(port, workdir), port, workdir), timeout=60.0):
            yield port
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@contextlib.contextmanager
def redis_server(url: str | None = None) -> Iterator[str]:
    """Yield a Redis URL: ``url`` as given, or a ``redis-server`` of our own on a free port.

    Our own server keeps nothing on disk (``--save '' --appendonly no``), so
    its ``INFO commandstats`` count this benchmark's commands alone.
    """
    if url:
        yield url
        return
    executable = servers.redis_executable()
    if executable is None:
        raise SystemExit(
            "redis-server is not on PATH (Debian: apt-get install redis-server), or give --redis-url"
        )
    with _server(
        "redis", lambda port, workdir: servers.redis_command(executable, port, workdir, append_only=False)
    ) as port:
        yield f"redis://127.0.0.1:{port}/0"


@contextlib.contextmanager
def mongodb_server(url: str | None = None) -> Iterator[str]:
    """Yield a MongoDB URL: ``url`` as given, or a ``secantusd-py`` of our own, in memory, on a free port."""
    if url:
        yield url
        return
    executable = servers.mongodb_executable()  # a MongoDB-compatible server written in Python
    if executable is None:
        raise SystemExit("secantusd-py is missing (pip install 'secantusdb==0.7.0b3'), or give --mongodb-url")
    with _server("mongodb", lambda port, _: servers.mongodb_command(executable, port)) as port:
        yield f"mongodb://127.0.0.1:{port}/?database=bench"


@contextlib.contextmanager
def postgresql_server() -> Iterator[str]:
    """Yield a PostgreSQL URL: a cluster of our own (initdb in a temporary directory) on a free port.

    As the tests start it: trust auth, fsync off (nothing waits for a disk
    flush: the figures are the server's work and the round-trip alone).
    """
    workdir = Path(tempfile.mkdtemp(prefix="ratequeue-bench-postgresql-"))
    # a generator, annotated an Iterator in tests/servers.py: closing it stops the server
    started = cast("Generator[servers.Server, None, None]", servers.postgresql_server(workdir))
    try:
        server = next(started)
        yield f"postgresql://postgres@127.0.0.1:{server.port}/postgres"
    finally:
        started.close()
        shutil.rmtree(workdir, ignore_errors=True)


@contextlib.contextmanager
def redis_cluster() -> Iterator[str]:
    """Yield a ``redis+cluster://`` URL: three masters of our own, as the tests start them."""
    from tests import redis_cluster as cluster_module

    found = cluster_module.executables()
    if found is None:
        raise SystemExit("redis-server and redis-cli are needed for the Redis Cluster (Debian: redis-server)")
    workdir = Path(tempfile.mkdtemp(prefix="ratequeue-bench-cluster-"))
    try:
        with cluster_module.cluster(workdir, *found) as made:
            yield made.url
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@contextlib.contextmanager
def state_url(backend: str, args: argparse.Namespace, file_url: str) -> Iterator[str]:
    """A state URL for ``backend``: a server of our own (or ``args.redis_url`` / ``args.mongodb_url``),
    a PostgreSQL or a Redis Cluster of our own, ``file_url`` for the file state, or ``memory://bench``."""
    if backend == "redis":
        with redis_server(getattr(args, "redis_url", None)) as url:
            yield url
    elif backend == "mongodb":
        with mongodb_server(getattr(args, "mongodb_url", None)) as url:
            yield url
    elif backend == "postgresql":
        with postgresql_server() as url:
            yield url
    elif backend == "redis-cluster":
        with redis_cluster() as url:
            yield url
    elif backend == "file":
        yield file_url
    elif backend == "memory":
        yield "memory://bench"
    else:
        raise ValueError(f"unknown state {backend!r}")


def redis_version() -> str:
    """``redis-server --version``, shortened."""
    executable = servers.redis_executable()
    if executable is None:
        return "redis-server not found"
    out = subprocess.run([executable, "--version"], capture_output=True, text=True, check=False).stdout
    return " ".join(out.split()[:3])


# --------------------------------------------------------------------------- arguments and output


def new_parser(doc: str | None) -> argparse.ArgumentParser:
    """A script's argument parser: ``doc`` (its docstring) is the help text, as written."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def add_backends(parser: argparse.ArgumentParser, known: Sequence[str], help: str) -> None:
    """``--backends``: a comma-separated choice among ``known`` (all by default); see :func:`chosen`."""
    parser.add_argument("--backends", default=",".join(known), help=help)


def add_common(
    parser: argparse.ArgumentParser,
    *,
    quick: str,
    plot: str,
    redis_url: str = "use this Redis instead of starting one",
    mongodb_url: bool = False,
    seed: bool = False,
    json: str | None = None,
) -> None:
    """The options every benchmark has, after its own: the servers to use, ``--quick`` and the outputs.

    ``--redis-url`` (help ``redis_url``), ``--mongodb-url`` if ``mongodb_url``,
    ``--seed`` (of the divide peer's phases) if ``seed``, ``--quick`` (help
    ``quick``), ``--plot DIR`` (help ``plot``) and ``--json FILE`` if ``json``
    (its help).
    """
    parser.add_argument("--redis-url", help=redis_url)
    if mongodb_url:
        parser.add_argument("--mongodb-url", help="use this MongoDB instead of starting secantusd-py")
    if seed:
        parser.add_argument("--seed", type=int, default=1, help="seed of the divide peer's random phases")
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--plot", type=Path, metavar="DIR", help=plot)
    if json is not None:
        parser.add_argument("--json", type=Path, metavar="FILE", help=json)


def names(text: str) -> list[str]:
    """The comma-separated names in ``text``, stripped; empty ones dropped."""
    return [name.strip() for name in text.split(",") if name.strip()]


def numbers(text: str, kind: Callable[[str], Any] = float) -> list[Any]:
    """The comma-separated numbers in ``text``, each read by ``kind``."""
    return [kind(x) for x in text.split(",")]


def refuse_unknown(parser: argparse.ArgumentParser, what: str, unknown: Iterable[str]) -> None:
    """Exit with a usage error naming the ``unknown`` ``what`` (backends, peers, ...), if there are any."""
    unknown = set(unknown)
    if unknown:
        parser.error(f"unknown {what}: {', '.join(sorted(unknown))}")


def chosen(parser: argparse.ArgumentParser, text: str, known: Sequence[str], what: str) -> list[str]:
    """The names in ``text``, each one of ``known``; else a usage error."""
    picked = names(text)
    refuse_unknown(parser, what, set(picked) - set(known))
    return picked


def print_machine() -> None:
    """The first lines of every benchmark's output: the machine and its load (see :func:`machine`)."""
    print(f"Machine: {machine()}\n")


def print_written(paths: Iterable[Path], before: str = "") -> None:
    """Say on stderr which files (plots, JSON) were written."""
    for path in paths:
        print(f"{before}wrote {path}", file=sys.stderr)


# --------------------------------------------------------------------------- Redis statistics


@dataclass(frozen=True)
class RedisStats:
    """What a Redis server counted: calls per command (scripts' inner commands included) and its CPU."""

    calls: dict[str, int]
    cpu: float

    @classmethod
    def read(cls, client: Any) -> RedisStats:
        stats = client.info("commandstats")
        calls = {key.removeprefix("cmdstat_"): int(value["calls"]) for key, value in stats.items()}
        cpu = client.info("cpu")
        return cls(calls, float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]))

    def minus(self, before: RedisStats) -> RedisStats:
        """The counts since ``before``, without the commands the benchmark itself sends to read them."""
        own = {"info", "config|resetstat"}
        calls = {
            name: count - before.calls.get(name, 0)
            for name, count in self.calls.items()
            if name not in own and count - before.calls.get(name, 0)
        }
        return RedisStats(calls, self.cpu - before.cpu)

    def plus(self, other: RedisStats) -> RedisStats:
        """These counts and ``other``'s, added."""
        calls = dict(self.calls)
        for name, count in other.calls.items():
            calls[name] = calls.get(name, 0) + count
        return RedisStats(calls, self.cpu + other.cpu)

    @property
    def total(self) -> int:
        return sum(self.calls.values())

    def breakdown(self, per: int) -> str:
        """``evalsha 1.00, hset 1.00, ...`` per ``per`` (starts)."""
        parts = sorted(self.calls.items(), key=lambda item: (-item[1], item[0]))
        return ", ".join(
            f"{name} {count / per:.2f}" if count / per >= 0.005 else f"{name} <0.01" for name, count in parts
        )


def redis_client(url: str) -> Any:
    """A plain redis-py client for ``url`` (for statistics and floors)."""
    import redis

    return redis.Redis.from_url(url)


class RedisRoundTrips:
    """Counts the requests redis-py sends in this process: one per command or pipeline.

    Wraps ``AbstractConnection.send_packed_command`` (every command and every
    pipeline goes through it once), so any library built on redis-py is
    counted the same way. Install it once per process, before connecting.
    """

    count = 0

    @classmethod
    def install(cls) -> None:
        from redis.connection import AbstractConnection

        original: Callable[..., Any] = AbstractConnection.send_packed_command
        if getattr(original, "_bench_counting", False):
            return

        def counting(self: Any, command: Any, check_health: bool = True) -> Any:
            cls.count += 1
            return original(self, command, check_health)

        counting._bench_counting = True  # type: ignore[attr-defined]
        AbstractConnection.send_packed_command = counting  # type: ignore[method-assign]


# --------------------------------------------------------------------------- counting state


@dataclass
class CallLog:
    """Calls a :class:`CountingState` made, their answers and how long each took (seconds)."""

    calls: dict[str, int] = field(default_factory=dict)
    answers: dict[str, int] = field(default_factory=dict)
    durations: list[float] = field(default_factory=list)

    def clear(self) -> None:
        self.calls.clear()
        self.answers.clear()
        self.durations.clear()

    @property
    def total(self) -> int:
        return sum(self.calls.values())


class CountingState(State):
    """A real ratequeue state, with every operation counted and timed where the limiter calls it.

    A proxy, not a mock: each operation goes to the wrapped state's
    ``execute`` unchanged, and is counted under its kind (``take_and_try``,
    ``try_start``, ``retime``, ...). Pass it to ``ratequeue.Limiter`` in
    place of a URL. Under a checkout from before ``State.execute``
    (``fleet_start.py --compare``) it is a :class:`_OldCountingState`.
    """

    def __new__(cls, inner: State) -> CountingState:
        if cls is CountingState and not hasattr(State, "execute"):
            return super().__new__(_OldCountingState)
        return super().__new__(cls)

    def __init__(self, inner: State) -> None:
        self.inner = inner
        self.url = inner.url
        self.clock_resolution = inner.clock_resolution
        self.reads_monotonic = getattr(inner, "reads_monotonic", False)  # (older checkouts' states lack it)
        self.log = CallLog()

    def _count(self, op: str, started: float, answer: Any) -> None:
        self.log.durations.append(time.perf_counter() - started)
        self.log.calls[op] = self.log.calls.get(op, 0) + 1
        kind = type(answer).__name__.lower()
        self.log.answers[kind] = self.log.answers.get(kind, 0) + 1

    def execute(self, op: Operation) -> Answer:
        started = time.perf_counter()
        answer = self.inner.execute(op)
        self._count(op.kind, started, answer)
        return answer

    def local_now(self) -> float | None:
        return self.inner.local_now()

    def read(self, name: str) -> Snapshot:
        return self.inner.read(name)

    def reset(self, name: str) -> bool:
        return self.inner.reset(name)

    def names(self, prefix: str = "") -> list[str]:
        return self.inner.names(prefix)

    def sweep(self) -> int:
        return self.inner.sweep()

    def close(self) -> None:
        self.inner.close()


class _OldCountingState(CountingState):
    """A :class:`CountingState` under a checkout from before ``State.execute`` (``fleet_start.py --compare``).

    That checkout's limiters call one method per operation (``take_and_try``,
    ``try_start``, ...): each is forwarded to the same method of the wrapped
    state and counted under its name, as ``execute`` counts the kinds. Its
    ``State`` is abstract in the ``_``-prefixed forms of the operations,
    which the public ones never reach here.
    """

    def _forward(self, kind: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        started = time.perf_counter()
        answer = getattr(self.inner, kind)(*args, **kwargs)
        self._count(kind, started, answer)
        return answer

    def take(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward("take", args, kwargs)

    def try_start(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward("try_start", args, kwargs)

    def take_and_try(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward("take_and_try", args, kwargs)

    def retime(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward("retime", args, kwargs)

    def set_paused(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward("set_paused", args, kwargs)

    def release(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward("release", args, kwargs)

    def renew(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward("renew", args, kwargs)

    def _unreached(self, *args: Any) -> Any:
        raise AssertionError("the public operations forward to the wrapped state")

    _take = _try_start = _take_and_try = _retime = _set_paused = _release = _renew = _unreached

    def _read(self, name: str) -> Snapshot:
        return self.read(name)

    def _reset(self, name: str) -> bool:
        return self.reset(name)

    def _names(self, prefix: str) -> list[str]:
        return self.names(prefix)

    def _sweep(self) -> int:
        return self.sweep()


class MongoCommands:
    """A pymongo command listener counting the commands a client sends (its round-trips)."""

    def __init__(self) -> None:
        self.count = 0
        self.names: dict[str, int] = {}

    def started(self, event: Any) -> None:
        self.count += 1
        self.names[event.command_name] = self.names.get(event.command_name, 0) + 1

    def succeeded(self, event: Any) -> None:
        pass

    def failed(self, event: Any) -> None:
        pass


def open_state(url: str, *, mongo_listener: MongoCommands | None = None) -> State:
    """The ratequeue state at ``url``; a MongoDB client gets ``mongo_listener`` to count its commands."""
    try:
        from ratequeue.state import open_state as opened
    except ImportError:  # a checkout from before open_state (fleet_start.py --compare)
        from ratequeue.state import from_url as opened  # type: ignore[attr-defined,no-redef]

    if url.startswith("mongodb") and mongo_listener is not None:
        from pymongo import MongoClient, monitoring

        from ratequeue.state.mongodb import MongoState, split_url

        counter = mongo_listener

        class _Listener(monitoring.CommandListener):
            def started(self, event: Any) -> None:
                counter.started(event)

            def succeeded(self, event: Any) -> None:
                pass

            def failed(self, event: Any) -> None:
                pass

        client_url, database, collection = split_url(url)
        client: Any = MongoClient(client_url, event_listeners=[_Listener()], serverSelectionTimeoutMS=5000)
        return MongoState(client, database=database, collection=collection, url=url)
    return opened(url)


def prepare_queue(url: str, name: str, interval: float) -> None:
    """Create queue ``name``'s record and load every script before the measured run.

    Two acquires: the first creates the record (on MongoDB, three commands)
    and starts at once, the second waits once, so both ``take_and_try`` and
    ``try_start`` have run (Redis loads a script on its first use).
    """
    import ratequeue

    limiter = ratequeue.Limiter(url, name=name, interval=interval)
    try:
        limiter.acquire()
        limiter.acquire()
        limiter.status()
    finally:
        limiter.close()


# --------------------------------------------------------------------------- processes


class Gate:
    """Handed to a worker: :meth:`wait` says it is ready for the next round and blocks until every worker is.

    Returns the round's common start time on ``time.monotonic()`` (a little in
    the future, and slept to), the same clock in every process of this host.
    """

    def __init__(self, ready: Any, go: list[Any], start: Any) -> None:
        self._ready, self._go, self._start = ready, go, start
        self._round = 0

    def wait(self, timeout: float = 300.0) -> float:
        k = self._round
        self._round += 1
        self._ready.put(k)
        if not self._go[k].wait(timeout):
            raise RuntimeError("the benchmark did not release its workers in time")
        t0 = float(self._start[k])
        delay = t0 - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        return t0


def _worker_main(target: Callable[[int, Any, Gate], Any], index: int, arg: Any, gate: Gate, out: Any) -> None:
    try:
        result = target(index, arg, gate)
    except BaseException:
        out.put((index, "error", traceback.format_exc()))
        return
    out.put((index, "ok", result))


def run_processes(
    target: Callable[[int, Any, Gate], Any],
    args: Sequence[Any],
    *,
    rounds: int = 1,
    before_start: Callable[[int], None] | None = None,
    timeout: float = 900.0,
) -> list[Any]:
    """Run ``target(index, arg, gate)`` in one spawned process per ``arg``; return their results in order.

    Each worker sets itself up, then calls ``gate.wait()`` once per round;
    when all have, ``before_start(round)`` runs here (to prepare a queue or
    read counters) and they are released together. ``target`` must be a
    module-level function (``spawn`` pickles it by name).
    """
    ctx = multiprocessing.get_context("spawn")
    ready, out = ctx.Queue(), ctx.Queue()
    go = [ctx.Event() for _ in range(rounds)]
    start = ctx.Array("d", rounds)
    gate = Gate(ready, go, start)
    processes = [
        ctx.Process(target=_worker_main, args=(target, i, arg, gate, out), daemon=True)
        for i, arg in enumerate(args)
    ]
    for process in processes:
        process.start()
    results: dict[int, Any] = {}
    try:
        deadline = time.monotonic() + timeout
        for k in range(rounds):
            for _ in processes:
                _ready_or_error(ready, out, deadline)
            if before_start is not None:
                before_start(k)
            start[k] = time.monotonic() + 0.05
            go[k].set()
        while len(results) < len(processes):
            index, status, value = out.get(timeout=max(0.1, deadline - time.monotonic()))
            if status == "error":
                raise RuntimeError(f"worker {index} failed:\n{value}")
            results[index] = value
    finally:
        for process in processes:
            process.join(5)
            if process.is_alive():
                process.kill()
                process.join(5)
    return [results[i] for i in range(len(processes))]


def _ready_or_error(ready: Any, out: Any, deadline: float) -> None:
    """Wait for one worker's ready message; raise if a worker failed instead."""
    import queue

    while True:
        try:
            ready.get(timeout=0.2)
            return
        except queue.Empty:
            pass
        with contextlib.suppress(queue.Empty):
            index, status, value = out.get_nowait()
            if status == "error":
                raise RuntimeError(f"worker {index} failed:\n{value}")
            raise RuntimeError(f"worker {index} ended before the last round")
        if time.monotonic() > deadline:
            raise RuntimeError("workers did not get ready in time")


# --------------------------------------------------------------------------- numbers


def percentile(values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile (0-100) of ``values``, interpolated linearly; NaN if empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def gaps(times: Sequence[float]) -> list[float]:
    """The gaps between consecutive instants of ``times`` (in any order)."""
    ordered = sorted(times)
    return [b - a for a, b in itertools.pairwise(ordered)]


def max_in_window(times: Sequence[float], window: float) -> int:
    """The largest number of ``times`` in any half-open window ``[t, t + window)``."""
    ordered = sorted(times)
    best, low = 0, 0
    for high, t in enumerate(ordered):
        while ordered[low] <= t - window:
            low += 1
        best = max(best, high - low + 1)
    return best


@dataclass(frozen=True)
class Spacing:
    """How a run's starts were spaced, on the local clock (and the state's, when known)."""

    starts: int
    rate: float
    state_min_gap: float
    state_under: int
    local_min_gap: float
    local_p1_gap: float
    local_median_gap: float
    max_in_window: int
    local_under_half: int

    @classmethod
    def of(cls, local: Sequence[float], interval: float, state: Sequence[float] | None = None) -> Spacing:
        """Spacing of starts at local times ``local`` (s) and state times ``state`` (s), for ``interval``.

        ``rate`` is starts per second between the first and the last start on
        the local clock; ``state_under`` counts state-clock gaps below the
        interval (by more than 1 µs of float rounding).
        """
        local_gaps = gaps(local)
        span = max(local) - min(local) if len(local) > 1 else math.nan
        state_gaps = gaps(state) if state else []
        return cls(
            starts=len(local),
            rate=(len(local) - 1) / span if span and span > 0 else math.nan,
            state_min_gap=min(state_gaps) if state_gaps else math.nan,
            state_under=sum(1 for g in state_gaps if g < interval - 1e-6),
            local_min_gap=min(local_gaps) if local_gaps else math.nan,
            local_p1_gap=percentile(local_gaps, 1),
            local_median_gap=percentile(local_gaps, 50),
            max_in_window=max_in_window(local, interval) if local else 0,
            local_under_half=sum(1 for g in local_gaps if g < interval / 2),
        )


def ms(seconds: float, digits: int = 3) -> str:
    """Seconds as milliseconds text, or ``—`` for NaN."""
    return "—" if seconds is None or math.isnan(seconds) else f"{seconds * 1000:.{digits}f}"


def us(seconds: float, digits: int = 0) -> str:
    """Seconds as microseconds text, or ``—`` for NaN."""
    return "—" if seconds is None or math.isnan(seconds) else f"{seconds * 1e6:.{digits}f}"


def num(value: float, digits: int = 2) -> str:
    """A number as text, or ``—`` for NaN."""
    return "—" if value is None or math.isnan(value) else f"{value:.{digits}f}"


# --------------------------------------------------------------------------- output


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], align: str | None = None) -> str:
    """A Markdown table; ``align`` has one letter per column, ``l`` or ``r`` (default: first l, rest r)."""
    align = align or "l" + "r" * (len(headers) - 1)
    marks = [":--" if a == "l" else "--:" for a in align]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(marks) + "|"]
    lines += ["| " + " | ".join(str(cell).replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


class Progress:
    """A progress bar on stderr: ``label [#####.....] 5/10 note``, redrawn in place on a terminal."""

    def __init__(self, total: int, label: str, stream: TextIO | None = None) -> None:
        self.total = max(1, total)
        self.done = 0
        self.label = label
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.started = time.monotonic()
        self._width = 0

    def note(self, text: str) -> None:
        """Show ``text`` as what is being done now."""
        filled = round(24 * self.done / self.total)
        elapsed = time.monotonic() - self.started
        bar = "#" * filled + "." * (24 - filled)
        line = f"{self.label} [{bar}] {self.done}/{self.total} {elapsed:5.0f}s {text}"
        if self.tty:
            self.stream.write("\r" + line.ljust(self._width))
            self._width = len(line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def step(self, text: str = "") -> None:
        """One more item done."""
        self.done += 1
        self.note(text)

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def machine() -> str:
    """One Markdown paragraph describing this machine, its load, and the versions in use."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    memory = ""
    with contextlib.suppress(OSError, ValueError, IndexError):
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        memory = f", {kb / 2**20:.0f} GiB RAM"
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    import ratequeue

    return (
        f"{os.cpu_count()} x {cpu}{memory}; {platform.system()} {platform.release()}; "
        f"Python {platform.python_version()}; ratequeue {ratequeue.__version__}; {redis_version()}; "
        f"load average {load} (1, 5, 15 min) when this ran."
    )


def pyplot() -> Any:
    """matplotlib's pyplot with the Agg backend, or exit saying how to install it."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib (or the 'bench' extra)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def wall_minus_monotonic(samples: int = 21) -> float:
    """``time.time() - time.monotonic()`` now, the median of ``samples`` readings (seconds).

    Converts this host's wall clock (the file state's clock, and a local
    Redis's ``TIME``) to ``time.monotonic()``, to check ``Turn.local_start``.
    """
    readings = []
    for _ in range(samples):
        before = time.monotonic()
        wall = time.time()
        after = time.monotonic()
        readings.append(wall - (before + after) / 2)
    return sorted(readings)[samples // 2]


def unique_name(prefix: str) -> str:
    """A queue name not used before, so every run starts from a fresh record."""
    return f"{prefix}-{os.getpid()}-{time.monotonic_ns()}"


# --------------------------------------------------------------------------- load and checkouts


@contextlib.contextmanager
def busy_loops(count: int) -> Iterator[list[int]]:
    """Run ``count`` processes doing nothing but ``while True: pass``; yield their pids; kill them after.

    They load the cores the way unrelated busy work would. Each is ended by
    its own pid (SIGKILL), whatever happens inside the ``with`` block.
    """
    hogs = [
        subprocess.Popen(
            [sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL, start_new_session=True
        )
        for _ in range(count)
    ]
    try:
        yield [hog.pid for hog in hogs]
    finally:
        for hog in hogs:
            if hog.poll() is None:
                hog.kill()
            hog.wait(10)


def checkout(path: str | os.PathLike[str]) -> str:
    """Which commit the git checkout holding ``path`` is at, and whether ``ratequeue/`` has local changes."""
    import hashlib

    where = Path(path)
    where = where if where.is_dir() else where.parent

    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True, check=False)
        return done.stdout.strip() if done.returncode == 0 else ""

    commit = git("rev-parse", "--short", "HEAD")
    if not commit:
        return f"{where} (not a git checkout)"
    root = git("rev-parse", "--show-toplevel")
    changed = git("status", "--porcelain", "--", ":/ratequeue")
    if not changed:
        return f"{root} at {commit}"
    # a fingerprint of the uncommitted state, to tell two runs on a changing work tree apart
    digest = hashlib.sha1(git("diff", "HEAD", "--", ":/ratequeue").encode())
    for name in git("ls-files", "--others", "--exclude-standard", "--", ":/ratequeue").splitlines():
        with contextlib.suppress(OSError):
            digest.update(name.encode() + (Path(root) / name).read_bytes())
    return (
        f"{root} at {commit} + uncommitted changes in {len(changed.splitlines())} files of ratequeue/ "
        f"(fingerprint {digest.hexdigest()[:10]})"
    )
