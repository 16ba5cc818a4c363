"""Where queues keep their shared record: one module or package per state, each with both forms.

:func:`open_state` and :func:`open_async_state` open a state from a URL; the
state's module, and the optional dependency it needs, are imported only then.
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Union

from .._redact import redact, secrets_kept_out
from ..errors import ConfigurationError
from .base import AsyncState, Snapshot, State, ThreadedState

__all__ = [
    "BACKENDS",
    "AsyncState",
    "AsyncStateLike",
    "Backend",
    "Snapshot",
    "State",
    "StateLike",
    "ThreadedState",
    "open_async_state",
    "open_state",
    "schemes",
]


@dataclass(frozen=True)
class Backend:
    """Where a URL scheme's state classes live, and the extra that installs their dependency."""

    #: the module, and the class of the synchronous state
    module: str
    state: str
    #: the class of the asyncio state in the same module; ``None``: the sync state runs in a thread
    async_state: str | None = None
    #: the extra (``pip install 'ratequeue[extra]'``) providing the client library, or ``None``
    extra: str | None = None


_REDIS = Backend("ratequeue.state.redis", "RedisState", "AsyncRedisState", "redis")
_MONGODB = Backend("ratequeue.state.mongodb", "MongoState", "AsyncMongoState", "mongodb")
_POSTGRESQL = Backend("ratequeue.state.postgresql", "PostgresState", "AsyncPostgresState", "postgresql")

#: every URL scheme :func:`open_state` and :func:`open_async_state` know
BACKENDS: dict[str, Backend] = {
    "memory": Backend("ratequeue.state.memory", "MemoryState"),
    "file": Backend("ratequeue.state.file", "FileState"),
    "redis": _REDIS,
    "rediss": _REDIS,
    "redis+cluster": _REDIS,
    "rediss+cluster": _REDIS,
    "unix": _REDIS,
    "mongodb": _MONGODB,
    "mongodb+srv": _MONGODB,
    "postgresql": _POSTGRESQL,
    "postgres": _POSTGRESQL,
}

#: what the limiters and queues accept as their state
StateLike = Union[str, "os.PathLike[str]", State, None]

#: what the asyncio limiters and queues accept as their state
AsyncStateLike = Union[str, "os.PathLike[str]", State, AsyncState, None]


def schemes() -> list[str]:
    """The URL schemes :func:`open_state` knows."""
    return sorted(BACKENDS)


#: a URL's scheme, as ``urllib.parse`` reads it, but never raising on the rest of the URL
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*):")


def scheme_of(url: str) -> str:
    """The lowercased scheme of ``url`` (``""`` if none); whatever follows may be malformed."""
    match = _SCHEME.match(url)
    return match[1].lower() if match else ""


def backend_of(url: str) -> Backend:
    """The backend of a state URL; :class:`ConfigurationError` for an unknown scheme."""
    scheme = scheme_of(url)
    if scheme not in BACKENDS:
        hint = f"; for a state file write file://{url}" if url.startswith("/") else ""
        raise ConfigurationError(
            f"unknown state URL scheme in {redact(url)!r}: use one of {', '.join(schemes())}{hint}"
        )
    return BACKENDS[scheme]


def opener(url: str, module_name: str, class_name: str, extra: str | None) -> Callable[[str], Any]:
    """``module_name.class_name.from_url``, imported now; a clear error if its client library is missing."""
    scheme = scheme_of(url)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        if exc.name == module_name:
            raise ConfigurationError(f"{scheme}:// states are not available in this version") from exc
        if extra is None or exc.name is None or exc.name.startswith("ratequeue"):
            raise
        raise ConfigurationError(
            f"{scheme}:// states need the {exc.name!r} package: pip install 'ratequeue[{extra}]'"
        ) from exc
    opens: Callable[[str], Any] = getattr(module, class_name).from_url
    return opens


def open_state(url: StateLike) -> State:
    """Open the state named by ``url``.

    ``None`` means the per-user default state file; a path (``os.PathLike``)
    means a JSON state file there; a :class:`State` is returned as it is.
    Raises :class:`ConfigurationError` for an unknown scheme, a malformed URL
    or a missing optional dependency, before anything is connected.
    """
    if isinstance(url, State):
        return url
    if url is None or isinstance(url, os.PathLike):
        from .file import FileState

        return FileState.default() if url is None else FileState(url)
    if not isinstance(url, str):
        raise ConfigurationError(f"a state is a URL, a path or a State object, got {type(url).__name__}")
    backend = backend_of(url)
    with secrets_kept_out(url):
        state: State = opener(url, backend.module, backend.state, backend.extra)(url)
    return state


def open_async_state(url: AsyncStateLike) -> AsyncState:
    """Open the state named by ``url`` for asyncio, as :func:`open_state` does.

    Redis, MongoDB and PostgreSQL use their client libraries' asyncio clients; the
    memory and file states, and any :class:`State` object, run in a thread.
    """
    if isinstance(url, AsyncState):
        return url
    if isinstance(url, str):
        backend = backend_of(url)
        if backend.async_state is not None:
            with secrets_kept_out(url):
                state: AsyncState = opener(url, backend.module, backend.async_state, backend.extra)(url)
            return state
    return ThreadedState(open_state(url))
