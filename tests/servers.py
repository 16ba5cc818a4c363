"""Real servers on free loopback ports (no mocks), for the tests and the benchmarks.

``redis-server`` comes from PATH (Debian: ``apt-get install redis-server``);
the MongoDB-compatible server is secantusdb's ``secantusd-py`` (``pip install
secantusdb==0.7.0b3``); PostgreSQL is Debian's (``apt-get install postgresql``:
``initdb`` and ``postgres`` from ``pg_config --bindir`` or
``/usr/lib/postgresql/*/bin``), run in a temporary cluster of its own on a free
port, never the machine's own server.

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

    def __init__(
        self, name: str, command: list[str], port: int, workdir: Path, *, stop_signal: int = signal.SIGTERM
    ) -> None:
        self.name = name
        #: what stops the server (PostgreSQL: SIGINT, a fast shutdown; SIGTERM waits for every client)
        self.stop_signal = stop_signal
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
            os.killpg(self.process.pid, self.stop_signal)
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


def postgresql_bindir() -> Path | None:
    """The directory of Debian's PostgreSQL server programs (``initdb``, ``postgres``), if installed."""
    candidates: list[Path] = []
    pg_config = shutil.which("pg_config")
    if pg_config:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                [pg_config, "--bindir"], capture_output=True, text=True, timeout=10, check=True
            )
            candidates.append(Path(out.stdout.strip()))
    versions = sorted(
        Path("/usr/lib/postgresql").glob("*/bin"),
        key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0,
        reverse=True,
    )
    candidates += versions
    initdb = shutil.which("initdb")
    if initdb:
        candidates.append(Path(initdb).resolve().parent)
    return next((c for c in candidates if (c / "initdb").is_file() and (c / "postgres").is_file()), None)


def as_postgres_user(command: list[str]) -> list[str]:
    """``command`` run as the ``postgres`` user when this process is root (initdb refuses root)."""
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        return ["runuser", "-u", "postgres", "--", *command]
    return command


def postgresql_cluster(bindir: Path, port: int) -> tuple[Path, list[str]]:
    """A new cluster (initdb, trust auth) in a temporary directory, and the command serving it on ``port``.

    The directory is created under the system's temporary directory (the
    ``postgres`` user, when running as root, could not reach pytest's, which
    only root may enter) and handed to that user. The server listens on
    127.0.0.1:``port`` and on a unix socket in the directory; it syncs nothing
    to disk (a test cluster is thrown away).
    """
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="ratequeue-pg-"))
    data, sockets = root / "data", root / "sockets"
    sockets.mkdir()
    if os.geteuid() == 0:
        import pwd

        user = pwd.getpwnam("postgres")
        for path in (root, sockets):
            os.chown(path, user.pw_uid, user.pw_gid)
    subprocess.run(
        as_postgres_user(
            [str(bindir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres", "-E", "UTF8",
             "--locale=C", "--no-sync"]
        ),
        check=True, capture_output=True, timeout=120, cwd=root,
    )  # fmt: skip
    command = as_postgres_user(
        [str(bindir / "postgres"), "-D", str(data), "-p", str(port), "-h", "127.0.0.1", "-k", str(sockets),
         "-c", "fsync=off", "-c", "full_page_writes=off", "-c", "max_connections=200",
         "-c", "shared_buffers=32MB"]
    )  # fmt: skip
    return root, command


class PostgresServer(Server):
    """A ``postgres`` that counts as started once it answers queries, and stops with a fast shutdown."""

    def __init__(self, command: list[str], port: int, workdir: Path) -> None:
        super().__init__("postgresql", command, port, workdir, stop_signal=signal.SIGINT)

    def start(self, timeout: float = 30.0) -> None:
        super().start(timeout)
        wait_for_postgresql(self.port, timeout)

    @property
    def url(self) -> str:
        """The URL of the cluster's ``postgres`` database, as its superuser (trust: no password)."""
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"


def wait_for_postgresql(port: int, timeout: float = 30.0) -> None:
    """Wait until the server on ``port`` answers queries (it listens before it is ready)."""
    import psycopg

    deadline = time.monotonic() + timeout
    while True:
        try:
            with psycopg.connect(f"postgresql://postgres@127.0.0.1:{port}/postgres", connect_timeout=2):
                return
        except psycopg.OperationalError as exc:
            if time.monotonic() > deadline:
                raise RuntimeError(f"postgres did not answer on port {port}: {exc}") from exc
            time.sleep(0.05)


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


def postgresql_server(workdir: Path) -> Iterator[Server]:
    """A PostgreSQL cluster of its own (initdb in a temporary directory) on a free loopback port.

    ``workdir`` holds the server's log. Never the machine's own server on 5432.
    """
    bindir = postgresql_bindir()
    if bindir is None:
        unavailable(
            "PostgreSQL's initdb is missing: apt-get install postgresql (Debian) to run the PostgreSQL tests"
        )
    assert bindir is not None
    port = free_port()
    try:
        root, command = postgresql_cluster(bindir, port)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        unavailable(f"initdb failed: {exc} {detail.decode(errors='replace')[-2000:]}")
        raise
    try:
        yield from serve(PostgresServer(command, port, workdir), "postgres")
    finally:
        shutil.rmtree(root, ignore_errors=True)


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
