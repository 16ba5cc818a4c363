"""Functions run in child processes by the multi-process tests (importable under spawn)."""

from __future__ import annotations

import os
import random
import threading
import time
from typing import Any

from ratequeue import Limiter
from ratequeue.core.protocol import Started
from ratequeue.state import open_state

from .ops import do


def take_many(url: str, name: str, interval_us: int, count: int, barrier: Any) -> list[int]:
    """Take ``count`` tickets as fast as possible; return them."""
    with open_state(url) as state:
        barrier.wait(60)
        return [do(state, "take", name, interval_us).ticket for _ in range(count)]


def race_try_start(
    url: str, name: str, interval_us: int, ticket: int, lead_us: int, barrier: Any
) -> tuple[str, int | None]:
    """Try to start ``ticket`` at the same moment as the other racers; return the answer's kind and start."""
    with open_state(url) as state:
        barrier.wait(60)
        outcome = do(state, "try_start", name, interval_us, ticket, lead_us)
        if isinstance(outcome, Started):
            return "started", outcome.start
        return type(outcome).__name__.lower(), None


def acquire_many(
    url: str, name: str, interval: float, count: int, offset: float, index: int, reports: Any
) -> None:
    """Acquire ``count`` turns on a limiter whose local clock is shifted by ``offset`` s; report each.

    Reports ``(index, ticket, start_us)`` per turn, then ``(index, None, error)`` at the end.
    """
    import time

    from ratequeue import Limiter

    error = ""
    try:
        limiter = Limiter(url, name=name, interval=interval, clock=lambda: time.monotonic() + offset)
        for _ in range(count):
            turn = limiter.acquire(timeout=60)
            reports.put((index, turn.ticket, turn.start_us))
        limiter.close()
    except Exception as exc:  # reported to the test, which fails
        error = f"{type(exc).__name__}: {exc}"
    reports.put((index, None, error))


def acquire_many_async(
    url: str, name: str, interval: float, tasks: int, count: int, index: int, reports: Any
) -> None:
    """Run ``tasks`` asyncio tasks in one loop, each acquiring ``count`` turns; report as ``acquire_many``."""
    import asyncio

    from ratequeue import aio

    async def main() -> None:
        limiter = aio.Limiter(url, name=name, interval=interval)

        async def task() -> None:
            for _ in range(count):
                turn = await limiter.acquire(timeout=60)
                reports.put((index, turn.ticket, turn.start_us))

        await asyncio.gather(*(task() for _ in range(tasks)))
        await limiter.close()

    error = ""
    try:
        asyncio.run(main())
    except Exception as exc:  # reported to the test, which fails
        error = f"{type(exc).__name__}: {exc}"
    reports.put((index, None, error))


def hold_lock_and_stop(lock_path: str, conn: Any) -> None:
    """Take the file state's lock ``lock_path``, say ``"locked"``, then SIGSTOP this process.

    The stop comes while the lock is held, so whoever continues the process
    (SIGCONT) knows that it was stopped inside the lock; then the lock is
    released and ``"released"`` said.
    """
    import os
    import signal

    from ratequeue.state.file import LockFile

    lock = LockFile.of(lock_path)
    lock.acquire(60)
    conn.send("locked")
    os.kill(os.getpid(), signal.SIGSTOP)
    lock.release()
    conn.send("released")


def acquire_bursts(
    url: str, name: str, rate: str, burst: int, count: int, index: int, barrier: Any, reports: Any
) -> None:
    """After ``barrier``, acquire ``count`` turns of ``rate`` with ``burst``; report as ``acquire_many``."""
    from ratequeue import Limiter

    error = ""
    try:
        limiter = Limiter(url, name=name, rate=rate, burst=burst)
        barrier.wait(60)
        for _ in range(count):
            turn = limiter.acquire(timeout=60)
            reports.put((index, turn.ticket, turn.start_us))
        limiter.close()
    except Exception as exc:  # reported to the test, which fails
        error = f"{type(exc).__name__}: {exc}"
    reports.put((index, None, error))


def acquire_keys(
    url: str, group: str, rate: str, keys: list[str], rounds: int, index: int, barrier: Any, reports: Any
) -> None:
    """After ``barrier``, acquire ``rounds`` turns of each of ``keys`` in a group.

    Reports ``(index, key, start_us)`` per turn, then ``(index, None, error)`` at the end.
    """
    from ratequeue import LimiterGroup

    error = ""
    try:
        with LimiterGroup(url, name=group, rate=rate) as limiters:
            barrier.wait(60)
            for _ in range(rounds):
                for key in keys:
                    reports.put((index, key, limiters[key].acquire(timeout=60).start_us))
    except Exception as exc:  # reported to the test, which fails
        error = f"{type(exc).__name__}: {exc}"
    reports.put((index, None, error))


def run_capped_jobs(
    url: str, name: str, interval: float, max_running: int, lease: float, jobs: int, seed: int, record: str
) -> int:
    """Run ``jobs`` jobs of random length under ``max_running``; append each begin and end to ``record``.

    Lines ``b KEY T`` and ``e KEY T``, ``T`` the host's monotonic clock (one
    for every process), each written with one ``write`` to a file opened
    for appending, so lines from several processes never interleave.
    """
    rng = random.Random(seed)
    limiter = Limiter(url, name=name, interval=interval, max_running=max_running, lease=lease)
    fd = os.open(record, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        for job in range(jobs):
            with limiter:
                os.write(fd, f"b {seed}-{job} {time.monotonic()!r}\n".encode())
                time.sleep(rng.uniform(0.005, 0.06))
                os.write(fd, f"e {seed}-{job} {time.monotonic()!r}\n".encode())
    finally:
        os.close(fd)
        limiter.close()
    return jobs


def hold_a_place(url: str, name: str, lease: float, conn: Any) -> None:
    """Take the one place of a ``max_running=1`` queue and keep it (renewing its lease) until killed.

    Sends ``"holding"`` once the job runs and ``"renewed"`` once its lease
    has been renewed (read from the state: its expiry moved on).
    """
    limiter = Limiter(url, name=name, interval=0.005, max_running=1, lease=lease)
    limiter.acquire()
    conn.send("holding")
    first = limiter.state.read(name).record
    assert first is not None
    while True:
        time.sleep(lease / 10)
        record = limiter.state.read(name).record
        if record is not None and record.leases and record.leases[0][1] > first.leases[0][1]:
            conn.send("renewed")
            break
    threading.Event().wait()  # until SIGKILL


def run_grouped_jobs(url: str, name: str, interval: float, jobs: int, seed: int, record: str) -> int:
    """Add ``jobs`` jobs of groups "even" and "odd" to a queue; each appends its begin and end to ``record``.

    Lines ``b GROUP KEY T`` and ``e GROUP KEY T`` on the host's monotonic
    clock, each one ``write`` to a file opened for appending.
    """
    from ratequeue import Queue

    rng = random.Random(seed)
    fd = os.open(record, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def job(group: str, key: str, seconds: float) -> None:
        os.write(fd, f"b {group} {key} {time.monotonic()!r}\n".encode())
        time.sleep(seconds)
        os.write(fd, f"e {group} {key} {time.monotonic()!r}\n".encode())

    queue = Queue(url, name=name, interval=interval)
    try:
        futures = []
        for number in range(jobs):
            group = "even" if number % 2 == 0 else "odd"
            futures.append(queue.add(job, group, f"{seed}-{number}", rng.uniform(0.005, 0.03), group=group))
        for future in futures:
            future.result(60)
    finally:
        queue.close()
        os.close(fd)
    return jobs


def call_at_published_rate(
    url: str,
    name: str,
    rate: str,
    referee: str,
    calls: int,
    who: str,
    go: Any,
    out: Any,
    margin: float | None,
) -> None:
    """Call the referee ``calls`` times, each as soon as ``acquire()`` returns, at ``rate``; put the 429s."""
    import sys
    from pathlib import Path

    bench = str(Path(__file__).resolve().parents[1] / "bench")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    from referee import RefereeClient

    client = RefereeClient(referee)
    client.connect()
    limiter = Limiter(url, name=name, rate=rate, margin=margin)
    try:
        go.wait(60)
        refused = 0
        for _ in range(calls):
            limiter.acquire()
            refused += client.call(who) != 200
        out.put(refused)
    finally:
        limiter.close()
