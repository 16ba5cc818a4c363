"""Real servers for the tests, started on free loopback ports (no mocks).

``redis-server`` comes from PATH (Debian: ``apt-get install redis-server``);
the MongoDB-compatible server is secantusdb's ``secantusd-py`` (``pip install
secantusdb==0.7.0b3``). When one is missing or cannot start, the tests that
need it fail under CI and are skipped locally with a message saying how to
get it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ._env import CI


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def unavailable(message: str) -> None:
    """Fail under CI, skip locally."""
    if CI:
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


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

    def start(self) -> None:
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                self.command, cwd=self.workdir, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        wait_for_port(self.port, self.process, self.log)

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


def redis_server(workdir: Path) -> Iterator[Server]:
    executable = shutil.which("redis-server")
    if executable is None:
        unavailable(
            "redis-server is not on PATH: apt-get install redis-server (Debian) to run the Redis tests"
        )
    port = free_port()
    # Append-only, so that a restart (SIGTERM: a clean shutdown that flushes the file) keeps the
    # records (the restart test). fsync once a second, Redis's default: with "always" every reply
    # waits for a disk sync after the script read the clock, and shards, which bound the state
    # clock's offset by each answer's delay, convert starts milliseconds late (docs/backends.md).
    command = [
        str(executable), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
        "--appendonly", "yes", "--appendfsync", "everysec", "--dir", str(workdir),
    ]  # fmt: skip
    yield from serve(Server("redis", command, port, workdir), "redis-server")


def mongodb_server(workdir: Path) -> Iterator[Server]:
    candidates = [shutil.which("secantusd-py"), str(Path(sys.executable).parent / "secantusd-py")]
    executable = next((c for c in candidates if c and os.access(c, os.X_OK)), None)
    if executable is None:
        unavailable("secantusd-py is missing: pip install 'secantusdb==0.7.0b3' to run the MongoDB tests")
    port = free_port()
    command = [str(executable), "--host", "127.0.0.1", "--port", str(port), "--storage-path", ":memory:"]
    yield from serve(Server("mongodb", command, port, workdir), "secantusd-py")


def serve(server: Server, program: str) -> Iterator[Server]:
    """Start ``server``, yield it, stop it; a start that fails is ``unavailable``."""
    try:
        server.start()
    except (OSError, RuntimeError) as exc:
        unavailable(f"{program} could not start: {exc}")
    try:
        yield server
    finally:
        server.stop()
