"""Where queues keep their shared record: one module per backend.

:func:`from_url` opens a state from a URL; the backend's module, and the
optional dependency it needs, are imported only then.
"""

from __future__ import annotations

import importlib
import os
from typing import Union
from urllib.parse import urlsplit

from ..errors import ConfigurationError
from .base import Snapshot, State

__all__ = ["Snapshot", "State", "StateLike", "from_url", "schemes"]

#: scheme -> (module, class, extra that provides its dependency or None)
_BACKENDS: dict[str, tuple[str, str, str | None]] = {
    "memory": ("ratequeue.state.memory", "MemoryState", None),
    "file": ("ratequeue.state.file", "FileState", None),
    "redis": ("ratequeue.state.redis", "RedisState", "redis"),
    "rediss": ("ratequeue.state.redis", "RedisState", "redis"),
    "unix": ("ratequeue.state.redis", "RedisState", "redis"),
    "mongodb": ("ratequeue.state.mongodb", "MongoState", "mongodb"),
    "mongodb+srv": ("ratequeue.state.mongodb", "MongoState", "mongodb"),
}

#: what the limiters and queues accept as their state
StateLike = Union[str, "os.PathLike[str]", State, None]


def schemes() -> list[str]:
    """The URL schemes :func:`from_url` knows."""
    return sorted(_BACKENDS)


def from_url(url: StateLike) -> State:
    """Open the state named by ``url``.

    ``None`` means the per-user default state file; a path (``os.PathLike``)
    means a JSON state file there; a :class:`State` is returned as it is.
    Raises :class:`ConfigurationError` for an unknown scheme, a malformed URL
    or a missing optional dependency, before anything is connected.
    """
    if url is None:
        from .file import FileState

        return FileState.default()
    if isinstance(url, State):
        return url
    if isinstance(url, os.PathLike):
        from .file import FileState

        return FileState(url)
    if not isinstance(url, str):
        raise ConfigurationError(f"a state is a URL, a path or a State object, got {type(url).__name__}")
    scheme = urlsplit(url).scheme.lower()
    if scheme not in _BACKENDS:
        hint = f"; for a state file write file://{url}" if url.startswith("/") else ""
        raise ConfigurationError(
            f"unknown state URL scheme in {url!r}: use one of {', '.join(schemes())}{hint}"
        )
    module_name, class_name, extra = _BACKENDS[scheme]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        if exc.name == module_name:
            raise ConfigurationError(f"{scheme}:// states are not available in this version") from exc
        if extra is None or exc.name is None:
            raise
        raise ConfigurationError(
            f"{scheme}:// states need the {exc.name!r} package: pip install 'ratequeue[{extra}]'"
        ) from exc
    backend: type[State] = getattr(module, class_name)
    return backend.from_url(url)  # type: ignore[attr-defined, no-any-return]
