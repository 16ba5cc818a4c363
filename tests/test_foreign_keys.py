"""A key under a Redis state's prefix that is not UTF-8, written by another program, on Redis and a cluster.

Every listing still lists: ``State.names()`` (and ``LimiterGroup.keys()``)
give such a key's bad bytes as lone surrogates (``\\xff`` as ``\\udcff``), which
no queue name can hold, and ``ratequeue keys`` and ``ratequeue list`` name it on
stderr, show the others and exit with status 2.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path

import pytest
import redis

import ratequeue
from ratequeue import aio
from ratequeue.errors import ConfigurationError
from ratequeue.state import open_state
from ratequeue.state.redis import RedisState

from .redis_cluster import Cluster
from .servers import Server
from .test_cli import Cli

_prefixes = itertools.count()

#: the group's key another program wrote: not UTF-8, and as ratequeue lists it
FOREIGN, LISTED = b"\xff\xfe", "\udcff\udcfe"


@pytest.fixture(params=["redis", "redis-cluster"])
def url(request: pytest.FixtureRequest) -> str:
    """A state URL with a prefix no other test uses, on one Redis or on a cluster."""
    prefix = f"foreign{next(_prefixes)}:"
    if request.param == "redis":
        server: Server = request.getfixturevalue("redis_server")
        return f"redis://127.0.0.1:{server.port}/0?prefix={prefix}"
    made: Cluster = request.getfixturevalue("redis_cluster")
    return f"{made.url}?prefix={prefix}"


def plant_foreign_key(url: str) -> str:
    """Two keys of group ``grp`` in ratequeue's hands, and a third, not UTF-8, written by another program.

    Returns the state's key prefix.
    """
    with ratequeue.LimiterGroup(url, name="grp", interval=0.001) as group:
        group["a"].acquire()
        group["b"].acquire()
    with open_state(url) as state:
        assert isinstance(state, RedisState)
        prefix = state.key("")
        state.client.hset(prefix.encode() + b"grp:" + FOREIGN, "ticket", 1)
    return prefix


def test_names_and_group_keys_list_a_key_that_is_not_utf8_as_no_name_can_be(url: str) -> None:
    plant_foreign_key(url)
    with open_state(url) as state:
        assert state.names() == ["grp:a", "grp:b", f"grp:{LISTED}"]
        assert state.names("grp:") == ["grp:a", "grp:b", f"grp:{LISTED}"]
        with pytest.raises(ConfigurationError, match="printable characters only"):
            state.read(f"grp:{LISTED}")
    with ratequeue.LimiterGroup(url, name="grp", interval=0.001) as group:
        assert group.keys() == ["a", "b", LISTED]
        with pytest.raises(ConfigurationError, match="printable characters only"):
            group[LISTED].acquire()

    async def listed() -> list[str]:
        async with aio.open_state(url) as state:
            return await state.names("grp:")

    assert asyncio.run(listed()) == ["grp:a", "grp:b", f"grp:{LISTED}"]


def test_a_client_that_decodes_replies_lists_it_too(redis_server: Server) -> None:
    prefix = plant_foreign_key(f"redis://127.0.0.1:{redis_server.port}/0?prefix=foreign{next(_prefixes)}:")
    client = redis.Redis(port=redis_server.port, decode_responses=True)
    with RedisState(client, prefix=prefix) as state:
        assert state.names() == ["grp:a", "grp:b", f"grp:{LISTED}"]


def test_keys_and_list_name_it_on_stderr_show_the_others_and_exit_2(url: str, tmp_path: Path) -> None:
    plant_foreign_key(url)
    cli = Cli(tmp_path)
    escaped = repr(f"grp:{LISTED}")  # 'grp:\udcff\udcfe'
    for command in (["keys", url, "grp:"], ["list", url, "--prefix", "grp:"]):
        result = cli(*command)
        assert result.returncode == 2, result.stdout + result.stderr
        assert "Traceback" not in result.stderr
        assert [line.split()[0] for line in result.stdout.splitlines() if line] in (
            ["grp:a", "grp:b"],
            ["NAME", "grp:a", "grp:b"],
        )
        assert f"holds a record under {escaped}, not a valid queue name" in result.stderr, result.stderr
        report = json.loads(cli(*command, "--json").stdout)
        assert report.get("names", [row["name"] for row in report.get("queues", [])]) == ["grp:a", "grp:b"]
        assert len(report["unreadable"]) == 1
        assert escaped in report["unreadable"][0]
