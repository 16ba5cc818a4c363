"""A queue paused everywhere, with real processes: ``ratequeue pause`` stops every shard, ``resume`` restarts.

Three worker processes acquire continuously on one queue (20 ms interval, a
fixed lead of 5 ms) through each shared backend. The test pauses the queue
with the command line, as an operator would (``python -m ratequeue pause``),
watches the state clock run on for a while, resumes it the same way, and
checks from the starts the workers report, all on the state's clock:

* no start lies after the moment the pause was written, but for a start
  granted just before it, which may lie up to the lead ahead;
* after the resume, starts come again within one recheck (1 s) and an
  interval, and every two starts of the whole run are an interval apart.

Every wait has a deadline; none stands in for synchronisation.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import queue as queue_module
import re
import subprocess
import sys
import time
import traceback
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import pytest

import ratequeue
from ratequeue import AcquireTimeout, Limiter
from ratequeue.core.protocol import PAUSED_RECHECK_US, US
from ratequeue.state import open_state

from .backends import Backend

pytestmark = pytest.mark.processes

INTERVAL = 0.02
INTERVAL_US = round(INTERVAL * US)
#: every worker's lead, set explicitly: a start granted just before the pause lies at most this far ahead
LEAD = 0.005
LEAD_US = round(LEAD * US)
WORKERS = 3
#: how long (state clock, us) the queue stays paused while the test watches
PAUSED_FOR_US = 3 * US
#: the longest any single wait may take before the run is declared broken
WAIT = 60.0
#: slack (us) on the resume bound for scheduling three busy processes and the CLI's own process
SLACK_US = 250_000

SOURCE_ROOT = Path(ratequeue.__file__).resolve().parents[1]


def worker(url: str, name: str, index: int, reports: Any, stop: Event) -> None:
    """Acquire one turn after another until ``stop`` is set; report each start on the state clock.

    ``max_late=None``: a turn granted before the pause is never moved later
    by a retime (which, unchanged by a pause, may move it a few ms on), so
    the test's bound on starts after the pause is exact.
    """
    try:
        limiter = Limiter(url, name=name, interval=INTERVAL, lead=LEAD, max_late=None)
        reports.put(("ready", index))
        while not stop.is_set():
            try:
                turn = limiter.acquire(timeout=2.0)  # past a paused queue's recheck: never expires at once
            except AcquireTimeout:
                continue
            reports.put(("start", index, turn.ticket, turn.start_us))
        limiter.close()
        reports.put(("done", index))
    except BaseException:
        reports.put(("error", index, traceback.format_exc()))


class Run:
    """The workers' reports, collected as they come."""

    def __init__(self, reports: Any) -> None:
        self.reports = reports
        self.starts: list[tuple[int, int, int]] = []  # (start_us, ticket, worker)
        self.done = 0

    def collect(self, until: Any, what: str) -> None:
        """Take reports until ``until()`` holds; fail after :data:`WAIT` s or on a worker's error."""
        deadline = time.monotonic() + WAIT
        while not until():
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"not within {WAIT} s: {what}"
            try:
                message = self.reports.get(timeout=min(remaining, 0.05))
            except queue_module.Empty:
                continue
            if message[0] == "start":
                self.starts.append((message[3], message[2], message[1]))
            elif message[0] == "done":
                self.done += 1
            elif message[0] == "error":
                raise AssertionError(f"worker {message[1]} failed:\n{message[2]}")


def cli(*args: str) -> int:
    """Run ``python -m ratequeue ARGS``; the state clock (us) it read right after its change."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(SOURCE_ROOT), os.environ.get("PYTHONPATH")])),
    }
    result = subprocess.run(
        [sys.executable, "-m", "ratequeue", *args],
        capture_output=True,
        text=True,
        timeout=WAIT,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    found = re.search(r"^state clock: (\d+) us$", result.stdout, re.MULTILINE)
    assert found, result.stdout
    return int(found[1])


def test_a_queue_paused_everywhere_starts_nothing_until_resumed(shared_backend: Backend) -> None:
    name = shared_backend.fresh_name()
    url = shared_backend.url
    if shared_backend.kind == "mongodb":
        url += f"&collection={name}"  # a collection of its own: secantusdb slows as documents add up
    state = open_state(url)
    context = multiprocessing.get_context("spawn")
    reports = context.Queue()
    stop = context.Event()
    workers = [
        context.Process(target=worker, args=(url, name, index, reports, stop), daemon=True)
        for index in range(WORKERS)
    ]
    for process in workers:
        process.start()
    run = Run(reports)
    try:
        run.collect(lambda: len(run.starts) >= 30, "30 starts before the pause")

        paused_at = cli("pause", url, name)
        record = state.read(name).record
        assert record is not None
        assert record.paused
        run.collect(lambda: state.read(name).now >= paused_at + PAUSED_FOR_US, "the paused spell")
        before_resume = len(run.starts)

        resuming = state.read(name).now  # the resume is written after this (and read back at resumed_at)
        resumed_at = cli("resume", url, name)
        run.collect(lambda: len(run.starts) >= before_resume + 30, "30 starts after the resume")
    finally:
        stop.set()
    run.collect(lambda: run.done == WORKERS, "the workers to stop")
    for process in workers:
        process.join(WAIT)
    state.close()

    starts = sorted(run.starts)
    paused_spell = [start for start in starts if paused_at + LEAD_US < start[0] < resuming]
    assert paused_spell == [], f"started while paused (from {paused_at} us on the state clock)"
    after = [start for start in starts if start[0] >= resuming]
    assert len(after) >= 30, "the starts after the resume"
    first_after = after[0][0] - resumed_at
    assert first_after <= PAUSED_RECHECK_US + INTERVAL_US + SLACK_US, (
        f"the first start came {first_after / 1000:.1f} ms after the resume"
    )
    gaps = [later[0] - earlier[0] for earlier, later in itertools.pairwise(starts)]
    assert min(gaps) >= INTERVAL_US, "two starts closer than the interval"
    tickets = [ticket for _, ticket, _ in starts]
    assert tickets == sorted(tickets), "starts in ticket order"
    # the measurements, for the record (pytest -s shows them)
    print(
        f"\n{shared_backend.kind}: {len(starts) - len(after)} starts before the pause, none while paused; "
        f"paused {(resumed_at - paused_at) / 1000:.0f} ms; first start {first_after / 1000:.1f} ms "
        f"after the resume; {len(after)} after it, smallest gap {min(gaps) / 1000:.3f} ms"
    )
