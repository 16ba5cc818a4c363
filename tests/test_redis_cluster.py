"""The Redis state on a real Redis Cluster: the contract suite, processes, and a queue's slot moved mid-run.

A cluster of three masters (``tests/redis_cluster.py``) runs for the
session. The contract tests of ``tests/test_contract.py`` (and the fair
queues' of ``tests/test_fairness.py``) are collected here again with this
module's ``backend`` fixture, so every operation is held to the reference on
the cluster too. Then real processes share a queue through
``redis+cluster://``, and while they run the slot holding the queue's key
moves to another master: no two starts closer than the interval, every
acquire answered, no ticket given twice.
"""

from __future__ import annotations

import itertools
import multiprocessing
import queue as queue_module
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis
import redis.asyncio.cluster
import redis.cluster

from ratequeue import Limiter
from ratequeue.core.protocol import US
from ratequeue.state import AsyncState, open_state
from ratequeue.state.base import Clock
from ratequeue.state.redis import AsyncRedisState, RedisState

from . import _workers
from .backends import Backend
from .redis_cluster import Cluster

# the contract suite, collected again here with this module's ``backend`` (the cluster)
from .test_contract import (  # noqa: F401
    test_backend_answers_as_the_reference,
    test_backend_answers_as_the_reference_with_bursts_and_costs,
    test_backend_answers_as_the_reference_with_leases,
    test_max_running_is_fixed_per_queue,
)

# and the fair queues' contract (the script runs them on the cluster as on one server)
from .test_fairness import test_the_states_carry_out_fair_queues_as_the_reference  # noqa: F401

INTERVAL = 0.01
WAIT = 120.0


@dataclass
class ClusterBackend(Backend):
    """The contract table's Redis entry, on the cluster: ready ``RedisCluster`` clients."""

    seed: int = 0

    def open(self, clock: Clock | None = None) -> RedisState:
        client: Any = redis.cluster.RedisCluster(host="127.0.0.1", port=self.seed)
        state = RedisState(client, prefix="test:", clock=clock, url=self.url)
        self._opened.append(state)
        return state

    def open_async(self, clock: Clock | None = None) -> AsyncState:
        client: Any = redis.asyncio.cluster.RedisCluster(host="127.0.0.1", port=self.seed)
        return AsyncRedisState(client, prefix="test:", clock=clock, url=self.url)


@pytest.fixture(scope="module")
def backend(redis_cluster: Cluster) -> Iterator[Backend]:
    made = ClusterBackend("redis-cluster", f"{redis_cluster.url}?prefix=test:", seed=redis_cluster.ports[0])
    yield made
    made.close()


def test_a_cluster_url_opens_a_cluster_state_that_pickles_as_its_url(redis_cluster: Cluster) -> None:
    url = f"{redis_cluster.url}?prefix=urltest:"
    state = open_state(url)
    assert isinstance(state, RedisState)
    assert isinstance(state.client, redis.cluster.RedisCluster)
    assert state.url == url
    limiter = Limiter(url, name="opened", interval=INTERVAL)
    limiter.acquire()
    assert state.names("") == ["opened"]
    assert "cluster 127.0.0.1" in repr(state._where)
    limiter.close()
    state.close()


def test_a_wrong_cluster_url_is_a_clear_error() -> None:
    from ratequeue.errors import StateUnavailable

    with pytest.raises(
        StateUnavailable, match=re.escape("Redis Cluster at redis+cluster://u:***@127.0.0.1:1")
    ):
        open_state("redis+cluster://u:secret@127.0.0.1:1")


def collect(reports: Any, workers: int) -> list[tuple[int, int, int]]:
    """The ``(index, ticket, start_us)`` reports of ``workers`` processes, until each has said it is done."""
    starts: list[tuple[int, int, int]] = []
    done = 0
    deadline = time.monotonic() + WAIT
    while done < workers:
        remaining = deadline - time.monotonic()
        assert remaining > 0, "the workers did not finish in time"
        try:
            index, ticket, value = reports.get(timeout=min(remaining, 1.0))
        except queue_module.Empty:
            continue
        if ticket is None:
            assert not value, f"worker {index} failed: {value}"
            done += 1
        else:
            starts.append((index, ticket, value))
    return starts


@pytest.mark.processes
def test_processes_keep_the_interval_while_the_queue_s_slot_moves(redis_cluster: Cluster) -> None:
    """Four processes, 40 turns each; the slot of the queue's key moves to another master twice mid-run."""
    name = f"moving-{time.monotonic_ns()}"
    url = f"{redis_cluster.url}?prefix=move:"
    key = f"move:{name}"
    with redis_cluster.node(redis_cluster.ports[0]) as node:
        slot = int(node.execute_command("CLUSTER", "KEYSLOT", key))
    ctx = multiprocessing.get_context("spawn")
    reports = ctx.Queue()
    workers = [
        ctx.Process(target=_workers.acquire_many, args=(url, name, INTERVAL, 40, 0.0, index, reports))
        for index in range(4)
    ]
    for process in workers:
        process.start()
    moves: list[int] = []
    mover_error: list[BaseException] = []

    def mover() -> None:
        try:
            for _ in range(2):
                time.sleep(0.4)  # the run is under way (160 turns take 1.6 s)
                owner = redis_cluster.owner(slot)
                target = next(port for port in redis_cluster.ports if port != owner)
                redis_cluster.move_slot(slot, target)
                moves.append(target)
        except BaseException as exc:  # reported below
            mover_error.append(exc)

    thread = threading.Thread(target=mover)
    thread.start()
    starts = collect(reports, len(workers))
    thread.join(WAIT)
    for process in workers:
        process.join(WAIT)
    assert not mover_error, mover_error
    assert len(moves) == 2
    assert redis_cluster.owner(slot) == moves[-1]
    assert len(starts) == 160  # every acquire answered: nothing lost
    tickets = [ticket for _, ticket, _ in starts]
    assert len(set(tickets)) == 160  # no ticket given twice
    times = sorted(start for _, _, start in starts)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert min(gaps) >= INTERVAL * US  # the nodes share this host's clock: gaps compare exactly


@pytest.mark.processes
def test_processes_share_one_rate_on_the_cluster(redis_cluster: Cluster) -> None:
    name = f"steady-{time.monotonic_ns()}"
    url = f"{redis_cluster.url}?prefix=steady:"
    ctx = multiprocessing.get_context("spawn")
    reports = ctx.Queue()
    workers = [
        ctx.Process(target=_workers.acquire_many, args=(url, name, INTERVAL, 25, 0.0, index, reports))
        for index in range(3)
    ]
    for process in workers:
        process.start()
    starts = collect(reports, len(workers))
    for process in workers:
        process.join(WAIT)
    times = sorted(start for _, _, start in starts)
    assert len(times) == 75
    assert min(b - a for a, b in itertools.pairwise(times)) >= INTERVAL * US
    assert len({ticket for _, ticket, _ in starts}) == 75  # (a turn given up for a late wake-up skips one)
