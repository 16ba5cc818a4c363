"""Real servers on free loopback ports (no mocks), for the tests and the benchmarks.

``redis-server`` comes from PATH (Debian: ``apt-get install redis-server``);
the MongoDB-compatible server is secantusdb's ``secantusd-py`` (``pip install
secantusdb==0.7.0b3``).

Starting and stopping a server needs no pytest (:class:`Server`,
:func:`running`, the executables and commands below): ``bench/_common.py``
starts the benchmarks' servers with them. The tests' servers
(:func:`redis_server`, :func:`mongodb_server`, :func:`serve`) add what a
test run needs: when one is missing or cannot start, the tests that need it
fail under CI and are skipped locally with a message saying how to get it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from ._env import CI

# --------------------------------------------------------------------------- starting and stopping


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for_port(port: int, process: subprocess.Popen[bytes], log: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}: {log.read_text()[-2000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.02)
    raise RuntimeError(f"server did not listen on port {port} within {timeout} s: {log.read_text()[-2000:]}")


class Server:
    """A server process on a fixed loopback port that can be stopped and started again."""

    def __init__(self, name: str, command: list[str], port: int, workdir: Path) -> None:
        self.name = name
        self.command = command
        self.port = port
        self.workdir = workdir
        self.log = workdir / f"{name}.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> None:
        """Start the process and wait up to ``timeout`` seconds for its port to accept connections."""
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                self.command, cwd=self.workdir, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        wait_for_port(self.port, self.process, self.log, timeout)

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(15)
        self.process = None

    def restart(self) -> None:
        self.stop()
        self.start()


@contextlib.contextmanager
def running(server: Server, timeout: float = 30.0) -> Iterator[Server]:
    """Start ``server``, yield it, stop it; also stopped when it fails to start (the error propagates)."""
    try:
        server.start(timeout)
        yield server
    finally:
        server.stop()


def redis_executable() -> str | None:
    """``redis-server`` from PATH, if there is one."""
    return shutil.which("redis-server")


def redis_command(executable: str, port: int, workdir: Path, *, append_only: bool = True) -> list[str]:
    """A ``redis-server`` on ``127.0.0.1:port`` that saves no snapshots.

    ``append_only``: keep an append-only file in ``workdir``, so that a restart
    (SIGTERM: a clean shutdown that flushes the file) keeps the records (the
    restart test). It is synced once a second, Redis's default: with "always"
    every reply waits for a disk sync after the script read the clock, and
    shards, which bound the state clock's offset by each answer's delay,
    convert starts milliseconds late (docs/backends.md). Without it the server
    keeps nothing on disk.
    """
    persistence = (
        ["--appendonly", "yes", "--appendfsync", "everysec"] if append_only else ["--appendonly", "no"]
    )
    return [
        executable, "--port", str(port), "--bind", "127.0.0.1", "--save", "", *persistence,
        "--dir", str(workdir),
    ]  # fmt: skip


def mongodb_executable() -> str | None:
    """secantusdb's ``secantusd-py``, from PATH or beside this Python, if installed."""
    candidates = [shutil.which("secantusd-py"), str(Path(sys.executable).parent / "secantusd-py")]
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


def mongodb_command(executable: str, port: int) -> list[str]:
    """A ``secantusd-py`` on ``127.0.0.1:port`` that keeps its data in memory."""
    return [executable, "--host", "127.0.0.1", "--port", str(port), "--storage-path", ":memory:"]


# --------------------------------------------------------------------------- the tests' servers


def unavailable(message: str) -> None:
    """Fail under CI, skip locally."""
    import pytest

    if CI:
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def redis_server(workdir: Path) -> Iterator[Server]:
    executable = redis_executable()
    if executable is None:
        unavailable(
            "redis-server is not on PATH: apt-get install redis-server (Debian) to run the Redis tests"
        )
    port = free_port()
    yield from serve(
        Server("redis", redis_command(str(executable), port, workdir), port, workdir), "redis-server"
    )


def mongodb_server(workdir: Path) -> Iterator[Server]:
    executable = mongodb_executable()
    if executable is None:
        unavailable("secantusd-py is missing: pip install 'secantusdb==0.7.0b3' to run the MongoDB tests")
    port = free_port()
    yield from serve(Server("mongodb", mongodb_command(str(executable), port), port, workdir), "secantusd-py")


def serve(server: Server, program: str) -> Iterator[Server]:
    """Start ``server``, yield it, stop it; a start that fails is ``unavailable``."""
    try:
        server.start()
    except (OSError, RuntimeError) as exc:
        server.stop()  # a process that runs but never listened
        unavailable(f"{program} could not start: {exc}")
    try:
        yield server
    finally:
        server.stop()
