"""What the thread and asyncio limiter groups share: keys, their limiters, and the bound on idle ones.

A group is one rate per key (a customer, an API key): ``group[key]`` is the
limiter of queue ``f"{name}:{key}"``, made on first use with the group's
settings and its one state. Each key's record is created by its first
acquire and deleted by the state once the key has been idle ``keep``
seconds past the moment forgetting it changes nothing (see
:class:`ratequeue.state.base.Terms`), so keys seen once do not stay. In the
process, the limiters of the most recently used keys are kept (up to
``max_keys``); older ones that nobody waits on are dropped, and made anew
(from the same state) if their key comes back.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from . import _validate
from ._limiting import DEFAULT_LEASE, LimiterBase, Seconds
from ._redact import redact
from .errors import ConfigurationError
from .events import EventHook
from .rates import RateLike
from .shard import DEFAULT_MAX_LATE
from .state.base import StateBase

__all__ = ["DEFAULT_KEEP", "DEFAULT_MAX_KEYS", "GroupBase", "SEPARATOR"]

#: seconds a key's record is kept idle (past the moment forgetting it changes nothing) by default
DEFAULT_KEEP = 60.0

#: how many keys' limiters a group keeps in the process by default
DEFAULT_MAX_KEYS = 1024

#: between the group's name and a key in the queue name
SEPARATOR = ":"

L = TypeVar("L", bound=LimiterBase[Any])
S = TypeVar("S", bound=StateBase)


class GroupBase(ABC, Generic[L, S]):
    """Limiters of one rate, one per key, sharing one state; the drivers say which limiter and state."""

    #: the group's name: key ``k`` is queue ``f"{name}:{k}"``
    name: str

    def __init__(
        self,
        url: Any,
        *,
        name: str,
        interval: Seconds | None = None,
        rate: RateLike | None = None,
        burst: int = 1,
        keep: Seconds = DEFAULT_KEEP,
        max_keys: int = DEFAULT_MAX_KEYS,
        lead: Seconds | None = None,
        max_late: Seconds | None = DEFAULT_MAX_LATE,
        clock: Callable[[], float] | None = None,
        max_running: int | None = None,
        lease: Seconds = DEFAULT_LEASE,
        on_event: EventHook | None = None,
    ) -> None:
        """
        :param url: the state, as for :class:`~ratequeue.Limiter` (opened once, shared by every key).
        :param name: the group's name: key ``k`` is the queue ``f"{name}:{k}"``.
        :param interval: seconds between two starts of one key (or give ``rate``).
        :param rate: each key's rate, such as ``"5000/hour"``.
        :param burst: how many starts of one key may come at once after an idle spell.
        :param keep: seconds a key's record is kept once idle (past the moment
            forgetting it changes nothing): then the state deletes it. 60 s by default.
        :param max_keys: how many keys' limiters this process keeps; older ones
            nobody waits on are dropped and made anew if their key comes back.
        :param lead: as for :class:`~ratequeue.Limiter`.
        :param max_late: as for :class:`~ratequeue.Limiter`.
        :param clock: as for :class:`~ratequeue.Limiter`.
        :param max_running: how many jobs of one key may run at once across
            every process (``None``: no cap), as for :class:`~ratequeue.Limiter`.
        :param lease: as for :class:`~ratequeue.Limiter`, with ``max_running``.
        :param on_event: as for :class:`~ratequeue.Limiter`, given to every key's
            limiter: each :class:`~ratequeue.Event` names its key's queue, ``f"{name}:{key}"``.
        """
        self.name = _validate.name(name)
        if keep is None:
            raise ConfigurationError("a group's keys must expire: keep must be a number of seconds, not None")
        self._settings: dict[str, Any] = {
            "interval": interval,
            "rate": rate,
            "burst": burst,
            "keep": keep,
            "lead": lead,
            "max_late": max_late,
            "clock": clock,
            "max_running": max_running,
            "lease": lease,
            "on_event": on_event,
        }
        self._max_keys = _validate.positive_int("max_keys", max_keys)
        # Every setting is checked now, by the limiter of a first key, not at the first use of a key.
        self._state: S = self._open(url)
        self._owns_state = not isinstance(url, StateBase)
        probe = self._make(f"{self.name}{SEPARATOR}probe")
        self.interval, self.burst, self.keep = probe.interval, probe.burst, probe.keep
        self._limiters: OrderedDict[str, L] = OrderedDict()
        #: guards ``_limiters`` (threads may share a group; on asyncio it is never contended)
        self._guard = threading.Lock()

    def __getitem__(self, key: str) -> L:
        """The limiter of ``key``, made on first use; the same object while it is among the recent ones."""
        queue_name = self._queue_name(key)
        with self._guard:
            limiter = self._limiters.get(key)
            if limiter is None:
                limiter = self._make(queue_name)
                if self._limiters:  # the most recently used key's limiter knows the state's clock best
                    sibling = next(reversed(self._limiters.values()))
                    limiter._shard.learn_clock_from(sibling._shard, limiter._clock())
                self._limiters[key] = limiter
                self._forget_idle()
            else:
                self._limiters.move_to_end(key)
            return limiter

    def __len__(self) -> int:
        """How many keys' limiters this process keeps now (``max_keys`` at most, but for busy ones)."""
        return len(self._limiters)

    @property
    def state(self) -> S:
        """The state every key's limiter uses."""
        return self._state

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({redact(self._state.url)!r}, name={self.name!r}, "
            f"interval={self.interval!r}, burst={self.burst!r}, keep={self.keep!r})"
        )

    def _queue_name(self, key: object) -> str:
        if not isinstance(key, str) or not key:
            raise ConfigurationError(f"a group's key must be a non-empty string, got {key!r}")
        try:
            return _validate.name(f"{self.name}{SEPARATOR}{key}")
        except ConfigurationError as exc:
            raise ConfigurationError(f"key {key!r} of group {self.name!r}: {exc}") from None

    def _keys_of(self, names: list[str]) -> list[str]:
        """The keys of the queue names ``names`` (all of this group's, from the state)."""
        start = len(self.name) + len(SEPARATOR)
        return [name[start:] for name in names]

    def _forget_idle(self) -> None:
        """Drop the least recently used limiters beyond ``max_keys`` that nobody waits on (holding the guard).

        A paused limiter is kept: dropping it would drop its pause; so is one
        holding leases (its keeper renews them).
        """
        excess = len(self._limiters) - self._max_keys
        if excess <= 0:
            return
        for key in list(self._limiters)[:excess]:
            if self._limiters[key]._is_idle():
                del self._limiters[key]

    def _make(self, queue_name: str) -> L:
        return self._limiter_class()(self._state, name=queue_name, **self._settings)

    @abstractmethod
    def _limiter_class(self) -> type[L]: ...

    @abstractmethod
    def _open(self, url: Any) -> S: ...
