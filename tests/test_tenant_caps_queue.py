"""A queue's per-tenant caps (``Queue(..., fair=True, tenant_max_running=N)``): gated jobs, on every state.

The jobs record when they begin and end, per tenant, on this host's
monotonic clock; the checks read that record (begun after the turn, ended
before the place goes back: it can only show more overlap than there was).
A capped tenant's jobs wait for a place without a turn, so another
tenant's jobs pass them: checked while the capped jobs are blocked.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import defaultdict

import pytest

from ratequeue import Backoff, Limiter, Queue, TermsMismatch, aio
from ratequeue.tenant_caps import cap_queue_name

from .backends import Backend
from .test_max_running import peak

INTERVAL = 0.002
WAIT = 60.0


class Recorder:
    """Begin and end times of jobs per tenant; a job may block until :attr:`go` is set."""

    def __init__(self) -> None:
        self.spans: dict[str, list[tuple[float, float]]] = defaultdict(list)
        self.begun: dict[str, int] = defaultdict(int)
        self.go = threading.Event()
        self._changed = threading.Condition()

    def job(self, tenant: str, seconds: float = 0.0, block: bool = False) -> str:
        begin = time.monotonic()
        with self._changed:
            self.begun[tenant] += 1
            self._changed.notify_all()
        if block:
            assert self.go.wait(WAIT)
        time.sleep(seconds)
        with self._changed:
            self.spans[tenant].append((begin, time.monotonic()))
        return tenant

    def wait_begun(self, tenant: str, count: int) -> None:
        with self._changed:
            assert self._changed.wait_for(lambda: self.begun[tenant] >= count, WAIT), dict(self.begun)


def test_a_capped_tenants_jobs_run_n_at_a_time_and_delay_no_other_tenant(backend: Backend) -> None:
    recorder = Recorder()
    queue = Queue(backend.url, name=backend.fresh_name(), interval=INTERVAL, fair=True, tenant_max_running=2)
    big = [queue.add(recorder.job, "big", block=True, tenant="big") for _ in range(6)]
    recorder.wait_begun("big", 2)
    small = [queue.add(recorder.job, "small", tenant="small") for _ in range(3)]
    assert [future.result(WAIT) for future in small] == ["small"] * 3  # past big's 4 gated jobs
    assert recorder.begun["big"] == 2  # the cap held while small's jobs ran
    assert queue.pending == 4
    recorder.go.set()
    assert [future.result(WAIT) for future in big] == ["big"] * 6
    queue.close()
    assert peak(recorder.spans["big"]) == 2


def test_two_queue_objects_share_a_tenants_cap(backend: Backend) -> None:
    """Two shards of one queue name (as two processes): one tenant's jobs never overlap across them."""
    recorder = Recorder()
    name = backend.fresh_name()
    queues = [Queue(backend.url, name=name, interval=INTERVAL, fair=True, tenant_max_running=1) for _ in "ab"]
    futures = [queues[n % 2].add(recorder.job, "t", 0.01, tenant="t") for n in range(8)]
    for future in futures:
        future.result(WAIT)
    for queue in queues:
        queue.close()
    assert len(recorder.spans["t"]) == 8
    assert peak(recorder.spans["t"]) == 1


def test_a_queue_and_a_limiter_share_a_tenants_cap(backend: Backend) -> None:
    name = backend.fresh_name()
    limiter = Limiter(backend.url, name=name, interval=INTERVAL, fair=True, tenant_max_running=1)
    queue = Queue(backend.url, name=name, interval=INTERVAL, fair=True, tenant_max_running=1)
    turn = limiter.acquire(timeout=WAIT, tenant="t")
    recorder = Recorder()
    held = queue.add(recorder.job, "t", tenant="t")
    other = queue.add(recorder.job, "u", tenant="u")
    assert other.result(WAIT) == "u"
    assert recorder.begun["t"] == 0  # the limiter's job holds t's one place
    assert limiter.release(turn)
    assert held.result(WAIT) == "t"
    queue.close()
    limiter.close()


def test_a_job_takes_its_groups_place_then_its_tenants(backend: Backend) -> None:
    recorder = Recorder()
    queue = Queue(backend.url, name=backend.fresh_name(), interval=INTERVAL, fair=True, tenant_max_running=2)
    futures = [
        queue.add(recorder.job, f"{tenant}/{group}", 0.01, tenant=tenant, group=f"{tenant}/{group}")
        for _ in range(3)
        for tenant in ("x", "y")
        for group in ("a", "b", "c")
    ]
    for future in futures:
        future.result(WAIT)
    queue.close()
    for tenant in ("x", "y"):
        spans = [span for key, spans in recorder.spans.items() if key.startswith(tenant) for span in spans]
        assert len(spans) == 9
        assert peak(spans) <= 2
    for spans in recorder.spans.values():
        assert peak(spans) == 1


def test_a_cancelled_or_finished_job_leaves_no_place_held(backend: Backend) -> None:
    recorder = Recorder()
    name = backend.fresh_name()
    queue = Queue(backend.url, name=name, interval=INTERVAL, fair=True, tenant_max_running=1)
    holder = queue.add(recorder.job, "t", block=True, tenant="t")
    recorder.wait_begun("t", 1)
    waiting = queue.add(recorder.job, "never", tenant="t")
    last = queue.add(recorder.job, "t", tenant="t")
    assert waiting.cancel()
    recorder.go.set()
    assert holder.result(WAIT) == "t"
    assert last.result(WAIT) == "t"
    assert waiting.cancelled()
    assert recorder.begun["never"] == 0
    queue.close()
    record = backend.open().read(cap_queue_name(name, "t")).record  # the queue closed its own state
    assert record is not None
    assert record.leases == ()


def test_a_retried_job_keeps_its_tenants_place(backend: Backend) -> None:
    events: list[str] = []
    tries = {"n": 0}

    def flaky() -> str:
        tries["n"] += 1
        events.append(f"flaky try {tries['n']}")
        if tries["n"] < 3:
            raise ConnectionError("not yet")
        return "ok"

    queue = Queue(
        backend.url,
        name=backend.fresh_name(),
        interval=INTERVAL,
        fair=True,
        tenant_max_running=1,
        retries=3,
        backoff=Backoff(base=0.02, jitter=False),
    )
    first = queue.add(flaky, tenant="t")
    second = queue.add(events.append, "after", tenant="t")
    assert first.result(WAIT) == "ok"
    second.result(WAIT)
    queue.close()
    assert events == ["flaky try 1", "flaky try 2", "flaky try 3", "after"]


def test_a_tenant_whose_place_cannot_be_had_fails_its_job_and_the_queue_goes_on(backend: Backend) -> None:
    name = backend.fresh_name()
    other_terms = Limiter(backend.url, name=cap_queue_name(name, "t"), interval=1e-6, max_running=5)
    other_terms.release(other_terms.acquire(timeout=WAIT))  # t's cap record now has max_running 5
    queue = Queue(backend.url, name=name, interval=INTERVAL, fair=True, tenant_max_running=1)
    refused = queue.add(lambda: "never", tenant="t")
    fine = queue.add(lambda: "fine", tenant="u")
    with pytest.raises(TermsMismatch):
        refused.result(WAIT)
    assert fine.result(WAIT) == "fine"
    queue.close()
    other_terms.close()


@pytest.mark.parametrize("bad", [0, True, 1001, "2"])
def test_a_bad_cap_is_refused_before_the_state_is_opened(bad: object) -> None:
    from ratequeue import ConfigurationError

    with pytest.raises(ConfigurationError, match="tenant_max_running"):
        Queue("memory://", name="caps-bad", interval=1, fair=True, tenant_max_running=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="fair=True"):
        Queue("memory://", name="caps-bad", interval=1, tenant_max_running=1)


def test_asyncio_queue_caps_a_tenant(backend: Backend) -> None:
    async def main() -> tuple[dict[str, int], list[str]]:
        state = backend.open_async()
        queue = aio.Queue(
            state, name=backend.fresh_name(), interval=INTERVAL, fair=True, tenant_max_running=1
        )
        running: dict[str, int] = defaultdict(int)
        most: dict[str, int] = defaultdict(int)
        done: list[str] = []

        async def job(tenant: str, seconds: float) -> None:
            running[tenant] += 1
            most[tenant] = max(most[tenant], running[tenant])
            await asyncio.sleep(seconds)
            running[tenant] -= 1
            done.append(tenant)

        slow = [queue.add(job, "a", 0.05, tenant="a") for _ in range(4)]
        quick = [queue.add(job, "b", 0.0, tenant="b") for _ in range(2)]
        await asyncio.wait_for(asyncio.gather(*quick), WAIT)
        await asyncio.wait_for(asyncio.gather(*slow), WAIT)
        await queue.close()
        await state.close()
        return dict(most), done

    most, done = asyncio.run(main())
    assert most == {"a": 1, "b": 1}
    assert done.count("b") == 2
    assert done.index("b") < 2  # b's jobs passed a's gated ones


def test_a_job_for_later_holds_no_place_until_its_time(backend: Backend) -> None:
    """A job added with ``not_before`` asks for its tenant's (and group's) place when that time comes."""
    recorder = Recorder()
    queue = Queue(backend.url, name=backend.fresh_name(), interval=INTERVAL, fair=True, tenant_max_running=1)
    later = queue.add(recorder.job, "later", tenant="t", group="g", not_before=1.0)
    now = queue.add(recorder.job, "now", tenant="t", group="g")
    assert now.result(WAIT) == "now"  # t's one place and g's were free: the job for later holds neither
    assert not later.done()
    assert later.result(WAIT) == "later"
    queue.close()
