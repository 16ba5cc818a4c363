"""Bad input gets a precise ConfigurationError at the boundary, and touches no state."""

from __future__ import annotations

import datetime
import math
import pickle
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import ratequeue
from ratequeue import errors
from ratequeue.errors import AcquireTimeout, ConfigurationError, StateCorrupted, StateUnavailable
from ratequeue.state.file import FileState


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
    "queue max_running zero": (queue(max_running=0), "max_running"),
    "queue interval zero": (queue(interval=0), "interval"),
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
        (lambda s: s.take("q", 0), "interval_us"),
        (lambda s: s.take("q", 1.5), "interval_us"),
        (lambda s: s.take_and_try("q", 1000, -1), "lead_us"),
        (lambda s: s.try_start("q", 1000, 0, 0), "ticket"),
        (lambda s: s.try_start("q", 1000, True, 0), "ticket"),
        (lambda s: s.retime("q", 1000, 0, 0), "ticket"),
        (lambda s: s.retime("q", 1000, 1, -5), "lead_us"),
        (lambda s: s.read(""), "empty"),
        (lambda s: s.reset("x" * 500), "at most"),
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
    rq = ratequeue.Limiter(f"file://{path}", name="q", interval=0.1)
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
