"""Shared test settings: hypothesis profiles, real servers, and the backend table."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from . import servers
from ._env import CI
from .backends import Backend, make_backend
from .redis_cluster import Cluster, cluster, executables

settings.register_profile("dev", max_examples=60, deadline=None)
settings.register_profile("ci", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if CI else "dev"))


@pytest.fixture(autouse=True)
def _private_default_state(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point the per-user default state file into a temporary directory for every test."""
    path = tmp_path_factory.mktemp("default-state") / "state.json"
    monkeypatch.setenv("RATEQUEUE_STATE_FILE", str(path))
    return path


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[servers.Server]:
    """A real redis-server on a free loopback port, for the whole session."""
    yield from servers.redis_server(tmp_path_factory.mktemp("redis"))


@pytest.fixture(scope="session")
def mongodb_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[servers.Server]:
    """A real MongoDB-compatible server (secantusdb) on a free loopback port, for the whole session."""
    yield from servers.mongodb_server(tmp_path_factory.mktemp("mongodb"))


@pytest.fixture(scope="session")
def postgresql_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[servers.Server]:
    """A PostgreSQL cluster of its own (initdb in a temporary directory) on a free loopback port."""
    yield from servers.postgresql_server(tmp_path_factory.mktemp("postgresql"))


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Three Redis masters on loopback, joined in a cluster, for the whole session."""
    found = executables()
    if found is None:
        servers.unavailable(
            "redis-server and redis-cli are needed for the Redis Cluster tests (Debian: redis-server)"
        )
        raise AssertionError("unreachable")
    with cluster(tmp_path_factory.mktemp("redis-cluster"), *found) as made:
        yield made


#: the backends that run on a server the tests start
SERVED = ("redis", "mongodb", "postgresql")


@pytest.fixture(scope="session", params=["memory", "file", "redis", "mongodb", "postgresql"])
def backend(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backend]:
    """Each backend in turn, on a real server where it needs one (the contract table)."""
    kind = str(request.param)
    server = request.getfixturevalue(f"{kind}_server") if kind in SERVED else None
    made = make_backend(kind, tmp_path_factory.mktemp(kind), server)
    yield made
    made.close()


@pytest.fixture(scope="session", params=["file", "redis", "mongodb", "postgresql"])
def shared_backend(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Backend]:
    """Each backend that processes can share (all but memory)."""
    kind = str(request.param)
    server = request.getfixturevalue(f"{kind}_server") if kind in SERVED else None
    made = make_backend(kind, tmp_path_factory.mktemp(kind), server)
    yield made
    made.close()
