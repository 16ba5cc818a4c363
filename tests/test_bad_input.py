"""Bad input gets a precise ConfigurationError at the boundary, touches no state, and shows no password."""

from __future__ import annotations

import asyncio
import datetime
import math
import pickle
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import ratequeue
import ratequeue.aio
from ratequeue import errors
from ratequeue._redact import redact
from ratequeue.errors import AcquireTimeout, ConfigurationError, StateCorrupted, StateUnavailable
from ratequeue.state.file import FileState
from ratequeue.state.memory import MemoryState

from .ops import do


def limiter(**changes: Any) -> Callable[[], object]:
    kwargs = {"name": "q", "interval": 0.1} | changes
    url = kwargs.pop("url", None)
    return lambda: ratequeue.Limiter(url, **kwargs)


def queue(**changes: Any) -> Callable[[], object]:
    kwargs = {"name": "q", "interval": 0.1} | changes
    url = kwargs.pop("url", None)
    return lambda: ratequeue.Queue(url, **kwargs)


CASES: dict[str, tuple[Callable[[], object], str]] = {
    "interval zero": (limiter(interval=0), "interval"),
    "interval negative": (limiter(interval=-1), "interval"),
    "interval NaN": (limiter(interval=math.nan), "interval"),
    "interval infinite": (limiter(interval=math.inf), "interval"),
    "interval a string": (limiter(interval="1"), "interval"),
    "interval a bool": (limiter(interval=True), "interval"),
    "interval under a microsecond": (limiter(interval=1e-7), "microsecond"),
    "interval a negative timedelta": (limiter(interval=datetime.timedelta(seconds=-1)), "interval"),
    "name empty": (limiter(name=""), "empty"),
    "name oversized": (limiter(name="x" * 201), "at most 200"),
    "name not a string": (limiter(name=42), "string"),
    "name with a newline": (limiter(name="a\nb"), "printable"),
    "lead negative": (limiter(lead=-0.1), "lead"),
    "lead NaN": (limiter(lead=math.nan), "lead"),
    "max_late negative": (limiter(max_late=-0.001), "max_late"),
    "max_late infinite": (limiter(max_late=math.inf), "max_late"),
    "max_late a string": (limiter(max_late="0.3 ms"), "max_late"),
    "unknown scheme": (limiter(url="ftp://host/x"), "unknown state URL scheme"),
    "a bare path string": (limiter(url="/tmp/state.json"), "file:///tmp/state.json"),
    "a URL of the wrong type": (limiter(url=42), "URL"),
    "memory URL with a path": (limiter(url="memory://x/y"), "memory://"),
    "file URL with a host": (limiter(url="file://otherhost/x.json"), "file:///"),
    "redis URL with a bad port": (limiter(url="redis://localhost:notaport"), "Redis URL"),
    "mongodb URL with a bad port": (limiter(url="mongodb://localhost:notaport"), "MongoDB URL"),
    "lead 1e10 s": (limiter(lead=1e10), r"lead .* from 0 to 3600"),
    "lead just over an hour": (limiter(lead=3600.001), r"lead .*\(an hour\), got 3600\.001"),
    "lead infinite": (limiter(lead=math.inf), "lead"),
    "redis URL with an unclosed IPv6 bracket": (limiter(url="redis://[::1"), r"Redis URL .*IPv6"),
    "mongodb database with a slash": (
        limiter(url="mongodb://localhost/?database=a/b"),
        r"database or collection name \(database='a/b'.*'/'",
    ),
    "mongodb database empty": (limiter(url="mongodb://localhost/?database="), r"database=''.*empty"),
    "mongodb collection with a dollar": (
        limiter(url="mongodb://localhost/?collection=$bad"),
        r"collection='\$bad'.*\$",
    ),
    "mongodb TLS key file missing": (
        limiter(url="mongodb://localhost/?tls=true&tlsCertificateKeyFile=/nonexistent/key.pem"),
        r"MongoDB URL .*/nonexistent/key\.pem",
    ),
    "queue max_running zero": (queue(max_running=0), "max_running"),
    "queue interval zero": (queue(interval=0), "interval"),
    "rate with an unknown unit": (limiter(interval=None, rate="10/fortnight"), "unknown unit 'fortnight'"),
    "rate zero": (limiter(interval=None, rate="0/s"), "whole number >= 1, got 0"),
    "rate negative": (limiter(interval=None, rate="-1/s"), "whole number >= 1, got -1"),
    "rate a float count": (limiter(interval=None, rate=(2.5, 1)), "whole number >= 1"),
    "rate a bare number": (limiter(interval=None, rate=10), "rate must be 'N/UNIT'"),
    "rate beside an interval": (limiter(rate="10/s"), "not both"),
    "neither interval nor rate": (limiter(interval=None), "give interval="),
    "burst zero": (limiter(burst=0), "burst must be an integer >= 1"),
    "burst a float": (limiter(burst=2.0), "burst must be an integer >= 1"),
    "burst too long for the record": (limiter(interval=86400, burst=2**31), r"burst \* interval"),
    "keep negative": (limiter(keep=-1), "keep"),
    "keep NaN": (limiter(keep=math.nan), "keep"),
    "queue rate unreadable": (queue(interval=None, rate="ten per second"), "cannot read rate"),
    "group keep None": (
        lambda: ratequeue.LimiterGroup("memory://", name="g", rate="1/s", keep=None),  # type: ignore[arg-type]
        "must expire",
    ),
    "group max_keys zero": (
        lambda: ratequeue.LimiterGroup("memory://", name="g", rate="1/s", max_keys=0),
        "max_keys",
    ),
    "group key empty": (lambda: ratequeue.LimiterGroup("memory://", name="g", rate="1/s")[""], "key"),
    "group key not a string": (lambda: ratequeue.LimiterGroup("memory://", name="g", rate="1/s")[7], "key"),  # type: ignore[index]
    "cost above the burst": (
        lambda: ratequeue.Limiter("memory://", name="c", rate="1/s").acquire(cost=2),
        "cost",
    ),
    "cost zero": (
        lambda: ratequeue.Limiter("memory://", name="c", rate="1/s", burst=3).try_acquire(cost=0),
        "cost",
    ),
    "all_of nothing": (lambda: ratequeue.all_of(), "at least one"),
}


@pytest.mark.parametrize(("make", "message"), CASES.values(), ids=CASES.keys())
def test_bad_construction(make: Callable[[], object], message: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match=message):
        make()


@pytest.mark.parametrize(
    ("url", "driver", "extra"),
    [("redis://localhost", "redis", "redis"), ("mongodb://localhost", "pymongo", "mongodb")],
)
def test_missing_extra_says_what_to_install(
    url: str, driver: str, extra: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the driver installed (hidden from import here), the error names the pip command."""
    monkeypatch.setitem(sys.modules, driver, None)
    monkeypatch.delitem(sys.modules, f"ratequeue.state.{extra}", raising=False)
    with pytest.raises(ConfigurationError, match=rf"pip install 'ratequeue\[{extra}\]'"):
        ratequeue.Limiter(url, name="q", interval=1)


@pytest.mark.parametrize("timeout", [-1, -0.001, math.nan, "1", datetime.timedelta(seconds=-1)])
def test_bad_timeout_raises_before_touching_state(timeout: object, tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    rq = ratequeue.Limiter(f"file://{path}", name="q", interval=0.1)
    with pytest.raises(ConfigurationError, match="timeout"):
        rq.acquire(timeout=timeout)  # type: ignore[arg-type]
    assert not path.exists()


def test_interval_mismatch_names_both_and_changes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    ratequeue.Limiter(f"file://{path}", name="q", interval=0.1).acquire()
    before = path.read_bytes()
    other = ratequeue.Limiter(f"file://{path}", name="q", interval=0.25)
    with pytest.raises(ConfigurationError, match=r"interval 0\.1 s .* not 0\.25 s"):
        other.acquire()
    assert path.read_bytes() == before
    assert other.status().waiting == 0


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda s: do(s, "take", "q", 0), "interval_us"),
        (lambda s: do(s, "take", "q", 1.5), "interval_us"),
        (lambda s: do(s, "take_and_try", "q", 1000, -1), "lead_us"),
        (lambda s: do(s, "try_start", "q", 1000, 0, 0), "ticket"),
        (lambda s: do(s, "try_start", "q", 1000, True, 0), "ticket"),
        (lambda s: do(s, "retime", "q", 1000, 0, 0), "ticket"),
        (lambda s: do(s, "retime", "q", 1000, 1, -5), "lead_us"),
        (lambda s: s.read(""), "empty"),
        (lambda s: s.reset("x" * 500), "at most"),
        (lambda s: do(s, "take", "q", 1000, burst=0), "burst"),
        (lambda s: do(s, "take", "q", 1000, cost=2), r"cost .* burst \(1\)"),
        (lambda s: do(s, "take_and_try", "q", 1000, 0, burst=3, cost=4), "cost"),
        (lambda s: do(s, "try_start", "q", 1000, 1, 0, burst=2, cost=0), "cost"),
        (lambda s: do(s, "take", "q", 1000, keep_us=-1), "keep_us"),
        (lambda s: do(s, "retime", "q", 2**40, 1, 0, burst=2**20), r"burst \* interval"),
        (lambda s: s.names("bad\nprefix"), "printable"),
        (lambda s: s.names(5), "prefix must be a string"),
    ],
)
def test_state_operations_check_their_arguments(
    call: Callable[[FileState], object], message: str, tmp_path: Path
) -> None:
    path = tmp_path / "state.json"
    state = FileState(path)
    with pytest.raises(ConfigurationError, match=message):
        call(state)
    assert not path.exists()


def test_corrupted_state_reaches_the_caller_and_is_not_overwritten(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    path.write_text("{broken")
    # max_late=None: a late wake-up under load would give ticket 1 up and the zero timeout would fail
    rq = ratequeue.Limiter(f"file://{path}", name="q", interval=0.1, max_late=None)
    with pytest.raises(StateCorrupted, match="not valid JSON"):
        rq.acquire()
    assert path.read_text() == "{broken"
    assert rq.status  # the limiter stays usable once the file is repaired
    path.unlink()
    assert rq.acquire(timeout=0).ticket == 1


@pytest.mark.parametrize(
    "error",
    [
        ConfigurationError("bad"),
        StateUnavailable("down", where="host:1"),
        StateCorrupted("broken", where="/x#q"),
        AcquireTimeout("late", name="q", timeout=1.5),
        errors.QueueClosed("closed"),
    ],
)
def test_errors_pickle_with_their_context(error: Exception) -> None:
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is type(error)
    assert again.args == error.args
    assert vars(again) == vars(error)


def test_errors_subclass_the_builtins_callers_expect() -> None:
    assert issubclass(AcquireTimeout, TimeoutError)
    assert issubclass(ConfigurationError, ValueError)
    assert issubclass(StateUnavailable, ConnectionError)
    for error in (AcquireTimeout, ConfigurationError, StateUnavailable, StateCorrupted, errors.QueueClosed):
        assert issubclass(error, errors.RateQueueError)


# ---------------------------------------------------------------- secrets stay out of messages

SECRET = "s3cretPW"

#: URLs holding SECRET that ratequeue refuses: (url, what the message still says)
LEAKING_URLS: dict[str, tuple[str, str]] = {
    "redis port not a number": (
        f"redis://:{SECRET}@host:notaport/0",
        r"Redis URL 'redis://:\*\*\*@host:notaport",
    ),
    "redis unclosed IPv6 bracket": (f"redis://user:{SECRET}@[::1/0", r"Redis URL .*user:\*\*\*@.*IPv6"),
    "redis query password, bad option": (
        f"redis://host/0?password={SECRET}&socket_timeout=bad",
        r"password=\*\*\*.*socket_timeout",
    ),
    "unix socket, bad db": (f"unix://:{SECRET}@/tmp/x.sock?db=notint", r"Redis URL .*'db'"),
    "unknown scheme": (f"ftp://u:{SECRET}@host/x", r"unknown state URL scheme in 'ftp://u:\*\*\*@host/x'"),
    "no scheme": (f"user:{SECRET}@host:6379", r"unknown state URL scheme in 'user:\*\*\*@host:6379'"),
    "memory URL with credentials": (f"memory://u:{SECRET}@x/y", r"memory URL .*u:\*\*\*@x/y"),
    "memory URL with a query password": (f"memory://?password={SECRET}", r"memory URL"),
    "file URL with credentials": (f"file://u:{SECRET}@host/x.json", r"file:///absolute"),
    "mongodb port not a number": (f"mongodb://u:{SECRET}@host:notaport", r"MongoDB URL .*Port"),
    "mongodb unescaped @ in the password": (f"mongodb://u:{SECRET}@x@host/", r"MongoDB URL .*RFC 3986"),
    "mongodb empty host": (f"mongodb://u:{SECRET}@/", r"MongoDB URL .*[Ee]mpty host"),
    "mongodb bad database name": (f"mongodb://u:{SECRET}@host/?database=a/b", r"database='a/b'"),
    "mongodb TLS key password, missing key file": (
        f"mongodb://host/?tls=true&tlsCertificateKeyFile=/nonexistent.pem&tlsCertificateKeyFilePassword={SECRET}",
        r"tlsCertificateKeyFilePassword=\*\*\*",
    ),
}


@pytest.mark.parametrize(("url", "message"), LEAKING_URLS.values(), ids=LEAKING_URLS.keys())
@pytest.mark.parametrize("driver", ["thread", "asyncio"])
def test_a_refused_url_never_shows_its_password(url: str, message: str, driver: str) -> None:
    """Nor in the message, nor in any chained error a traceback would print."""
    make = ratequeue.Limiter if driver == "thread" else ratequeue.aio.Limiter
    with pytest.raises(ConfigurationError, match=message) as caught:
        make(url, name="q", interval=1)
    printed = "".join(traceback.format_exception(caught.value))
    assert SECRET not in printed, printed
    assert "***" in str(caught.value) or "password" not in url


#: URLs holding secrets that ratequeue opens (lazily, connecting later) and shows in its repr
OPENED_URLS = [
    f"redis://127.0.0.1:1/0?password={SECRET}",
    f"redis://user:{SECRET}@127.0.0.1:1/0",
    f"rediss://127.0.0.1:1/0?ssl_password={SECRET}&ssl_keyfile_password={SECRET}",
    f"mongodb://u:{SECRET}@127.0.0.1:1/?authSource=admin",
    f"mongodb://127.0.0.1:1/?authMechanism=MONGODB-AWS&authMechanismProperties=AWS_SESSION_TOKEN:{SECRET}",
]


@pytest.mark.parametrize("url", OPENED_URLS)
def test_reprs_hide_passwords(url: str) -> None:
    rq = ratequeue.Limiter(url, name="q", interval=1)
    try:
        with ratequeue.Queue(rq.state, name="q", interval=1) as queue_:
            shown = [repr(rq), repr(rq.state), repr(rq.reserve()), repr(queue_)]
        assert all("127.0.0.1:1" in text and "***" in text for text in shown), shown
        assert not any(SECRET in text for text in shown), shown
    finally:
        rq.close()


def test_an_unreachable_server_is_reported_without_the_password() -> None:
    url = f"mongodb://u:{SECRET}@127.0.0.1:1/?serverSelectionTimeoutMS=50&connectTimeoutMS=50"
    rq = ratequeue.Limiter(url, name="q", interval=1)
    with pytest.raises(StateUnavailable) as caught:
        rq.acquire()
    rq.close()
    assert "127.0.0.1:1" in str(caught.value)
    assert SECRET not in str(caught.value)
    assert SECRET not in caught.value.where


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:pw@host:6379/0", "redis://:***@host:6379/0"),
        ("redis://user:pw@host:notaport/0", "redis://user:***@host:notaport/0"),
        ("redis://user:pw@[::1/0", "redis://user:***@[::1/0"),
        ("redis://:pa/ss@host/0", "redis://:***@host/0"),
        ("mongodb://u:p@w@h1:1,h2:2/admin", "mongodb://u:***@h1:1,h2:2/admin"),
        ("redis://host/0?password=pw&prefix=x", "redis://host/0?password=***&prefix=x"),
        ("redis://host/0?PassWord=pw", "redis://host/0?PassWord=***"),
        ("rediss://h/?ssl_password=a&ssl_keyfile_password=b", "rediss://h/?ssl_password=***&ssl_keyfile_password=***"),
        ("mongodb://h/?sslKeyPassword=a&tlsCertificateKeyFilePassword=b&tls=true",
         "mongodb://h/?sslKeyPassword=***&tlsCertificateKeyFilePassword=***&tls=true"),
        ("mongodb://h/?authMechanismProperties=AWS_SESSION_TOKEN:t,SERVICE_NAME:s",
         "mongodb://h/?authMechanismProperties=AWS_SESSION_TOKEN:***,SERVICE_NAME:s"),
        ("user:pw@host:6379", "user:***@host:6379"),
        ("redis://user@host/0", "redis://user@host/0"),
        ("file:///tmp/a@b.json", "file:///tmp/a@b.json"),
        ("memory://", "memory://"),
        ("", ""),
    ],
)  # fmt: skip
def test_redact(url: str, shown: str) -> None:
    assert redact(url) == shown


# ---------------------------------------------------------------- timeouts: math.inf waits for ever


@pytest.mark.parametrize("timeout", [math.inf, 1e12, 1e300, 10**400, datetime.timedelta.max])
def test_an_endless_timeout_waits_for_ever_even_while_paused(timeout: object) -> None:
    """math.inf (and any timeout over about 32 years, 10**400 too) is None: no OverflowError from the wait."""
    # max_late=None: a late wake-up under load would give ticket 1 up and shift the numbers
    rq = ratequeue.Limiter(f"memory://endless-{id(timeout)}", name="q", interval=0.01, max_late=None)
    assert rq.acquire(timeout=timeout).ticket == 1  # type: ignore[arg-type]
    rq.pause()
    threading.Timer(0.2, rq.resume).start()
    assert rq.acquire(timeout=timeout).ticket >= 2  # type: ignore[arg-type]
    rq.pause()
    threading.Timer(0.2, rq.resume).start()
    assert rq.reserve().wait(timeout=timeout) is not None  # type: ignore[arg-type]
    rq.close()


@pytest.mark.parametrize("timeout", [math.inf, 1e12])
def test_an_endless_timeout_waits_for_ever_on_asyncio(timeout: float) -> None:
    async def run() -> None:
        rq = ratequeue.aio.Limiter(f"memory://endless-aio-{timeout}", name="q", interval=0.01)
        await rq.acquire(timeout=timeout)
        rq.pause()
        asyncio.get_running_loop().call_later(0.2, rq.resume)
        assert (await rq.acquire(timeout=timeout)).ticket >= 2  # a late wake-up may take a new ticket
        await rq.close()

    asyncio.run(run())


def test_a_long_finite_timeout_still_expires_at_its_deadline() -> None:
    """Waits are cut to MAX_WAIT and taken again; the deadline is kept (a fake clock jumps past it)."""
    now = [0.0]
    rq = ratequeue.Limiter("memory://long-timeout", name="q", interval=1, clock=lambda: now[0])
    rq.pause()

    def later() -> None:
        now[0] = 2e6  # past the 1e6 s timeout
        rq.pause()  # still paused: wakes the waiting job to look at its deadline

    threading.Timer(0.1, later).start()
    with pytest.raises(AcquireTimeout, match=r"within 1000000\.0 s"):
        rq.acquire(timeout=1e6)
    rq.close()


# --------------------------------------------------------------------------- integers too large for a float

#: every parameter a number of seconds (or a rate's part) can come in by; each gets the huge integer
_HUGE_SETTINGS = ("interval", "lease", "lead", "max_late", "keep")


def _huge_cases(big: int) -> dict[str, Callable[[], object]]:
    """Each public way a huge integer reaches a setting, a timeout or a due time (issue 27, item 7)."""

    def memory() -> MemoryState:
        return MemoryState(private=True)

    def run(coroutine: Callable[[], Any]) -> Callable[[], object]:
        return lambda: asyncio.run(coroutine())

    async def aio_acquire() -> None:
        await ratequeue.aio.Limiter(memory(), name="q", interval=1).acquire(timeout=big)

    async def aio_all_of() -> None:
        await ratequeue.aio.all_of(ratequeue.aio.Limiter(memory(), name="q", interval=1), timeout=big)

    async def aio_join() -> None:
        rq = ratequeue.aio.Queue(memory(), name="q", interval=1)
        try:
            await rq.join(timeout=big)
        finally:
            await rq.close()

    async def aio_add() -> None:
        rq = ratequeue.aio.Queue(memory(), name="q", interval=1)
        try:
            rq.add(print, not_before=big)
        finally:
            await rq.close(cancel_pending=True)

    def join() -> None:
        with ratequeue.Queue(memory(), name="q", interval=1) as rq:
            rq.join(timeout=big)

    def add() -> None:
        with ratequeue.Queue(memory(), name="q", interval=1) as rq:
            rq.add(print, not_before=big)

    cases: dict[str, Callable[[], object]] = {}
    for name in _HUGE_SETTINGS:
        options = {"interval": 1, name: big}
        cases[f"Limiter {name}"] = lambda o=options: ratequeue.Limiter(memory(), name="q", **o)  # type: ignore[misc]
        cases[f"aio.Limiter {name}"] = lambda o=options: ratequeue.aio.Limiter(memory(), name="q", **o)  # type: ignore[misc]
        cases[f"Queue {name}"] = lambda o=options: ratequeue.Queue(memory(), name="q", **o)  # type: ignore[misc]
        cases[f"aio.Queue {name}"] = lambda o=options: ratequeue.aio.Queue(memory(), name="q", **o)  # type: ignore[misc]
    cases |= {
        "LimiterGroup keep": lambda: ratequeue.LimiterGroup(memory(), name="g", interval=1, keep=big),
        "rate (count, per): count": lambda: ratequeue.Limiter(memory(), name="q", rate=(big, 1)),
        "rate (count, per): per": lambda: ratequeue.Limiter(memory(), name="q", rate=(1, big)),
        "Queue rate (count, per): per": lambda: ratequeue.Queue(memory(), name="q", rate=(1, big)),
        "Rate count": lambda: ratequeue.Rate(big, per=1),
        "Rate per": lambda: ratequeue.Rate(1, per=big),
        "rate text count": lambda: ratequeue.parse_rate(f"{big}/s"),
        "Backoff base": lambda: ratequeue.Backoff(base=big),
        "Backoff factor": lambda: ratequeue.Backoff(factor=big),
        "Backoff max": lambda: ratequeue.Backoff(max=big),
        "Queue.add not_before": add,
        "aio.Queue.add not_before": run(aio_add),
    }
    if big > 0:  # a timeout over about 32 years is None, waiting for ever (as math.inf): see above
        return cases
    cases |= {
        "acquire timeout": lambda: ratequeue.Limiter(memory(), name="q", interval=1).acquire(timeout=big),
        "reservation wait timeout": lambda: (
            ratequeue.Limiter(memory(), name="q", interval=1).reserve().wait(timeout=big)
        ),
        "all_of timeout": lambda: ratequeue.all_of(
            ratequeue.Limiter(memory(), name="q", interval=1), timeout=big
        ),
        "aio acquire timeout": run(aio_acquire),
        "aio all_of timeout": run(aio_all_of),
        "Queue.join timeout": join,
        "aio.Queue.join timeout": run(aio_join),
    }
    return cases


_HUGE = [
    pytest.param(make, id=f"{label} {sign}10**400")
    for sign, big in (("+", 10**400), ("-", -(10**400)))
    for label, make in _huge_cases(big).items()
]


@pytest.mark.parametrize("make", _HUGE)
def test_an_integer_too_large_for_a_float_is_a_configuration_error(make: Callable[[], object]) -> None:
    """``float(10**400)`` raises ``OverflowError``: every parameter turns it into a ConfigurationError."""
    with pytest.raises(ConfigurationError):
        make()


def test_the_huge_integer_error_names_the_parameter() -> None:
    with pytest.raises(ConfigurationError, match=r"lease must be a number a float can hold.*1329 bits"):
        ratequeue.Limiter("memory://", name="q", interval=1, lease=10**400)
    with (
        ratequeue.Queue("memory://", name="q", interval=1) as rq,
        pytest.raises(ConfigurationError, match=r"not_before must be a number a float can hold"),
    ):
        rq.add(print, not_before=-(10**400))
