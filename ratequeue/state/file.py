"""``file:///path/state.json``: a JSON file shared by the processes of one host.

The file holds the records of many queue names. Every operation reads,
changes and rewrites it while holding an exclusive lock on ``PATH.lock``; the
new content is written to a temporary file and moved into place, so a
process killed mid-write never leaves a torn file. The clock is the host's
wall clock, which every user of the file shares.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import time
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from filelock import FileLock, Timeout

from ..errors import ConfigurationError, StateCorrupted, StateUnavailable
from ..protocol import NEVER, Record
from ._local import LocalState, R, Step, open_record
from .base import Clock, check_record

__all__ = ["FileState", "default_path"]

#: what the file's top level says it is
FORMAT = "ratequeue-state"
VERSION = 1

#: how often a waiting process retries a held lock; small, because the lock
#: is held for well under a millisecond and waits add to every gap
LOCK_POLL_INTERVAL = 0.0002


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
    """Records kept in one JSON file, locked for every operation.

    The file and its lock are created with mode 0600. A path that is a
    symbolic link or a directory is refused. Content that is not a
    ratequeue state raises :class:`StateCorrupted` and is never overwritten.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        clock: Clock | None = None,
        lock_timeout: float = 30.0,
        create_parents: bool = False,
    ) -> None:
        """Use the state file at ``path`` (created on first write).

        :param clock: the state's clock (the host's wall clock by default, in whole microseconds); tests
            pass a fake one to drive time.
        :param lock_timeout: seconds to wait for the file lock before raising
            :class:`StateUnavailable`.
        :param create_parents: create missing parent directories (mode 0700).
        """
        self.path = Path(os.path.abspath(os.fspath(path)))
        self.url = self.path.as_uri()
        self._clock = clock
        self._lock_timeout = lock_timeout
        _refuse_link_or_directory(self.path)
        if create_parents:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        elif not self.path.parent.is_dir():
            raise ConfigurationError(f"the directory of state file {str(self.path)!r} does not exist")
        self._lock = FileLock(f"{self.path}.lock", mode=0o600)

    @classmethod
    def from_url(cls, url: str) -> FileState:
        """Open ``file:///absolute/path.json``."""
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost") or not parts.path or parts.query or parts.fragment:
            raise ConfigurationError(f"a file URL is file:///absolute/path.json, got {url!r}")
        return cls(unquote(parts.path))

    @classmethod
    def default(cls) -> FileState:
        """Open the per-user default state file (see :func:`default_path`)."""
        return cls(default_path(), create_parents=True)

    def _transact(
        self, name: str, interval: int | None, step: Step[R] | None
    ) -> tuple[Record | None, int, R | None]:
        with self._locked():
            data = self._load()
            now = self._clock() if self._clock else _host_clock()
            queues = data["queues"]
            where = f"{self.path}#{name}"
            record = check_record(queues[name], where=where) if name in queues else None
            if interval is None or step is None:
                if interval is not None:
                    open_record(name, record, interval)
                return record, now, None
            updated, answer = step(open_record(name, record, interval), now)
            if updated != record:
                queues[name] = _encode(updated)
                self._store(data)
            return record, now, answer

    def _reset(self, name: str) -> bool:
        with self._locked():
            data = self._load()
            if name not in data["queues"]:
                return False
            del data["queues"][name]
            self._store(data)
            return True

    def _locked(self) -> Any:
        try:
            return self._lock.acquire(timeout=self._lock_timeout, poll_interval=LOCK_POLL_INTERVAL)
        except Timeout as exc:
            raise StateUnavailable(
                f"could not lock {self.path}.lock within {self._lock_timeout} s", where=str(self.path)
            ) from exc
        except OSError as exc:
            raise StateUnavailable(f"cannot lock {self.path}.lock: {exc}", where=str(self.path)) from exc

    def _load(self) -> dict[str, Any]:
        try:
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except FileNotFoundError:
            return {"format": FORMAT, "version": VERSION, "queues": {}}
        except OSError as exc:
            _refuse_link_or_directory(self.path)
            raise StateUnavailable(
                f"cannot read state file {self.path}: {exc}", where=str(self.path)
            ) from exc
        with os.fdopen(fd, "rb") as file:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ConfigurationError(f"state file {str(self.path)!r} is not a regular file")
            raw = file.read()
        return _decode(raw, where=str(self.path))

    def _store(self, data: dict[str, Any]) -> None:
        text = json.dumps(data, indent=1, sort_keys=True, allow_nan=False).encode()
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{id(self)}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o600)
            try:
                os.write(fd, text)
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise StateUnavailable(
                f"cannot write state file {self.path}: {exc}", where=str(self.path)
            ) from exc


def _host_clock() -> int:
    """The host's wall clock in whole microseconds.

    Read through ``time.time`` (rounded, so exact to the microsecond) rather
    than ``time.time_ns``, so that tests can drive it with freezegun.
    """
    return round(time.time() * 1_000_000)


def _decode(raw: bytes, *, where: str) -> dict[str, Any]:
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise StateCorrupted(
            f"state file {where} is not valid JSON ({exc}); move it aside to start afresh", where=where
        ) from exc
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise StateCorrupted(f"{where} is not a ratequeue state file; give another path", where=where)
    if data.get("version") != VERSION:
        raise StateCorrupted(
            f"state file {where} has version {data.get('version')!r}; this ratequeue reads version {VERSION}",
            where=where,
        )
    if not isinstance(data.get("queues"), dict):
        raise StateCorrupted(f"state file {where} has no 'queues' object", where=where)
    return data


def _encode(record: Record) -> dict[str, Any]:
    return {
        "ticket": record.ticket,
        "pos": record.pos,
        "at": None if record.at == NEVER else record.at,
        "interval": record.interval,
    }


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
