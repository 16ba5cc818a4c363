"""A place freed in one process reaches a waiter in another at once, not at its next recheck.

A shard whose held ticket waits for a place on a full queue rechecks every
``FULL_RECHECK_US`` (100 ms); a state that can tell of freed places
(:meth:`ratequeue.state.State.watch`: Redis by pub/sub, the file state by
inotify on doorbells) wakes it as soon as another process releases one. The
timings here are those of real processes on one host (``time.monotonic`` is
system-wide), so they are compared across processes. An idle shard (no wait
for a place) makes no state call and holds no subscription or watch.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import redis

from ratequeue import AcquireTimeout, Limiter, aio
from ratequeue.core.operation import Operation
from ratequeue.core.protocol import FULL_RECHECK_US, NEVER, US, Answer, Started, Wait
from ratequeue.state import State, open_state
from ratequeue.state.file import DOORBELLS, FileState
from ratequeue.state.redis import AsyncRedisState, RedisState
from ratequeue.state.redis.freed import LINGER, channel_of

from . import servers
from .ops import do

#: the longest any single wait may take before a run is declared broken
WAIT = 30.0
#: a waiter woken by the release, not by its recheck, has its place well within this (s)
PROMPT = 0.05
TRIES = 5


@pytest.fixture(params=["file", "redis"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A state URL processes share: a file state, or Redis (a real server)."""
    if request.param == "file":
        yield (tmp_path / "state.json").as_uri()
    else:
        server: servers.Server = request.getfixturevalue("redis_server")
        yield f"redis://127.0.0.1:{server.port}/0?prefix=wakeups:"


def _expect(conn: Connection, kind: str) -> tuple[Any, ...]:
    assert conn.poll(WAIT), f"no {kind!r} from the waiter within {WAIT} s"
    message: tuple[Any, ...] = conn.recv()
    assert message[0] != "error", message[1]
    assert message[0] == kind, message
    return message


def _until(condition: Callable[[], bool], what: str, within: float = WAIT) -> None:
    """Wait for ``condition`` to hold (a state outside this process, read again and again)."""
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {within} s"
        time.sleep(0.001)


def _found_full(limiter: Limiter, state: State) -> None:
    """Try ``limiter``'s queue until its record notes that it was found full (a try may wait for its slot)."""

    def found() -> bool:
        # (acquire with no time to wait: its ticket's call notes the full record; a try_acquire
        # changes nothing unless it starts)
        with contextlib.suppress(AcquireTimeout):
            limiter.acquire(timeout=0)
            raise AssertionError("the queue is full: no turn")
        record = state.read(limiter.name).record
        return record is not None and record.held != NEVER

    _until(found, "finding the queue full")


def _numsub(url: str, name: str) -> int:
    """How many connections listen for the freed places of queue ``name`` on the Redis at ``url``."""
    client = redis.Redis.from_url(url.partition("?")[0])
    try:
        channel = channel_of("wakeups:" + name)
        return int(dict(client.pubsub_numsub(channel))[channel.encode()])
    finally:
        client.close()


def waiter(conn: Connection, url: str, name: str, tries: int) -> None:
    """A process taking ``tries`` turns, each waiting for the place the parent holds; says when it watches."""
    try:
        state = open_state(url)
        watch = state.watch

        def watched(queue: str, freed: Callable[[], None]) -> Callable[[], None] | None:
            unwatch = watch(queue, freed)
            conn.send(("watching", unwatch is not None))
            return unwatch

        state.watch = watched  # type: ignore[method-assign,assignment]
        limiter = Limiter(state, name=name, interval=0.001, max_running=1)
        conn.send(("ready",))
        for _ in range(tries):
            turn = limiter.acquire(timeout=WAIT)
            conn.send(("started", time.monotonic()))
            limiter.release(turn)
            assert conn.poll(WAIT)
            assert conn.recv() == "next"
        limiter.close()
        state.close()
    except BaseException as exc:
        conn.send(("error", repr(exc)))
        raise


def test_a_release_wakes_a_waiter_in_another_process_at_once(url: str) -> None:
    subscribed = (lambda name: _numsub(url, name) >= 1) if url.startswith("redis") else None
    delays = cross_process_delays(url, subscribed)
    # each woken by the release (a recheck would come some 100 ms after it was told to wait)
    assert max(delays) < PROMPT, delays
    assert PROMPT < FULL_RECHECK_US / US


def cross_process_delays(url: str, listening: Callable[[str], bool] | None) -> list[float]:
    """Seconds from each of :data:`TRIES` releases here to the begin of the waiter it woke in another process.

    ``listening(name)``: whether the waiter's state listens for the queue's
    freed places (made in a thread, so waited for); ``None`` where the watch
    is in place once the waiter says it watches (inotify). With it, the
    waiter must say it watches.
    """
    name = f"wake-{time.monotonic_ns()}"
    limiter = Limiter(url, name=name, interval=0.001, max_running=1)
    turn = limiter.acquire(timeout=WAIT)
    parent, child = multiprocessing.get_context("spawn").Pipe()
    process = multiprocessing.get_context("spawn").Process(target=waiter, args=(child, url, name, TRIES))
    process.start()
    delays = []
    try:
        _expect(parent, "ready")
        for _ in range(TRIES):
            _, watching = _expect(parent, "watching")  # told the queue is full: it waits for a place
            if listening is not None:
                assert watching
                _until(lambda: listening(name), "the subscription")  # (made in the listener's thread)
            released = time.monotonic()
            assert limiter.release(turn)
            _, started = _expect(parent, "started")
            delays.append(started - released)
            turn = limiter.acquire(timeout=WAIT)  # once the waiter released its place
            parent.send("next")
        process.join(WAIT)
        assert process.exitcode == 0
    finally:
        if process.is_alive():
            process.kill()
        limiter.close()
    return delays


class Counting(State):
    """A state that counts the calls made through it (``execute``)."""

    def __init__(self, inner: State) -> None:
        self.inner, self.url, self.calls = inner, inner.url, 0
        self.watches = 0

    def execute(self, op: Operation) -> Answer:
        self.calls += 1
        return self.inner.execute(op)

    def local_now(self) -> float | None:
        return self.inner.local_now()

    def watch(self, name: str, freed: Callable[[], None]) -> Callable[[], None] | None:
        self.watches += 1
        return self.inner.watch(name, freed)


def _pubsub_clients(url: str) -> int:
    client = redis.Redis.from_url(url.partition("?")[0])
    try:
        return len(client.client_list(_type="pubsub"))
    finally:
        client.close()


def test_an_idle_shard_makes_no_call_and_watches_nothing(url: str) -> None:
    inner = open_state(url)
    state = Counting(inner)
    limiter = Limiter(state, name=f"idle-{time.monotonic_ns()}", interval=0.001, max_running=3)
    for _ in range(3):
        limiter.release(limiter.acquire(timeout=WAIT))
    _until(lambda: limiter._runner.idle, "the shard's going idle")
    calls = state.calls
    time.sleep(3 * FULL_RECHECK_US / US)  # (time for a recheck or a renewal, were any made)
    assert state.calls == calls
    assert state.watches == 0  # it never waited for a place: nothing watched
    if isinstance(inner, RedisState):
        assert inner._freed is None
        assert _pubsub_clients(url) == 0
    elif isinstance(inner, FileState):
        assert inner._doorbells is None
    limiter.close()
    inner.close()


def test_a_watch_hears_a_release_and_its_unwatch_stops_it(url: str) -> None:
    """A watch hears a freeing release (not another's), and its unwatch unsubscribes or unwatches."""
    name = f"watch-{time.monotonic_ns()}"
    state = open_state(url)
    holder = Limiter(url, name=name, interval=0.001, max_running=1)
    waiting = Limiter(url, name=name, interval=0.001, max_running=1)
    turn = holder.acquire(timeout=WAIT)
    _found_full(waiting, state)  # a release publishes from now on
    waiting.close()  # (with its state: it stops listening)
    heard = threading.Event()
    unwatch = state.watch(name, heard.set)
    assert unwatch is not None
    other = state.watch("another", lambda: None)
    assert other is not None
    if isinstance(state, RedisState):
        _until(lambda: _numsub(url, name) == 1, "the subscription")
    else:
        assert isinstance(state, FileState)
        assert state._doorbells is not None
        assert state._doorbells.watching()
    assert holder.release(turn)
    assert heard.wait(WAIT)
    unwatch()
    other()
    if isinstance(state, RedisState):
        _until(lambda: _numsub(url, name) == 0, "the unsubscription", within=LINGER + WAIT)
        _until(lambda: _pubsub_clients(url) == 0, "closing the pub/sub connection", within=LINGER + WAIT)
    else:
        assert isinstance(state, FileState)
        assert state._doorbells is not None
        assert not state._doorbells.watching()
        assert (state.records / DOORBELLS).is_dir()
    holder.close()
    state.close()


def test_a_sweep_or_reset_removes_the_doorbell(tmp_path: Path) -> None:
    state = FileState(tmp_path / "state.json")
    name = "rung"
    holder = Limiter(state, name=name, interval=0.001, max_running=1)
    turn = holder.acquire(timeout=WAIT)
    _found_full(holder, state)  # a release rings from now on
    unwatch = state.watch(name, lambda: None)
    assert unwatch is not None
    assert holder.release(turn)
    bell = state.records / DOORBELLS / state.record_files(name)[0].stem
    assert bell.exists()
    assert state.names() == [name]  # a doorbell is no record
    assert state.reset(name)
    assert not bell.exists()
    unwatch()
    holder.close()
    state.close()


def asyncio_wake_up(url: str, state_class: Any, watching: Callable[[str], bool]) -> float:
    """Seconds from a release (by a limiter of this thread) to the begin of an asyncio waiter it woke.

    The waiter's state is ``state_class.from_url(url)``; ``watching(name)``
    says when it listens for the queue's freed places.
    """
    name = f"async-{time.monotonic_ns()}"
    holder = Limiter(url, name=name, interval=0.001, max_running=1)
    turn = holder.acquire(timeout=WAIT)

    async def main() -> float:
        state = state_class.from_url(url)
        limiter = aio.Limiter(state, name=name, interval=0.001, max_running=1)
        waited = asyncio.ensure_future(limiter.acquire(timeout=WAIT))
        await asyncio.to_thread(_until, lambda: watching(name), "the subscription")
        released = time.monotonic()
        assert await asyncio.to_thread(holder.release, turn)
        await limiter.release(await waited)
        delay = time.monotonic() - released
        await limiter.close()
        await state.close()
        return delay

    try:
        return asyncio.run(main())
    finally:
        holder.close()


def test_an_asyncio_waiter_is_woken_by_a_release_in_another_process(redis_server: servers.Server) -> None:
    """The asyncio Redis state listens in a thread too; the driver hands the wake-up to the loop."""
    url = f"redis://127.0.0.1:{redis_server.port}/0?prefix=wakeups:"
    assert asyncio_wake_up(url, AsyncRedisState, lambda name: _numsub(url, name) == 1) < PROMPT


def test_a_start_that_leaves_a_place_free_wakes_the_next_ticket(url: str) -> None:
    """The grace holds every ticket but the next back: a start leaving a place free tells them too."""
    name = f"next-{time.monotonic_ns()}"
    state = open_state(url)
    terms = {"max_running": 2, "lease_us": 10 * US}
    first = do(state, "take_and_try", name, 1000, 10_000, token=1, **terms)
    second = do(state, "take_and_try", name, 1000, 10_000, token=2, **terms)
    assert isinstance(first, Started)
    assert isinstance(second, Started)
    third = do(state, "take_and_try", name, 1000, 10_000, token=3, **terms)
    assert isinstance(third, Wait)  # full: found so (held)
    heard = threading.Event()
    unwatch = state.watch(name, heard.set)
    assert unwatch is not None
    if isinstance(state, RedisState):
        _until(lambda: _numsub(url, name) == 1, "the subscription")
    for ticket, token in ((first.ticket, 1), (second.ticket, 2)):
        assert do(state, "release", name, 1000, ticket, token=token, **terms) is True
        assert heard.wait(WAIT)
        heard.clear()
    started = do(state, "try_start", name, 1000, third.ticket, 10_000, token=3, **terms)
    assert isinstance(started, Started)  # one place of two taken: the next ticket may take the other
    assert heard.wait(5.0)
    unwatch()
    state.close()
