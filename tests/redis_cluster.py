"""A real Redis Cluster for the tests: three masters on loopback, no replicas, started and stopped here.

Each node is a ``redis-server --cluster-enabled yes`` on a free port at most
55535 (its cluster bus listens on the port + 10000); ``redis-cli --cluster
create`` joins them and hands out the 16384 slots. :func:`move_slot` moves
one slot, with its keys, from the master holding it to another, the way
``redis-cli --cluster reshard`` does (SETSLOT IMPORTING / MIGRATING,
MIGRATE, SETSLOT NODE), so a test can move a queue's key mid-run.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import redis

from .servers import Server, running

#: the highest port a node may have: its cluster bus is the port + 10000
HIGHEST_PORT = 55535
#: how long (s) the cluster may take to form, or a slot to move
WAIT = 60.0


def _is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def cluster_ports(count: int) -> list[int]:
    """``count`` ports at most :data:`HIGHEST_PORT` that are free, each with its bus port free too."""
    ports: list[int] = []
    candidate = 30000 + (time.monotonic_ns() // 1000) % 20000
    while len(ports) < count:
        candidate = 30000 + (candidate - 30000 + 7) % (HIGHEST_PORT - 30000)
        if _is_free(candidate) and _is_free(candidate + 10000) and candidate not in ports:
            ports.append(candidate)
    return ports


def executables() -> tuple[str, str] | None:
    """``redis-server`` and ``redis-cli`` from PATH, if both are there."""
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    return (server, cli) if server and cli else None


@dataclass
class Cluster:
    """The running nodes of a test cluster."""

    ports: list[int]
    cli: str

    @property
    def url(self) -> str:
        """A ``redis+cluster://`` URL with the first node as its seed."""
        return f"redis+cluster://127.0.0.1:{self.ports[0]}"

    def node(self, port: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=port, decode_responses=True)

    def masters(self) -> list[int]:
        """The ports of the masters, as the first node sees them."""
        with self.node(self.ports[0]) as node:
            return sorted({int(master[1]) for _, _, master, *_ in node.execute_command("CLUSTER", "SLOTS")})

    def replica_of(self, master_port: int) -> int:
        """The port of a replica of the master on ``master_port`` (as the master itself says)."""
        with self.node(master_port) as node:
            first = node.info("replication").get("slave0")
        if not first:
            raise AssertionError(f"the master on {master_port} has no replica")
        port = (
            first["port"]
            if isinstance(first, dict)
            else dict(p.split("=") for p in str(first).split(","))["port"]
        )
        return int(port)

    def replicas_online(self, per_master: int) -> bool:
        """Whether every master has ``per_master`` replicas that finished their first sync."""
        if not per_master:
            return True
        for port in self.ports:
            with self.node(port) as node:
                info = node.info("replication")
            if (
                info.get("role") == "master"
                and sum("online" in str(info.get(f"slave{i}", "")) for i in range(per_master)) < per_master
            ):
                return False
        return True

    def owner(self, slot: int) -> int:
        """The port of the master holding ``slot``, as the first node sees it."""
        with self.node(self.ports[0]) as node:
            for start, end, master, *_ in node.execute_command("CLUSTER", "SLOTS"):
                if int(start) <= slot <= int(end):
                    return int(master[1])
        raise AssertionError(f"no master holds slot {slot}")

    def move_slot(self, slot: int, to_port: int) -> None:
        """Move ``slot`` and its keys to the master on ``to_port`` (what ``--cluster reshard`` does)."""
        from_port = self.owner(slot)
        if from_port == to_port:
            return
        with self.node(from_port) as source, self.node(to_port) as target:
            source_id = source.execute_command("CLUSTER", "MYID")
            target_id = target.execute_command("CLUSTER", "MYID")
            target.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
            source.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
            while keys := source.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100):
                source.execute_command("MIGRATE", "127.0.0.1", to_port, "", 0, 5000, "KEYS", *keys)
            for port in self.masters():  # (a replica refuses SETSLOT: it follows its master)
                with self.node(port) as node:
                    node.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
        deadline = time.monotonic() + WAIT
        while any(self._owner_seen_by(port, slot) != to_port for port in self.ports):
            assert time.monotonic() < deadline, f"slot {slot} did not move to {to_port}"
            time.sleep(0.05)

    def _owner_seen_by(self, port: int, slot: int) -> int | None:
        with self.node(port) as node:
            for start, end, master, *_ in node.execute_command("CLUSTER", "SLOTS"):
                if int(start) <= slot <= int(end):
                    return int(master[1])
        return None


@contextlib.contextmanager
def cluster(workdir: Path, server: str, cli: str, masters: int = 3, replicas: int = 0) -> Iterator[Cluster]:
    """Start ``masters`` cluster nodes (and ``replicas`` per master) in ``workdir``, join them, stop them."""
    ports = cluster_ports(masters * (1 + replicas))
    with contextlib.ExitStack() as stack:
        for port in ports:
            directory = workdir / f"node-{port}"
            directory.mkdir()
            command = [
                server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", "5000", "--dir", str(directory),
            ]  # fmt: skip
            stack.enter_context(running(Server(f"redis-cluster-{port}", command, port, directory)))
        created = subprocess.run(
            [cli, "--cluster", "create", *(f"127.0.0.1:{port}" for port in ports), "--cluster-replicas",
             str(replicas), "--cluster-yes"],
            capture_output=True, text=True, timeout=WAIT, check=False,
        )  # fmt: skip
        assert created.returncode == 0, created.stdout + created.stderr
        made = Cluster(ports, cli)
        deadline = time.monotonic() + WAIT
        while not all(_ok(made, port) for port in ports) or not made.replicas_online(replicas):
            assert time.monotonic() < deadline, "the cluster did not reach cluster_state:ok"
            time.sleep(0.05)
        yield made


def _ok(made: Cluster, port: int) -> bool:
    with made.node(port) as node:
        info = node.execute_command("CLUSTER", "INFO")
    text = info if isinstance(info, str) else str(info)
    return "cluster_state:ok" in text and "cluster_slots_assigned:16384" in text
