"""The strict rate-limit referee of the benchmarks (``bench/referee.py``), on real sockets.

Each test starts a real referee process and talks HTTP to it over loopback.
Time is only ever driven by waiting on the monotonic clock for a stated
duration, which is the thing under test (arrival gaps); where the outcome
must not depend on how fast this machine is, the referee's interval is long
(seconds) so that "back to back" is certainly inside it and a 20 ms wait
certainly shorter.
"""

from __future__ import annotations

import http.client
import os
import pickle
import signal
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

BENCH = str(Path(__file__).resolve().parents[1] / "bench")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)

from referee import Referee, RefereeClient  # noqa: E402

pytestmark = pytest.mark.timeout(30)

#: the short interval the waiting tests use, in seconds
SHORT = 0.02


def wait_until(deadline: float) -> None:
    """Wait until ``time.monotonic()`` reaches ``deadline``."""
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(left)


@pytest.fixture(scope="module")
def referee() -> Iterator[Referee]:
    """One referee process for the module; each test resets it to the settings it needs."""
    with Referee(interval=10.0) as started:
        yield started


@pytest.fixture
def client(referee: Referee) -> Iterator[RefereeClient]:
    made = RefereeClient(str(referee.url))
    made.connect()
    yield made
    made.close()


def raw(url: str, data: bytes) -> bytes:
    """Send ``data`` on a new connection and return everything the referee sends until it closes it."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(data)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_the_first_call_is_accepted(referee: Referee, client: RefereeClient) -> None:
    referee.reset(interval=10.0, tolerance=0.0)
    assert client.call("first") == 200


def test_a_call_back_to_back_with_an_accepted_one_is_refused(referee: Referee, client: RefereeClient) -> None:
    referee.reset(interval=10.0, tolerance=0.0)
    assert client.call() == 200
    assert client.call() == 429
    assert client.call() == 429  # a refused call does not move the reference point
    stats = referee.stats()
    assert (stats.accepted, stats.rejected) == (1, 2)


def test_a_call_an_interval_after_the_last_accepted_is_accepted(
    referee: Referee, client: RefereeClient
) -> None:
    referee.reset(interval=SHORT, tolerance=0.0)
    assert client.call("a") == 200
    answered = time.monotonic()  # "a" arrived before this
    assert client.call("b") == 429
    wait_until(answered + SHORT)
    assert client.call("c") == 200
    arrivals = referee.stats().arrivals
    assert [a.who for a in arrivals] == ["a", "b", "c"]
    assert arrivals[2].t_ns - arrivals[0].t_ns >= SHORT * 1e9


def test_the_tolerance_lets_a_call_come_that_much_early(referee: Referee, client: RefereeClient) -> None:
    # interval 10 s, tolerance 9.98 s: a call 20 ms after the last accepted one is accepted...
    referee.reset(interval=10.0, tolerance=10.0 - SHORT)
    assert client.call("a") == 200
    answered = time.monotonic()
    wait_until(answered + SHORT)
    assert client.call("b") == 200
    # ...and one back to back with it (far less than 10 - 9 s later) is refused
    referee.reset(interval=10.0, tolerance=9.0)
    assert client.call("c") == 200
    assert client.call("d") == 429
    # without the tolerance the same 20 ms wait is far too short
    referee.reset(interval=10.0, tolerance=0.0)
    assert client.call("e") == 200
    answered = time.monotonic()
    wait_until(answered + SHORT)
    assert client.call("f") == 429


def test_stats_record_every_arrival_in_order_with_its_tag(referee: Referee) -> None:
    referee.reset(interval=10.0, tolerance=0.0)
    one, two = RefereeClient(str(referee.url)), RefereeClient(str(referee.url))
    try:
        before = time.time()
        statuses = [one.call("p1"), two.call("p2"), one.call(), two.call("p 2/x&y")]
        after = time.time()
    finally:
        one.close()
        two.close()
    stats = referee.stats()
    assert statuses == [200, 429, 429, 429]
    assert [(a.who, a.accepted) for a in stats.arrivals] == [
        ("p1", True),
        ("p2", False),
        (None, False),
        ("p 2/x&y", False),
    ]
    times = [a.t_ns for a in stats.arrivals]
    assert times == sorted(times)
    # CLOCK_REALTIME; allow for the float rounding of time.time()
    assert before - 0.001 <= stats.arrivals[0].t <= stats.arrivals[-1].t <= after + 0.001
    assert (stats.interval, stats.tolerance, stats.accepted, stats.rejected) == (10.0, 0.0, 1, 3)
    assert stats.kernel_stamped + stats.fallback_stamped == 4
    if sys.platform.startswith("linux"):
        assert stats.kernel_timestamps, stats.timestamps


def test_reset_forgets_the_arrivals_and_changes_the_settings(referee: Referee, client: RefereeClient) -> None:
    referee.reset(interval=10.0, tolerance=0.0)
    assert client.call() == 200
    assert client.call() == 429
    referee.reset(interval=5.0, tolerance=1.0)
    stats = referee.stats()
    assert (stats.interval, stats.tolerance, stats.accepted, stats.rejected, stats.arrivals) == (
        5.0,
        1.0,
        0,
        0,
        [],
    )
    assert client.call() == 200  # the last accepted call is forgotten too


def test_reset_over_http_keeps_what_it_is_not_given(referee: Referee) -> None:
    referee.reset(interval=3.0, tolerance=0.5)
    answer = raw(
        str(referee.url), b"GET /reset?tolerance=0.25 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    assert answer.startswith(b"HTTP/1.1 200 ")
    stats = referee.stats()
    assert (stats.interval, stats.tolerance) == (3.0, 0.25)


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GARBAGE\r\n\r\n",
        b"GET /call HTTP/2.0\r\n\r\n",
        b"GET /call HTTP/1.1\r\nno colon here\r\n\r\n",
        b"POST /call HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        b"POST /call HTTP/1.1\r\nContent-Length: -3\r\n\r\n",
    ],
)
def test_a_malformed_request_gets_400_and_its_connection_is_closed(
    referee: Referee, request_bytes: bytes
) -> None:
    referee.reset(interval=10.0, tolerance=0.0)
    answer = raw(str(referee.url), request_bytes + b"GET /call HTTP/1.1\r\nConnection: close\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 400 "), answer
    assert answer.count(b"HTTP/1.1 ") == 1  # what followed on that connection was not read
    stats = referee.stats()
    assert (stats.accepted, stats.rejected) == (0, 0)


@pytest.mark.parametrize("query", [b"interval=0", b"interval=soon", b"tolerance=-1", b"interval=inf"])
def test_a_reset_with_bad_settings_gets_400_and_changes_nothing(referee: Referee, query: bytes) -> None:
    referee.reset(interval=10.0, tolerance=0.0)
    answer = raw(
        str(referee.url),
        b"POST /reset?" + query + b" HTTP/1.1\r\n\r\n"
        b"GET /call?who=after HTTP/1.1\r\nConnection: close\r\n\r\n",
    )
    assert answer.startswith(b"HTTP/1.1 400 "), answer
    assert answer.count(b"HTTP/1.1 200 ") == 1  # the connection stays usable
    stats = referee.stats()
    assert (stats.interval, stats.tolerance) == (10.0, 0.0)
    assert [a.who for a in stats.arrivals] == ["after"]


def test_unknown_paths_and_methods_are_refused(referee: Referee) -> None:
    url = str(referee.url)
    assert raw(url, b"GET /nothing HTTP/1.1\r\nConnection: close\r\n\r\n").startswith(b"HTTP/1.1 404 ")
    assert raw(url, b"DELETE /call HTTP/1.1\r\nConnection: close\r\n\r\n").startswith(b"HTTP/1.1 405 ")


def test_bodies_keep_alive_and_connection_close(referee: Referee) -> None:
    referee.reset(interval=10.0, tolerance=0.0)
    pipelined = (
        b"POST /call?who=a HTTP/1.1\r\nContent-Length: 5\r\n\r\nGET /"  # a body that looks like a request
        b"GET /call?who=b HTTP/1.1\r\n\r\n"
        b"GET /call?who=c HTTP/1.0\r\n\r\n"  # HTTP/1.0 without keep-alive: the last one answered
        b"GET /call?who=d HTTP/1.1\r\n\r\n"
    )
    answer = raw(str(referee.url), pipelined)
    assert answer.count(b"HTTP/1.1 ") == 3
    assert answer.startswith(b"HTTP/1.1 200 ")
    assert answer.count(b"HTTP/1.1 429 ") == 2
    assert answer.rstrip().endswith(b"too soon")
    assert [a.who for a in referee.stats().arrivals] == ["a", "b", "c"]


def test_a_stalled_referee_judges_by_arrival_not_by_reading_time(referee: Referee) -> None:
    """Calls reaching a stopped referee are judged by when they arrived, in the order they arrived."""
    if not sys.platform.startswith("linux"):
        pytest.skip("kernel receive timestamps are a Linux feature")
    referee.reset(interval=SHORT, tolerance=0.0)
    pid = referee.pid
    assert pid is not None
    host, port = str(referee.url).removeprefix("http://").split(":")
    later = http.client.HTTPConnection(host, int(port), timeout=5)
    earlier = http.client.HTTPConnection(host, int(port), timeout=5)
    try:
        later.connect()  # the later caller's connection is the older one
        earlier.connect()
        os.kill(pid, signal.SIGSTOP)
        try:
            earlier.request("GET", "/call?who=first")  # in the referee's socket buffer once sent
            sent = time.monotonic()
            wait_until(sent + SHORT + 0.005)
            later.request("GET", "/call?who=second")
        finally:
            os.kill(pid, signal.SIGCONT)
        statuses = []
        for conn in (earlier, later):
            response = conn.getresponse()
            response.read()
            statuses.append(response.status)
    finally:
        earlier.close()
        later.close()
    arrivals = referee.stats().arrivals
    # read together once the referee runs again, yet both accepted: they arrived 25 ms apart
    assert [(a.who, a.accepted) for a in arrivals] == [("first", True), ("second", True)]
    assert statuses == [200, 200]
    assert arrivals[1].t_ns - arrivals[0].t_ns >= SHORT * 1e9


def test_a_client_is_picklable_and_reconnects_lazily(referee: Referee, client: RefereeClient) -> None:
    referee.reset(interval=10.0, tolerance=0.0)
    assert client.call("before") == 200
    copy = pickle.loads(pickle.dumps(client))
    try:
        assert copy.url == client.url
        assert copy.call("copy") == 429
    finally:
        copy.close()
    assert [a.who for a in referee.stats().arrivals] == ["before", "copy"]


def test_referee_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="interval"):
        Referee(interval=0.0)
    with pytest.raises(ValueError, match="tolerance"):
        Referee(interval=1.0, tolerance=-0.1)
    with pytest.raises(ValueError, match="http://HOST:PORT"):
        RefereeClient("127.0.0.1:80")
