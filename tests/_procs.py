"""Real worker processes for ``tests/test_processes.py``.

Every worker is a separate OS process started with the ``spawn`` context, so
it shares nothing with the parent but the state file. Each worker talks to the
parent over its own pipe (never a shared ``multiprocessing.Queue``: a queue's
write lock is shared by all writers, so killing one of them with SIGKILL while
it holds that lock would silence all the others). The messages are tuples
whose first item says what they are:

* ``("ready",)`` -- the limiter is built; the worker waits for ``"go"``;
* ``("start", ticket, start_us, returned_us, returned_local, local_start)``
  -- ``acquire`` returned a turn; ``returned_us`` is the host wall clock (the
  file state's clock) and ``returned_local`` ``time.monotonic()`` just after
  it returned;
* ``("paused", at_us, waiting, held_ticket, paused)`` and
  ``("resuming", at_us, waiting, paused)`` -- the answers to the parent's
  ``"pause"`` and ``"resume"`` (workers whose :attr:`Spec.controlled` is set);
* ``("done",)`` -- every job ran; ``("error", traceback)`` -- something raised.

The parent side, :class:`Fleet`, starts the workers, releases them together
and yields their messages; every wait in it, and in the workers, has a
deadline, so a broken run fails instead of hanging.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from ratequeue import Limiter

#: seconds any single wait (for a message, a turn, a thread) may take before
#: the run is declared broken; far above anything a healthy run needs
WAIT = 30.0


def _now_us() -> int:
    """The file state's clock: the host wall clock in whole microseconds."""
    return time.time_ns() // 1000


@dataclass(frozen=True)
class Spec:
    """What one worker process does."""

    #: acquires to make
    jobs: int
    #: threads making them concurrently (each waits in ``acquire`` at once)
    threads: int = 1
    #: whether the parent pauses and resumes this worker's limiter, by sending
    #: ``"pause"`` and then ``"resume"`` over the pipe
    controlled: bool = False
    #: whether the worker reports each turn it gives up, ``("given_up", ticket)``, from the
    #: limiter's events; off where begins are timed, as events cost time between a turn's
    #: check and ``acquire()`` returning (a begin test failed 1 in 4 runs with them on)
    reports_given_up: bool = False


def worker(conn: Connection, url: str, name: str, interval: float, spec: Spec) -> None:
    """The body of a worker process: ``spec.jobs`` acquires on one limiter."""
    send_lock = threading.Lock()

    def send(*message: Any) -> None:
        with send_lock:
            conn.send(message)

    try:
        _work(send, conn, url, name, interval, spec)
    except BaseException:
        send("error", traceback.format_exc())
        raise SystemExit(1) from None
    send("done")


def _expect(conn: Connection, command: str) -> None:
    if not conn.poll(WAIT):
        raise TimeoutError(f"no {command!r} from the parent within {WAIT} s")
    received = conn.recv()
    if received != command:
        raise RuntimeError(f"expected {command!r} from the parent, got {received!r}")


def _work(send: Any, conn: Connection, url: str, name: str, interval: float, spec: Spec) -> None:
    def on_event(event: Any) -> None:
        # a turn given up for a late wake-up or a late answer (G7): its ticket started but is
        # never reported as a start, so the parent counts it between two starts
        if event.kind == "late" and event.outcome == "given_up":
            send("given_up", event.ticket)

    limiter = Limiter(url, name=name, interval=interval, on_event=on_event if spec.reports_given_up else None)
    send("ready")
    _expect(conn, "go")

    todo: queue.SimpleQueue[int] = queue.SimpleQueue()
    for job in range(spec.jobs):
        todo.put(job)
    errors: list[str] = []

    def run() -> None:
        try:
            while True:
                try:
                    todo.get_nowait()
                except queue.Empty:
                    return
                turn = limiter.acquire(timeout=WAIT)
                returned_local = time.monotonic()
                returned_us = _now_us()
                send("start", turn.ticket, turn.start_us, returned_us, returned_local, turn.local_start)
        except BaseException:
            errors.append(traceback.format_exc())

    threads = [threading.Thread(target=run, daemon=True) for _ in range(spec.threads)]
    for thread in threads:
        thread.start()

    if spec.controlled:
        _expect(conn, "pause")
        limiter.pause()
        paused_us = _now_us()
        status = limiter.status()
        send("paused", paused_us, status.waiting, status.held_ticket, status.paused)
        _expect(conn, "resume")
        status = limiter.status()
        send("resuming", _now_us(), status.waiting, status.paused)
        limiter.resume()

    deadline = time.monotonic() + WAIT
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    if any(thread.is_alive() for thread in threads):
        raise TimeoutError(f"the acquiring threads did not finish within {WAIT} s")
    if errors:
        raise RuntimeError(errors[0])
    limiter.close()


@dataclass(frozen=True)
class Start:
    """One turn a worker reported."""

    index: int
    ticket: int
    start_us: int
    returned_us: int
    returned_local: float
    local_start: float


@dataclass
class Fleet:
    """Worker processes sharing one queue, and their messages."""

    url: str
    name: str
    interval: float
    specs: list[Spec]
    processes: list[Any] = field(default_factory=list)
    conns: list[Connection] = field(default_factory=list)

    def start(self) -> None:
        """Start every worker, wait until each has built its limiter, then release them together."""
        context = multiprocessing.get_context("spawn")
        for spec in self.specs:
            mine, theirs = context.Pipe(duplex=True)
            process = context.Process(
                target=worker, args=(theirs, self.url, self.name, self.interval, spec), daemon=True
            )
            process.start()
            theirs.close()  # so that our end sees EOF when the worker dies
            self.processes.append(process)
            self.conns.append(mine)
        for index, conn in enumerate(self.conns):
            if not conn.poll(WAIT):
                raise AssertionError(f"worker {index} not ready within {WAIT} s")
            message = conn.recv()
            assert message == ("ready",), f"worker {index}: {message}"
        for conn in self.conns:
            conn.send("go")

    def messages(
        self, timeout: float = WAIT, tick: float | None = None
    ) -> Iterator[tuple[int | None, tuple[Any, ...]]]:
        """Yield ``(worker index, message)`` until every worker has closed its pipe.

        A worker that exits (or is killed) yields ``(index, ("eof",))`` once.
        With ``tick``, ``(None, ("tick",))`` comes whenever ``tick`` seconds
        pass without a message. Raises ``AssertionError`` if no message comes
        for ``timeout`` seconds.
        """
        open_conns = {conn: index for index, conn in enumerate(self.conns)}
        silent_since = time.monotonic()
        while open_conns:
            left = silent_since + timeout - time.monotonic()
            ready = wait(list(open_conns), max(0.0, left if tick is None else min(left, tick)))
            if not ready:
                if time.monotonic() - silent_since >= timeout:
                    waiting_for = sorted(open_conns.values())
                    raise AssertionError(f"no message from workers {waiting_for} within {timeout} s")
                yield None, ("tick",)
                continue
            silent_since = time.monotonic()
            for conn in ready:
                assert isinstance(conn, Connection)
                index = open_conns[conn]
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    del open_conns[conn]
                    yield index, ("eof",)
                    continue
                yield index, message

    def send(self, index: int, command: str) -> None:
        """Send ``command`` to worker ``index``."""
        self.conns[index].send(command)

    def kill(self, index: int) -> None:
        """SIGKILL worker ``index`` and reap it."""
        process = self.processes[index]
        os.kill(process.pid, signal.SIGKILL)
        process.join(WAIT)
        assert process.exitcode == -signal.SIGKILL, process.exitcode

    def join(self) -> list[int | None]:
        """Wait for every worker to exit; return their exit codes."""
        deadline = time.monotonic() + WAIT
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        return [process.exitcode for process in self.processes]

    def close(self) -> None:
        """Kill whatever is still running (a failed test) and release the pipes."""
        for process in self.processes:
            if process.is_alive():
                os.kill(process.pid, signal.SIGKILL)
            process.join(WAIT)
        for conn in self.conns:
            conn.close()


def busy_loop(seconds: float) -> None:
    """Burn one core for ``seconds`` (a stand-in for the other work on a busy host)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        pass


@dataclass
class Hogs:
    """``count`` busy-loop processes keeping the host's cores busy while a test runs."""

    count: int
    processes: list[Any] = field(default_factory=list)

    def __enter__(self) -> Hogs:
        context = multiprocessing.get_context("spawn")
        for _ in range(self.count):
            process = context.Process(target=busy_loop, args=(WAIT,), daemon=True)
            process.start()
            self.processes.append(process)
        return self

    def __exit__(self, *exc: object) -> None:
        for process in self.processes:
            if process.is_alive():
                os.kill(process.pid, signal.SIGKILL)
            process.join(WAIT)
