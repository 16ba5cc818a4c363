"""``file:///path/state.json``: the records of a host's queues, one small file per queue name.

``PATH`` itself is a small header that says what the state is; the records
live in the directory ``PATH.d``, one file per queue name, each with a lock
file of its own. An operation on a name takes that name's lock, reads its
record (a few hundred bytes), decides, and, if the record changes, writes
the new one over the file in place: one ``pwrite`` of at most a page,
padded with spaces to the file's length, which a process killed at any
instant has made whole or not at all. A new record, or one grown past its
file, is written whole to a temporary file and renamed into place. With
``durable`` (``?durable=1``) every change is written so, synced to disk
before the rename and its directory after, so that it also survives an
operating-system crash or a power loss. Its cost therefore does not depend
on how many names the state holds, a process killed mid-way never leaves a
torn record, the lock is held for microseconds (and a disk sync, if
durable), and a process stopped while it holds a name's lock stalls that
name only (docs/file-state.md). The clock is the host's wall clock, which
every user of the state shares.

Waiting for a lock costs no CPU while it stays held: the threads of a
process queue on an in-process lock, and the one at the head waits for the
file's ``flock`` in the kernel (see :class:`LockFile`).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import functools
import hashlib
import json
import logging
import os
import select
import stat
import struct
import tempfile
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

try:
    import fcntl

    _HAS_FLOCK = True
except ImportError:  # pragma: no cover - Windows
    _HAS_FLOCK = False

from ..core.operation import Operation
from ..core.protocol import FULL_GRACE_US, NEVER, Answer, Record, Started, live_leases
from ..errors import ConfigurationError, StateCorrupted, StateUnavailable
from ._local import Clock, LocalState, keep_until
from .base import Snapshot
from .records import check_record
from .watchers import Watchers

__all__ = ["FileState", "LockFile", "LockTimeout", "default_path"]

#: what the state file's top level says it is
FORMAT = "ratequeue-state"
#: the layout: ``PATH`` is a header, the records are files in ``PATH.d``
VERSION = 2

#: where ``flock`` is missing, the first wait between two tries of a held
#: lock, doubled after each try up to the cap; the lock is held for well under
#: a millisecond, so the first tries come soon and the cap keeps a long wait cheap
POLL_FIRST = 0.00005
POLL_CAP = 0.002

#: how many queue names' lock files a process keeps open after their
#: operations (the most recently used), so that a busy name is not reopened
#: each time and a process using many names does not run out of descriptors
KEPT_LOCKS = 64

#: hex digits of SHA-256 in a record file's name
KEY_DIGITS = 32

#: a record file written whole is padded with spaces to a multiple of this many bytes, so that the
#: next records, a little longer or shorter, are written over it in place
RECORD_BLOCK = 512

#: the longest record file written over in place: one write of at most a page, which a process
#: killed mid-way finishes or never starts; a longer one is written whole and renamed into place
IN_PLACE_MOST = 4096

#: what a record that is not there reads as
_MISSING: Any = object()

#: how many more times a record is read without its lock (held by another) until two reads agree
_READS = 10

#: the directory in ``PATH.d`` of the doorbells: a release that frees a place of a record found
#: full lately (or a start that leaves one free) closes the empty file named as the record file
#: without ``.json`` in it, and the shards of other processes waiting for a place hear it (by
#: inotify, :meth:`FileState.watch`)
DOORBELLS = "freed"

_log = logging.getLogger("ratequeue.state.file")


def default_path() -> Path:
    """The per-user state file used when no URL is given.

    ``$RATEQUEUE_STATE_FILE`` if set, else ``$XDG_CACHE_HOME/ratequeue/state.json``,
    else ``~/.cache/ratequeue/state.json``.
    """
    explicit = os.environ.get("RATEQUEUE_STATE_FILE")
    if explicit:
        return Path(explicit)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(cache) / "ratequeue" / "state.json"


class FileState(LocalState):
    """Records kept in one small file per queue name, each locked on its own.

    ``path`` names the state: a header file there says which layout it has,
    and the records are in the directory next to it, ``path`` + ``.d``. The
    files are created with mode 0600, the directories ratequeue creates with
    mode 0700. A path that is a symbolic link or a directory is refused.
    Content that is not a ratequeue state or record raises
    :class:`StateCorrupted` and is never overwritten.
    """

    # looked up at each call, so that tests that move time.time (freezegun) move this too
    _host_seconds = staticmethod(lambda: time.time())

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        clock: Clock | None = None,
        lock_timeout: float = 30.0,
        create_parents: bool = False,
        durable: bool = False,
    ) -> None:
        """Use the state at ``path`` (created on first write).

        :param clock: the state's clock (the host's wall clock by default, in whole microseconds); tests
            pass a fake one to drive time.
        :param lock_timeout: seconds to wait for a lock before raising
            :class:`StateUnavailable`.
        :param create_parents: create missing parent directories (mode 0700).
        :param durable: sync every change to disk before the operation returns, so that it
            survives an operating-system crash or a power loss (``?durable=1`` in the URL); by
            default a change survives any process's death, not the host's (docs/file-state.md).
        """
        self.path = Path(os.path.abspath(os.fspath(path)))
        self.url = self.path.as_uri()
        #: the directory of the record files
        self.records = self.path.with_name(f"{self.path.name}.d")
        self._clock = clock
        self._lock_timeout = lock_timeout
        #: whether every change is synced to disk before its operation returns
        self.durable = durable
        if durable:
            self.url += "?durable=1"
        _refuse_link_or_directory(self.path)
        if create_parents:
            _make_directories(self.path.parent)
        elif not self.path.parent.is_dir():
            raise ConfigurationError(f"the directory of state file {str(self.path)!r} does not exist")
        #: the header's lock: taken to create the header
        self._lock = LockFile.of(f"{self.path}.lock")
        #: (device, inode, size, mtime) of the header last found to be of this layout
        self._header: tuple[int, int, int, int] | None = None
        #: hears the doorbells of places freed elsewhere (made at the first watch)
        self._doorbells: _Doorbells | None = None
        #: the names used last: their record and lock files, and the bytes last read or written in
        #: their record file with the record and keep time they hold (a record read back as this
        #: process wrote it, the usual case, is not parsed and checked again)
        self._files: dict[str, tuple[Path, Path]] = {}
        self._known: dict[str, tuple[bytes, Record | None, int | None]] = {}
        #: the record files of the names used last, kept open for the operations on them
        self._handles: dict[str, _RecordFile] = {}

    @classmethod
    def from_url(cls, url: str) -> FileState:
        """Open ``file:///absolute/path.json``, or ``file:///absolute/path.json?durable=1``."""
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost") or not parts.path or parts.fragment:
            raise ConfigurationError(f"a file URL is file:///absolute/path.json, got {url!r}")
        return cls(unquote(parts.path), durable=_durable(parts.query, url))

    @classmethod
    def default(cls) -> FileState:
        """Open the per-user default state file (see :func:`default_path`)."""
        return cls(default_path(), create_parents=True)

    def record_files(self, name: str) -> tuple[Path, Path]:
        """The record file of queue ``name`` and its lock file (which need not exist).

        Named after the first :data:`KEY_DIGITS` hex digits of the SHA-256 of
        the name in UTF-8, so that any name makes a short, portable file
        name, distinct even where file names ignore case.
        """
        files = self._files.get(name)
        if files is None:
            key = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:KEY_DIGITS]
            files = self.records / f"{key}.json", self.records / f"{key}.lock"
            _remember(self._files, name, files)
        return files

    def watch(self, name: str, freed: Callable[[], None]) -> Callable[[], None] | None:
        """As :meth:`ratequeue.state.State.watch`: by inotify on the doorbells (:data:`DOORBELLS`).

        ``None`` where inotify is missing (not Linux) or cannot watch the
        doorbells' directory: the waiters then recheck every ``FULL_RECHECK_US``.
        """
        bells = self._doorbells
        if bells is None or bells.pid != os.getpid():
            with _doorbells_guard:
                bells = self._doorbells
                if bells is None or bells.pid != os.getpid():
                    try:
                        bells = self._doorbells = _Doorbells(self.records / DOORBELLS)
                    except OSError as exc:
                        _log.debug("cannot watch for freed places in %s: %s", self.records, exc)
                        return None
        return bells.watch(self.record_files(name)[0].stem, freed)

    def close(self) -> None:
        if self._doorbells is not None:
            self._doorbells.close()

    def _ring(self, file: Path) -> None:
        """Ring the doorbell of the record ``file``: close it, empty, opened for writing (no sync).

        Where no one ever watched, its directory is missing and nothing is made.
        """
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)
        with contextlib.suppress(OSError):
            os.close(os.open(self.records / DOORBELLS / file.stem, flags, 0o600))

    def _silence(self, file: Path) -> None:
        """Remove the doorbell of the record ``file`` (which is gone), if it has one."""
        with contextlib.suppress(OSError):
            os.unlink(self.records / DOORBELLS / file.stem)

    # --- operations ---

    def _execute(self, op: Operation) -> Answer:
        name = op.name
        file, lock = self.record_files(name)
        handle = self._handle(name, file)
        if handle.fd is None:
            self._ready(create=True)
        locked = self._name_lock(lock)
        self._take(locked)  # (not a context manager: this is the hot path)
        try:
            seen = self._held_record_bytes(name, handle)
            record, now, answer, content, written = self._decided(op, file, seen)
            if content is not None:
                stored, renamed = self._store(handle, content, seen, what=f"queue {name!r}")
                _remember(self._known, name, (stored, *written))
        finally:
            locked.release()
        if content is not None:
            if self._freeing(op, record, now, answer):
                self._ring(file)  # after the lock, which a woken waiter may want at once
            if renamed and self.durable:
                _sync_directory(file.parent)
        if record is None and self._sweep_due(now):
            self._sweep()
        return answer

    @staticmethod
    def _freeing(op: Operation, record: Record | None, now: int, answer: Answer) -> bool:
        """Whether ``op``, answered ``answer``, may let a waiting ticket start: its doorbell rings.

        While ``record`` was found full within ``FULL_GRACE_US``: a release
        that frees a place, and a start that leaves one free (the next
        ticket, which the grace holds back, may take it).
        """
        if record is None or not record.max_running or record.held + FULL_GRACE_US <= now:
            return False
        if answer is True:
            return op.kind == "release"
        return (
            type(answer) is Started
            and op.kind != "retime"
            and len(live_leases(record, now)) + 1 < record.max_running
        )

    def _read(self, name: str) -> Snapshot:
        raw = _MISSING
        if self._ready(create=False):
            raw = self._read_record(name, self.record_files(name)[0])[0]
        record = None if raw is _MISSING else check_record(raw, where=f"{self.path}#{name}")
        return self._checked(name, record, self._now())

    def _decided(
        self, op: Operation, file: Path, seen: bytes | None
    ) -> tuple[Record | None, int, Answer, bytes | None, tuple[Record, int | None]]:
        """``op`` decided from ``seen``, the bytes of its record file (``None``: no file).

        The record found, the time, the answer, the record file's new
        content (``None`` if the answer changes nothing, and so writes
        nothing), and the new record with its keep time.
        """
        known = self._known.get(op.name)
        if known is not None and seen is not None and known[0] == seen:
            record, kept = known[1], known[2]
        else:
            raw, kept = self._parse_record(op.name, file, seen)
            record = None if raw is _MISSING else check_record(raw, where=f"{self.path}#{op.name}")
            if seen is not None:
                _remember(self._known, op.name, (seen, record, kept))
        now = self._now()
        updated, answer = self._applied(op, record, now)
        until = kept if updated is record and op.kind == "try_take" else keep_until(updated, op.terms, now)
        if updated == record and until == kept:
            return record, now, answer, None, (updated, until)
        return record, now, answer, _record_content(op.name, updated, until), (updated, until)

    def _store(
        self, handle: _RecordFile, content: bytes, seen: bytes | None, *, what: str
    ) -> tuple[bytes, bool]:
        """Make the record file of ``handle``, which holds ``seen`` (``None``: no file), hold ``content``.

        Its bytes now (``content`` padded), and whether it was renamed.

        Called holding the name's lock. Over a record file of at least
        ``content``'s length, up to :data:`IN_PLACE_MOST` bytes, unless
        durable: written over in place, padded to its length (one write,
        which a killed process finishes or never starts). Else written whole
        to a temporary file (synced to disk if durable), padded to a
        multiple of :data:`RECORD_BLOCK`, and renamed over it.
        """
        file = handle.path
        if not self.durable and seen is not None and len(content) <= len(seen) <= IN_PLACE_MOST:
            return self._write_in_place(handle, content, seen, what=what), False
        padded = _padded(content, RECORD_BLOCK)
        tmp = self._write_new(file, padded, what=what, sync=self.durable)
        try:
            os.replace(tmp, file)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise self._cannot_write(what, file, exc) from exc
        handle.close()  # it was open on the file replaced
        return padded, True

    def _write_in_place(self, handle: _RecordFile, content: bytes, seen: bytes, *, what: str) -> bytes:
        """Write ``content``, padded to the length of ``seen`` (the file's bytes), over it; its bytes now.

        A write the system cuts short (a file-size limit) puts the bytes it
        overwrote back, so the record stays as it was, and raises.
        """
        padded = _padded(content, len(seen))
        fd = handle.fd
        assert fd is not None  # (open: ``seen`` was read through it, holding the lock)
        try:
            written = os.pwrite(fd, padded, 0)
            if written != len(padded):
                os.pwrite(fd, seen[:written], 0)
                raise OSError(errno.EFBIG, f"the write was cut short at {written} of {len(padded)} bytes")
        except OSError as exc:
            raise self._cannot_write(what, handle.path, exc) from exc
        return padded

    def _names(self, prefix: str) -> list[str]:
        return [name for name, _ in self._record_names() if name.startswith(prefix)]

    def _sweep(self) -> int:
        """Delete the record files kept until now or earlier; say how many.

        Each is read again under its name's lock before it goes, since an
        operation may have kept it longer meanwhile.
        """
        now = self._swept = self._now()
        gone = 0
        for name, file in self._record_names(expired_by=now):
            with self._locked(self._name_lock(self.record_files(name)[1])):
                _, kept = self._parse_record(name, file, self._record_bytes(name, file))
                if kept is None or kept > self._now():
                    continue
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(file)
                    gone += 1
                self._silence(file)
        if gone:
            _sync_directory(self.records)
        return gone

    def _record_names(self, expired_by: int | None = None) -> list[tuple[str, Path]]:
        """The queue names of the record files (kept until ``expired_by`` or earlier, if given).

        A file that cannot be read or is not a record is left out: the
        operations on its name report it.
        """
        try:
            _refuse_others_directory(self.records, os.stat(self.records))
            entries = list(os.scandir(self.records))
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise self._unavailable(f"cannot list {self.records}: {exc}") from exc
        found: list[tuple[str, Path]] = []
        for entry in entries:
            if entry.name.startswith(".") or not entry.name.endswith(".json"):
                continue
            try:
                data = json.loads(Path(entry.path).read_bytes())
            except (OSError, ValueError, RecursionError):
                continue
            if not isinstance(data, dict) or not isinstance(data.get("name"), str):
                continue
            kept = data.get("expires")
            if expired_by is None or (isinstance(kept, int) and kept <= expired_by):
                found.append((data["name"], Path(entry.path)))
        return found

    def _reset(self, name: str) -> bool:
        if not self._ready(create=False):
            return False
        file, lock = self.record_files(name)
        with self._locked(self._name_lock(lock)):
            try:
                os.unlink(file)
            except FileNotFoundError:
                return False
            except OSError as exc:
                raise self._unavailable(f"cannot delete the record of queue {name!r}, {file}: {exc}") from exc
            self._silence(file)
            _sync_directory(self.records)
            return True

    def _unavailable(self, message: str) -> StateUnavailable:
        """The error for a file operation that failed: the state is unavailable, as it was left."""
        return StateUnavailable(message, where=str(self.path))

    def _cannot_write(self, what: str, target: Path, exc: OSError) -> StateUnavailable:
        """The error for a write of ``what`` to ``target`` that failed and left it as it was."""
        return self._unavailable(
            f"cannot write {what} of state {self.path} to {target} (left as it was): {exc}"
        )

    def _now(self) -> int:
        # The host's wall clock in whole microseconds, read through time.time (rounded, so exact to
        # the microsecond) rather than time.time_ns, so that tests can drive it with freezegun.
        return self._clock() if self._clock else round(time.time() * 1_000_000)

    # --- the header ---

    def _ready(self, *, create: bool) -> bool:
        """Whether the state exists (its header, of this layout); with ``create``, make it if missing."""
        try:
            if _identity(os.lstat(self.path)) == self._header:
                return True
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise self._unavailable(f"cannot read state file {self.path}: {exc}") from exc
        identity = self._load()
        if identity is None and create:
            with self._locked(self._lock):
                identity = self._load()  # again: another process may have made it meanwhile
                if identity is None:
                    self._make_records_directory()
                    header = {"format": FORMAT, "version": VERSION, "records": self.records.name}
                    content = (json.dumps(header, indent=1, sort_keys=True) + "\n").encode()
                    self._replace(self.path, content, what="the state header")
                    identity = self._load()
        if identity is None:
            return False
        self._make_records_directory()
        self._header = identity
        return True

    def _load(self) -> tuple[int, int, int, int] | None:
        """The identity of the state file, checked to be a header of this layout; ``None`` if none."""
        try:
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except FileNotFoundError:
            return None
        except OSError as exc:
            _refuse_link_or_directory(self.path)
            raise self._unavailable(f"cannot read state file {self.path}: {exc}") from exc
        with os.fdopen(fd, "rb") as file:
            seen = os.fstat(fd)
            if not stat.S_ISREG(seen.st_mode):
                raise ConfigurationError(f"state file {str(self.path)!r} is not a regular file")
            _check_header(file.read(), where=str(self.path))
        return _identity(seen)

    def _make_records_directory(self) -> None:
        """Create ``PATH.d`` (mode 0700) if it is missing; refuse anything but a safe directory there.

        Safe: owned by this process's user or root, and writable by no one else
        (else another user could replace, delete or plant the records).
        """
        directory = self.records
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:
            seen = os.lstat(directory)
            if not stat.S_ISDIR(seen.st_mode):
                raise ConfigurationError(
                    f"{str(directory)!r}, where the state's records go, is not a directory"
                ) from None
            _refuse_others_directory(directory, seen)
            return
        except OSError as exc:
            raise self._unavailable(f"cannot create the record directory {directory}: {exc}") from exc
        with contextlib.suppress(OSError):
            os.chmod(directory, 0o700)  # whatever the umask
        _sync_directory(directory.parent)

    # --- record files and locks ---

    def _read_record(self, name: str, file: Path) -> tuple[Any, int | None]:
        """The stored fields of queue ``name``'s record, unchecked, or :data:`_MISSING`; and its keep time.

        Read holding the name's lock if it is free, since a record may be
        being written over in place; if another holds it (for a moment, or
        stopped), read until two reads agree: a write over in place is one
        system call, which a stopped process is never in the middle of.
        """
        lock = self._name_lock(file.with_suffix(".lock"))
        try:
            lock.acquire(0)
        except (LockTimeout, OSError):
            seen = self._record_bytes(name, file)
            for _ in range(_READS):
                again = self._record_bytes(name, file)
                if again == seen:
                    break
                seen = again
            return self._parse_record(name, file, seen)
        try:
            return self._parse_record(name, file, self._record_bytes(name, file))
        finally:
            lock.release()

    def _record_bytes(self, name: str, file: Path) -> bytes | None:
        """The bytes of queue ``name``'s record file, or ``None`` if there is none."""
        fd = self._open_record(name, file, os.O_RDONLY)
        if fd is None:
            return None
        try:
            return self._read_all(name, file, fd)
        finally:
            os.close(fd)

    def _held_record_bytes(self, name: str, handle: _RecordFile) -> bytes | None:
        """As :meth:`_record_bytes`, holding the name's lock, through ``handle``, which stays open.

        The file kept open is opened again if it has been replaced or deleted
        since (it has no link left): every replacement and deletion of a
        record file is made holding its name's lock. The state's header is
        checked (:meth:`_ready`) each time a record file is opened, not while
        it stays open.
        """
        fd = handle.fd
        if fd is not None:
            try:
                seen = os.fstat(fd)
            except OSError as exc:
                raise self._unavailable(
                    f"cannot read the record of queue {name!r}, {handle.path}: {exc}"
                ) from exc
            if seen.st_nlink > 0:
                return self._read_all(name, handle.path, fd, seen.st_size)
            handle.close()
            self._ready(create=True)
        fd = handle.fd = self._open_record(name, handle.path, os.O_RDWR)
        return None if fd is None else self._read_all(name, handle.path, fd)

    def _open_record(self, name: str, file: Path, mode: int) -> int | None:
        """``file``, queue ``name``'s record file, opened (``mode``); ``None`` if there is none."""
        where = f"{self.path}#{name}"
        try:
            fd = os.open(file, mode | getattr(os, "O_NOFOLLOW", 0))
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise StateCorrupted(
                    f"record file {file} of queue {name!r} is a symbolic link; reset the queue", where=where
                ) from exc
            raise self._unavailable(f"cannot read the record of queue {name!r}, {file}: {exc}") from exc
        try:
            regular = stat.S_ISREG(os.fstat(fd).st_mode)
        except OSError as exc:
            os.close(fd)
            raise self._unavailable(f"cannot read the record of queue {name!r}, {file}: {exc}") from exc
        if not regular:
            os.close(fd)
            raise StateCorrupted(
                f"record file {file} of queue {name!r} is not a regular file; reset the queue", where=where
            )
        return fd

    def _read_all(self, name: str, file: Path, fd: int, size: int | None = None) -> bytes:
        """All the bytes of the open record file ``fd`` (queue ``name``'s ``file``; ``size`` if known)."""
        try:
            if size is None:
                size = os.fstat(fd).st_size
            data = os.pread(fd, size + 1, 0)
            if len(data) <= size:  # (all of it, the usual case: one read)
                return data
            chunks = [data]  # it grew meanwhile (a durable writer renamed it: read what this opened)
            while chunks[-1]:
                chunks.append(os.pread(fd, 65536, sum(map(len, chunks))))
            return b"".join(chunks)
        except OSError as exc:
            raise self._unavailable(f"cannot read the record of queue {name!r}, {file}: {exc}") from exc

    def _handle(self, name: str, file: Path) -> _RecordFile:
        """Queue ``name``'s record file ``file``, kept open while among the :data:`KEPT_LOCKS` used last."""
        handle = self._handles.get(name)
        if handle is None or handle.pid != os.getpid():
            handle = _RecordFile(file)
            _remember(self._handles, name, handle)
        return handle

    def _parse_record(self, name: str, file: Path, raw: bytes | None) -> tuple[Any, int | None]:
        """The stored fields in a record file's bytes (see :meth:`_read_record`)."""
        where = f"{self.path}#{name}"
        if raw is None:
            return _MISSING, None
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise StateCorrupted(
                f"record file {file} of queue {name!r} is not valid JSON ({_short(exc)}); reset the queue",
                where=where,
            ) from exc
        if not isinstance(data, dict) or data.get("name") != name or "record" not in data:
            raise StateCorrupted(
                f"record file {file} does not hold a record of queue {name!r}; reset the queue", where=where
            )
        kept = data.get("expires")
        if kept is not None and (type(kept) is not int or not NEVER <= kept < 2**62):
            raise StateCorrupted(
                f"record file {file} of queue {name!r} has expires={kept!r}; want whole microseconds or null",
                where=where,
            )
        return data["record"], kept

    def _write_new(self, target: Path, content: bytes, *, what: str, sync: bool = True) -> Path:
        """A new temporary file beside ``target`` holding ``content``, written whole (and synced if ``sync``).

        Its name is new (``mkstemp``: created exclusively, mode 0600), since a
        record is written without the lock: two processes never share one,
        even with the same process id in two containers on one volume. A
        records directory deleted meanwhile is made again.
        """
        for again in (True, False):
            try:
                fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
                break
            except OSError as exc:
                if not (again and isinstance(exc, FileNotFoundError) and target.parent == self.records):
                    raise self._cannot_write(what, target, exc) from exc
                self._header = None
                self._make_records_directory()
        try:
            # a buffered file writes all of it, looping on short writes
            with os.fdopen(fd, "wb") as written:
                written.write(content)
                written.flush()
                if sync:
                    os.fsync(fd)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(name)
            raise self._cannot_write(what, target, exc) from exc
        return Path(name)

    def _replace(self, target: Path, content: bytes, *, what: str) -> None:
        """Replace ``target`` with ``content``: written whole and synced, or not at all.

        The content goes to a temporary file, which is synced and then
        renamed over the old file; the directory is synced after the rename
        where the platform allows. A failed or short write leaves the old file
        as it was and removes the temporary file.
        """
        tmp = self._write_new(target, content, what=what)
        try:
            os.replace(tmp, target)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise self._cannot_write(what, target, exc) from exc
        _sync_directory(target.parent)

    @staticmethod
    @functools.lru_cache(maxsize=KEPT_LOCKS)
    def _name_lock(path: Path) -> LockFile:
        """The lock of one queue name's record, kept open while among the :data:`KEPT_LOCKS` used last."""
        return LockFile.of(str(path))

    def _take(self, lock: LockFile) -> None:
        """Take ``lock`` within the lock timeout (making ``PATH.d`` again if it was deleted)."""
        for again in (True, False):
            try:
                lock.acquire(self._lock_timeout)
                return
            except LockTimeout as exc:
                raise self._unavailable(f"could not lock {lock.path} within {self._lock_timeout} s") from exc
            except OSError as exc:
                if not (again and isinstance(exc, FileNotFoundError) and lock is not self._lock):
                    raise self._unavailable(f"cannot lock {lock.path}: {exc}") from exc
                self._header = None  # PATH.d was deleted meanwhile: make it again
                self._make_records_directory()

    @contextlib.contextmanager
    def _locked(self, lock: LockFile) -> Iterator[None]:
        self._take(lock)
        try:
            yield
        finally:
            lock.release()


class _RecordFile:
    """A queue name's record file, kept open between operations; closed when no longer used.

    Read and written only holding the name's lock. A dropped handle that a
    thread still uses stays open until that thread is done with it.
    """

    __slots__ = ("fd", "path", "pid")

    def __init__(self, path: Path) -> None:
        self.path = path
        #: the open file (read and write), ``None`` until opened or after :meth:`close`
        self.fd: int | None = None
        #: the process that opened it: a forked child opens its own
        self.pid = os.getpid()

    def close(self) -> None:
        """Close the file (it is opened again when next used)."""
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)

    def __del__(self) -> None:
        with contextlib.suppress(OSError):
            self.close()


# --------------------------------------------------------------------------- doorbells (inotify)

#: inotify's flags and event bits (linux/inotify.h)
_IN_CLOSE_WRITE = 0x00000008
_IN_Q_OVERFLOW = 0x00004000
_IN_ONLYDIR = 0x01000000
_IN_DONT_FOLLOW = 0x02000000
_IN_NONBLOCK = os.O_NONBLOCK
_IN_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
#: an inotify event's header: watch descriptor, mask, cookie, length of the name after it
_EVENT = struct.Struct("iIII")


@functools.lru_cache(maxsize=1)
def _libc() -> Any:
    """The C library, if it has inotify (Linux); else ``None``."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.inotify_init1.argtypes = [ctypes.c_int]
        libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        libc.inotify_rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]
    except (OSError, AttributeError):
        return None
    return libc


def _checked(result: int) -> int:
    """A C call's result; -1 raised as the ``OSError`` of its ``errno``."""
    if result < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return result


class _Doorbells(Watchers):
    """One inotify descriptor on a state's doorbells, read by a daemon thread that calls their watchers.

    The directory is watched only while some doorbell has a watcher; the
    thread blocks on the descriptor and its wake-up pipe (no call, no timer).
    """

    def __init__(self, directory: Path) -> None:
        libc = _libc()
        if libc is None:
            raise OSError(errno.ENOSYS, "no inotify here")
        self._libc, self._directory = libc, directory
        self._fd = _checked(libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC))
        #: the watch on the directory, while a doorbell (a record file's name, no ``.json``) has a watcher
        self._wd: int | None = None
        super().__init__(f"ratequeue doorbells {directory}")

    def _watching(self, name: str) -> bool:
        if self._wd is None:  # the first watcher: the directory is watched from now on
            try:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(self._directory, 0o700)
                path = os.fsencode(self._directory)
                mask = _IN_CLOSE_WRITE | _IN_ONLYDIR | _IN_DONT_FOLLOW
                self._wd = _checked(self._libc.inotify_add_watch(self._fd, path, mask))
            except OSError as exc:
                _log.debug("cannot watch for freed places in %s: %s", self._directory, exc)
                return False
        return True

    def _left(self, name: str) -> bool:
        if not self._watchers and self._wd is not None and not self._closed:
            self._libc.inotify_rm_watch(self._fd, self._wd)  # (fails only if already gone)
            self._wd = None
        return False

    def _descriptors(self) -> tuple[int, ...]:
        return (self._fd,)

    def watching(self) -> bool:
        """Whether the directory is watched now (some doorbell has a watcher)."""
        with self._lock:
            return self._wd is not None

    def _run(self) -> None:
        """The thread: read the events, call the watchers of the doorbells rung."""
        while True:
            try:
                readable, _, _ = select.select([self._fd, self._wake_read], [], [])
                if self.closed:
                    return
                if self._fd not in readable:
                    continue
                try:
                    data = os.read(self._fd, 65536)
                except BlockingIOError:
                    continue
            except OSError as exc:  # (not expected) the waiters ask again within FULL_RECHECK_US
                _log.debug("reading the doorbells of %s failed: %s", self._directory, exc)
                return
            rung: set[str] = set()
            everyone = False
            offset = 0
            while offset + _EVENT.size <= len(data):
                _, mask, _, length = _EVENT.unpack_from(data, offset)
                name = data[offset + _EVENT.size : offset + _EVENT.size + length].rstrip(b"\0")
                offset += _EVENT.size + length
                if mask & _IN_Q_OVERFLOW:
                    everyone = True  # events were lost: any place may have been freed
                elif mask & _IN_CLOSE_WRITE:
                    rung.add(os.fsdecode(name))
            self._ring(None if everyone else rung)


#: guards the making of a state's doorbells
_doorbells_guard = threading.Lock()


class LockTimeout(Exception):
    """:meth:`LockFile.acquire` gave up: the lock stayed held for the whole timeout."""


class LockFile(ABC):
    """An exclusive lock on a file, for the threads and processes of one host.

    Get one with :meth:`of`: a process has one object per path, so that its
    threads queue on an in-process lock (a futex wait, woken in turn) and at
    most one of them at a time waits for the file lock. That one tries
    ``flock`` without blocking; while another process holds it, a helper
    thread blocks in ``flock`` for it, in the kernel, and hands it over, so
    that the caller can still give up at its timeout (a blocking ``flock``
    has no timeout, and only the main thread can break one with a signal).
    A wait costs no CPU while the lock stays held, and the lock passes to a
    waiter as soon as it is released.

    Where ``flock`` is missing (Windows), :mod:`filelock` tries the lock,
    with waits doubling from :data:`POLL_FIRST` to :data:`POLL_CAP`.

    The lock file is created with mode 0600 and kept open between uses. A
    child process made by ``fork`` closes its copy and opens its own: a lock
    taken through the copy would be its parent's lock too.
    """

    @staticmethod
    def of(path: str) -> LockFile:
        """This process's lock on ``path``: the same object while any user keeps it."""
        with _locks_guard:
            lock = _locks.get(path)
            if lock is None:
                lock = _locks[path] = (_FlockFile if _HAS_FLOCK else _PolledLockFile)(path)
            return lock

    def __init__(self, path: str) -> None:
        """A lock on the file at ``path``, opened when first taken; :meth:`of` makes them."""
        self.path = path
        self._reset()

    def _reset(self) -> None:
        """Start afresh: nothing opened, held or waited for (in a forked child too)."""
        #: held by the thread that holds or waits for the file lock
        self._turn = threading.Lock()

    def acquire(self, timeout: float) -> None:
        """Take the lock, waiting ``timeout`` seconds at most.

        :raises LockTimeout: if it stayed held by others for ``timeout`` seconds.
        :raises OSError: if the lock file cannot be opened or locked.
        """
        deadline = time.monotonic() + timeout
        if not self._turn.acquire(timeout=_wait_arg(timeout)):
            raise LockTimeout(self.path)
        try:
            self._lock_file(deadline)
        except BaseException:
            self._turn.release()
            raise

    def release(self) -> None:
        """Give the lock back; the calling thread must hold it."""
        try:
            self._unlock_file()
        finally:
            self._turn.release()

    @abstractmethod
    def _lock_file(self, deadline: float) -> None:
        """Take the file lock by ``deadline`` (a ``time.monotonic`` time), holding ``_turn``."""

    @abstractmethod
    def _unlock_file(self) -> None:
        """Release the file lock, holding ``_turn``."""


class _FlockFile(LockFile):
    """:class:`LockFile` by ``flock``, waited for by a helper thread."""

    #: the open lock file; ``None`` until first used
    _fd: int | None = None

    def _reset(self) -> None:
        # In a forked child, closing the child's copy leaves the parent's lock, if any, as it is.
        with contextlib.suppress(OSError):
            self._close()
        super()._reset()
        #: guards ``_pending``, which the helper thread changes too
        self._mutex = threading.Lock()
        #: the helper thread's ``flock(LOCK_EX)`` on ``_fd``, while it blocks in it
        self._pending: _Pending | None = None

    def _lock_file(self, deadline: float) -> None:
        while True:
            fd = self._open()
            self._flock(fd, deadline)
            try:
                if os.fstat(fd).st_nlink > 0:
                    return
            except BaseException:
                self._unlock_file()
                raise
            # PATH.lock was deleted or replaced since it was opened: other
            # processes lock another file now, so holding this one excludes no one.
            self._unlock_file()
            self._close()

    def _unlock_file(self) -> None:
        if self._fd is None:
            return
        try:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        except OSError:
            self._close()  # closing the last copy releases it too

    def _flock(self, fd: int, deadline: float) -> None:
        """Take the lock of ``fd`` by ``deadline``: at once if it is free, else from a helper thread."""
        with self._mutex:
            pending = self._pending
            # While the helper waits on fd, a lock taken here would be taken by
            # the helper too, and released by it if no one wanted it: join its wait.
            if pending is None:
                if _try_flock(fd):
                    return
                if deadline <= time.monotonic():
                    raise LockTimeout(self.path)
                pending = _Pending()
                threading.Thread(
                    target=self._help, args=(fd, pending), name=f"ratequeue lock {self.path}", daemon=True
                ).start()
                self._pending = pending
            pending.wanted = True
        # Waits on the real clock (not on a clock that tests may freeze).
        if not pending.done.wait(_wait_arg(deadline - time.monotonic())):
            with self._mutex:
                if not pending.done.is_set():
                    pending.wanted = False  # the helper releases the lock when it gets it
                    raise LockTimeout(self.path)
        if pending.failure is not None:
            raise pending.failure

    def _help(self, fd: int, pending: _Pending) -> None:
        """The helper thread: block in the kernel until the lock is free, then hand it over or release it."""
        failure: OSError | None = None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as exc:
            failure = exc
        with self._mutex:
            self._pending = None
            if pending.wanted:
                pending.failure = failure
                pending.done.set()
            elif failure is None:
                # the caller gave up meanwhile; unlocking a lock held cannot fail
                with contextlib.suppress(OSError):
                    fcntl.flock(fd, fcntl.LOCK_UN)

    def _open(self) -> int:
        if self._fd is None:
            self._fd = _open_lock_file(self.path)
        return self._fd

    def _close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __del__(self) -> None:
        with contextlib.suppress(OSError):
            self._close()


class _Pending:
    """A helper thread's wait for a lock: whether a caller still wants it, and how it ended."""

    def __init__(self) -> None:
        #: set when the helper got the lock for the caller, or failed to
        self.done = threading.Event()
        self.wanted = False
        self.failure: OSError | None = None


class _PolledLockFile(LockFile):
    """:class:`LockFile` by :mod:`filelock`, tried with waits that double up to :data:`POLL_CAP`."""

    def _reset(self) -> None:
        from filelock import FileLock

        super()._reset()
        self._filelock = FileLock(self.path, mode=0o600)

    def _lock_file(self, deadline: float) -> None:
        from filelock import Timeout

        delay = POLL_FIRST
        while True:
            with contextlib.suppress(Timeout):
                self._filelock.acquire(timeout=0)
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise LockTimeout(self.path)
            time.sleep(min(delay, remaining))
            delay = min(2 * delay, POLL_CAP)

    def _unlock_file(self) -> None:
        self._filelock.release()


#: this process's lock files by path, and the lock that guards the mapping (replaced in a forked child)
_locks: weakref.WeakValueDictionary[str, LockFile] = weakref.WeakValueDictionary()
_locks_guard = threading.Lock()


def _after_fork_in_child() -> None:
    # Only the forking thread lives on in the child: a lock another thread
    # held would stay held for ever, and an open lock file shares its flock
    # with the parent.
    global _locks_guard
    _locks_guard = threading.Lock()
    for lock in list(_locks.values()):
        lock._reset()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _wait_arg(seconds: float) -> float:
    """``seconds`` as a timeout that ``threading`` accepts: not negative, not above its maximum."""
    return min(max(seconds, 0.0), threading.TIMEOUT_MAX)


def _try_flock(fd: int) -> bool:
    """Take the ``flock`` of ``fd`` if it is free; whether it was."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as exc:
        # EACCES is how some file systems say "held"
        if isinstance(exc, BlockingIOError) or exc.errno == errno.EACCES:
            return False
        raise


def _open_lock_file(path: str) -> int:
    """Open ``path`` for locking: created with mode 0600 if missing, never through a symbolic link."""
    flags = os.O_RDWR | getattr(os, "O_NOFOLLOW", 0)
    while True:
        with contextlib.suppress(FileNotFoundError):
            return os.open(path, flags)
        with contextlib.suppress(FileExistsError):  # else made meanwhile: open it
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.fchmod(fd, 0o600)  # whatever the umask
            except BaseException:
                os.close(fd)
                raise
            return fd


def _sync_directory(directory: Path) -> None:
    """Flush ``directory``'s entries to disk, so that a rename in it survives a crash; best effort.

    Where a directory cannot be opened or synced (Windows, some file
    systems), this does nothing: the file's content is synced already.
    """
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _remember(cache: dict[str, Any], name: str, value: Any) -> None:
    """``cache[name] = value``, the oldest entry dropped past :data:`KEPT_LOCKS` names."""
    cache.pop(name, None)
    cache[name] = value
    if len(cache) > KEPT_LOCKS:
        with contextlib.suppress(StopIteration, RuntimeError, KeyError):  # (another thread's meanwhile)
            del cache[next(iter(cache))]


def _padded(content: bytes, length: int) -> bytes:
    """``content`` (ending in a newline) with spaces before its newline up to ``length`` bytes, or a multiple.

    JSON allows the whitespace, so the record reads the same.
    """
    size = length if len(content) <= length else -(-len(content) // length) * length
    return content[:-1] + b" " * (size - len(content)) + b"\n"


def _durable(query: str, url: str) -> bool:
    """Whether a file URL's query (empty, or ``durable=1`` / ``0``) asks for a durable state."""
    if not query:
        return False
    key, _, value = query.partition("=")
    if key == "durable" and value in _YES_NO:
        return _YES_NO[value]
    raise ConfigurationError(
        f"a file URL takes one option, durable=1 (sync every change to disk) or durable=0, got {url!r}"
    )


_YES_NO = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}


def _identity(seen: os.stat_result) -> tuple[int, int, int, int]:
    """What tells one version of a file from another, without reading it."""
    return seen.st_dev, seen.st_ino, seen.st_size, seen.st_mtime_ns


def _short(exc: BaseException) -> str:
    """``exc`` as a short phrase: a RecursionError's message says nothing about the file."""
    return "nested too deeply" if isinstance(exc, RecursionError) else str(exc)


def _check_header(raw: bytes, *, where: str) -> None:
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise StateCorrupted(
            f"state file {where} is not valid JSON ({_short(exc)}); move it aside to start afresh",
            where=where,
        ) from exc
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise StateCorrupted(f"{where} is not a ratequeue state file; give another path", where=where)
    if data.get("version") != VERSION:
        raise StateCorrupted(
            f"state file {where} has version {data.get('version')!r}; this ratequeue reads version {VERSION}",
            where=where,
        )


def _encode(record: Record) -> dict[str, Any]:
    """The stored fields of ``record``: ``NEVER`` as null, no cap as ``max_running`` 0."""
    return {
        "ticket": record.ticket,
        "pos": record.pos,
        "at": None if record.at == NEVER else record.at,
        "interval": record.interval,
        "due": None if record.due == NEVER else record.due,
        "burst": record.burst,
        "paused": record.paused,
        "max_running": record.max_running or 0,
        "leases": [list(lease) for lease in record.leases],
        "held": None if record.held == NEVER else record.held,
        "not_before": None if record.not_before == NEVER else record.not_before,
        "pace": record.pace,
        "paced_at": None if record.paced_at == NEVER else record.paced_at,
        "settled": record.settled,
        **(_fair_fields(record) if record.fair else {}),
        **({} if record.paused_at == NEVER else {"paused_at": record.paused_at}),
    }


def _fair_fields(record: Record) -> dict[str, Any]:
    """A fair queue's own stored fields (a queue that is not fair stores none of them)."""
    return {
        "fair": True,
        "number": record.number,
        "begun": record.begun,
        "waiters": [list(waiter) for waiter in record.waiters],
    }


def _record_bytes(name: str, fields: Any, kept: int | None = None) -> bytes:
    """A record file's content: the queue's name, its record's fields, and until when it is kept."""
    content: dict[str, Any] = {"name": name, "record": fields}
    if kept is not None:
        content["expires"] = kept
    return (json.dumps(content, sort_keys=True) + "\n").encode()


def _record_content(name: str, record: Record, kept: int | None) -> bytes:
    """``_record_bytes(name, _encode(record), kept)``, the same bytes, several times faster.

    Formatted by hand, since the fields' types are fixed: the operations write
    a record this way each time it changes.
    """
    never = NEVER
    if record.fair or record.paused_at != never:
        return _record_bytes(name, _encode(record), kept)
    ticket, pos, at, interval, due, burst, paused, cap, leases, held, not_before, pace, paced_at = record[:13]
    settled = record.settled
    return (
        ("{" if kept is None else f'{{"expires": {kept:d}, ')
        + _RECORD_CONTENT
        % (
            _json_name(name),
            "null" if at == never else at,
            burst,
            "null" if due == never else due,
            "null" if held == never else held,
            interval,
            ", ".join([f"[{a:d}, {b:d}, {c:d}]" for a, b, c in leases]) if leases else "",
            cap or 0,
            "null" if not_before == never else not_before,
            pace,
            "null" if paced_at == never else paced_at,
            "true" if paused else "false",
            pos,
            settled,
            ticket,
        )
    ).encode()


#: what follows ``{`` or ``"expires"`` in a record file, in the order of ``json.dumps(..., sort_keys=True)``
_RECORD_CONTENT = (
    '"name": %s, "record": {"at": %s, "burst": %d, "due": %s, "held": %s, "interval": %d, "leases": [%s], '
    '"max_running": %d, "not_before": %s, "pace": %d, "paced_at": %s, "paused": %s, "pos": %d, '
    '"settled": %d, "ticket": %d}}\n'
)


@functools.lru_cache(maxsize=KEPT_LOCKS)
def _json_name(name: str) -> str:
    """A queue name in JSON."""
    return json.dumps(name)


def _make_directories(directory: Path) -> None:
    """Create ``directory`` and its missing parents with mode 0700; existing ones are left as they are."""
    if os.path.lexists(directory):
        return  # the root always exists
    _make_directories(directory.parent)
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        return  # made meanwhile by someone else: theirs
    except OSError as exc:
        raise ConfigurationError(f"cannot create directory {str(directory)!r}: {exc}") from exc
    os.chmod(directory, 0o700)  # whatever the umask


def _refuse_others_directory(directory: Path, seen: os.stat_result) -> None:
    """Refuse a records directory owned by another user than this process's (or root), or others may write."""
    if not hasattr(os, "geteuid"):
        return  # Windows: no owners or modes to compare
    user, wrong = os.geteuid(), []
    if seen.st_uid not in (user, 0):
        wrong.append(f"is owned by uid {seen.st_uid}, not by this process's user (uid {user}) or root")
    if seen.st_mode & 0o022:
        wrong.append(f"is writable by other users (mode {stat.S_IMODE(seen.st_mode):04o})")
    if wrong:
        raise ConfigurationError(
            f"{str(directory)!r}, where the state's records go, {' and '.join(wrong)}: another user could "
            "change the records; remove it (ratequeue makes it again, mode 0700) or give another path"
        )


def _refuse_link_or_directory(path: Path) -> None:
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise ConfigurationError(f"cannot use state file {str(path)!r}: {exc}") from exc
    if stat.S_ISLNK(mode):
        raise ConfigurationError(f"state file {str(path)!r} is a symbolic link; give the real path")
    if stat.S_ISDIR(mode):
        raise ConfigurationError(f"state file {str(path)!r} is a directory; give a file path inside it")
