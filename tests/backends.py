"""The one table of backends the contract and multi-process tests run against."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
import redis.asyncio
from hypothesis import given, settings
from pymongo import AsyncMongoClient, MongoClient

from ratequeue.state import AsyncState, State, ThreadedState
from ratequeue.state.base import Clock
from ratequeue.state.file import FileState
from ratequeue.state.memory import MemoryState
from ratequeue.state.mongodb import AsyncMongoState, MongoState
from ratequeue.state.postgresql import AsyncPostgresState, PostgresState
from ratequeue.state.redis import AsyncRedisState, RedisState

from .servers import Server

_names = itertools.count()

#: the table the PostgreSQL backend's tests keep their queues in
PG_TABLE = "ratequeue_test"


def given_for_backend(**strategies: Any) -> Callable[[Callable[..., None]], Callable[[Backend], None]]:
    """``@given(**strategies)`` for a test of the ``backend`` fixture, run with :func:`examples_for` it.

    The test takes ``backend``, then the values drawn; each backend's run is
    a property test of its own, with that backend's number of examples.
    """

    def decorate(test: Callable[..., None]) -> Callable[[Backend], None]:
        def run(backend: Backend) -> None:
            def drawn(**values: Any) -> None:
                test(backend, **values)

            examples_for(backend)(given(**strategies)(drawn))()

        run.__name__, run.__qualname__, run.__doc__ = test.__name__, test.__qualname__, test.__doc__
        run.__module__ = test.__module__
        return run

    return decorate


def examples_for(backend: Backend) -> settings:
    """The settings of a property test against ``backend``: on MongoDB's stand-in, a third of the examples.

    secantusdb evaluates each update pipeline in Python, 13-35 ms: at CI's 300
    examples its runs of the contract suite took over two of CI's 30 minutes.
    A third (100) still drives every operation on MongoDB; the other backends
    run them all.
    """
    examples = settings.default.max_examples
    return settings(max_examples=max(1, examples // 3) if backend.kind == "mongodb" else examples)


@dataclass
class Backend:
    """How to open one kind of state, fresh for each test."""

    kind: str
    url: str
    server: Server | None = None
    _opened: list[State] = field(default_factory=list)
    _clocked: tuple[State, list[int]] | None = None

    def open(self, clock: Clock | None = None) -> State:
        """A new state object on this backend; ``clock`` fixes its ``now`` (tests only)."""
        state: State
        if self.kind == "memory":
            state = MemoryState("contract", clock=clock)
        elif self.kind == "file":
            state = FileState(self.url.removeprefix("file://"), clock=clock)
        elif self.kind == "redis":
            client = redis.Redis(host="127.0.0.1", port=self.server.port)  # type: ignore[union-attr]
            state = RedisState(client, prefix="test:", clock=clock, url=self.url)
        elif self.kind == "postgresql":
            state = PostgresState(conninfo=self.conninfo, table=PG_TABLE, clock=clock, url=self.url)
        else:
            mongo: MongoClient[Any] = MongoClient(f"mongodb://127.0.0.1:{self.server.port}")  # type: ignore[union-attr]
            state = MongoState(mongo, database="ratequeue_test", clock=clock, url=self.url)
        self._opened.append(state)
        return state

    def open_async(self, clock: Clock | None = None) -> AsyncState:
        """A new asyncio state on this backend (call inside the event loop that will use it)."""
        if self.kind in ("memory", "file"):
            return ThreadedState(self.open(clock))
        if self.kind == "redis":
            client = redis.asyncio.Redis(host="127.0.0.1", port=self.server.port)  # type: ignore[union-attr]
            return AsyncRedisState(client, prefix="test:", clock=clock, url=self.url)
        if self.kind == "postgresql":
            return AsyncPostgresState(conninfo=self.conninfo, table=PG_TABLE, clock=clock, url=self.url)
        mongo: AsyncMongoClient[Any] = AsyncMongoClient(f"mongodb://127.0.0.1:{self.server.port}")  # type: ignore[union-attr]
        return AsyncMongoState(mongo, database="ratequeue_test", clock=clock, url=self.url)

    @property
    def conninfo(self) -> str:
        """The PostgreSQL server's URL, less ratequeue's options."""
        assert self.server is not None
        return f"postgresql://postgres@127.0.0.1:{self.server.port}/postgres"

    def clocked(self) -> tuple[State, list[int]]:
        """A state whose ``now`` is ``holder[0]``, set by the test (one per backend and session)."""
        if self._clocked is None:
            holder = [0]
            self._clocked = (self.open(clock=lambda: holder[0]), holder)
        return self._clocked

    def fresh_name(self) -> str:
        """A queue name no other test has used on this backend."""
        return f"q{next(_names)}"

    def close(self) -> None:
        for state in self._opened:
            state.close()


def make_backend(kind: str, workdir: Path, server: Server | None) -> Backend:
    if kind == "memory":
        return Backend(kind, "memory://contract")
    if kind == "file":
        return Backend(kind, f"file://{workdir / 'state.json'}")
    assert server is not None
    if kind == "postgresql":
        return Backend(
            kind, f"postgresql://postgres@127.0.0.1:{server.port}/postgres?table={PG_TABLE}", server
        )
    if kind == "redis":
        return Backend(kind, f"redis://127.0.0.1:{server.port}/0?prefix=test:", server)
    return Backend(kind, f"mongodb://127.0.0.1:{server.port}/?database=ratequeue_test", server)
