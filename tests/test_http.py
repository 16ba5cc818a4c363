"""ratequeue's HTTP integrations against the quota referee (``bench/quota_referee.py``), on real sockets.

The referee allows a number of calls per fixed window, answers 429 with
``Retry-After`` over it, and publishes ``X-RateLimit-Remaining`` and
``-Reset-After`` on every answer; the clients are configured far faster
than it allows and do not know its quota. Through each integration, the
answer that says "0 left" holds the queue until the window's end, so no
call is refused; and after a ``Retry-After``, no call of any process comes
before it has run out.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import closing
from pathlib import Path

import httpx
import pytest

import ratequeue
import ratequeue.aio
import ratequeue.httpx
from ratequeue import ConfigurationError

from ._http_workers import call_in_process, call_through
from .backends import Backend

BENCH = str(Path(__file__).resolve().parents[1] / "bench")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)

from quota_referee import QuotaReferee  # noqa: E402

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def referee() -> Iterator[QuotaReferee]:
    with QuotaReferee() as served:
        yield served


@pytest.mark.parametrize("client", ["httpx", "httpx-async", "requests", "aiohttp"])
def test_a_quota_left_at_zero_holds_until_the_window_ends(
    client: str, referee: QuotaReferee, tmp_path: Path
) -> None:
    """5 calls per 1 s window, 12 calls at a 10 ms interval: the 6th and 11th wait for the next window."""
    referee.reset(phases=((5.0, 100.0),), window=1.0)
    url = f"file://{tmp_path / 'state.json'}"
    statuses = call_through(client, url, "quota", 0.01, f"{referee.url}/call?who={client}", 12)
    stats = referee.stats()
    assert statuses == [200] * 12, "no call refused"
    windows = {int((t - stats.started) // stats.window) for t, *_ in stats.arrivals}
    assert windows == {0, 1, 2}, "5 calls in each of the first two windows, 2 in the third"


def test_no_process_calls_while_a_retry_after_runs(shared_backend: Backend, referee: QuotaReferee) -> None:
    """A quota of 0: every call is refused with Retry-After; 4 processes wait it out together."""
    if shared_backend.kind not in ("file", "redis"):
        pytest.skip("the integrations are measured on the file state and Redis (bench/feedback.py)")
    referee.reset(phases=((0.0, 100.0),), window=1.0)
    name = shared_backend.fresh_name()
    jobs = [("httpx", shared_backend.url, name, 0.1, f"{referee.url}/call?who=p{i}", 2) for i in range(4)]
    with ProcessPoolExecutor(4, mp_context=multiprocessing.get_context("spawn")) as pool:
        results = list(pool.map(call_in_process, jobs))
    assert all(statuses == [429, 429] for statuses in results)
    early = referee.stats().early_calls()
    # a call already sent when the refusal came (within an interval of it) was not told yet
    assert [after for after, _ in early if after > 0.05] == [], "no call within a Retry-After"


def test_retries_send_a_refused_call_again_after_the_hold(referee: QuotaReferee, tmp_path: Path) -> None:
    referee.reset(phases=((0.0, 1.0), (100.0, 100.0)), window=1.0)  # nothing in the first second
    with closing(ratequeue.Limiter(f"file://{tmp_path / 's.json'}", name="again", interval=0.01)) as limiter:
        transport = ratequeue.httpx.Transport(limiter, retries=2)
        with httpx.Client(transport=transport) as http:
            assert http.get(f"{referee.url}/call").status_code == 200
    statuses = [status for _, status, *_ in referee.stats().arrivals]
    assert statuses == [429, 200], "refused once, sent again after Retry-After: 1"


def test_a_group_gives_each_host_its_own_limiter(referee: QuotaReferee) -> None:
    referee.reset(phases=((100.0, 100.0),), window=1.0)
    group = ratequeue.LimiterGroup("memory://", name="hosts", interval=0.01)
    transport = ratequeue.httpx.Transport(group, key=lambda request: request.url.host)
    with httpx.Client(transport=transport) as http:
        assert http.get(f"{referee.url}/call").status_code == 200
    assert [limiter.name for limiter in group.limiters()] == ["hosts:127.0.0.1"]
    group.close()


def test_bad_arguments_are_refused_when_made() -> None:
    limiter = ratequeue.Limiter("memory://", name="bad", interval=0.01)
    with pytest.raises(ConfigurationError, match="retries"):
        ratequeue.httpx.Transport(limiter, retries=-1)
    with pytest.raises(ConfigurationError, match="limiter"):
        ratequeue.httpx.Transport(object())
    with pytest.raises(ConfigurationError, match="key"):
        ratequeue.httpx.Transport(limiter, key=lambda request: "k")  # a limiter has no keys
    with pytest.raises(ConfigurationError, match="cost"):
        ratequeue.httpx.Transport(limiter, cost=0)
    limiter.close()


def test_an_idle_request_costs_one_state_call() -> None:
    """Nothing heard, nothing written: a request through the transport makes the acquire's one call."""
    calls: list[str] = []

    def count(event: ratequeue.Event) -> None:
        if event.kind == "call":
            calls.append(event.operation or "")

    # (max_late=None: a first answer's round-trip may make its start late, which a retime would mend)
    limiter = ratequeue.Limiter("memory://", name="idle", interval=0.01, max_late=None, on_event=count)
    quota_left = {"X-RateLimit-Remaining": "7", "X-RateLimit-Reset": "30"}
    service = httpx.MockTransport(lambda request: httpx.Response(200, headers=quota_left))
    with httpx.Client(transport=ratequeue.httpx.Transport(limiter, service)) as http:
        http.get("https://api.example/a")
    limiter.close()  # delivers the events
    assert calls == ["take_and_try"]


def test_an_answer_the_state_cannot_be_told_of_still_reaches_the_caller(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The state down (a closed port; turns begin locally): a 429 is returned, not lost to an error."""
    import socket

    with socket.socket() as probe:  # a loopback port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    limiter = ratequeue.Limiter(f"redis://127.0.0.1:{port}/0", name="down", interval=0.01, when_down="open")
    service = httpx.MockTransport(lambda request: httpx.Response(429, headers={"Retry-After": "1"}))
    with httpx.Client(transport=ratequeue.httpx.Transport(limiter, service, retries=2)) as http:
        assert http.get("https://api.example/a").status_code == 429, "returned as it came, not retried"
    limiter.close()
    assert "a 429 answer could not be heeded (StateUnavailable" in caplog.text


def test_a_refused_streamed_body_is_not_sent_again(referee: QuotaReferee, tmp_path: Path) -> None:
    """A body read from a generator cannot be replayed: the refusal is returned, not a broken retry."""
    referee.reset(phases=((0.0, 100.0),), window=1.0)
    with closing(ratequeue.Limiter(f"file://{tmp_path / 's.json'}", name="stream", interval=0.01)) as limiter:
        transport = ratequeue.httpx.Transport(limiter, retries=2)
        with httpx.Client(transport=transport) as http:
            body = (part for part in (b"a", b"b"))
            assert http.post(f"{referee.url}/call", content=body).status_code == 429
    assert len(referee.stats().arrivals) == 1, "sent once"


def test_an_adaptive_limiter_takes_any_stated_policy_without_raising() -> None:
    with closing(ratequeue.Limiter("memory://", name="daily", interval=0.01, adaptive=True)) as limiter:
        limiter.heed({"RateLimit-Policy": "10;w=86400"}, status=200)  # 10 a day: slowed as far as it goes
        status = limiter.status()
        assert status.effective_interval is not None
        assert status.effective_interval == pytest.approx(0.64), "64 intervals at most"


def test_a_refusal_with_an_unreadable_wait_is_refused_when_made() -> None:
    with pytest.raises(ConfigurationError, match="retry_after"):
        ratequeue.RateLimited(retry_after="2")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="retry_after"):
        ratequeue.RateLimited(retry_after=-1)
    assert ratequeue.RateLimited(retry_after=2).retry_after == 2


class _Descheduled(httpx.BaseTransport):
    """httpx's own transport, after ``delay`` s: the fault of a process descheduled before its write."""

    def __init__(self, delay: float) -> None:
        self.delay, self.inner = delay, httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        time.sleep(self.delay)  # the injected fault, not a wait for anything
        return self.inner.handle_request(request)

    def close(self) -> None:
        self.inner.close()


class _AsyncDescheduled(httpx.AsyncBaseTransport):
    """:class:`_Descheduled` for ``httpx.AsyncClient``."""

    def __init__(self, delay: float) -> None:
        self.delay, self.inner = delay, httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(self.delay)
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


@pytest.mark.parametrize("delay", [0.0, 0.1], ids=["in-time", "100-ms-late"])
def test_httpx_tells_the_limiter_when_a_request_is_written(referee: QuotaReferee, delay: float) -> None:
    """A request written 100 ms after its turn's start holds the queue; one in time holds nothing.

    The request's own ``trace`` still sees every event.
    """
    referee.reset(phases=((100.0, 100.0),), window=1.0)
    seen: list[str] = []
    limiter = ratequeue.Limiter("memory://", name=f"written-{delay}", interval=0.5, max_late=0.04)
    with (
        closing(limiter),
        httpx.Client(transport=ratequeue.httpx.Transport(limiter, _Descheduled(delay))) as http,
    ):
        answer = http.get(f"{referee.url}/call", extensions={"trace": lambda name, info: seen.append(name)})
        assert answer.status_code == 200
        held = limiter.status().held_until
    assert "http11.send_request_body.complete" in seen, seen
    assert (held is not None) == (delay > 0), f"held until {held} for a request {delay * 1000:g} ms late"


def test_the_async_httpx_transport_holds_after_a_late_write(referee: QuotaReferee) -> None:
    referee.reset(phases=((100.0, 100.0),), window=1.0)

    async def main() -> float | None:
        limiter = ratequeue.aio.Limiter("memory://", name="written-async", interval=0.5, max_late=0.04)
        transport = ratequeue.httpx.AsyncTransport(limiter, _AsyncDescheduled(0.1))
        try:
            async with httpx.AsyncClient(transport=transport) as http:
                assert (await http.get(f"{referee.url}/call")).status_code == 200
            return (await limiter.status()).held_until
        finally:
            await limiter.close()

    assert asyncio.run(main()) is not None
