"""What the thread and asyncio limiter groups share: keys, their limiters, and the bound on idle ones.

A group is one rate per key (a customer, an API key): ``group[key]`` is the
limiter of queue ``f"{name}:{key}"``, made on first use with the group's
settings and its one state. In the queue name a key's ``%`` and ``:`` are
written ``%25`` and ``%3A`` (:func:`key_part`), so the key is always the
last part of the name: a key, whatever a tenant sends, never reaches a
record it does not own (``group["a:b"]`` is not the record of the group
``f"{name}:a"``'s key ``b``, nor a queue's group ``b``). Each key's record is created by its first
acquire and deleted by the state once the key has been idle ``keep``
seconds past the moment forgetting it changes nothing (see
:class:`ratequeue.core.operation.Terms`), so keys seen once do not stay. In the
process, the limiters of the most recently used keys are kept (up to
``max_keys``); older ones that nobody waits on are dropped, and made anew
(from the same state) if their key comes back.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

from ._redact import redact
from .errors import ConfigurationError
from .running import LimiterBase, runner_of
from .settings import Options, Settings, check_name, positive_int
from .state.base import StateBase

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["DEFAULT_KEEP", "DEFAULT_MAX_KEYS", "SEPARATOR", "GroupBase", "key_of", "key_part"]

#: seconds a key's record is kept idle (past the moment forgetting it changes nothing) by default
DEFAULT_KEEP = 60.0

#: how many keys' limiters a group keeps in the process by default
DEFAULT_MAX_KEYS = 1024

#: between the group's name and a key in the queue name
SEPARATOR = ":"

_ESCAPES = {"%": "%25", ":": "%3A"}
_ESCAPED = re.compile("[%:]")
_UNESCAPED = re.compile("%(25|3A)")


def key_part(key: str) -> str:
    """``key`` as written in a queue name: ``%`` as ``%25``, ``:`` as ``%3A``, the rest as it is."""
    return _ESCAPED.sub(lambda match: _ESCAPES[match[0]], key) if ("%" in key or ":" in key) else key


def key_of(part: str) -> str | None:
    """The key :func:`key_part` wrote as ``part``; ``None`` if no key is written so (a longer name)."""
    if ":" in part or "%" in _UNESCAPED.sub("", part):
        return None
    return _UNESCAPED.sub(lambda match: "%" if match[1] == "25" else ":", part)


L = TypeVar("L", bound=LimiterBase)


class GroupBase(Generic[L]):
    """Limiters of one rate, one per key, sharing one state; the drivers say which limiter class."""

    #: the limiter class of the thread or asyncio API
    _limiter_class: ClassVar[type[Any]]

    def __init__(
        self, url: Any = None, *, name: str, max_keys: int = DEFAULT_MAX_KEYS, **options: Unpack[Options]
    ) -> None:
        """
        :param url: the state, as for :class:`~ratequeue.Limiter` (opened once, shared by every key).
        :param name: the group's name: key ``k`` is the queue ``f"{name}:{k}"``.
        :param max_keys: how many keys' limiters this process keeps; older ones nobody waits
            on are dropped and made anew if their key comes back.
        :param options: each key's settings, as for :class:`~ratequeue.Limiter`. ``keep``
            (60 s by default) is how long a key's record is kept idle once forgetting it
            changes nothing: then the state deletes it. ``on_event`` is given to every key's
            limiter: each :class:`~ratequeue.Event` names its key's queue, ``f"{name}:{key}"``
            (a key's ``%`` and ``:`` written ``%25`` and ``%3A``).
        """
        self.name = check_name(name)
        options.setdefault("keep", DEFAULT_KEEP)
        if options.get("keep") is None:
            raise ConfigurationError("a group's keys must expire: keep must be a number of seconds, not None")
        self._max_keys = positive_int("max_keys", max_keys)
        # Every setting is checked now, not at the first use of a key.
        settings, _, self._hook = Settings.of(f"{self.name}{SEPARATOR}probe", options)
        self._options = options
        self.interval, self.burst, self.keep = settings.interval, settings.burst, settings.keep
        probe: L = self._limiter_class(url, name=settings.name, **options)
        self._state: StateBase = runner_of(probe).state
        self._owns_state = not isinstance(url, StateBase)
        self._limiters: OrderedDict[str, L] = OrderedDict()
        #: guards ``_limiters`` (threads may share a group; on asyncio it is never contended)
        self._guard = threading.Lock()

    def __getitem__(self, key: str) -> L:
        """The limiter of ``key``, made on first use; the same object while it is among the recent ones."""
        queue_name = self._queue_name(key)
        with self._guard:
            limiter = self._limiters.get(key)
            if limiter is None:
                limiter = self._limiter_class(self._state, name=queue_name, **self._options)
                if self._limiters:  # the most recently used key's limiter knows the state's clock best
                    sibling = runner_of(next(reversed(self._limiters.values())))
                    runner = runner_of(limiter)
                    runner.shard.learn_clock(sibling.shard, runner.clock())
                self._limiters[key] = limiter
                self._forget_idle()
            else:
                self._limiters.move_to_end(key)
            return limiter

    def __len__(self) -> int:
        """How many keys' limiters this process keeps now (``max_keys`` at most, but for busy ones)."""
        return len(self._limiters)

    def limiters(self) -> Iterator[L]:
        """The keys' limiters this process keeps now."""
        return iter(list(self._limiters.values()))

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({redact(self._state.url)!r}, name={self.name!r}, "
            f"interval={self.interval!r}, burst={self.burst!r}, keep={self.keep!r})"
        )

    def _queue_name(self, key: object) -> str:
        if not isinstance(key, str) or not key:
            raise ConfigurationError(f"a group's key must be a non-empty string, got {key!r}")
        try:
            return check_name(f"{self.name}{SEPARATOR}{key_part(key)}")
        except ConfigurationError as exc:
            raise ConfigurationError(f"key {key!r} of group {self.name!r}: {exc}") from None

    def _keys_of(self, names: list[str]) -> list[str]:
        """The keys of the queue names ``names`` (from the state, under this group's prefix).

        A name under the prefix that no key of this group has (``NAME:a:b``, a
        key of another group) is not one of its keys.
        """
        start = len(self.name) + len(SEPARATOR)
        return sorted(key for key in map(key_of, (name[start:] for name in names)) if key is not None)

    def _stop_fallbacks(self) -> None:
        """The group closes: the keys whose state is down stop probing it (``when_down``)."""
        for limiter in self.limiters():
            runner = runner_of(limiter)
            if runner.fallback is not None:
                runner.fallback.stop(runner)

    def _forget_idle(self) -> None:
        """Drop the least recently used limiters beyond ``max_keys`` that nobody waits on (holding the guard).

        A paused limiter is kept (dropping it would drop its pause), and one holding leases.
        """
        excess = len(self._limiters) - self._max_keys
        if excess <= 0:
            return
        for key in list(self._limiters)[:excess]:
            runner = runner_of(self._limiters[key])
            with runner.driver.lock:
                idle = runner.idle
            if idle:
                del self._limiters[key]
