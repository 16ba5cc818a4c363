"""A dead-letter handler raising SystemExit or KeyboardInterrupt loses no job (issue 27, item 5).

It used to leave the job's future pending for good (while ``join()``
returned ``True``), and with ``group=`` the group's place held and renewed
for ever, so the group's next job never ran. Now the job is settled first
(its future fails with the job's own error, its group's place goes back)
and the exception then goes on: in the job's thread (``threading.excepthook``
sees it), or out of the event loop (``asyncio.run()`` raises it).

Each case runs in a process of its own: the exception is meant to escape
into a thread or out of ``asyncio.run()``, which pytest's own process must not
see. The process prints what it saw as one JSON line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: how long a child waits for what should come at once (the lease, 10 s, would free the place later)
WAIT = 5.0

_THREADS = """
import json, logging, sys, threading
from ratequeue import Queue
logging.basicConfig()  # (ratequeue's logger has a NullHandler: an application shows its records)
from ratequeue.state.memory import MemoryState

kind = {"SystemExit": SystemExit, "KeyboardInterrupt": KeyboardInterrupt}[sys.argv[1]]
WAIT = float(sys.argv[2])
escaped = []
hooked = threading.Event()

def excepthook(args):
    escaped.append([args.exc_type.__name__, args.thread.name if args.thread else None])
    hooked.set()

threading.excepthook = excepthook

def job():
    raise ValueError("the job's own error")

def handler(letter):
    raise kind(3)

seen = {}
queue = Queue(MemoryState(private=True), name="q", interval=0.001, dead_letter=handler)
first = queue.add(job, group="bob")
try:
    error = first.exception(WAIT)
    seen["future"] = [type(error).__name__, str(error)]
except TimeoutError:
    seen["future"] = "pending"
seen["escaped"] = escaped if hooked.wait(WAIT) else []
nxt = queue.add(lambda: "the next job ran", group="bob")
try:
    seen["next"] = nxt.result(WAIT)
except TimeoutError:
    seen["next"] = "never ran"
seen["join"] = queue.join(WAIT)
closing = threading.Thread(target=queue.close, daemon=True)
closing.start()
closing.join(WAIT)
seen["closed"] = not closing.is_alive()
print(json.dumps(seen), flush=True)
"""

_ASYNCIO = """
import asyncio, json, logging, sys
from ratequeue import aio
logging.basicConfig()  # (ratequeue's logger has a NullHandler: an application shows its records)
from ratequeue.state.memory import MemoryState

kind = {"SystemExit": SystemExit, "KeyboardInterrupt": KeyboardInterrupt}[sys.argv[1]]
WAIT = float(sys.argv[2])
same_loop = sys.argv[3] == "same loop"
loop = asyncio.new_event_loop() if same_loop else None
made = {}

async def job():
    raise ValueError("the job's own error")

async def handler(letter):
    raise kind(3)

async def first_loop():
    queue = aio.Queue(MemoryState(private=True), name="q", interval=0.001, dead_letter=handler)
    made["queue"], made["future"] = queue, queue.add(job, group="bob")
    await asyncio.wait_for(asyncio.Event().wait(), WAIT)  # until the interruption stops the loop

seen = {}
try:
    if same_loop:  # the interruption leaves run_until_complete(); the loop is run again below
        loop.run_until_complete(first_loop())
    else:
        asyncio.run(first_loop())
    seen["run"] = "returned"
except BaseException as exc:
    seen["run"] = type(exc).__name__
future = made["future"]
if future.done():
    error = future.exception()
    seen["future"] = [type(error).__name__, str(error)]
else:
    seen["future"] = "pending"

async def second_loop():
    queue = made["queue"]
    nxt = queue.add(lambda: "the next job ran", group="bob")
    try:
        seen["next"] = await asyncio.wait_for(nxt, WAIT)
    except TimeoutError:
        seen["next"] = "never ran"
    seen["join"] = await queue.join(WAIT)
    await asyncio.wait_for(queue.close(), WAIT)
    seen["closed"] = True

if same_loop:
    loop.run_until_complete(second_loop())
    loop.close()
else:  # asyncio.run() closed the first loop: the queue goes on in a new one
    asyncio.run(second_loop())
print(json.dumps(seen), flush=True)
"""


def run_child(script: str, *args: str) -> dict[str, Any]:
    """Run ``script`` in a new interpreter with ``args``; what it printed last, as JSON."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        done = subprocess.run(
            [sys.executable, "-c", script, args[0], str(WAIT), *args[1:]],
            capture_output=True,
            text=True,
            timeout=8 * WAIT,
            env=env,
            cwd=ROOT,
            check=False,
        )
    except subprocess.TimeoutExpired as hung:
        raise AssertionError(f"the process did not end; it printed {hung.stdout!r}") from None
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines, done.stderr[-3000:]
    seen: dict[str, Any] = json.loads(lines[-1])
    seen["stderr"] = done.stderr
    return seen


@pytest.mark.processes
@pytest.mark.parametrize("kind", ["SystemExit", "KeyboardInterrupt"])
def test_threads_settle_the_job_then_the_interruption_ends_the_jobs_thread(kind: str) -> None:
    seen = run_child(_THREADS, kind)
    assert seen["future"] == ["ValueError", "the job's own error"], "the future fails with the job's error"
    assert seen["next"] == "the next job ran", "the group's place was given back"
    assert seen["join"] is True, "the queue goes on"
    assert seen["closed"] is True, "and closes"
    [(escaped, thread)] = seen["escaped"]
    assert escaped == kind, "the interruption went on, in the job's own thread"
    assert thread.startswith("ratequeue-job-q")
    assert f"the dead-letter handler raised {kind}" in seen["stderr"], "logged at ERROR"


@pytest.mark.processes
@pytest.mark.parametrize("loop", ["asyncio.run", "same loop"])
@pytest.mark.parametrize("kind", ["SystemExit", "KeyboardInterrupt"])
def test_asyncio_settles_the_job_then_the_interruption_leaves_the_event_loop(kind: str, loop: str) -> None:
    """The interruption leaves ``asyncio.run()``, or ``run_until_complete()`` (the loop then run again)."""
    seen = run_child(_ASYNCIO, kind, loop)
    assert seen["run"] == kind, "asyncio.run() raised the interruption"
    assert seen["future"] == ["ValueError", "the job's own error"], "settled before the loop stopped"
    assert seen["next"] == "the next job ran", "the group's place was given back"
    assert seen["join"] is True
    assert seen["closed"] is True
    assert f"the dead-letter handler raised {kind}" in seen["stderr"], "logged at ERROR"
