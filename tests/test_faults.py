"""The fault suite (issue 11, item 5): faults injected into running limiters, and what must hold.

Every case asserts, where it applies: **0 gaps under the interval** on the
state's clock (from the turns' ``start_us``, per queue name); **0 jobs lost**
(every ``acquire`` returned a turn or raised a ``ratequeue.errors`` error,
and nothing else was raised); **the state intact** (the record reads back,
past every ticket handed out) **or a precise error** (``StateCorrupted``
naming the field, ``StateUnavailable`` naming the file).

==============================  ============================================  ==============================
fault injected                  how                                           asserted beyond the above
==============================  ============================================  ==============================
Redis restart mid-run           SIGTERM + start, same port, append-only file  every acquire returned a turn
Redis SCRIPT FLUSH mid-run      ``SCRIPT FLUSH``                              every acquire returned a turn
Redis CLIENT KILL mid-run       ``CLIENT KILL TYPE normal SKIPME yes``        every acquire returned a turn
Redis DEBUG SLEEP 0.5 mid-run   ``DEBUG SLEEP 0.5`` (own server, debug on)    every acquire returned a turn
MongoDB restart mid-run         secantusdb on disk, SIGTERM + start           every acquire returned a turn
SIGKILL of 3 of 4 processes     file state and Redis; victims hold 25         the survivor runs all its jobs;
                                waiting callers each                          <= 1 lost ticket per dead shard
                                                                              after the kills (G4)
SIGSTOP of a name-lock holder   a child takes one name's lock on the file     that name stalls for the stop;
                                state and stops itself; SIGCONT after 1 s     another name keeps its rate
Disk full (RLIMIT_FSIZE)        a child under a file-size limit acquires on   turns, then StateUnavailable
                                8 new names beside 300 stored ones            naming the file; the file
                                                                              intact; all names work after
Poisoned record, every backend  file, Redis, MongoDB: wrong types, ticket     StateCorrupted naming the
                                2**52 - 1, ``at`` 10 years ahead              field; the record unchanged
==============================  ============================================  ==============================

A write cut short under one name is covered by
``tests/test_file_state.py::test_write_cut_short_raises_and_leaves_the_old_file``;
the disk-full case here is the multi-queue run.

Servers: Redis and MongoDB servers of this module's own, on free ports (the
session's are not restarted under the other tests); this Redis has the DEBUG
command enabled, this MongoDB keeps its data on disk so that a restart keeps
the records.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
from pymongo import MongoClient

from ratequeue import Limiter
from ratequeue.core.protocol import NEVER
from ratequeue.errors import RateQueueError, StateCorrupted
from ratequeue.state import open_state
from ratequeue.state.file import FileState

from . import _workers, servers
from ._procs import Fleet, Spec, Start
from .ops import do

pytestmark = [pytest.mark.timeout(120)]

INTERVAL = 0.02
INTERVAL_US = 20_000
#: any single wait of this module; far above what a healthy run needs
WAIT = 30.0
#: how late a start may come beyond its slot on a loaded 2-core host (see test_processes.ALLOWANCE_US)
ALLOWANCE_US = 1_000_000


# --------------------------------------------------------------------------- servers


@pytest.fixture(scope="module")
def fault_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[servers.Server]:
    """A redis-server of this module's own, with an append-only file and DEBUG enabled."""
    executable = servers.redis_executable()
    if executable is None:
        servers.unavailable("redis-server is not on PATH: apt-get install redis-server")
    workdir = tmp_path_factory.mktemp("fault-redis")
    port = servers.free_port()
    command = [*servers.redis_command(str(executable), port, workdir), "--enable-debug-command", "local"]
    yield from servers.serve(servers.Server("redis", command, port, workdir), "redis-server")


@pytest.fixture(scope="module")
def fault_mongodb(tmp_path_factory: pytest.TempPathFactory) -> Iterator[servers.Server]:
    """A secantusdb server of this module's own that keeps its data on disk across restarts."""
    executable = servers.mongodb_executable()
    if executable is None:
        servers.unavailable("secantusd-py is missing: pip install 'secantusdb==0.7.0b3'")
    workdir = tmp_path_factory.mktemp("fault-mongodb")
    port = servers.free_port()
    command = [
        str(executable), "--host", "127.0.0.1", "--port", str(port), "--storage-path", str(workdir / "data"),
    ]  # fmt: skip
    yield from servers.serve(servers.Server("mongodb", command, port, workdir), "secantusd-py")


def redis_url(server: servers.Server, prefix: str) -> str:
    return f"redis://127.0.0.1:{server.port}/0?prefix={prefix}:"


def mongodb_url(server: servers.Server, database: str) -> str:
    return f"mongodb://127.0.0.1:{server.port}/?database={database}"


_names = itertools.count()


def fresh(stem: str) -> str:
    return f"{stem}{next(_names)}-{os.getpid()}"


# --------------------------------------------------------------------------- acquiring threads


@dataclass(frozen=True)
class Turned:
    name: str
    worker: int
    ticket: int
    start_us: int


@dataclass
class Outcomes:
    """What the acquiring threads saw; every attempt ends as a turn, a precise error or a raw one."""

    attempts: int = 0
    turns: list[Turned] = field(default_factory=list)
    precise: list[str] = field(default_factory=list)
    raw: list[str] = field(default_factory=list)
    changed: threading.Condition = field(default_factory=threading.Condition)

    def wait_for_turns(self, count: int, name: str | None = None) -> None:
        """Block until ``count`` turns (of ``name``, if given) were reported; fail after WAIT s."""

        def enough() -> bool:
            return sum(name is None or t.name == name for t in self.turns) >= count

        with self.changed:
            if not self.changed.wait_for(enough, WAIT):
                pytest.fail(f"{count} turns not reached within {WAIT} s: {self.summary()}")

    def summary(self) -> str:
        return f"{self.attempts} attempts, {len(self.turns)} turns, precise {self.precise}, raw {self.raw}"


@contextmanager
def acquiring(url: str, names: list[str], per_name: int) -> Iterator[Outcomes]:
    """``per_name`` threads per name, each with a limiter (a shard) of its own, acquire until the end."""
    out = Outcomes()
    stop = threading.Event()
    limiters = [Limiter(url, name=name, interval=INTERVAL) for name in names for _ in range(per_name)]

    def run(worker: int, limiter: Limiter) -> None:
        while not stop.is_set():
            outcome: Any
            try:
                turn = limiter.acquire(timeout=WAIT)
            except RateQueueError as exc:
                outcome = f"{type(exc).__name__}: {exc}"
            except Exception as exc:
                outcome = exc
            else:
                outcome = Turned(limiter.name, worker, turn.ticket, turn.start_us)
            with out.changed:
                out.attempts += 1
                if isinstance(outcome, Turned):
                    out.turns.append(outcome)
                elif isinstance(outcome, str):
                    out.precise.append(outcome)
                else:
                    out.raw.append(f"{type(outcome).__name__}: {outcome}")
                out.changed.notify_all()

    threads = [
        threading.Thread(target=run, args=(i, limiter), daemon=True) for i, limiter in enumerate(limiters)
    ]
    for thread in threads:
        thread.start()
    try:
        yield out
    finally:
        stop.set()
        deadline = time.monotonic() + WAIT + 5
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        for limiter in limiters:
            limiter.close()
    assert not any(thread.is_alive() for thread in threads), f"an acquire hung: {out.summary()}"


def check_outcomes(out: Outcomes, url: str, *, all_turned: bool) -> None:
    """0 jobs lost, 0 gaps under the interval, the records intact."""
    assert not out.raw, f"errors that are not ratequeue's: {out.raw}"
    assert out.attempts == len(out.turns) + len(out.precise), out.summary()
    if all_turned:
        assert not out.precise, out.summary()
    by_name: dict[str, list[Turned]] = defaultdict(list)
    for turn in out.turns:
        by_name[turn.name].append(turn)
    for name, turns in by_name.items():
        duplicates = [t for t, n in Counter(t.ticket for t in turns).items() if n > 1]
        assert not duplicates, f"{name}: tickets handed out twice: {duplicates}"
        ordered = sorted(turns, key=lambda t: t.start_us)
        assert [t.ticket for t in ordered] == sorted(t.ticket for t in turns), f"{name}: G2"
        short = [(a, b) for a, b in itertools.pairwise(ordered) if b.start_us - a.start_us < INTERVAL_US]
        assert not short, f"{name}: starts closer than the interval: {short}"
        with open_state(url) as state:
            record = state.read(name).record
        assert record is not None
        assert record.ticket > max(t.ticket for t in turns), (name, record)
        assert record.at >= max(t.start_us for t in turns), (name, record)
        assert record.interval == INTERVAL_US


def run_with_fault(url: str, inject: Callable[[], None], *, before: int = 10, after: int = 15) -> Outcomes:
    """4 shards acquire on one name; ``inject`` runs after ``before`` turns; ``after`` more turns follow."""
    name = fresh("fault")
    with acquiring(url, [name], per_name=4) as out:
        out.wait_for_turns(before)
        inject()
        with out.changed:
            seen = len(out.turns)
        out.wait_for_turns(seen + after)
    return out


# --------------------------------------------------------------------------- Redis and MongoDB faults


def _redis_client(server: servers.Server) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=server.port)


def _redis_command(*command: str) -> Callable[[servers.Server], None]:
    def inject(server: servers.Server) -> None:
        with _redis_client(server) as client:
            client.execute_command(*command)

    return inject


REDIS_FAULTS: dict[str, Callable[[servers.Server], None]] = {
    "restart": servers.Server.restart,
    "script-flush": _redis_command("SCRIPT", "FLUSH"),
    "client-kill": _redis_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes"),
    "debug-sleep": _redis_command("DEBUG", "SLEEP", "0.5"),
}


@pytest.mark.servers
@pytest.mark.parametrize("fault", list(REDIS_FAULTS))
def test_redis_fault_mid_run(fault_redis: servers.Server, fault: str) -> None:
    url = redis_url(fault_redis, "faults")
    out = run_with_fault(url, lambda: REDIS_FAULTS[fault](fault_redis))
    check_outcomes(out, url, all_turned=True)


@pytest.mark.servers
def test_mongodb_restart_mid_run(fault_mongodb: servers.Server) -> None:
    url = mongodb_url(fault_mongodb, "faults")
    out = run_with_fault(url, fault_mongodb.restart)
    check_outcomes(out, url, all_turned=True)


@pytest.mark.servers
def test_postgresql_restart_mid_run(postgresql_server: servers.Server) -> None:
    """A fast shutdown and a start of the server (its data kept): every acquire still gets its turn."""
    url = f"postgresql://postgres@127.0.0.1:{postgresql_server.port}/postgres?table=faults"
    out = run_with_fault(url, postgresql_server.restart)
    check_outcomes(out, url, all_turned=True)


# --------------------------------------------------------------------------- SIGKILL of n-1 of n

PROCESSES = 4
#: each victim is killed on its KILL_AFTER-th reported turn
KILL_AFTER = 3
SURVIVOR_JOBS = 40
VICTIM_JOBS = 25
#: a caller woken too late gives its granted start up (G7): that ticket started but is never reported
GIVEN_UP = 1


@pytest.mark.processes
@pytest.mark.parametrize("kind", ["file", "redis"])
def test_sigkill_of_all_but_one_process(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """3 of 4 processes die by SIGKILL, with callers waiting in them: the survivor keeps the rate.

    Each dead shard held at most one ticket, whose slot the survivor loses
    once (G4): after the last kill at most one ticket per dead shard (and one
    given up by a late wake-up) never starts, and the survivor's starts stay
    within those lost slots (plus the scheduling allowance) of one per interval.
    """
    if kind == "file":
        url = f"file://{tmp_path / 'state.json'}"
    else:
        url = redis_url(request.getfixturevalue("fault_redis"), "kill")
    name = fresh("kill")
    survivor = 0
    victims = list(range(1, PROCESSES))
    specs = [Spec(jobs=SURVIVOR_JOBS)] + [Spec(jobs=VICTIM_JOBS, threads=VICTIM_JOBS)] * len(victims)
    fleet = Fleet(url, name, INTERVAL, specs)
    starts: list[Start] = []
    errors: list[Any] = []
    killed_us: dict[int, int] = {}
    try:
        fleet.start()
        for index, message in fleet.messages():
            if message[0] == "start":
                assert index is not None
                start = Start(index, *message[1:])
                starts.append(start)
                mine = sum(s.index == index for s in starts)
                if index in victims and index not in killed_us and mine >= KILL_AFTER:
                    fleet.kill(index)
                    killed_us[index] = time.time_ns() // 1000
            elif message[0] == "error":
                errors.append((index, message[1]))
        exitcodes = fleet.join()
    finally:
        fleet.close()

    assert not errors, errors
    assert sorted(killed_us) == victims, "every victim was killed mid-run"
    assert exitcodes == [0] + [-signal.SIGKILL] * len(victims)
    per_process = Counter(s.index for s in starts)
    assert per_process[survivor] == SURVIVOR_JOBS, "no job of the survivor lost"
    assert all(KILL_AFTER <= per_process[v] < VICTIM_JOBS for v in victims), per_process

    ordered = sorted(starts, key=lambda s: s.start_us)
    assert len({s.ticket for s in starts}) == len(starts), "a ticket handed out twice"
    assert [s.ticket for s in ordered] == sorted(s.ticket for s in starts)
    gaps = [b.start_us - a.start_us for a, b in itertools.pairwise(ordered)]
    assert min(gaps) >= INTERVAL_US, f"a gap of {min(gaps)} us"

    last_kill = max(killed_us.values())
    alone = [s for s in ordered if s.start_us > last_kill]
    assert len(alone) >= 10, "the survivor ran on after the kills"
    lost = sum(b.ticket - a.ticket - 1 for a, b in itertools.pairwise(alone))
    assert lost <= len(victims) + GIVEN_UP, f"{lost} tickets never started after the last kill"
    span = alone[-1].start_us - alone[0].start_us
    assert span <= (len(alone) - 1 + lost) * INTERVAL_US + ALLOWANCE_US, (span, len(alone), lost)

    with open_state(url) as state:
        record = state.read(name).record
    assert record is not None
    assert record.ticket > max(s.ticket for s in starts)


# --------------------------------------------------------------------------- SIGSTOP inside the file lock

#: how long the lock holder stays stopped
STOPPED = 1.0
#: starts granted just before the stop may lie up to the lead ahead (ms on a file); far above that
GRANTED_AHEAD_US = 150_000


def _process_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


@pytest.mark.processes
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
def test_sigstop_of_the_file_lock_holder(tmp_path: Path) -> None:
    """A process stopped while it holds a queue name's lock on the file state: what the others see.

    Measured on the layout of issue 11 item 1 (one record file and lock per
    name): while the holder is stopped, its name (``same``) starts nothing
    and goes on after SIGCONT; another name of the same state (``other``)
    keeps its rate throughout. Nothing is lost and no gap is under the
    interval (the acquire timeout outlasts the stop). Before that redesign one
    lock covered the whole file and ``other`` stalled for the stop too (issue
    11 item 2: 0 starts anywhere for the stop's length). A stopped holder of
    a name's lock still stalls that name for as long as it stays stopped.
    """
    path = tmp_path / "state.json"
    url = f"file://{path}"
    same, other = fresh("held"), fresh("other")
    context = multiprocessing.get_context("spawn")
    with acquiring(url, [same, other], per_name=2) as out:
        out.wait_for_turns(5, same)
        out.wait_for_turns(5, other)
        mine, theirs = context.Pipe()
        holder = context.Process(
            target=_workers.hold_lock_and_stop, args=(str(FileState(path).record_files(same)[1]), theirs)
        )
        holder.start()
        theirs.close()
        try:
            assert mine.poll(WAIT), "the holder did not take the lock"
            assert mine.recv() == "locked"
            deadline = time.monotonic() + WAIT
            while _process_state(holder.pid) != "T":  # type: ignore[arg-type]
                assert time.monotonic() < deadline, "the holder did not stop"
                time.sleep(0.001)
            stopped_us = time.time_ns() // 1000
            # the fault's length, not a synchronisation: the holder stays stopped this long
            time.sleep(STOPPED)
            continued_us = time.time_ns() // 1000
            os.kill(holder.pid, signal.SIGCONT)  # type: ignore[arg-type]
            assert mine.poll(WAIT), "the holder did not release the lock"
            assert mine.recv() == "released"
            holder.join(WAIT)
            assert holder.exitcode == 0
        finally:
            if holder.is_alive():
                holder.kill()
                holder.join(WAIT)
            mine.close()
        with out.changed:
            seen = {n: sum(t.name == n for t in out.turns) for n in (same, other)}
        out.wait_for_turns(seen[same] + 5, same)
        out.wait_for_turns(seen[other] + 5, other)

    check_outcomes(out, url, all_turned=True)
    window = (stopped_us + GRANTED_AHEAD_US, continued_us)
    during = Counter(t.name for t in out.turns if window[0] <= t.start_us <= window[1])
    # the held name stalls for the stop's length ...
    assert during[same] == 0, f"{same} started while its lock holder was stopped: {during}"
    ordered = sorted(t.start_us for t in out.turns if t.name == same)
    stall = max(b - a for a, b in itertools.pairwise(ordered))
    assert stall >= STOPPED * 1_000_000 - GRANTED_AHEAD_US, stall
    # ... the other name does not: it keeps starting through the stop (with one lock for the whole
    # file, before issue 11's redesign, it started 0 turns). Its full rate is ~42 turns in the window;
    # 42 were seen on an idle host, 13 on one busy with other test runs, so only "not stalled" is asserted.
    assert during[other] >= 1, f"{other} stalled with the holder of {same}'s lock: {during}"
    others = sorted(t.start_us for t in out.turns if t.name == other and window[0] <= t.start_us)
    longest = max(b - a for a, b in itertools.pairwise([window[0], *others]))
    assert longest < STOPPED * 1_000_000 * 3 // 4, f"{other} stalled {longest} us during the stop"


# --------------------------------------------------------------------------- disk full

DISK_FULL = """
import json, resource, signal, sys
from ratequeue import Limiter
from ratequeue.core.protocol import NEVER
from ratequeue.errors import RateQueueError
path, names, rounds, limit = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3]), int(sys.argv[4])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails instead of killing
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
limiters = {name: Limiter("file://" + path, name=name, interval=0.001) for name in names}
outcomes = []
for _ in range(rounds):
    for name, limiter in limiters.items():
        try:
            turn = limiter.acquire(timeout=10)
        except RateQueueError as exc:
            outcomes.append([name, type(exc).__name__, getattr(exc, "where", ""), str(exc)])
        else:
            outcomes.append([name, "turn", turn.ticket, turn.start_us])
print(json.dumps(outcomes))
"""

#: the names the disk-full run acquires on, each with SEEDED turns already, beside STORED other names
DISK_NAMES = 8
SEEDED = 5
STORED = 20
ROUNDS = 10


@pytest.mark.processes
@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="needs RLIMIT_FSIZE and SIGXFSZ")
def test_writes_cut_short_on_many_queues_tear_nothing(tmp_path: Path) -> None:
    """Every write of a process is cut short (a file-size limit below a record file's size) while 8
    names acquire: precise errors, nothing torn.

    A change is written over its record file in place; a write cut short
    puts the bytes it overwrote back. So each acquire raises StateUnavailable
    naming the state, and afterwards every record reads back exactly as it
    was (the 8 names' and the others'), no temporary file is left, and
    without the limit every name goes on. (A full disk does not stop the
    writes in place at all: they need no new space. Before issue 11's
    redesign, with every record in one file, such a limit tore the file.)
    """
    path = tmp_path / "state.json"
    url = f"file://{path}"
    names = [f"new{i}" for i in range(DISK_NAMES)]
    for name in names:
        seeding = Limiter(url, name=name, interval=0.001)
        for _ in range(SEEDED):
            seeding.acquire(timeout=WAIT)
        seeding.close()
    stored = FileState(path)
    for i in range(STORED):
        do(stored, "take", f"stored{i}", INTERVAL_US)
    before = {name: stored.read(name).record for name in [*names, *(f"stored{i}" for i in range(STORED))]}
    limit = min(stored.record_files(name)[0].stat().st_size for name in names) // 2
    ran = subprocess.run(
        [sys.executable, "-c", DISK_FULL, str(path), ",".join(names), str(ROUNDS), str(limit)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ran.returncode == 0, ran.stderr
    outcomes = json.loads(ran.stdout)
    assert len(outcomes) == DISK_NAMES * ROUNDS, "every acquire returned a turn or a ratequeue error"
    assert {o[1] for o in outcomes} == {"StateUnavailable"}, outcomes[:3]
    assert all(o[2] == str(path) for o in outcomes), outcomes[:3]
    assert all("cut short" in o[3] for o in outcomes), outcomes[:3]

    state = FileState(path)
    assert {n: state.read(n).record for n in before} == before, "every record is as it was"
    assert not [p for p in tmp_path.rglob("*") if ".tmp" in p.name], "a temporary file left"
    for name in names:  # nothing left broken: without the limit every name goes on
        with Limiter(url, name=name, interval=0.001) as turn:
            assert turn.ticket > SEEDED


# --------------------------------------------------------------------------- poisoned records

NOW_US = time.time_ns() // 1000
TEN_YEARS_US = 10 * 365 * 86_400 * 1_000_000
NEAR_2_52 = 2**52 - 1

#: a well-formed record as ratequeue stores it (a fresh one's burst, pause, cap, leases and hold); each
#: poison below replaces some of its fields, and only the named one is bad
WELL_FORMED: dict[str, Any] = {
    "ticket": 3,
    "pos": 2,
    "at": NOW_US,
    "interval": INTERVAL_US,
    "due": NOW_US,
    "burst": 1,
    "paused": False,
    "max_running": 0,
    "leases": [],
    "held": NEVER,
}

#: poison -> (the fields it replaces in WELL_FORMED, the field the error must name); values
#: JSON/BSON/Redis can hold
POISONS: dict[str, tuple[dict[str, Any], str]] = {
    "ticket-text": ({"ticket": "seven", "pos": 1}, "ticket"),
    "at-fraction": ({"at": NOW_US + 0.5}, "at"),
    "interval-text": ({"interval": "often"}, "interval"),
    "ticket-near-2**52": ({"ticket": NEAR_2_52, "pos": NEAR_2_52 - 1}, "ticket"),
    "at-far-future": ({"at": NOW_US + TEN_YEARS_US, "due": NOW_US + TEN_YEARS_US}, "at"),
}


def _poisoned(poison: str) -> dict[str, Any]:
    """Every field of a record, as stored, with ``poison``'s in place of the well-formed ones."""
    return {**WELL_FORMED, **POISONS[poison][0]}


def _redis_text(value: Any) -> str:
    """A field as the Redis state stores it: decimal text, paused "1"/"0", leases "T:E,T:E"."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, list):
        return ",".join(f"{ticket}:{expiry}" for ticket, expiry in value)
    return str(value)


#: the poisons a read still reports (a record at its last ticket is well formed; only taking
#: another ticket, which would overflow it, is refused)
READABLE = {"ticket-near-2**52"}


def _poison_cases() -> Iterator[Any]:
    for backend in ("file", "redis", "mongodb"):
        for poison in POISONS:
            yield pytest.param(backend, poison, id=f"{backend}-{poison}")


@pytest.mark.parametrize(("backend", "poison"), list(_poison_cases()))
def test_poisoned_record_is_refused_naming_the_field(
    backend: str, poison: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    fields, named = _poisoned(poison), POISONS[poison][1]
    name = fresh("poison")
    read_raw: Callable[[], Any]
    if backend == "file":
        path = tmp_path / "state.json"
        file_state = FileState(path)
        do(file_state, "take", "neighbour", INTERVAL_US)  # a valid state, in its current layout
        record_file = file_state.record_files(name)[0]
        stored = {**fields, "held": None}  # the file state stores NEVER as null
        record_file.write_text(json.dumps({"name": name, "record": stored}))
        url = f"file://{path}"
        read_raw = record_file.read_bytes
    elif backend == "redis":
        server = request.getfixturevalue("fault_redis")
        url = redis_url(server, "poison")
        client = _redis_client(server)
        request.addfinalizer(client.close)
        client.hset(f"poison:{name}", mapping={k: _redis_text(v) for k, v in fields.items()})
        read_raw = lambda: client.hgetall(f"poison:{name}")  # noqa: E731
    else:
        server = request.getfixturevalue("fault_mongodb")
        url = mongodb_url(server, "poison")
        mongo: MongoClient[Any] = MongoClient(port=server.port)
        request.addfinalizer(mongo.close)
        collection = mongo["poison"]["queues"]
        collection.insert_one({"_id": name, **fields})
        # the document's ``answer`` is where an operation leaves its reply, not part of the record
        read_raw = lambda: collection.find_one({"_id": name}, {"answer": 0})  # noqa: E731
    before = read_raw()
    with open_state(url) as state:
        with pytest.raises(StateCorrupted, match=rf"\b{named}=") as raised:
            do(state, "take_and_try", name, INTERVAL_US, 0)
        assert name in raised.value.where, raised.value.where
        if poison in READABLE:
            assert state.read(name).record is not None, "a record at its last ticket is still read"
        else:
            with pytest.raises(StateCorrupted, match=rf"\b{named}="):
                state.read(name)
    limiter = Limiter(url, name=name, interval=INTERVAL)
    try:
        with pytest.raises(StateCorrupted, match=rf"\b{named}="):
            limiter.acquire(timeout=5)
    finally:
        limiter.close()
    assert read_raw() == before, "a refused record is left as it was"
