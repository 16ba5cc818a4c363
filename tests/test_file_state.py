"""The JSON-file state: the host clock, the file's format and permissions, and bad content."""

from __future__ import annotations

import datetime
import json
import os
import stat
from pathlib import Path

import pytest
from freezegun import freeze_time

from ratequeue import protocol
from ratequeue.errors import ConfigurationError, StateCorrupted
from ratequeue.protocol import Passed, Started, Wait
from ratequeue.state import from_url
from ratequeue.state.file import FileState

INTERVAL = 100_000  # us
T0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
T0_US = int(T0.timestamp()) * 1_000_000


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "state.json"


def test_frozen_clock_makes_every_answer_exact(path: Path) -> None:
    """With time frozen, the answers are exactly those of the reference at that instant."""
    state = FileState(path)
    with freeze_time(T0):
        assert state.take_and_try("q", INTERVAL, 0) == Started(ticket=1, start=T0_US, now=T0_US)
        assert state.take_and_try("q", INTERVAL, 0) == Wait(ticket=2, slot=T0_US + INTERVAL, now=T0_US)
        assert state.try_start("q", INTERVAL, 2, INTERVAL) == Started(
            ticket=2, start=T0_US + INTERVAL, now=T0_US
        )
        assert state.try_start("q", INTERVAL, 1, 0) == Passed(ticket=1, pos=2, now=T0_US)
        snapshot = state.read("q")
    assert snapshot.now == T0_US
    assert snapshot.record == protocol.Record(ticket=3, pos=2, at=T0_US + INTERVAL, interval=INTERVAL)


def test_ticking_clock_grants_the_slot_when_it_comes(path: Path) -> None:
    """As the host clock moves, a waiting ticket starts exactly at its slot, not before."""
    state = FileState(path)
    with freeze_time(T0) as frozen:
        state.take_and_try("q", INTERVAL, 0)
        assert isinstance(state.take_and_try("q", INTERVAL, 0), Wait)
        frozen.tick(datetime.timedelta(microseconds=INTERVAL - 1))
        assert state.try_start("q", INTERVAL, 2, 0) == Wait(
            ticket=2, slot=T0_US + INTERVAL, now=T0_US + INTERVAL - 1
        )
        frozen.tick(datetime.timedelta(microseconds=1))
        assert state.try_start("q", INTERVAL, 2, 0) == Started(
            ticket=2, start=T0_US + INTERVAL, now=T0_US + INTERVAL
        )


def test_clock_stepping_back_only_delays(path: Path) -> None:
    """A host clock stepped back never lets a start come sooner than one interval after the last."""
    state = FileState(path)
    with freeze_time(T0) as frozen:
        state.take_and_try("q", INTERVAL, 0)
        frozen.move_to(T0 - datetime.timedelta(seconds=5))
        outcome = state.take_and_try("q", INTERVAL, 0)
        assert outcome == Wait(ticket=2, slot=T0_US + INTERVAL, now=T0_US - 5_000_000)
        frozen.move_to(T0 + datetime.timedelta(microseconds=INTERVAL))
        assert state.try_start("q", INTERVAL, 2, 0) == Started(
            ticket=2, start=T0_US + INTERVAL, now=T0_US + INTERVAL
        )


def test_many_queues_in_one_file_and_a_readable_format(path: Path) -> None:
    state = FileState(path)
    with freeze_time(T0):
        state.take_and_try("a", INTERVAL, 0)
        state.take("b", 2 * INTERVAL)
    data = json.loads(path.read_text())
    assert data == {
        "format": "ratequeue-state",
        "version": 1,
        "queues": {
            "a": {"ticket": 2, "pos": 1, "at": T0_US, "interval": INTERVAL},
            "b": {"ticket": 2, "pos": 0, "at": None, "interval": 2 * INTERVAL},
        },
    }


def test_file_and_lock_are_private_to_the_user(path: Path) -> None:
    FileState(path).take("q", INTERVAL)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(Path(f"{path}.lock").stat().st_mode) == 0o600
    assert sorted(p.name for p in path.parent.iterdir()) == ["state.json", "state.json.lock"]


def test_interval_mismatch_changes_nothing(path: Path) -> None:
    state = FileState(path)
    state.take("q", INTERVAL)
    before = path.read_bytes()
    with pytest.raises(ConfigurationError, match=r"interval 0\.1 s .* not 0\.2 s"):
        state.take_and_try("q", 2 * INTERVAL, 0)
    assert path.read_bytes() == before


def test_reset_removes_one_queue(path: Path) -> None:
    state = FileState(path)
    state.take("a", INTERVAL)
    state.take("b", INTERVAL)
    assert state.reset("a") is True
    assert state.reset("a") is False
    assert state.read("a").record is None
    assert state.read("b").record is not None


CORRUPT = {
    "not json": b"{not json",
    "empty": b"",
    "a list": b"[]",
    "another format": json.dumps({"format": "other", "version": 1, "queues": {}}).encode(),
    "a future version": json.dumps({"format": "ratequeue-state", "version": 99, "queues": {}}).encode(),
    "queues not an object": json.dumps({"format": "ratequeue-state", "version": 1, "queues": []}).encode(),
    "record not an object": json.dumps(
        {"format": "ratequeue-state", "version": 1, "queues": {"q": 3}}
    ).encode(),
    "record missing a field": json.dumps(
        {"format": "ratequeue-state", "version": 1, "queues": {"q": {"ticket": 2, "pos": 1, "at": 5}}}
    ).encode(),
    "pos not below ticket": json.dumps(
        {
            "format": "ratequeue-state",
            "version": 1,
            "queues": {"q": {"ticket": 2, "pos": 2, "at": 5, "interval": 1}},
        }
    ).encode(),
    "ticket a float": json.dumps(
        {
            "format": "ratequeue-state",
            "version": 1,
            "queues": {"q": {"ticket": 2.5, "pos": 1, "at": 5, "interval": 1}},
        }
    ).encode(),
    "interval zero": json.dumps(
        {
            "format": "ratequeue-state",
            "version": 1,
            "queues": {"q": {"ticket": 2, "pos": 1, "at": 5, "interval": 0}},
        }
    ).encode(),
    "at a string": json.dumps(
        {
            "format": "ratequeue-state",
            "version": 1,
            "queues": {"q": {"ticket": 2, "pos": 1, "at": "x", "interval": 1}},
        }
    ).encode(),
}


@pytest.mark.parametrize("content", CORRUPT.values(), ids=CORRUPT.keys())
@pytest.mark.parametrize("operation", ["take", "take_and_try", "try_start", "read"])
def test_corrupted_file_raises_and_is_left_untouched(path: Path, content: bytes, operation: str) -> None:
    path.write_bytes(content)
    os.chmod(path, 0o600)
    state = FileState(path)
    calls = {
        "take": lambda: state.take("q", 1),
        "take_and_try": lambda: state.take_and_try("q", 1, 0),
        "try_start": lambda: state.try_start("q", 1, 1, 0),
        "read": lambda: state.read("q"),
    }
    with pytest.raises(StateCorrupted) as raised:
        calls[operation]()
    assert str(path) in raised.value.where
    assert path.read_bytes() == content


def test_symlink_and_directory_are_refused(tmp_path: Path) -> None:
    real = tmp_path / "real.json"
    link = tmp_path / "link.json"
    link.symlink_to(real)
    with pytest.raises(ConfigurationError, match="symbolic link"):
        FileState(link)
    with pytest.raises(ConfigurationError, match="directory"):
        FileState(tmp_path)
    assert not real.exists()


def test_symlink_swapped_in_after_opening_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    state = FileState(path)
    target = tmp_path / "elsewhere.json"
    target.write_text("precious")
    path.symlink_to(target)
    with pytest.raises(ConfigurationError, match="symbolic link"):
        state.take("q", INTERVAL)
    assert target.read_text() == "precious"


def test_missing_directory_is_a_configuration_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="does not exist"):
        FileState(tmp_path / "nowhere" / "state.json")


@pytest.mark.parametrize("host", ["", "localhost"])
def test_file_urls(tmp_path: Path, host: str) -> None:
    state = from_url(f"file://{host}{tmp_path}/my%20state.json")
    assert isinstance(state, FileState)
    assert state.path == tmp_path / "my state.json"
    assert from_url(state.url).path == state.path  # type: ignore[attr-defined]


def test_default_state_is_the_per_user_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RATEQUEUE_STATE_FILE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    state = from_url(None)
    assert isinstance(state, FileState)
    assert state.path == tmp_path / "cache" / "ratequeue" / "state.json"
    assert stat.S_IMODE(state.path.parent.stat().st_mode) == 0o700
