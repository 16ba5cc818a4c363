"""A standalone Spark cluster on this host, from PySpark's own scripts: a master and workers, each a JVM.

Starting and stopping needs no pytest: :class:`SparkCluster` starts
``org.apache.spark.deploy.master.Master`` on a free port of 127.0.0.1 and
``org.apache.spark.deploy.worker.Worker`` processes registered with it, each
through ``$SPARK_HOME/bin/spark-class`` (the launcher builds the JVM's
command line, with the module options Spark needs on Java 17), where
``SPARK_HOME`` is the installed ``pyspark`` package. Each worker launches an
executor JVM of its own for every application, which starts its own Python
workers: as on a real cluster, but on one host. The web UIs listen on
ports the kernel picks, the master's REST submission server is off, and
every process writes its log into the cluster's directory.

:meth:`SparkCluster.stop` ends each process group (a worker's group holds
the executors it launched and their Python workers).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from .servers import free_port

#: what the master logs when a worker registers with it
REGISTERED = re.compile(r"Master: Registering worker (\S+) with (\d+) cores?")


def spark_home() -> Path | None:
    """The installed ``pyspark`` package's directory, if it holds Spark's scripts and jars."""
    try:
        import pyspark
    except ImportError:
        return None
    home = Path(pyspark.__file__).resolve().parent
    ok = (home / "bin" / "spark-class").is_file() and (home / "jars").is_dir()
    return home if ok else None


def cluster_env(home: Path, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of the cluster's processes and of ``spark-submit``: Spark on loopback.

    A PySpark gateway's variables are dropped, so that ``spark-submit``
    starts its own; the Python workers run this interpreter.
    """
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYSPARK_GATEWAY")}
    env.update(
        SPARK_HOME=str(home),
        SPARK_LOCAL_IP="127.0.0.1",
        SPARK_LOCAL_HOSTNAME="127.0.0.1",
        PYSPARK_PYTHON=sys.executable,
        PYSPARK_DRIVER_PYTHON=sys.executable,
    )
    env.update(extra or {})
    return env


class SparkCluster:
    """One master and ``workers`` workers of ``cores`` cores and ``memory`` each, on 127.0.0.1."""

    def __init__(
        self,
        workdir: Path,
        *,
        workers: int = 2,
        cores: int = 1,
        memory: str = "512m",
        home: Path | None = None,
    ) -> None:
        found = home or spark_home()
        if found is None:
            raise RuntimeError("pyspark, with its bin/spark-class and jars, is not installed")
        self.home = found
        self.workdir = workdir
        self.workers = workers
        self.cores = cores
        self.memory = memory
        self.port = free_port()
        self.processes: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []

    @property
    def master_url(self) -> str:
        return f"spark://127.0.0.1:{self.port}"

    def _launch(self, name: str, args: Sequence[str], env: Mapping[str, str]) -> None:
        log = self.workdir / f"{name}.log"
        self.logs.append(log)
        with log.open("wb") as out:  # a log of this start only: registered() reads it
            process = subprocess.Popen(
                [str(self.home / "bin" / "spark-class"), *args],
                cwd=self.workdir,
                env=cluster_env(self.home, env),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: stop() ends it with what it started
            )
        self.processes.append(process)

    def start(self, timeout: float = 90.0) -> None:
        """Start the master and the workers; return once every worker has registered with the master.

        :raises RuntimeError: a process exited, or the workers did not all register within ``timeout``
            (the processes started are stopped; the message ends with their logs).
        """
        # the daemons' own heap (Spark's default is 1 GB each); no REST submission server
        daemon = {
            "SPARK_DAEMON_MEMORY": "256m",
            "SPARK_MASTER_OPTS": "-Dspark.master.rest.enabled=false",
            "SPARK_DAEMON_JAVA_OPTS": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC",
        }
        try:
            self._launch(
                "master",
                ["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", str(self.port),
                 "--webui-port", "0"],
                daemon,
            )  # fmt: skip
            for number in range(1, self.workers + 1):
                work = self.workdir / f"worker-{number}"
                work.mkdir(exist_ok=True)
                self._launch(
                    f"worker-{number}",
                    ["org.apache.spark.deploy.worker.Worker", self.master_url, "--host", "127.0.0.1",
                     "--cores", str(self.cores), "--memory", self.memory, "--webui-port", "0",
                     "--work-dir", str(work)],
                    daemon,
                )  # fmt: skip
            self._wait_registered(timeout)
        except BaseException:
            self.stop()
            raise

    def registered(self) -> list[str]:
        """The workers the master has registered so far, as ``host:port``, from its log."""
        return REGISTERED.findall(self.logs[0].read_text(errors="replace")) if self.logs else []

    def _wait_registered(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.registered()) < self.workers:
            for process, log in zip(self.processes, self.logs, strict=True):
                if process.poll() is not None:
                    raise RuntimeError(f"{log.stem} exited with {process.returncode}\n{self.log_tails()}")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{len(self.registered())} of {self.workers} workers registered with the master "
                    f"within {timeout:g} s\n{self.log_tails()}"
                )
            time.sleep(0.1)

    def log_tails(self, chars: int = 2000) -> str:
        """The end of every process's log, for an error message."""
        parts = []
        for log in self.logs:
            text = log.read_text(errors="replace") if log.exists() else "(no log)"
            parts.append(f"--- {log}:\n{text[-chars:]}")
        return "\n".join(parts)

    def stop(self) -> None:
        """End every process group started (workers first, with their executors), then wait for them."""
        for process in reversed(self.processes):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
        for process in reversed(self.processes):
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(15)
            # whatever the group still holds (an executor or a Python worker that outlived its parent)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        self.processes.clear()

    def submit(
        self,
        script: Path,
        args: Sequence[str] = (),
        *,
        conf: Mapping[str, str] | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float = 180.0,
    ) -> subprocess.CompletedProcess[str]:
        """``spark-submit --master <this cluster> [--conf k=v ...] script args``; its output, as text."""
        options = [f"--conf={key}={value}" for key, value in (conf or {}).items()]
        command = [
            str(self.home / "bin" / "spark-submit"),
            "--master",
            self.master_url,
            *options,
            str(script),
        ]
        return subprocess.run(
            [*command, *args],
            env=cluster_env(self.home, env),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )


@contextlib.contextmanager
def running_cluster(
    workdir: Path, *, workers: int = 2, cores: int = 1, memory: str = "512m", timeout: float = 90.0
) -> Iterator[SparkCluster]:
    """A started :class:`SparkCluster`, stopped on exit."""
    cluster = SparkCluster(workdir, workers=workers, cores=cores, memory=memory)
    cluster.start(timeout)
    try:
        yield cluster
    finally:
        cluster.stop()
