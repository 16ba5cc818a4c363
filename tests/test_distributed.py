"""Server-side states across processes: skewed local clocks and a Redis restart mid-run."""

from __future__ import annotations

import itertools
import multiprocessing
import queue as queue_module
from typing import Any

import pytest

from . import _workers
from .servers import Server

INTERVAL = 0.02
INTERVAL_US = 20_000


def run_workers(
    url: str, name: str, count: int, offsets: list[float], on_report: Any = None
) -> tuple[list[tuple[int, int, int]], list[str]]:
    """Run one process per clock offset, each acquiring ``count`` turns; collect their reports."""
    context = multiprocessing.get_context("spawn")
    reports: Any = context.Queue()
    processes = [
        context.Process(target=_workers.acquire_many, args=(url, name, INTERVAL, count, offset, i, reports))
        for i, offset in enumerate(offsets)
    ]
    for process in processes:
        process.start()
    starts: list[tuple[int, int, int]] = []
    errors: list[str] = []
    finished = 0
    try:
        while finished < len(processes):
            try:
                index, ticket, value = reports.get(timeout=60)
            except queue_module.Empty:
                pytest.fail(f"no report for 60 s; {len(starts)} starts so far")
            if ticket is None:
                finished += 1
                if value:
                    errors.append(f"process {index}: {value}")
                continue
            starts.append((index, ticket, value))
            if on_report is not None:
                on_report(len(starts))
    finally:
        for process in processes:
            process.join(30)
            if process.is_alive():
                process.kill()
    return starts, errors


def check_spacing(starts: list[tuple[int, int, int]]) -> None:
    """G1 and G2 on the state's clock: sorted by start, tickets increase and gaps are >= the interval."""
    ordered = sorted(starts, key=lambda s: s[2])
    assert [s[1] for s in ordered] == sorted(s[1] for s in starts), "tickets start in increasing order"
    gaps = [b[2] - a[2] for a, b in itertools.pairwise(ordered)]
    assert min(gaps) >= INTERVAL_US, f"a gap of {min(gaps)} us is under the interval"


@pytest.mark.processes
@pytest.mark.parametrize("kind", ["redis", "mongodb", "postgresql"])
def test_hosts_with_skewed_clocks_share_one_rate(kind: str, request: pytest.FixtureRequest) -> None:
    """Processes whose local clocks are 2 s apart still start one per interval (server clock)."""
    server: Server = request.getfixturevalue(f"{kind}_server")
    url = {
        "redis": f"redis://127.0.0.1:{server.port}/0?prefix=skew:",
        "mongodb": f"mongodb://127.0.0.1:{server.port}/?database=skew",
        "postgresql": f"postgresql://postgres@127.0.0.1:{server.port}/postgres?table=skew",
    }[kind]
    name = f"skew-{kind}"
    starts, errors = run_workers(url, name, 15, [-2.0, 0.0, 2.0])
    assert not errors
    assert len(starts) == 45
    check_spacing(starts)
    assert {index for index, _, _ in starts} == {0, 1, 2}


@pytest.mark.processes
@pytest.mark.servers
def test_redis_restart_mid_run(redis_server: Server) -> None:
    """Redis restarted (same port, append-only file) mid-run: limiters reconnect and go on."""
    url = f"redis://127.0.0.1:{redis_server.port}/0?prefix=restart:"
    restarted: list[int] = []

    def restart_once(started: int) -> None:
        if started == 20 and not restarted:
            redis_server.restart()
            restarted.append(started)

    starts, errors = run_workers(url, "restart", 20, [0.0, 0.0, 0.0], on_report=restart_once)
    assert restarted == [20]
    assert not errors, errors
    assert len(starts) == 60, "no job lost"
    assert len({ticket for _, ticket, _ in starts}) == 60
    check_spacing(starts)
