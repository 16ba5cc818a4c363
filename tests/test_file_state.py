"""The JSON-file state: the host clock, the file's format and permissions, bad content, and its lock."""

from __future__ import annotations

import datetime
import json
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from freezegun import freeze_time
from hypothesis import given, settings
from hypothesis import strategies as st

from ratequeue.core import protocol
from ratequeue.core.protocol import NEVER, Passed, Started, Wait
from ratequeue.errors import ConfigurationError, StateCorrupted, StateUnavailable
from ratequeue.state import file as file_state
from ratequeue.state import open_state
from ratequeue.state.file import FileState, LockFile, LockTimeout

from .ops import do, stored_fields

INTERVAL = 100_000  # us
T0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
T0_US = int(T0.timestamp()) * 1_000_000


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "state.json"


def _plant(path: Path, records: dict[str, Any]) -> FileState:
    """Write the state at ``path`` in its layout as it is: the header at PATH, and a record file in
    PATH.d holding ``records[name]`` (stored fields, as they are) for each queue name."""
    state = FileState(path)
    header = {"format": "ratequeue-state", "version": 2, "records": state.records.name}
    path.write_text(json.dumps(header))
    os.chmod(path, 0o600)
    state.records.mkdir(mode=0o700, exist_ok=True)
    for name, fields in records.items():
        file, _ = state.record_files(name)
        file.write_bytes(file_state._record_bytes(name, fields))
        os.chmod(file, 0o600)
    return state


def test_frozen_clock_makes_every_answer_exact(path: Path) -> None:
    """With time frozen, the answers are exactly those of the reference at that instant."""
    state = FileState(path)
    with freeze_time(T0):
        assert do(state, "take_and_try", "q", INTERVAL, 0) == Started(ticket=1, start=T0_US, now=T0_US)
        assert do(state, "take_and_try", "q", INTERVAL, 0) == Wait(ticket=2, slot=T0_US + INTERVAL, now=T0_US)
        assert do(state, "try_start", "q", INTERVAL, 2, INTERVAL) == Started(
            ticket=2, start=T0_US + INTERVAL, now=T0_US
        )
        assert do(state, "try_start", "q", INTERVAL, 1, 0) == Passed(ticket=1, pos=2, now=T0_US)
        snapshot = state.read("q")
    assert snapshot.now == T0_US
    assert snapshot.record == protocol.Record(
        ticket=3, pos=2, at=T0_US + INTERVAL, interval=INTERVAL, due=T0_US + INTERVAL
    )


def test_ticking_clock_grants_the_slot_when_it_comes(path: Path) -> None:
    """As the host clock moves, a waiting ticket starts exactly at its slot, not before."""
    state = FileState(path)
    with freeze_time(T0) as frozen:
        do(state, "take_and_try", "q", INTERVAL, 0)
        assert isinstance(do(state, "take_and_try", "q", INTERVAL, 0), Wait)
        frozen.tick(datetime.timedelta(microseconds=INTERVAL - 1))
        assert do(state, "try_start", "q", INTERVAL, 2, 0) == Wait(
            ticket=2, slot=T0_US + INTERVAL, now=T0_US + INTERVAL - 1
        )
        frozen.tick(datetime.timedelta(microseconds=1))
        assert do(state, "try_start", "q", INTERVAL, 2, 0) == Started(
            ticket=2, start=T0_US + INTERVAL, now=T0_US + INTERVAL
        )


def test_clock_stepping_back_only_delays(path: Path) -> None:
    """A host clock stepped back never lets a start come sooner than one interval after the last."""
    state = FileState(path)
    with freeze_time(T0) as frozen:
        do(state, "take_and_try", "q", INTERVAL, 0)
        frozen.move_to(T0 - datetime.timedelta(seconds=5))
        outcome = do(state, "take_and_try", "q", INTERVAL, 0)
        assert outcome == Wait(ticket=2, slot=T0_US + INTERVAL, now=T0_US - 5_000_000)
        frozen.move_to(T0 + datetime.timedelta(microseconds=INTERVAL))
        assert do(state, "try_start", "q", INTERVAL, 2, 0) == Started(
            ticket=2, start=T0_US + INTERVAL, now=T0_US + INTERVAL
        )


def test_many_queues_one_small_file_each_in_a_readable_format(path: Path) -> None:
    """PATH is a header; each queue's record is a file of its own in PATH.d, named by a hash of the name."""
    state = FileState(path)
    with freeze_time(T0):
        do(state, "take_and_try", "a", INTERVAL, 0)
        do(state, "take", "b", 2 * INTERVAL)
    assert json.loads(path.read_text()) == {
        "format": "ratequeue-state",
        "version": 2,
        "records": "state.json.d",
    }
    records = path.parent / "state.json.d"
    assert state.records == records
    for name, fields in {
        "a": stored_fields(ticket=2, pos=1, at=T0_US, interval=INTERVAL),
        "b": stored_fields(ticket=2, pos=0, at=None, interval=2 * INTERVAL),
    }.items():
        file, lock = state.record_files(name)
        assert file.parent == lock.parent == records
        assert json.loads(file.read_text()) == {"name": name, "record": fields}
    assert len(list(records.glob("*.json"))) == 2


def test_a_paused_record_says_so_and_a_resumed_one_is_as_if_never_paused(path: Path) -> None:
    """``"paused"`` is true while paused; resumed, the record file is byte-identical to one never paused."""
    state = FileState(path)
    with freeze_time(T0):
        do(state, "take_and_try", "q", INTERVAL, 0)
        file = state.record_files("q")[0]
        before = file.read_bytes()
        assert do(state, "set_paused", "q", INTERVAL, True) is True
        fields = stored_fields(ticket=2, pos=1, at=T0_US, interval=INTERVAL, paused=True, paused_at=T0_US)
        assert json.loads(file.read_text()) == {"name": "q", "record": fields}
        assert do(state, "set_paused", "q", INTERVAL, True) is False
        assert do(state, "take_and_try", "q", INTERVAL, 0) == Wait(
            ticket=2, slot=T0_US + 1_000_000, now=T0_US
        )
        assert do(state, "set_paused", "q", INTERVAL, False) is True
        fields["paused"] = False
        del fields["paused_at"]  # (stored only while paused)
        fields["ticket"] = 3
        assert json.loads(file.read_text()) == {"name": "q", "record": fields}
        state.reset("q")
        do(state, "take_and_try", "q", INTERVAL, 0)
        do(state, "set_paused", "q", INTERVAL, True)
        do(state, "set_paused", "q", INTERVAL, False)
        assert file.read_bytes() == before


def test_file_and_lock_are_private_to_the_user(path: Path) -> None:
    """Every file is 0600 and the record directory 0700, whatever the umask."""
    old = os.umask(0)
    try:
        do(FileState(path), "take", "q", INTERVAL)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(Path(f"{path}.lock").stat().st_mode) == 0o600
    records = path.parent / "state.json.d"
    assert stat.S_IMODE(records.stat().st_mode) == 0o700
    assert sorted(p.name for p in path.parent.iterdir()) == ["state.json", "state.json.d", "state.json.lock"]
    file, lock = FileState(path).record_files("q")
    assert sorted(records.iterdir()) == sorted([file, lock])
    assert {stat.S_IMODE(p.stat().st_mode) for p in (file, lock)} == {0o600}


def test_names_that_differ_only_in_case_or_script_are_distinct(path: Path) -> None:
    state = FileState(path)
    names = ["api", "API", "Api", "ä/../x", "名前", "a" * 200]
    for i, name in enumerate(names):
        for _ in range(i + 1):
            do(state, "take", name, INTERVAL)
    for i, name in enumerate(names):
        record = state.read(name).record
        assert record is not None
        assert record.ticket == i + 2


def test_interval_mismatch_changes_nothing(path: Path) -> None:
    state = FileState(path)
    do(state, "take", "q", INTERVAL)
    file, _ = state.record_files("q")
    before = path.read_bytes(), file.read_bytes()
    with pytest.raises(ConfigurationError, match=r"interval 0\.1 s .* not 0\.2 s"):
        do(state, "take_and_try", "q", 2 * INTERVAL, 0)
    assert (path.read_bytes(), file.read_bytes()) == before


def test_reset_removes_one_queue(path: Path) -> None:
    state = FileState(path)
    do(state, "take", "a", INTERVAL)
    do(state, "take", "b", INTERVAL)
    assert state.reset("a") is True
    assert state.reset("a") is False
    assert state.read("a").record is None
    assert state.read("b").record is not None


def _v1(queues: object) -> bytes:
    """A state file of the earlier layout (version 1), every record in it: no longer read."""
    return json.dumps({"format": "ratequeue-state", "version": 1, "queues": queues}).encode()


#: content at PATH that is no state of this layout: every operation, reset included, raises and leaves
#: it as it is
CORRUPT = {
    "not json": b"{not json",
    "empty": b"",
    "a list": b"[]",
    "nested too deeply": b"[" * 100_000,
    "another format": json.dumps({"format": "other", "version": 1, "queues": {}}).encode(),
    "a future version": json.dumps({"format": "ratequeue-state", "version": 99, "queues": {}}).encode(),
    "version true": json.dumps({"format": "ratequeue-state", "version": True, "queues": {}}).encode(),
    "version 1": _v1({"q": {"ticket": 2, "pos": 1, "at": 5, "interval": 1}}),
}

#: a record file of queue q holding bad fields: only its queue raises, and the file is left as it is
BAD_RECORDS = {
    "record not an object": 3,
    "record missing a field": {
        key: value for key, value in stored_fields(2, 1, 5, 1).items() if key != "interval"
    },
    "pos not below ticket": stored_fields(ticket=2, pos=2, at=5, interval=1),
    "ticket a float": stored_fields(ticket=2.5, pos=1, at=5, interval=1),  # type: ignore[arg-type]
    "interval zero": stored_fields(ticket=2, pos=1, at=5, interval=0),
    "at a string": {**stored_fields(ticket=2, pos=1, at=5, interval=1), "at": "x"},
}

#: a record file of the new layout that is not a record of its queue
BAD_RECORD_FILES = {
    "not json": b"{not json",
    "empty": b"",
    "nested too deeply": b"[" * 100_000,
    "not an object": b"[1, 2]",
    "another queue's": json.dumps(
        {"name": "other", "record": stored_fields(ticket=1, pos=0, at=None, interval=1)}
    ).encode(),
    "no record": json.dumps({"name": "q"}).encode(),
    "a bad record": json.dumps(
        {"name": "q", "record": stored_fields(ticket=1, pos=5, at=None, interval=1)}
    ).encode(),
}

OPERATIONS: dict[str, Callable[[FileState], object]] = {
    "take": lambda state: do(state, "take", "q", 1),
    "take_and_try": lambda state: do(state, "take_and_try", "q", 1, 0),
    "try_start": lambda state: do(state, "try_start", "q", 1, 1, 0),
    "retime": lambda state: do(state, "retime", "q", 1, 1, 0),
    "read": lambda state: state.read("q"),
}


@pytest.mark.parametrize("content", CORRUPT.values(), ids=CORRUPT.keys())
@pytest.mark.parametrize("operation", [*OPERATIONS, "reset"])
def test_corrupted_file_raises_and_is_left_untouched(path: Path, content: bytes, operation: str) -> None:
    path.write_bytes(content)
    os.chmod(path, 0o600)
    state = FileState(path)
    with pytest.raises(StateCorrupted) as raised:
        state.reset("q") if operation == "reset" else OPERATIONS[operation](state)
    assert raised.value.where == str(path)
    assert str(path) in str(raised.value)
    assert path.read_bytes() == content
    assert not state.records.exists()


def test_a_version_1_file_is_refused_naming_the_version(path: Path) -> None:
    """A state file of the earlier layout (every record in PATH) is not read, moved or overwritten."""
    content = CORRUPT["version 1"]
    path.write_bytes(content)
    state = FileState(path)
    with pytest.raises(StateCorrupted, match="has version 1; this ratequeue reads version 2"):
        do(state, "take", "q", 1)
    with pytest.raises(StateCorrupted, match="has version 1; this ratequeue reads version 2"):
        state.read("q")
    assert path.read_bytes() == content
    assert not state.records.exists()


@pytest.mark.parametrize("fields", BAD_RECORDS.values(), ids=BAD_RECORDS.keys())
@pytest.mark.parametrize("operation", OPERATIONS)
def test_bad_record_raises_for_its_queue_only(path: Path, fields: object, operation: str) -> None:
    """The operation raises and leaves the bad record file as it is; the other queue works, and reset
    clears it."""
    state = _plant(path, {"q": fields, "good": stored_fields(ticket=4, pos=3, at=T0_US, interval=INTERVAL)})
    file, _ = state.record_files("q")
    content = file.read_bytes()
    with pytest.raises(StateCorrupted) as raised:
        OPERATIONS[operation](state)
    assert raised.value.where == f"{path}#q"
    assert file.read_bytes() == content
    assert state.read("good").record == protocol.Record(
        ticket=4, pos=3, at=T0_US, interval=INTERVAL, due=T0_US
    )
    assert state.reset("q") is True
    assert do(state, "take", "q", 1).ticket == 1
    assert do(state, "take", "good", INTERVAL).ticket == 4


@pytest.mark.parametrize("content", BAD_RECORD_FILES.values(), ids=BAD_RECORD_FILES.keys())
@pytest.mark.parametrize("operation", OPERATIONS)
def test_bad_record_file_raises_for_its_queue_only(path: Path, content: bytes, operation: str) -> None:
    state = FileState(path)
    do(state, "take", "good", INTERVAL)
    do(state, "take", "q", 1)
    file, _ = state.record_files("q")
    file.write_bytes(content)
    with pytest.raises(StateCorrupted) as raised:
        OPERATIONS[operation](state)
    assert raised.value.where == f"{path}#q"
    assert file.read_bytes() == content
    assert do(state, "take", "good", INTERVAL).ticket == 2
    assert state.reset("q") is True
    assert do(state, "take", "q", 1).ticket == 1


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
        do(state, "take", "q", INTERVAL)
    assert target.read_text() == "precious"


#: a user other than the tests' own (root), to own a directory ratequeue must not trust
NOBODY = 65534


@pytest.mark.parametrize(
    ("owner", "mode", "wrong"),
    [
        (
            NOBODY,
            0o777,
            r"is owned by uid 65534, not by this process's user \(uid 0\) or root and is writable by",
        ),
        (NOBODY, 0o700, r"is owned by uid 65534, not by this process's user \(uid 0\) or root: "),
        (None, 0o777, r"is writable by other users \(mode 0777\): "),
        (None, 0o1777, r"is writable by other users \(mode 1777\): "),
        (None, 0o770, r"is writable by other users \(mode 0770\): "),
    ],
)
def test_a_records_directory_another_user_could_change_is_refused(
    path: Path, owner: int | None, mode: int, wrong: str
) -> None:
    """A pre-made ``PATH.d`` another user owns, or may write in (sticky or not), is refused, naming it.

    Nothing is written there, and nothing listed from it; made private, it is used.
    """
    if owner is not None and os.geteuid() != 0:
        pytest.skip("making a directory another user's takes root")
    records = Path(f"{path}.d")
    records.mkdir()
    os.chown(records, os.geteuid() if owner is None else owner, -1)
    os.chmod(records, mode)
    state = FileState(path)
    message = rf"^'{re.escape(str(records))}', where the state's records go, {wrong}.*remove it"
    with pytest.raises(ConfigurationError, match=message):
        do(state, "take", "q", INTERVAL)
    with pytest.raises(ConfigurationError, match=message):
        state.names()
    assert not path.exists()
    assert list(records.iterdir()) == []
    os.chown(records, os.geteuid(), -1)
    os.chmod(records, 0o700)
    assert do(state, "take", "q", INTERVAL).ticket == 1
    assert state.names() == ["q"]


def test_missing_directory_is_a_configuration_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="does not exist"):
        FileState(tmp_path / "nowhere" / "state.json")


@pytest.mark.parametrize("host", ["", "localhost"])
def test_file_urls(tmp_path: Path, host: str) -> None:
    state = open_state(f"file://{host}{tmp_path}/my%20state.json")
    assert isinstance(state, FileState)
    assert state.path == tmp_path / "my state.json"
    assert open_state(state.url).path == state.path  # type: ignore[attr-defined]


def test_default_state_is_the_per_user_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RATEQUEUE_STATE_FILE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    state = open_state(None)
    assert isinstance(state, FileState)
    assert state.path == tmp_path / "cache" / "ratequeue" / "state.json"
    assert stat.S_IMODE(state.path.parent.stat().st_mode) == 0o700


#: opens the default state with umask 000 and takes a ticket
DEFAULT_UNDER_UMASK_0 = """
import os
os.umask(0)
from ratequeue.core.operation import Terms, operation
from ratequeue.state.file import FileState
FileState.default().execute(operation("take", "q", Terms.checked(100_000)))
"""


def test_directories_ratequeue_creates_are_0700_whatever_the_umask(tmp_path: Path) -> None:
    """The default path's missing parents (``.cache`` too) and PATH.d are made 0700; a directory
    that exists already is left as it is."""
    home = tmp_path / "home"
    home.mkdir(mode=0o755)
    os.chmod(home, 0o755)
    env = {**os.environ, "HOME": str(home)}
    env.pop("RATEQUEUE_STATE_FILE")
    env.pop("XDG_CACHE_HOME", None)
    subprocess.run([sys.executable, "-c", DEFAULT_UNDER_UMASK_0], env=env, check=True, timeout=60)
    made = [home / ".cache", home / ".cache" / "ratequeue", home / ".cache" / "ratequeue" / "state.json.d"]
    assert {str(p): stat.S_IMODE(p.stat().st_mode) for p in made} == {str(p): 0o700 for p in made}
    assert stat.S_IMODE(home.stat().st_mode) == 0o755


# --- the lock: timeouts, threads, processes, fork, and no busy waiting ---


def _lock_of(path: Path, name: str = "q") -> str:
    """The lock file of queue ``name`` in the state at ``path``, whose layout is made if missing."""
    state = FileState(path)
    do(state, "take", "other", INTERVAL)  # makes the header and PATH.d
    return str(state.record_files(name)[1])


@pytest.fixture
def hold_lock(path: Path) -> Iterator[Callable[[], None]]:
    """Take queue q's lock now through a descriptor of its own, as another process would; call to release."""
    fcntl = pytest.importorskip("fcntl")
    fd = os.open(_lock_of(path), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    released = False

    def release() -> None:
        nonlocal released
        if not released:
            released = True
            os.close(fd)

    try:
        yield release
    finally:
        release()


def test_lock_held_elsewhere_times_out_naming_the_path(path: Path, hold_lock: Callable[[], None]) -> None:
    """A lock held past ``lock_timeout`` raises StateUnavailable; once it is free, operations work again.

    Meanwhile the other queue names, their reads, and reads of the held one, go on.
    """
    state = FileState(path, lock_timeout=0.3)
    began = time.monotonic()
    with pytest.raises(
        StateUnavailable, match=r"could not lock .*state\.json\.d/[0-9a-f]{32}\.lock within 0\.3 s"
    ) as raised:
        do(state, "take", "q", INTERVAL)
    assert time.monotonic() - began >= 0.3
    assert raised.value.where == str(path)
    assert do(state, "take", "other", INTERVAL).ticket == 2
    assert state.read("q").record is None
    hold_lock()
    assert do(state, "take", "q", INTERVAL).ticket == 1
    assert do(state, "take", "q", INTERVAL).ticket == 2


def _start_holder(path: Path) -> subprocess.Popen[str]:
    _lock_of(path)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout is not None
    assert holder.stdout.readline() == "held\n"
    return holder


def test_lock_held_by_another_process_times_out(path: Path) -> None:
    """The same across processes: the waiter gives up at its timeout, and the holder is unaffected."""
    holder = _start_holder(path)
    try:
        with pytest.raises(StateUnavailable, match=r"within 0\.2 s") as raised:
            do(FileState(path, lock_timeout=0.2), "take_and_try", "q", INTERVAL, 0)
        assert raised.value.where == str(path)
    finally:
        holder.communicate("", timeout=30)
    assert holder.returncode == 0
    assert do(FileState(path, lock_timeout=5), "take", "q", INTERVAL).ticket == 2


@pytest.mark.processes
def test_a_killed_holder_releases_the_lock_at_once(path: Path) -> None:
    """SIGKILL of a process holding a queue's lock frees it: a waiter gets it as soon as the kernel
    closes the holder's files, long before its timeout."""
    holder = _start_holder(path)
    state = FileState(path, lock_timeout=30)
    got: list[float] = []

    def wait() -> None:
        do(state, "take", "q", INTERVAL)
        got.append(time.monotonic())

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.2)
    assert not got
    killed = time.monotonic()
    holder.kill()
    holder.communicate(timeout=30)  # closes the pipes too
    waiter.join(timeout=30)
    assert got
    assert got[0] - killed < 5
    assert state.read("q").record == protocol.Record(ticket=2, pos=0, at=NEVER, interval=INTERVAL, due=NEVER)


@pytest.mark.processes
def test_a_stopped_holder_stalls_its_queue_name_only(path: Path) -> None:
    """SIGSTOP of a process holding queue q's lock: q waits (and times out), every other name goes on."""
    holder = _start_holder(path)
    state = FileState(path, lock_timeout=0.2)
    try:
        os.kill(holder.pid, signal.SIGSTOP)
        began = time.monotonic()
        for _ in range(20):
            do(state, "take", "other", INTERVAL)
        assert time.monotonic() - began < 5
        assert state.read("q").record is None  # reads take no lock
        with pytest.raises(StateUnavailable, match=r"within 0\.2 s"):
            do(state, "take", "q", INTERVAL)
    finally:
        os.kill(holder.pid, signal.SIGCONT)
        holder.communicate("", timeout=30)
    assert do(state, "take", "q", INTERVAL).ticket == 2


#: holds queue q's lock through a FileState (taking q's ticket 1 after) until stdin closes
HOLDER = """
import sys
from ratequeue.core.operation import Terms, operation
from ratequeue.state.file import FileState
state = FileState(sys.argv[1])
with state._locked(state._name_lock(state.record_files("q")[1])):
    print("held", flush=True)
    sys.stdin.read()
state.execute(operation("take", "q", Terms.checked(100_000)))
"""


def test_lock_held_by_a_thread_of_this_process_times_out(path: Path) -> None:
    """A thread waiting behind another thread of its process also gives up at ``lock_timeout``."""
    lock = LockFile.of(_lock_of(path))
    lock.acquire(1)
    try:
        with pytest.raises(StateUnavailable, match=r"within 0\.1 s"):
            do(FileState(path, lock_timeout=0.1), "take", "q", INTERVAL)
    finally:
        lock.release()
    assert do(FileState(path, lock_timeout=0.1), "take", "q", INTERVAL).ticket == 1


def test_threads_of_one_process_are_serialized(path: Path) -> None:
    """Threads hammering ``take`` on two states of one file get every ticket exactly once."""
    states = [FileState(path), FileState(path)]
    tickets: list[int] = []
    record = threading.Lock()

    def hammer(state: FileState) -> None:
        for _ in range(40):
            ticket = do(state, "take", "q", INTERVAL).ticket
            with record:
                tickets.append(ticket)

    threads = [threading.Thread(target=hammer, args=(states[i % 2],)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sorted(tickets) == list(range(1, 8 * 40 + 1))


@pytest.mark.processes
def test_threads_of_several_processes_are_serialized(path: Path) -> None:
    """Three processes of three threads each take every ticket exactly once."""
    workers = [
        subprocess.Popen([sys.executable, "-c", TAKER, str(path)], stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    tickets = [ticket for worker in workers for ticket in json.loads(worker.communicate(timeout=60)[0])]
    assert all(worker.returncode == 0 for worker in workers)
    assert sorted(tickets) == list(range(1, 3 * 3 * 30 + 1))


#: three threads taking 30 tickets each; prints them as JSON
TAKER = """
import json, sys, threading
from ratequeue.core.operation import Terms, operation
from ratequeue.state.file import FileState
state = FileState(sys.argv[1])
take_q = operation("take", "q", Terms.checked(100_000))
tickets = []
def take():
    for _ in range(30):
        tickets.append(state.execute(take_q).ticket)
threads = [threading.Thread(target=take) for _ in range(3)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print(json.dumps(tickets))
"""


def test_waiting_for_the_lock_burns_no_cpu(path: Path, hold_lock: Callable[[], None]) -> None:
    """Half a second of waiting for a held lock costs this process under 20 ms of CPU (about 1 ms here).

    Polling every 0.2 ms, as the state did before, cost 60 ms. CPU time counts
    only this process's own work, so a loaded host does not inflate it.
    """
    state = FileState(path, lock_timeout=0.5)
    cpu = time.process_time()
    with pytest.raises(StateUnavailable):
        do(state, "take", "q", INTERVAL)
    assert time.process_time() - cpu < 0.02


@pytest.mark.parametrize("kind", ["flock", "polled"])
def test_lock_waiter_gets_the_lock_when_it_is_released(path: Path, kind: str) -> None:
    """Two lock objects on one file (as in two processes) exclude each other, with and without ``flock``."""
    if kind == "flock":
        pytest.importorskip("fcntl")
    make = {"flock": file_state._FlockFile, "polled": file_state._PolledLockFile}[kind]
    first, second = make(f"{path}.lock"), make(f"{path}.lock")
    first.acquire(1)
    with pytest.raises(LockTimeout):
        second.acquire(0.1)
    got = threading.Event()

    def wait() -> None:
        second.acquire(30)
        got.set()
        second.release()

    waiter = threading.Thread(target=wait)
    waiter.start()
    try:
        assert not got.wait(0.2)
        first.release()
        assert got.wait(30)
    finally:
        waiter.join(timeout=30)
    first.acquire(1)
    first.release()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_locks_on_its_own(path: Path) -> None:
    """A child forked while a thread held the lock neither shares the parent's lock nor inherits the hold."""
    lock = LockFile.of(f"{path}.lock")
    lock.acquire(1)  # opens the lock file: the child inherits the descriptor
    lock.release()
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        lock.acquire(1)
        holding.set()
        release.wait(30)
        lock.release()

    holder = threading.Thread(target=hold)
    holder.start()
    assert holding.wait(30)
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads running
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            try:
                lock.acquire(0.2)
            except LockTimeout:  # the parent's thread holds it
                os.write(ready_w, b"1")
                lock.acquire(10)  # the child's own hold, once the parent lets go
                os.write(ready_w, b"2")
                os.read(go_r, 1)
                lock.release()
                code = 0
        finally:
            os._exit(code)
    try:
        assert os.read(ready_r, 1) == b"1"
        release.set()
        holder.join(timeout=30)
        assert os.read(ready_r, 1) == b"2"
        # The child holds it: the parent must wait, not share the child's lock.
        with pytest.raises(LockTimeout):
            lock.acquire(0.2)
        os.write(go_w, b"g")
    finally:
        release.set()
        status = _reap(pid)
        for fd in (ready_r, ready_w, go_r, go_w):
            os.close(fd)
    assert os.waitstatus_to_exitcode(status) == 0
    lock.acquire(1)
    lock.release()


def _reap(pid: int, timeout: float = 30.0) -> int:
    """The wait status of child ``pid``, killed if it has not ended within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    return os.waitpid(pid, 0)[1]


def test_lock_file_deleted_in_use_is_opened_again(path: Path) -> None:
    """After a queue's lock file is deleted, the state locks the new one that others lock, not the old one."""
    fcntl = pytest.importorskip("fcntl")
    state = FileState(path, lock_timeout=0.2)
    do(state, "take", "q", INTERVAL)  # opens the lock file and keeps it open
    lock = state.record_files("q")[1]
    os.unlink(lock)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(StateUnavailable, match="could not lock"):
            do(state, "take", "q", INTERVAL)
    finally:
        os.close(fd)
    assert do(state, "take", "q", INTERVAL).ticket == 2


# --- writes: a failed write leaves the old file ---


#: runs one operation on the state file at argv[1] with files limited to argv[2] bytes, and
#: prints what it raised; a write past the limit comes up short, then fails with EFBIG
WRITE_LIMITED = """
import resource, signal, sys
from ratequeue.core.operation import Terms, operation
from ratequeue.errors import StateUnavailable
from ratequeue.state.file import FileState
state = FileState(sys.argv[1])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails instead of killing
limit = int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
try:
    state.execute(operation("take", sys.argv[3], Terms.checked(100_000)))
except StateUnavailable as exc:
    print("StateUnavailable", exc.where, exc, sep="\\n")
else:
    print("returned")
"""


def _planted(path: Path, count: int) -> tuple[FileState, dict[str, protocol.Record]]:
    """The state at ``path`` with ``count`` queues planted in its layout; their records by name."""
    records = {
        f"q{i}": protocol.Record(ticket=i + 2, pos=i + 1, at=T0_US + i, interval=INTERVAL, due=T0_US + i)
        for i in range(count)
    }
    state = _plant(path, {name: file_state._encode(record) for name, record in records.items()})
    return state, records


def _record_files(state: FileState) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in state.records.glob("*.json")}


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="needs RLIMIT_FSIZE and SIGXFSZ")
@pytest.mark.parametrize("name", ["q0", "new"], ids=["changed record", "new record"])
def test_write_cut_short_raises_and_leaves_the_old_file(path: Path, name: str) -> None:
    """A write that the disk cuts short (here: a file-size limit) raises StateUnavailable naming
    the state, and leaves the old record file complete, every other record, and no temporary file."""
    state, queues = _planted(path, 300)
    assert state.read("q1").record == queues["q1"]
    do(state, "take", "q1", INTERVAL)  # a record written by the state itself
    queues["q1"] = queues["q1"]._replace(ticket=queues["q1"].ticket + 1)
    header, before = path.read_bytes(), _record_files(state)
    listing = sorted(p.name for p in path.parent.iterdir())
    assert listing == ["state.json", "state.json.d"]
    assert len(before) == 300
    limit = 40  # a record file is about 200 bytes
    ran = subprocess.run(
        [sys.executable, "-c", WRITE_LIMITED, str(path), str(limit), name],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ran.returncode == 0, ran.stderr
    lines = ran.stdout.splitlines()
    assert lines[:2] == ["StateUnavailable", str(path)], ran.stdout
    assert str(state.record_files(name)[0]) in lines[2]
    assert path.read_bytes() == header
    assert _record_files(state) == before
    for queue, record in queues.items():
        assert state.read(queue).record == record
    assert state.read("new").record is None
    assert sorted(p.name for p in path.parent.iterdir()) == listing
    assert not [p for p in state.records.iterdir() if p.name.endswith(".tmp")]
    assert do(state, "take", name, INTERVAL).ticket == (queues[name].ticket if name in queues else 1)


def test_operations_on_one_name_ignore_twenty_thousand_others(path: Path) -> None:
    """With 20 000 other queue names in the state, operations on one name give the reference's
    answers and leave every other record file as it was, byte for byte and unwritten."""
    state, queues = _planted(path, 20_000)
    others = {
        p: (p.read_bytes(), p.stat().st_mtime_ns, p.stat().st_ino) for p in state.records.glob("*.json")
    }
    assert len(others) == 20_000
    reference = FileState(path.with_name("alone.json"))
    with freeze_time(T0) as frozen:
        for i in range(200):
            outcome = do(state, "take_and_try", "new", INTERVAL, INTERVAL // 2)
            assert outcome == do(reference, "take_and_try", "new", INTERVAL, INTERVAL // 2)
            if isinstance(outcome, Wait):
                assert do(state, "try_start", "new", INTERVAL, outcome.ticket, INTERVAL) == do(
                    reference, "try_start", "new", INTERVAL, outcome.ticket, INTERVAL
                )
            frozen.tick(datetime.timedelta(microseconds=INTERVAL // 3 + i))
        assert state.read("new").record == reference.read("new").record
        assert state.reset("new") is True
    assert {
        p: (p.read_bytes(), p.stat().st_mtime_ns, p.stat().st_ino) for p in state.records.glob("*.json")
    } == others
    for queue, record in queues.items():
        assert state.read(queue).record == record


#: three processes of two threads on their own queue name and on a shared one; prints the tickets
NAMED_TAKER = """
import json, sys, threading
from ratequeue.core.operation import Terms, operation
from ratequeue.state.file import FileState
state = FileState(sys.argv[1])
take_own = operation("take", sys.argv[2], Terms.checked(100_000))
take_shared = operation("take", "shared", Terms.checked(100_000))
tickets = {"own": [], "shared": []}
def take():
    for _ in range(25):
        tickets["own"].append(state.execute(take_own).ticket)
        tickets["shared"].append(state.execute(take_shared).ticket)
threads = [threading.Thread(target=take) for _ in range(2)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print(json.dumps(tickets))
"""


@pytest.mark.processes
def test_processes_on_different_names_and_on_the_same_name(path: Path) -> None:
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", NAMED_TAKER, str(path), f"own{i}"], stdout=subprocess.PIPE, text=True
        )
        for i in range(3)
    ]
    results = [json.loads(worker.communicate(timeout=60)[0]) for worker in workers]
    assert all(worker.returncode == 0 for worker in workers)
    for result in results:
        assert sorted(result["own"]) == list(range(1, 51))
    assert sorted(t for result in results for t in result["shared"]) == list(range(1, 151))


def test_a_deleted_records_directory_is_made_again_by_the_next_write(tmp_path: Path) -> None:
    import shutil

    state = FileState(tmp_path / "state.json")
    do(state, "take_and_try", "q", 1000, 0)
    shutil.rmtree(state.records)
    assert isinstance(do(state, "take_and_try", "q", 1000, 0), protocol.Started), (
        "a fresh record, as after a reset"
    )
    assert state.read("q").record is not None


# --------------------------------------------------------------------------- durability


def test_a_change_is_written_over_the_record_in_place_unless_durable(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """By default a changed record is written over its file (same inode, no disk sync); with
    ``durable`` each change is a new file, synced, renamed into place, its directory synced."""
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    fast = FileState(path)
    do(fast, "take", "q", INTERVAL)  # the header (synced) and the record's first file
    file = fast.record_files("q")[0]
    inode, synced[:] = file.stat().st_ino, []
    for ticket in range(2, 40):
        assert do(fast, "take", "q", INTERVAL).ticket == ticket
    assert file.stat().st_ino == inode, "written over in place"
    assert synced == [], "no disk sync"
    assert file.stat().st_size == file_state.RECORD_BLOCK, "padded to a block, so that later writes fit"
    assert json.loads(file.read_bytes())["record"]["ticket"] == 40

    durable = open_state(path.as_uri() + "?durable=1")
    assert isinstance(durable, FileState)
    assert durable.durable
    assert durable.url == path.as_uri() + "?durable=1"
    assert do(durable, "take", "q", INTERVAL).ticket == 40
    assert file.stat().st_ino != inode, "a new file, renamed into place"
    assert len(synced) == 2, "the new file and its directory, synced"
    assert do(fast, "take", "q", INTERVAL).ticket == 41, "the two kinds share the record"


@pytest.mark.parametrize("query", ["durable=2", "durable", "sync=1", "durable=1&x=2"])
def test_a_file_url_with_another_option_is_refused(tmp_path: Path, query: str) -> None:
    with pytest.raises(ConfigurationError, match="a file URL takes one option, durable=1"):
        open_state((tmp_path / "state.json").as_uri() + "?" + query)


def test_a_record_growing_past_its_file_is_written_whole_again(path: Path) -> None:
    """A record longer than its file (many leases) is written to a new file, padded to whole blocks."""
    state = FileState(path)
    terms = {"max_running": 40, "lease_us": 10**9}
    for _ in range(30):
        do(state, "take_and_try", "q", 1, 0, **terms)
    file = state.record_files("q")[0]
    assert file.stat().st_size % file_state.RECORD_BLOCK == 0
    assert file.stat().st_size > file_state.RECORD_BLOCK
    assert len(state.read("q").record.leases) == 30  # type: ignore[union-attr]


KILLED_WORKER = """
import sys
from ratequeue.core.protocol import Started
from ratequeue.state import open_state
from tests.ops import do

state = open_state(sys.argv[1])
while True:
    answer = do(state, "take_and_try", "q", 1, 0, burst=1)
    if isinstance(answer, Started):
        print(answer.ticket, flush=True)
"""


@pytest.mark.processes
def test_writers_killed_at_random_leave_no_torn_record_and_no_ticket_twice(path: Path) -> None:
    """SIGKILL of writers at random moments of their loops, 60 kills over thousands of operations on
    one queue name (one writer in three durable): the record always reads whole, no ticket starts twice."""
    import random

    chance = random.Random(29)
    fast, durable = path.as_uri(), path.as_uri() + "?durable=1"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    started: list[int] = []
    kills = 0
    state = FileState(path)
    while kills < 60 or len(started) < 1000:
        workers = [
            subprocess.Popen(
                [sys.executable, "-c", KILLED_WORKER, durable if i == 0 else fast],
                stdout=subprocess.PIPE,
                text=True,
                env=env,
            )
            for i in range(3)
        ]
        first = []
        for worker in workers:
            assert worker.stdout is not None
            first.append(worker.stdout.readline())  # in its loop now
        time.sleep(chance.random() * 0.02)  # (a random moment of their loops: this is the test)
        for worker in workers:
            worker.kill()
            kills += 1
        for worker, line in zip(workers, first, strict=True):
            assert worker.stdout is not None
            # (read() after readline(): communicate() with a timeout would skip what readline buffered)
            lines = (line + worker.stdout.read()).splitlines(keepends=True)
            worker.stdout.close()
            worker.wait(timeout=30)
            # (a worker killed while printing leaves its last line cut short, without its newline)
            started.extend(int(line) for line in lines if line.endswith("\n"))
        record = state.read("q").record  # whole, or this raises StateCorrupted
        assert record is not None
        assert record.pos >= max(started)
    assert len(started) == len(set(started)), "a ticket started twice"


# --------------------------------------------------------------------------- the fast path


_micros = st.one_of(st.just(NEVER), st.integers(min_value=0, max_value=2**62))
_counts = st.integers(min_value=0, max_value=2**62)


@settings(max_examples=300, deadline=None)
@given(
    name=st.text(),
    record=st.builds(
        protocol.Record,
        ticket=_counts,
        pos=_counts,
        at=_micros,
        interval=_counts,
        due=_micros,
        burst=st.integers(1, 10**6),
        paused=st.booleans(),
        max_running=st.one_of(st.none(), st.integers(1, 1000)),
        leases=st.lists(st.tuples(_counts, _counts, _counts), max_size=4).map(tuple),
        held=_micros,
        not_before=_micros,
        pace=_counts,
        paced_at=_micros,
        settled=_counts,
    ),
    kept=st.one_of(st.none(), _counts),
)
def test_a_record_is_written_as_json_dumps_writes_it(
    name: str, record: protocol.Record, kept: int | None
) -> None:
    """The hand-made content of a record file is, byte for byte, what ``json.dumps`` makes of its fields."""
    assert file_state._record_content(name, record, kept) == file_state._record_bytes(
        name, file_state._encode(record), kept
    )


def test_an_operation_on_a_name_in_use_opens_no_file(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The record file stays open between operations (and the state's header is not looked at again)."""
    state = FileState(path)
    do(state, "take", "q", INTERVAL)
    do(state, "take", "q", INTERVAL)
    opened: list[str] = []
    real_open, real_lstat = os.open, os.lstat
    monkeypatch.setattr(os, "open", lambda file, *a: (opened.append(str(file)), real_open(file, *a))[1])
    monkeypatch.setattr(os, "lstat", lambda file, *a: (opened.append(str(file)), real_lstat(file, *a))[1])
    for ticket in range(3, 10):
        assert do(state, "take", "q", INTERVAL).ticket == ticket
    assert opened == []


def test_a_record_deleted_or_replaced_by_another_process_is_opened_again(path: Path) -> None:
    """A record file kept open is not used once another process has deleted or replaced it."""
    state, other = FileState(path), FileState(path, durable=True)
    for ticket in range(1, 4):
        assert do(state, "take", "q", INTERVAL).ticket == ticket
    assert other.reset("q")
    assert do(state, "take", "q", INTERVAL).ticket == 1, "a fresh record, not the deleted one"
    assert do(other, "take", "q", INTERVAL).ticket == 2  # renamed into place
    assert do(state, "take", "q", INTERVAL).ticket == 3
    state.record_files("q")[0].unlink()  # as by hand
    assert do(state, "take", "q", INTERVAL).ticket == 1


@pytest.mark.parametrize("stored", [T0_US, None, "x", 2**60, -(2**60)])
def test_a_paused_at_counts_only_while_paused(stored: object) -> None:
    """Paused, a bad ``paused_at`` is refused; not paused, any is ignored (an older version's resume)."""
    from ratequeue.errors import StateCorrupted
    from ratequeue.state.records import check_record

    fields = stored_fields(ticket=2, pos=1, at=T0_US, interval=INTERVAL, paused_at=stored)
    assert check_record(fields, where="test").paused_at == protocol.NEVER
    fields["paused"] = True
    if stored is None or stored == T0_US:
        assert check_record(fields, where="test").paused_at == (protocol.NEVER if stored is None else T0_US)
    else:
        with pytest.raises(StateCorrupted, match="paused_at"):
            check_record(fields, where="test")
