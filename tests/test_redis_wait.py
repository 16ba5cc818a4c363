"""``?wait=N``: each write waits until N replicas have it (Redis WAIT), so a failover loses no start.

A master and one replica (``redis-server --replicaof``) run for this module.
With ``wait=1`` a start the limiter returns is on the replica already; with
``wait=2`` (one replica too few) a write is answered after the timeout,
with a warning saying why: made on the master, it stands. Without ``wait``
nothing changes.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from ratequeue import Limiter, aio
from ratequeue.errors import ConfigurationError
from ratequeue.state import open_state

from .ops import do
from .redis_cluster import Cluster, cluster, executables
from .servers import Server, free_port, redis_command, redis_executable, running, unavailable

WAIT = 30.0


@pytest.fixture(scope="module")
def master_and_replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, int]]:
    executable = redis_executable()
    if executable is None:
        unavailable("redis-server is not on PATH (Debian: apt-get install redis-server)")
        raise AssertionError("unreachable")
    workdir: Path = tmp_path_factory.mktemp("redis-replication")
    master_port, replica_port = free_port(), free_port()
    master_dir, replica_dir = workdir / "master", workdir / "replica"
    master_dir.mkdir()
    replica_dir.mkdir()
    master = Server(
        "master",
        redis_command(executable, master_port, master_dir, append_only=False),
        master_port,
        master_dir,
    )
    replica_command = [
        *redis_command(executable, replica_port, replica_dir, append_only=False),
        "--replicaof", "127.0.0.1", str(master_port),
    ]  # fmt: skip
    replica = Server("replica", replica_command, replica_port, replica_dir)
    with running(master), running(replica):
        deadline = time.monotonic() + WAIT
        with redis.Redis(port=master_port) as client:
            while "online" not in str(client.info("replication").get("slave0", "")):
                assert time.monotonic() < deadline, "the replica never came online"
                time.sleep(0.05)  # until its first full sync is done: only then does it acknowledge
        yield master_port, replica_port


def test_a_start_is_on_the_replica_when_acquire_returns(master_and_replica: tuple[int, int]) -> None:
    master_port, replica_port = master_and_replica
    url = f"redis://127.0.0.1:{master_port}/0?prefix=wait:&wait=1&wait_timeout=2000"
    limiter = Limiter(url, name="replicated", interval=0.001)
    with redis.Redis(port=replica_port, decode_responses=True) as replica:
        for _ in range(20):
            turn = limiter.acquire()
            # read at once, no waiting: WAIT returned only once the replica had the write
            assert int(replica.hget("wait:replicated", "pos") or 0) == turn.ticket
    limiter.close()


def test_asyncio_waits_for_the_replica_too(master_and_replica: tuple[int, int]) -> None:
    master_port, replica_port = master_and_replica
    url = f"redis://127.0.0.1:{master_port}/0?prefix=wait:&wait=1"

    async def main() -> list[tuple[int, int]]:
        limiter = aio.Limiter(url, name="replicated-aio", interval=0.001)
        seen = []
        with redis.Redis(port=replica_port, decode_responses=True) as replica:
            for _ in range(10):
                turn = await limiter.acquire()
                seen.append((turn.ticket, int(replica.hget("wait:replicated-aio", "pos") or 0)))
        await limiter.close()
        return seen

    assert all(ticket == on_replica for ticket, on_replica in asyncio.run(main()))


def test_too_few_replicas_are_reported_after_the_timeout_and_the_write_stands(
    master_and_replica: tuple[int, int], caplog: pytest.LogCaptureFixture
) -> None:
    """wait=2 with one replica: after the timeout a warning says so; the write, made, is answered."""
    master_port, _ = master_and_replica
    url = f"redis://127.0.0.1:{master_port}/0?prefix=wait:&wait=2&wait_timeout=100"
    state = open_state(url)
    began = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="ratequeue"):
        taken = do(state, "take", "too-few", 1000)
    assert time.monotonic() - began >= 0.1
    assert taken.ticket == 1
    assert "a write reached 1 of 2 replicas within 100 ms" in caplog.text
    assert state.read("too-few").record is not None  # the write stands
    state.close()


def test_a_client_with_wait_pickles_as_a_url_with_it(master_and_replica: tuple[int, int]) -> None:
    from ratequeue.state.redis import RedisState

    master_port, _ = master_and_replica
    state = RedisState(redis.Redis(port=master_port), prefix="wait:", wait=1, wait_timeout_ms=300)
    assert "wait=1" in state.url
    assert "wait_timeout=300" in state.url
    state.close()


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("redis://127.0.0.1:1/0?wait=-1", "option wait must be a whole number from 0 to 1000"),
        ("redis://127.0.0.1:1/0?wait=x", "option wait must be a whole number from 0 to 1000"),
        (
            "redis://127.0.0.1:1/0?wait=1&wait_timeout=0",
            "option wait_timeout must be a whole number from 1 to 5000",
        ),
        (
            "redis://127.0.0.1:1/0?wait=1&wait_timeout=6000",
            "option wait_timeout must be a whole number from 1 to 5000",
        ),
    ],
)
def test_bad_wait_options_are_refused(url: str, words: str) -> None:
    with pytest.raises(ConfigurationError, match=words):
        open_state(url)


# On a Redis Cluster: three masters with a replica each.


@pytest.fixture(scope="module")
def replicated_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    found = executables()
    if found is None:
        unavailable("the Redis Cluster tests need redis-server and redis-cli (Debian: redis-server)")
        raise AssertionError("unreachable")
    with cluster(tmp_path_factory.mktemp("redis-cluster-replicas"), *found, masters=3, replicas=1) as made:
        yield made


def test_on_a_cluster_a_start_is_on_the_replica_of_its_master(replicated_cluster: Cluster) -> None:
    url = f"{replicated_cluster.url}?prefix=cwait:&wait=1&wait_timeout=2000"
    name = "replicated"
    with replicated_cluster.node(replicated_cluster.ports[0]) as node:
        slot = int(node.execute_command("CLUSTER", "KEYSLOT", f"cwait:{name}"))
    replica_port = replicated_cluster.replica_of(replicated_cluster.owner(slot))
    limiter = Limiter(url, name=name, interval=0.001)
    with replicated_cluster.node(replica_port) as replica:
        replica.execute_command("READONLY")  # a replica answers reads of its master's slots
        for _ in range(10):
            turn = limiter.acquire()
            assert int(replica.hget(f"cwait:{name}", "pos") or 0) == turn.ticket
    limiter.close()


def test_on_a_cluster_writes_wait_through_a_moving_slot(replicated_cluster: Cluster) -> None:
    """The slot moves to another master twice while a limiter acquires: MOVED and ASK are followed."""
    url = f"{replicated_cluster.url}?prefix=cwait:&wait=1&wait_timeout=2000"
    name = f"moving-{time.monotonic_ns()}"
    with replicated_cluster.node(replicated_cluster.ports[0]) as node:
        slot = int(node.execute_command("CLUSTER", "KEYSLOT", f"cwait:{name}"))
    limiter = Limiter(url, name=name, interval=0.002)
    starts: list[int] = []
    errors: list[BaseException] = []

    def acquire_all() -> None:
        try:
            for _ in range(300):
                starts.append(limiter.acquire(timeout=WAIT).start_us)
        except BaseException as exc:  # reported below
            errors.append(exc)

    worker = threading.Thread(target=acquire_all)
    worker.start()
    moved = []
    for _ in range(2):
        time.sleep(0.2)
        owner = replicated_cluster.owner(slot)
        target = next(port for port in replicated_cluster.masters() if port != owner)
        replicated_cluster.move_slot(slot, target)
        moved.append(target)
    worker.join(WAIT)
    limiter.close()
    assert not errors, errors
    assert replicated_cluster.owner(slot) == moved[-1]
    assert len(starts) == 300
    assert min(b - a for a, b in itertools.pairwise(sorted(starts))) >= 2000


def test_asyncio_on_a_cluster_waits_too(replicated_cluster: Cluster) -> None:
    url = f"{replicated_cluster.url}?prefix=cwait:&wait=1"

    async def main() -> int:
        limiter = aio.Limiter(url, name="replicated-aio", interval=0.001)
        for _ in range(5):
            turn = await limiter.acquire()
        await limiter.close()
        return turn.ticket

    assert asyncio.run(main()) == 5
