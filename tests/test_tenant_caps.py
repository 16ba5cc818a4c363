"""Per-tenant caps on a fair queue (``tenant_max_running``): places taken, waited for, given back, expired.

A tenant's cap is a queue of its own, ``f"{name}:running:{tenant}"`` (the
default tenant ``""`` written ``%``), with ``max_running`` the cap: a caller
takes a place there first, then waits for its fair turn. So a tenant at its
cap holds no ticket of the fair queue and delays nobody. The checks read the
cap queue's record (its leases: the places held, fleet-wide) and recorders of
the jobs' own begins and ends, as tests/test_max_running.py does.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import pickle
import random
import signal
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ratequeue import AcquireTimeout, Limiter, LimiterGroup, Queue, Turn, aio
from ratequeue.core.protocol import FULL_RECHECK_US, NEVER, US
from ratequeue.errors import ConfigurationError
from ratequeue.state import AsyncState, State

from .backends import Backend
from .test_max_running import assert_capped, peak

INTERVAL = 0.005
#: the longest any single wait may take before a run is declared broken
WAIT = 60.0
#: the longest a thing that should come at once (a free turn, a place given back) may take
SOON = 5.0
#: how long a run that should take well under a second may take before it is declared hung (under
#: pytest's own timeout, so that a hung run fails as itself and its cleanup runs)
HUNG = 15.0


def cap_queue(name: str, tenant: str) -> str:
    """The name of the queue that holds ``tenant``'s places (the default tenant ``""`` is ``%``).

    For tenants without ``:`` or ``%``, which are written escaped (as a group's keys are).
    """
    return f"{name}:running:{tenant or '%'}"


def held(state: State, name: str, tenant: str) -> int:
    """How many places of ``tenant``'s cap are held now, fleet-wide (its cap queue's leases)."""
    record = state.read(cap_queue(name, tenant)).record
    return 0 if record is None else len(record.leases)


async def held_async(state: AsyncState, name: str, tenant: str) -> int:
    record = (await state.read(cap_queue(name, tenant))).record
    return 0 if record is None else len(record.leases)


def eventually(check: Callable[[], bool], seconds: float = SOON) -> bool:
    """Whether ``check()`` comes true within ``seconds`` (asked every few milliseconds)."""
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)
    return True


async def eventually_async(check: Callable[[], Awaitable[bool]], seconds: float = SOON) -> bool:
    deadline = time.monotonic() + seconds
    while not await check():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.005)
    return True


def try_until(limiter: Limiter, tenant: str, seconds: float = SOON) -> Turn | None:
    """``try_acquire`` asked again until it returns a turn (the fair queue's next start may be an
    interval away) or ``seconds`` pass."""
    deadline = time.monotonic() + seconds
    while True:
        turn = limiter.try_acquire(tenant=tenant)
        if turn is not None or time.monotonic() >= deadline:
            return turn
        time.sleep(0.002)


@pytest.fixture(params=["memory", "file"])
def local_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A state of this process's (memory) or of this host's (file), of this test only."""
    if request.param == "memory":
        return f"memory://caps-{uuid.uuid4().hex}"
    return f"file://{tmp_path / 'state.json'}"


#: the limiters :func:`capped` made in this test, closed at its teardown
_made: list[Limiter] = []


@pytest.fixture(autouse=True)
def _close_capped() -> Iterator[None]:
    """Close every limiter :func:`capped` made, even when the test failed (a second close does nothing)."""
    yield
    while _made:
        _made.pop().close()


def capped(url: str, name: str, cap: int, **options: Any) -> Limiter:
    # max_late=None: a late wake-up under load would give a turn up and shift the tickets and tries
    settings: dict[str, Any] = {"interval": INTERVAL, "lease": 5.0, "max_late": None} | options
    limiter = Limiter(url, name=name, fair=True, tenant_max_running=cap, **settings)
    _made.append(limiter)
    return limiter


# 1-3: the cap, on every state


def test_a_tenant_at_its_cap_waits_and_delays_nobody(backend: Backend) -> None:
    """Four threads of big, cap 2: two run, two wait; small gets turns meanwhile; a release lets one in."""
    name = backend.fresh_name()
    limiter = capped(backend.url, name, 2)
    state = limiter.state
    got: list[int] = []
    failures: list[BaseException] = []
    changed = threading.Condition()
    finish = [threading.Event() for _ in range(4)]

    def job(index: int) -> None:
        try:
            turn = limiter.acquire(WAIT, tenant="big")
            with changed:
                got.append(index)
                changed.notify_all()
            finish[index].wait(WAIT)
            assert limiter.release(turn) is True
        except BaseException as exc:  # reported by the test
            failures.append(exc)

    threads = [threading.Thread(target=job, args=(index,), daemon=True) for index in range(4)]
    for thread in threads:
        thread.start()
    try:
        with changed:
            assert changed.wait_for(lambda: len(got) >= 2, WAIT), "big never got its two places"
        assert held(state, name, "big") == 2
        assert limiter.try_acquire(tenant="big") is None, "big is at its cap"
        small = try_until(limiter, "small")
        assert small is not None, "small waits behind big, which is at its cap"
        assert held(state, name, "small") == 1
        assert limiter.release(small) is True
        assert held(state, name, "small") == 0
        with changed:
            assert len(got) == 2, f"more of big's jobs than its cap ran: {got}"
        first = got[0]
        finish[first].set()
        threads[first].join(WAIT)
        assert not threads[first].is_alive()
        with changed:
            assert changed.wait_for(lambda: len(got) >= 3, WAIT), "a place given back let no waiter in"
            assert len(got) == 3
        assert held(state, name, "big") == 2
        assert limiter.try_acquire(tenant="big") is None
    finally:
        for event in finish:
            event.set()
        for thread in threads:
            thread.join(WAIT)
    assert not failures, failures
    assert sorted(got) == [0, 1, 2, 3]
    assert held(state, name, "big") == 0, "every place given back"
    limiter.close()


def test_a_tenants_jobs_never_run_more_than_its_cap(backend: Backend) -> None:
    """Big's threads want four places, small's three: each tenant runs at most its cap, side by side."""
    name = backend.fresh_name()
    limiter = capped(backend.url, name, 2)
    spans: dict[str, list[tuple[float, float]]] = {"big": [], "small": []}
    failures: list[BaseException] = []
    lock = threading.Lock()

    def work(tenant: str, seed: int, jobs: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(jobs):
                turn = limiter.acquire(WAIT, tenant=tenant)
                begin = time.monotonic()
                time.sleep(rng.uniform(0.005, 0.04))  # the job
                end = time.monotonic()
                assert limiter.release(turn) is True
                with lock:
                    spans[tenant].append((begin, end))
        except BaseException as exc:  # reported by the test
            failures.append(exc)

    threads = [threading.Thread(target=work, args=("big", seed, 5), daemon=True) for seed in range(4)]
    threads += [threading.Thread(target=work, args=("small", 10 + seed, 4), daemon=True) for seed in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT)
    assert not failures, failures
    assert (len(spans["big"]), len(spans["small"])) == (20, 12)
    assert_capped(spans["big"], 2, backend.kind)
    assert peak(spans["small"]) <= 2
    if backend.kind == "memory":
        assert peak(spans["big"] + spans["small"]) > 2, "big's cap is big's: small runs beside it"
    assert (held(limiter.state, name, "big"), held(limiter.state, name, "small")) == (0, 0)
    limiter.close()


def test_two_shards_share_a_tenants_cap(backend: Backend) -> None:
    """The cap is fleet-wide: a place held through one limiter object is taken for the other."""
    name = backend.fresh_name()
    a = capped(backend.url, name, 1)
    b = capped(backend.url, name, 1)
    turn = a.acquire(WAIT, tenant="acme")
    assert b.try_acquire(tenant="acme") is None, "acme's one place is held through a"
    with pytest.raises(AcquireTimeout):
        b.acquire(0.2, tenant="acme")
    other = try_until(b, "globex")
    assert other is not None, "another tenant is not held up"
    assert b.release(other) is True
    assert a.release(turn) is True
    began = time.monotonic()
    b.release(b.acquire(SOON, tenant="acme"))
    # b's caller waiting at the full cap asks again every FULL_RECHECK_US at most
    assert time.monotonic() - began < FULL_RECHECK_US / US + 2.0
    assert held(a.state, name, "acme") == 0
    a.close()
    b.close()


def test_each_tenant_has_a_cap_queue_of_its_own(local_url: str) -> None:
    """The default tenant is written ``%``; a tenant named ``%``, or with a ``:``, gets a queue of its own."""
    limiter = capped(local_url, "q", 1)
    tenants = ["", "%", "a:b", "a", "b"]
    turns = []
    for tenant in tenants:
        turn = try_until(limiter, tenant)
        assert turn is not None, f"tenant {tenant!r} was held up by another's cap"
        turns.append(turn)
    names = limiter.state.names("q:running:")
    assert len(names) == len(tenants), names
    assert "q:running:%" in names
    for tenant in tenants:
        assert limiter.try_acquire(tenant=tenant) is None, f"tenant {tenant!r} is at its cap"
    for turn in turns:
        assert limiter.release(turn) is True
    assert all(limiter.state.read(name).record.leases == () for name in names)  # type: ignore[union-attr]
    limiter.close()


def test_a_global_cap_and_a_tenants_cap_both_hold(local_url: str) -> None:
    """With ``max_running`` too, a job holds both places; ``release`` answers for the global lease."""
    limiter = capped(local_url, "q", 1, max_running=2)
    first = limiter.acquire(WAIT, tenant="a")
    assert limiter.try_acquire(tenant="a") is None, "a is at its own cap"
    second = try_until(limiter, "b")
    assert second is not None
    assert limiter.status().running == 2
    assert limiter.try_acquire(tenant="c") is None, "the queue is at its cap, c at none"
    assert held(limiter.state, "q", "c") == 0, "the try gave c's place back"
    assert limiter.release(first) is True
    assert limiter.release(first) is False, "released once only"
    assert (limiter.status().running, held(limiter.state, "q", "a")) == (1, 0)
    third = try_until(limiter, "c")
    assert third is not None
    assert limiter.release(second) is True
    assert limiter.release(third) is True
    assert limiter.status().running == 0
    assert held(limiter.state, "q", "b") == held(limiter.state, "q", "c") == 0
    limiter.close()


def test_release_of_another_queues_turn_frees_no_tenant_place(local_url: str) -> None:
    """A turn of another queue, with the same ticket number, names another job: b's place stays taken.

    As for ``max_running``'s leases (test_max_running.py): only a turn's own limiter frees its place.
    """
    a = capped(local_url, "qa", 1, lease=30)
    b = capped(local_url, "qb", 1, lease=30)
    a_turn, b_turn = a.acquire(WAIT, tenant="acme"), b.acquire(WAIT, tenant="acme")
    assert a_turn.ticket == b_turn.ticket
    assert b.release(a_turn) is False, "b never granted a's turn"
    assert held(b.state, "qb", "acme") == 1, "b's job still holds acme's place"
    assert b.try_acquire(tenant="acme") is None
    assert held(a.state, "qa", "acme") == 1
    assert b.release(b_turn) is True
    assert a.release(a_turn) is True
    a.close()
    b.close()


def test_a_job_that_outlives_its_fair_queues_record_keeps_its_own_place(local_url: str) -> None:
    """The fair record, idle past ``keep``, is deleted while a job runs; the next turn's ticket is 1 again.

    Each job still gives back its own place: the running one's stays held, and both come back.
    """
    limiter = capped(local_url, "q", 2, keep=0.2, lease=30)
    state = limiter.state
    first = limiter.acquire(WAIT, tenant="acme")

    def fair_record_gone() -> bool:
        state.sweep()  # (the fair queue's record: idle, its keep time passed)
        return state.read("q").record is None

    assert eventually(fair_record_gone)
    second = limiter.acquire(WAIT, tenant="acme")
    assert second.ticket == first.ticket, "a new record hands out its tickets from 1 again"
    assert held(state, "q", "acme") == 2
    assert limiter.release(first) is True
    assert held(state, "q", "acme") == 1, "the second job still runs"
    assert limiter.release(second) is True, "the second job's place was given back by the first's end"
    assert held(state, "q", "acme") == 0, "a place stays taken for good (its lease renewed)"
    limiter.close()


# 4: a holder killed


def _hold_a_tenant_place(url: str, name: str, lease: float, conn: Any) -> None:
    """Take acme's one place and keep it (its lease renewed) until killed; say ``"holding"``."""
    limiter = capped(url, name, 1, lease=lease)
    limiter.acquire(WAIT, tenant="acme")
    conn.send("holding")
    threading.Event().wait()  # until SIGKILL


def _lease_expiry(state: State, name: str, tenant: str) -> int:
    record = state.read(cap_queue(name, tenant)).record
    assert record is not None
    assert len(record.leases) == 1
    return record.leases[0][1]


@pytest.mark.processes
@pytest.mark.parametrize("shared_backend", ["file", "redis"], indirect=True)
def test_sigkill_of_a_holder_frees_its_tenant_place_within_the_lease(shared_backend: Backend) -> None:
    name = shared_backend.fresh_name()
    lease = 0.6
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    holder = ctx.Process(
        target=_hold_a_tenant_place, args=(shared_backend.url, name, lease, child), daemon=True
    )
    holder.start()
    limiter = capped(shared_backend.url, name, 1, lease=lease)
    try:
        assert parent.poll(WAIT), "the holder never took its place"
        assert parent.recv() == "holding"
        assert limiter.try_acquire(tenant="acme") is None
        first = _lease_expiry(limiter.state, name, "acme")
        assert eventually(lambda: _lease_expiry(limiter.state, name, "acme") > first), "never renewed"
        with pytest.raises(AcquireTimeout):
            limiter.acquire(lease / 3, tenant="acme")  # taken while the holder lives (and renews)
        other = try_until(limiter, "globex")
        assert other is not None
        limiter.release(other)
        os.kill(holder.pid, signal.SIGKILL)  # type: ignore[arg-type]
        killed = time.monotonic()
        turn = limiter.acquire(WAIT, tenant="acme")
        recovered = time.monotonic() - killed
    finally:
        holder.kill()
        holder.join(WAIT)
    print(f"{shared_backend.kind}: a SIGKILLed holder's tenant place came back {recovered:.2f} s after")
    # renewed at most a third of the lease before the kill; the waiter asks every FULL_RECHECK_US
    assert recovered <= lease + FULL_RECHECK_US / US + 0.5
    assert limiter.release(turn) is True
    limiter.close()


# 5: failure paths leave no place behind


def test_a_timeout_at_the_cap_names_the_tenant(local_url: str) -> None:
    limiter = capped(local_url, "q", 1)
    turn = limiter.acquire(WAIT, tenant="acme")
    began = time.monotonic()
    with pytest.raises(AcquireTimeout) as raised:
        limiter.acquire(0.2, tenant="acme")
    assert time.monotonic() - began < 0.2 + SOON
    assert "acme" in str(raised.value), str(raised.value)
    assert held(limiter.state, "q", "acme") == 1, "the waiter took no place"
    assert limiter.release(turn) is True
    limiter.release(limiter.acquire(SOON, tenant="acme"))
    limiter.close()


def test_a_timeout_waiting_for_the_fair_turn_gives_the_place_back(local_url: str) -> None:
    limiter = capped(local_url, "q", 1, interval=0.5, lease=30)
    limiter.release(limiter.acquire(WAIT, tenant="other"))  # the next start is half a second away
    with pytest.raises(AcquireTimeout):
        limiter.acquire(0.1, tenant="acme")  # a free place at the cap, no fair turn in time
    # given back in the background; kept, it would stay taken for its lease (30 s, renewed)
    assert eventually(lambda: held(limiter.state, "q", "acme") == 0)
    turn = try_until(limiter, "acme")
    assert turn is not None, "acme's one place was not given back"
    assert limiter.release(turn) is True
    limiter.close()


def test_a_try_that_gets_no_fair_turn_leaves_no_place(local_url: str) -> None:
    limiter = capped(local_url, "q", 1, interval=0.5, lease=30)
    limiter.release(limiter.acquire(WAIT, tenant="other"))  # the next start is half a second away
    assert limiter.try_acquire(tenant="acme") is None
    assert held(limiter.state, "q", "acme") == 0, "the try released its place before it returned"
    other = capped(local_url, "q", 1, interval=0.5, lease=30)
    turn = try_until(other, "acme")
    assert turn is not None
    assert other.release(turn) is True
    limiter.close()
    other.close()


def test_a_task_cancelled_waiting_for_the_fair_turn_gives_the_place_back(local_url: str) -> None:
    async def main() -> None:
        limiter = aio.Limiter(local_url, name="q", interval=1.0, fair=True, tenant_max_running=1, lease=30)
        state = limiter.state
        try:
            await limiter.release(await limiter.acquire(WAIT, tenant="other"))  # next start: 1 s away
            task = asyncio.create_task(limiter.acquire(tenant="acme"))

            async def placed() -> bool:
                return await held_async(state, "q", "acme") == 1

            assert await eventually_async(placed), "the task never took its place at the cap"
            assert not task.done(), "the fair turn came early: the test proves nothing"
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

            async def given_back() -> bool:
                return await held_async(state, "q", "acme") == 0

            assert await eventually_async(given_back), "the cancelled task's place stayed taken"
            turn = await limiter.acquire(SOON, tenant="acme")
            assert await limiter.release(turn) is True
        finally:
            await limiter.close()

    asyncio.run(main())


def test_a_task_cancelled_waiting_at_the_cap_takes_no_place(local_url: str) -> None:
    async def main() -> None:
        limiter = aio.Limiter(
            local_url, name="q", interval=INTERVAL, fair=True, tenant_max_running=1, lease=30
        )
        state = limiter.state
        try:
            turn = await limiter.acquire(WAIT, tenant="acme")
            task = asyncio.create_task(limiter.acquire(tenant="acme"))

            async def refused() -> bool:  # the task asked for a place at acme's cap, and was refused
                record = (await state.read(cap_queue("q", "acme"))).record
                return record is not None and record.held != NEVER

            assert await eventually_async(refused), "the task never asked for acme's place"
            assert not task.done()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await limiter.release(turn) is True
            assert await held_async(state, "q", "acme") == 0, "the cancelled task took the place freed"
            again = await limiter.acquire(SOON, tenant="acme")
            assert await held_async(state, "q", "acme") == 1
            assert await limiter.try_acquire(tenant="acme") is None
            assert await limiter.release(again) is True
        finally:
            await limiter.close()

    asyncio.run(main())


# 6: asyncio


def test_asyncio_tasks_never_run_more_than_their_tenants_cap(backend: Backend) -> None:
    async def main() -> dict[str, list[tuple[float, float]]]:
        state = backend.open_async()
        name = backend.fresh_name()
        limiter = aio.Limiter(state, name=name, interval=INTERVAL, fair=True, tenant_max_running=2, lease=5)
        spans: dict[str, list[tuple[float, float]]] = {"big": [], "": [], "small": []}

        @limiter(tenant="big")
        async def decorated(seconds: float) -> None:
            begin = time.monotonic()
            await asyncio.sleep(seconds)
            spans["big"].append((begin, time.monotonic()))

        async def with_block(seconds: float) -> None:
            async with limiter:  # the default tenant, ""
                begin = time.monotonic()
                await asyncio.sleep(seconds)
                spans[""].append((begin, time.monotonic()))

        async def acquired(seconds: float) -> None:
            turn = await limiter.acquire(WAIT, tenant="small")
            begin = time.monotonic()
            await asyncio.sleep(seconds)
            spans["small"].append((begin, time.monotonic()))
            assert await limiter.release(turn) is True

        rng = random.Random(3)
        kinds = [decorated, with_block, acquired]
        tasks = [asyncio.create_task(kinds[i % 3](rng.uniform(0.005, 0.03))) for i in range(18)]
        try:
            await asyncio.wait_for(asyncio.gather(*tasks), HUNG)
            for tenant in spans:
                assert await held_async(state, name, tenant) == 0, f"{tenant!r}'s places all given back"
        finally:  # (a failed run too: the tasks left stopped, the places released)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await limiter.close()
            await state.close()  # passed in, so the limiter leaves it open
        return spans

    spans = asyncio.run(main())
    assert [len(spans[tenant]) for tenant in ("big", "", "small")] == [6, 6, 6]
    assert_capped(spans["big"], 2, backend.kind)
    assert_capped(spans[""], 2, backend.kind)
    assert peak(spans["small"]) <= 2


def test_asyncio_decorated_coroutine_and_async_with_release_at_their_end(local_url: str) -> None:
    async def main() -> None:
        limiter = aio.Limiter(
            local_url, name="q", interval=INTERVAL, fair=True, tenant_max_running=1, lease=30
        )
        state = limiter.state

        @limiter(tenant="acme")
        async def job() -> int:
            return await held_async(state, "q", "acme")

        @limiter(tenant="acme")
        async def fails() -> None:
            raise ValueError("the job failed")

        async def uses() -> None:
            assert await job() == 1
            assert await job() == 1  # the place came back at the first one's return
            with pytest.raises(ValueError, match="failed"):
                await fails()
            assert await job() == 1
            for _ in range(2):
                async with limiter:
                    assert await held_async(state, "q", "") == 1
            assert await held_async(state, "q", "acme") == 0
            assert await held_async(state, "q", "") == 0

        try:
            await asyncio.wait_for(uses(), HUNG)  # a place kept would block the next use for good
        finally:
            await limiter.close()

    asyncio.run(main())


# 7: the decorator and ``with`` give the place back


def test_the_decorator_and_with_give_the_place_back(local_url: str) -> None:
    limiter = capped(local_url, "q", 1, lease=30)
    state = limiter.state
    seen: list[int] = []
    failures: list[BaseException] = []

    @limiter(tenant="acme")
    def job() -> int:
        return held(state, "q", "acme")

    @limiter(tenant="acme")
    def fails() -> None:
        raise ValueError("the job failed")

    def body() -> None:
        try:
            for _ in range(2):
                with limiter:  # the default tenant, "": its cap queue is "q:running:%"
                    seen.append(held(state, "q", ""))
            seen.append(job())
            seen.append(job())  # a place kept by the first call would block this one for good
            with pytest.raises(ValueError, match="failed"):
                fails()
            seen.append(job())
        except BaseException as exc:  # reported by the test
            failures.append(exc)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    thread.join(HUNG)
    assert not thread.is_alive(), "deadlocked: a with block or a decorated call kept its place"
    assert not failures, failures
    assert seen == [1, 1, 1, 1, 1]
    assert held(state, "q", "") == 0
    assert held(state, "q", "acme") == 0
    turn = limiter.acquire(SOON, tenant="acme")
    assert limiter.release(turn) is True, "without max_running, release answers for the cap's lease"
    assert limiter.release(turn) is False, "released once only"
    limiter.close()


def test_close_gives_back_the_places_still_held(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'state.json'}"
    a = capped(url, "q", 1, lease=30)
    b = capped(url, "q", 1, lease=30)
    a.acquire(WAIT, tenant="acme")
    assert b.try_acquire(tenant="acme") is None
    a.close()
    assert held(b.state, "q", "acme") == 0, "close released acme's place (not left to its 30 s lease)"
    turn = try_until(b, "acme")
    assert turn is not None
    b.release(turn)
    b.close()


def test_a_group_passes_the_cap_to_each_key(local_url: str) -> None:
    with LimiterGroup(local_url, name="g", interval=INTERVAL, fair=True, tenant_max_running=1) as group:
        one, two = group["one"], group["two"]
        assert one.settings.tenant_max_running == 1
        turn = one.acquire(WAIT, tenant="acme")
        assert one.try_acquire(tenant="acme") is None
        other = try_until(two, "acme")
        assert other is not None, "each key has caps of its own"
        assert two.release(other) is True
        assert one.release(turn) is True


# 8: bad input


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"tenant_max_running": 2}, "fair=True"),
        ({"tenant_max_running": 2, "fair": False}, "fair=True"),
        ({"tenant_max_running": 0, "fair": True}, "tenant_max_running must be None"),
        ({"tenant_max_running": -1, "fair": True}, "tenant_max_running must be None"),
        ({"tenant_max_running": True, "fair": True}, "tenant_max_running must be None"),
        ({"tenant_max_running": False, "fair": True}, "tenant_max_running must be None"),
        ({"tenant_max_running": 1.5, "fair": True}, "tenant_max_running must be None"),
        ({"tenant_max_running": 2.0, "fair": True}, "tenant_max_running must be None"),
        ({"tenant_max_running": "2", "fair": True}, "tenant_max_running must be None"),
        ({"tenant_max_running": 1001, "fair": True}, "tenant_max_running must be None"),
        ({"tenant_max_running": 2, "fair": True, "when_down": "open"}, "when_down must be 'raise'"),
        ({"tenant_max_running": 2, "fair": True, "when_down": 0.5}, "when_down must be 'raise'"),
    ],
    ids=[
        "not fair",
        "fair=False",
        "zero",
        "negative",
        "True",
        "False",
        "a fraction",
        "a float",
        "a string",
        "over MAX_RUNNING",
        "when_down open",
        "when_down a share",
    ],
)
def test_bad_caps_are_refused(options: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        Limiter("memory://bad-caps", name="q", interval=0.01, **options)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=message):
        LimiterGroup("memory://bad-caps", name="g", interval=0.01, **options)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=message):
        Queue("memory://bad-caps", name="q", interval=0.01, **options)  # type: ignore[arg-type]

    async def main() -> None:
        with pytest.raises(ConfigurationError, match=message):
            aio.Limiter("memory://bad-caps", name="q", interval=0.01, **options)  # type: ignore[arg-type]
        with pytest.raises(ConfigurationError, match=message):
            aio.Queue("memory://bad-caps", name="q", interval=0.01, **options)  # type: ignore[arg-type]

    asyncio.run(main())


def test_the_largest_cap_is_taken() -> None:
    limiter = capped("memory://largest-cap", "q", 1000)
    assert limiter.settings.tenant_max_running == 1000
    limiter.close()


def test_what_a_capped_limiter_cannot_do_is_refused(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'state.json'}"
    limiter = capped(url, "q", 2)
    with pytest.raises(ConfigurationError, match="tenant_max_running"):
        limiter.reserve(tenant="acme")
    with pytest.raises(ConfigurationError, match="tenant_max_running"):
        limiter.reserve()

    async def job() -> None:
        return None

    with pytest.raises(ConfigurationError, match="aio"):
        limiter.wrap(job, tenant="acme")
    with pytest.raises(ConfigurationError, match="aio"):
        limiter(tenant="acme")(job)
    with pytest.raises(ConfigurationError, match="aio"):
        limiter(job)
    assert limiter.state.names() == [], "the refusals touched no state"
    limiter.close()

    async def main() -> None:
        capped_aio = aio.Limiter(url, name="q", interval=INTERVAL, fair=True, tenant_max_running=2)
        with pytest.raises(ConfigurationError, match="tenant_max_running"):
            capped_aio.reserve(tenant="acme")
        await capped_aio.close()

    asyncio.run(main())


def test_a_bad_call_of_a_capped_limiter_is_refused_before_any_place_is_taken(tmp_path: Path) -> None:
    limiter = capped(f"file://{tmp_path / 'state.json'}", "q", 1)
    with pytest.raises(ConfigurationError, match="tenant"):
        limiter.acquire(tenant=5)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="printable"):
        limiter.acquire(tenant="a\nb")
    with pytest.raises(ConfigurationError, match="printable"):
        limiter.try_acquire(tenant="a\nb")
    with pytest.raises(ConfigurationError, match="cost"):
        limiter.acquire(cost=2, tenant="acme")  # more than the burst, 1
    with pytest.raises(ConfigurationError, match="cost"):
        limiter.try_acquire(cost=2, tenant="acme")
    with pytest.raises(ConfigurationError, match="timeout"):
        limiter.acquire(-1, tenant="acme")
    assert limiter.state.names() == [], "no place taken, no ticket"
    limiter.close()


# 9: the cap's record expires


def test_a_tenants_cap_record_expires_once_idle(local_url: str) -> None:
    limiter = capped(local_url, "q", 1, keep=0.2)
    state = limiter.state
    turn = limiter.acquire(WAIT, tenant="acme")
    assert cap_queue("q", "acme") in state.names("q:running:")
    record = state.read(cap_queue("q", "acme")).record
    assert record is not None
    assert (record.max_running, record.interval, len(record.leases)) == (1, 1, 1)
    assert limiter.release(turn) is True

    def gone() -> bool:
        state.sweep()  # (deletes what is past its keep time; the states also do it by themselves)
        return cap_queue("q", "acme") not in state.names("q:running:")

    assert eventually(gone), "acme's cap record is kept for ever"
    limiter.close()


# 10: pickling


def test_a_capped_limiter_pickles_with_its_cap(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'state.json'}"
    limiter = capped(url, "q", 1)
    copy = pickle.loads(pickle.dumps(limiter))
    assert copy.settings.tenant_max_running == 1
    assert copy.settings == limiter.settings
    turn = limiter.acquire(WAIT, tenant="acme")
    assert copy.try_acquire(tenant="acme") is None, "the copy keeps the cap"
    assert limiter.release(turn) is True
    copy.release(copy.acquire(SOON, tenant="acme"))
    limiter.close()
    copy.close()


# what the review of the change found


def test_the_integrations_give_a_capped_limiters_place_back() -> None:
    """Celery's TaskTurns, the HTTP transports and Spark's helpers release turns that hold places.

    With a cap of 1 and nothing released, the second call of each would wait for ever.
    """
    import httpx

    import ratequeue.celery
    import ratequeue.httpx
    import ratequeue.spark

    url = f"memory://caps-{uuid.uuid4().hex}"
    limiter = capped(url, "integrations", 1)
    assert limiter.holds_places
    service = httpx.MockTransport(lambda request: httpx.Response(200))
    with httpx.Client(transport=ratequeue.httpx.Transport(limiter, service, timeout=SOON)) as http:
        assert [http.get("https://api.example/a").status_code for _ in range(2)] == [200, 200]
    assert [ratequeue.spark._at_turn(limiter, SOON, lambda n: n, n) for n in range(2)] == [0, 1]
    turns = ratequeue.celery.TaskTurns(
        url, name="integrations-celery", interval=INTERVAL, fair=True, tenant_max_running=1, lease=5.0
    )
    work = turns(lambda n: n)
    assert [work(n) for n in range(2)] == [0, 1]
    assert held(turns.limiter.state, "integrations-celery", "") == 0
    assert held(limiter.state, "integrations", "") == 0
    turns.limiter.close()
    limiter.close()


def test_a_caller_on_its_way_to_a_place_keeps_its_limiter_in_a_group(local_url: str) -> None:
    """A group drops no key's limiter whose caller waits at the cap (it would take a place unseen)."""
    from ratequeue.running import runner_of

    options: dict[str, Any] = {"interval": INTERVAL, "fair": True, "tenant_max_running": 1, "lease": 5.0}
    group = LimiterGroup(local_url, name="ways", max_keys=1, **options)
    outsider = Limiter(local_url, name="ways:k", **options)  # another process's shard of key k
    holding = outsider.acquire(WAIT, tenant="t")
    key = group["k"]
    waiting = threading.Thread(target=lambda: key.release(key.acquire(WAIT, tenant="t")))
    waiting.start()
    caps = runner_of(key).in_use
    assert caps is not None
    assert eventually(lambda: caps.busy)  # its caller waits at t's cap, holding nothing yet
    assert group["other"] is not None  # one key kept at most: idle ones are dropped
    assert group["k"] is key
    assert outsider.release(holding)
    waiting.join(HUNG)
    assert not waiting.is_alive()
    outsider.close()
    group.close()


def test_a_tenant_too_long_for_its_cap_queue_is_refused_by_name(local_url: str) -> None:
    limiter = capped(local_url, "long", 1)
    with pytest.raises(ConfigurationError, match=r"too long for tenant_max_running.*at most 187"):
        limiter.acquire(WAIT, tenant="x" * 188)
    limiter.release(limiter.acquire(WAIT, tenant="x" * 187))
    limiter.close()


def test_a_timeout_waiting_for_the_fair_turn_names_the_callers_timeout(local_url: str) -> None:
    limiter = capped(local_url, "timeouts", 2, interval=5.0)
    first = limiter.acquire(WAIT, tenant="a")  # the next turn is 5 s away
    with pytest.raises(AcquireTimeout, match=r"the timeout was 0.2 s, of which tenant 'b'") as raised:
        limiter.acquire(0.2, tenant="b")
    assert raised.value.timeout == 0.2
    limiter.release(first)
    limiter.close()
