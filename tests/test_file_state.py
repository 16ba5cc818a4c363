"""The JSON-file state: the host clock, the file's format and permissions, bad content, and its lock."""

from __future__ import annotations

import datetime
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from freezegun import freeze_time

from ratequeue import protocol
from ratequeue.errors import ConfigurationError, StateCorrupted, StateUnavailable
from ratequeue.protocol import Passed, Started, Wait
from ratequeue.state import file as file_state
from ratequeue.state import from_url
from ratequeue.state.file import FileState, LockFile, LockTimeout

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


# --- the lock: timeouts, threads, processes, fork, and no busy waiting ---


@pytest.fixture
def hold_lock(path: Path) -> Iterator[Callable[[], None]]:
    """Take ``PATH.lock`` now through a descriptor of its own, as another process would; call to release."""
    fcntl = pytest.importorskip("fcntl")
    fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o600)
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
    """A lock held past ``lock_timeout`` raises StateUnavailable; once it is free, operations work again."""
    state = FileState(path, lock_timeout=0.3)
    began = time.monotonic()
    with pytest.raises(StateUnavailable, match=r"could not lock .*state\.json\.lock within 0\.3 s") as raised:
        state.take("q", INTERVAL)
    assert time.monotonic() - began >= 0.3
    assert raised.value.where == str(path)
    hold_lock()
    assert state.take("q", INTERVAL).ticket == 1
    assert state.take("q", INTERVAL).ticket == 2


def test_lock_held_by_another_process_times_out(path: Path) -> None:
    """The same across processes: the waiter gives up at its timeout, and the holder is unaffected."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(StateUnavailable, match=r"within 0\.2 s") as raised:
            FileState(path, lock_timeout=0.2).take_and_try("q", INTERVAL, 0)
        assert raised.value.where == str(path)
    finally:
        holder.communicate("", timeout=30)
    assert holder.returncode == 0
    assert FileState(path, lock_timeout=5).take("q", INTERVAL).ticket == 2


#: holds PATH.lock through a FileState (taking ticket 1 under it) until stdin closes
HOLDER = """
import sys
from ratequeue.state.file import FileState
state = FileState(sys.argv[1])
with state._locked():
    print("held", flush=True)
    sys.stdin.read()
state.take("q", 100_000)
"""


def test_lock_held_by_a_thread_of_this_process_times_out(path: Path) -> None:
    """A thread waiting behind another thread of its process also gives up at ``lock_timeout``."""
    lock = LockFile.of(f"{path}.lock")
    lock.acquire(1)
    try:
        with pytest.raises(StateUnavailable, match=r"within 0\.1 s"):
            FileState(path, lock_timeout=0.1).take("q", INTERVAL)
    finally:
        lock.release()
    assert FileState(path, lock_timeout=0.1).take("q", INTERVAL).ticket == 1


def test_threads_of_one_process_are_serialized(path: Path) -> None:
    """Threads hammering ``take`` on two states of one file get every ticket exactly once."""
    states = [FileState(path), FileState(path)]
    tickets: list[int] = []
    record = threading.Lock()

    def hammer(state: FileState) -> None:
        for _ in range(40):
            ticket = state.take("q", INTERVAL).ticket
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
from ratequeue.state.file import FileState
state = FileState(sys.argv[1])
tickets = []
def take():
    for _ in range(30):
        tickets.append(state.take("q", 100_000).ticket)
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
        state.take("q", INTERVAL)
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
    """After ``PATH.lock`` is deleted, the state locks the new file that others lock, not the old one."""
    fcntl = pytest.importorskip("fcntl")
    state = FileState(path, lock_timeout=0.2)
    state.take("q", INTERVAL)  # opens the lock file and keeps it open
    os.unlink(f"{path}.lock")
    fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(StateUnavailable, match="could not lock"):
            state.take("q", INTERVAL)
    finally:
        os.close(fd)
    assert state.take("q", INTERVAL).ticket == 2


# --- writes: a failed write leaves the old file ---


#: runs one operation on the state file at argv[1] with files limited to argv[2] bytes, and
#: prints what it raised; a write past the limit comes up short, then fails with EFBIG
WRITE_LIMITED = """
import resource, signal, sys
from ratequeue.errors import StateUnavailable
from ratequeue.state.file import FileState
state = FileState(sys.argv[1])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails instead of killing
limit = int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
try:
    state.take(sys.argv[3], 100_000)
except StateUnavailable as exc:
    print("StateUnavailable", exc.where, exc, sep="\\n")
else:
    print("returned")
"""


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="needs RLIMIT_FSIZE and SIGXFSZ")
@pytest.mark.parametrize("name", ["q0", "new"], ids=["changed record", "new record"])
def test_write_cut_short_raises_and_leaves_the_old_file(path: Path, name: str) -> None:
    """A write that the disk cuts short (here: a file-size limit) raises StateUnavailable naming
    the file, and leaves the old file complete, with every queue's record, and no temporary file."""
    queues = {
        f"q{i}": {"ticket": i + 2, "pos": i + 1, "at": T0_US + i, "interval": INTERVAL} for i in range(300)
    }
    path.write_text(json.dumps({"format": "ratequeue-state", "version": 1, "queues": queues}, indent=1))
    os.chmod(path, 0o600)
    before = path.read_bytes()
    limit = 4096
    assert len(before) > 4 * limit
    ran = subprocess.run(
        [sys.executable, "-c", WRITE_LIMITED, str(path), str(limit), name],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ran.returncode == 0, ran.stderr
    lines = ran.stdout.splitlines()
    assert lines[:2] == ["StateUnavailable", str(path)], ran.stdout
    assert str(path) in lines[2]
    assert path.read_bytes() == before
    state = FileState(path)
    for queue, fields in queues.items():
        assert state.read(queue).record == protocol.Record(**fields)
    assert state.read("new").record is None
    assert sorted(p.name for p in path.parent.iterdir()) == ["state.json", "state.json.lock"]
    assert state.take(name, INTERVAL).ticket == queues.get(name, {"ticket": 1})["ticket"]
