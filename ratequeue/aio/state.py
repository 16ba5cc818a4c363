"""The asyncio state contract, and the adapter that runs a thread-safe state in a thread.

:class:`AsyncState` offers the same operations as :class:`ratequeue.state.State`,
as coroutines, with the same argument checks and errors. The memory and file
states have no asyncio driver: :class:`ThreadedState` runs them in the
default executor so the event loop never blocks on a file lock.
"""

from __future__ import annotations

import asyncio
import os
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, Union

from .. import _validate
from .._redact import secrets_kept_out
from ..protocol import Outcome, Taken
from ..state import State, backend_of, opener
from ..state import from_url as sync_from_url
from ..state.base import (
    Snapshot,
    StateBase,
    Terms,
    release_args,
    renew_args,
    retime_args,
    set_paused_args,
    take_and_try_args,
    take_args,
    try_start_args,
)

__all__ = ["AsyncState", "AsyncStateLike", "ThreadedState", "from_url"]

R = TypeVar("R")


class AsyncState(StateBase, ABC):
    """Where the shards of a queue keep their shared record, used from asyncio.

    The operations, their checks, errors and promises are those of
    :class:`ratequeue.state.State`, as coroutines.
    """

    async def take(
        self,
        name: str,
        interval_us: int,
        *,
        burst: int = 1,
        cost: int = 1,
        keep_us: int = 0,
        max_running: int = 0,
        lease_us: int = 0,
    ) -> Taken:
        """Hand out the next ticket of queue ``name``, for a job of ``cost``."""
        args = take_args(interval_us, burst, cost, keep_us, max_running, lease_us)
        return await self._guarded(name, self._take, *args)

    async def try_start(
        self,
        name: str,
        interval_us: int,
        ticket: int,
        lead_us: int,
        *,
        burst: int = 1,
        cost: int = 1,
        keep_us: int = 0,
        max_running: int = 0,
        lease_us: int = 0,
    ) -> Outcome:
        """Start ``ticket`` (taken for ``cost``) if its earliest start is at most ``lead_us`` us away."""
        args = try_start_args(interval_us, ticket, lead_us, burst, cost, keep_us, max_running, lease_us)
        return await self._guarded(name, self._try_start, *args)

    async def take_and_try(
        self,
        name: str,
        interval_us: int,
        lead_us: int,
        *,
        burst: int = 1,
        cost: int = 1,
        keep_us: int = 0,
        max_running: int = 0,
        lease_us: int = 0,
    ) -> Outcome:
        """Take a ticket and try to start it, in one atomic step."""
        args = take_and_try_args(interval_us, lead_us, burst, cost, keep_us, max_running, lease_us)
        return await self._guarded(name, self._take_and_try, *args)

    async def retime(
        self,
        name: str,
        interval_us: int,
        ticket: int,
        lead_us: int,
        *,
        burst: int = 1,
        keep_us: int = 0,
        max_running: int = 0,
        lease_us: int = 0,
    ) -> Outcome:
        """Move the start of ``ticket``, if it is the latest, to ``now + lead_us`` at the earliest."""
        args = retime_args(interval_us, ticket, lead_us, burst, keep_us, max_running, lease_us)
        return await self._guarded(name, self._retime, *args)

    async def release(
        self,
        name: str,
        interval_us: int,
        ticket: int,
        *,
        burst: int = 1,
        keep_us: int = 0,
        max_running: int = 0,
        lease_us: int = 0,
    ) -> bool:
        """Release ``ticket``'s lease; whether it was live (see :meth:`ratequeue.state.State.release`)."""
        args = release_args(interval_us, ticket, burst, keep_us, max_running, lease_us)
        return await self._guarded(name, self._release, *args)

    async def renew(
        self,
        name: str,
        interval_us: int,
        ticket: int,
        *,
        burst: int = 1,
        keep_us: int = 0,
        max_running: int = 0,
        lease_us: int = 0,
    ) -> bool:
        """Make ``ticket``'s lease last ``lease_us`` from now; whether it was live (see ``State.renew``)."""
        args = renew_args(interval_us, ticket, burst, keep_us, max_running, lease_us)
        return await self._guarded(name, self._renew, *args)

    async def set_paused(
        self,
        name: str,
        interval_us: int,
        paused: bool,
        *,
        burst: int = 1,
        keep_us: int = 0,
        max_running: int = 0,
        lease_us: int = 0,
    ) -> bool:
        """Pause queue ``name`` for every shard, or resume it; say whether that changed it.

        See :meth:`ratequeue.state.State.set_paused`.
        """
        args = set_paused_args(interval_us, paused, burst, keep_us, max_running, lease_us)
        return await self._guarded(name, self._set_paused, *args)

    async def read(self, name: str) -> Snapshot:
        """The record of queue ``name`` and the state clock's time; changes nothing."""
        return await self._guarded(name, self._read)

    async def reset(self, name: str) -> bool:
        """Delete the record of queue ``name``; say whether there was one."""
        return await self._guarded(name, self._reset)

    async def names(self, prefix: str = "") -> list[str]:
        """The names of the queues that have a record here and begin with ``prefix``, sorted."""
        return sorted(await self._mapped("", self._names, _validate.prefix(prefix)))

    async def sweep(self) -> int:
        """Delete every record whose keep time has passed; say how many (see :meth:`State.sweep`)."""
        return await self._mapped("", self._sweep)

    async def close(self) -> None:
        """Release connections; the state may not be used afterwards."""

    async def __aenter__(self) -> AsyncState:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _guarded(self, name: str, operation: Callable[..., Awaitable[R]], *args: Any) -> R:
        """``await operation(name, *args)`` with ``name`` checked and the driver's errors mapped."""
        name = _validate.name(name)
        return await self._mapped(name, operation, name, *args)

    async def _mapped(self, name: str, call: Callable[..., Awaitable[R]], *args: Any) -> R:
        """``await call(*args)``, an operation on queue ``name`` (or ``""``), driver errors mapped."""
        try:
            return await call(*args)
        except self._driver_errors as exc:
            raise self._error_for(exc, name) from exc

    @abstractmethod
    async def _take(self, name: str, terms: Terms, cost: int) -> Taken: ...

    @abstractmethod
    async def _try_start(self, name: str, terms: Terms, ticket: int, lead_us: int, cost: int) -> Outcome: ...

    @abstractmethod
    async def _take_and_try(self, name: str, terms: Terms, lead_us: int, cost: int) -> Outcome: ...

    @abstractmethod
    async def _retime(self, name: str, terms: Terms, ticket: int, lead_us: int) -> Outcome: ...

    @abstractmethod
    async def _set_paused(self, name: str, terms: Terms, paused: bool) -> bool: ...

    @abstractmethod
    async def _release(self, name: str, terms: Terms, ticket: int) -> bool: ...

    @abstractmethod
    async def _renew(self, name: str, terms: Terms, ticket: int) -> bool: ...

    @abstractmethod
    async def _read(self, name: str) -> Snapshot: ...

    @abstractmethod
    async def _reset(self, name: str) -> bool: ...

    @abstractmethod
    async def _names(self, prefix: str) -> list[str]: ...

    @abstractmethod
    async def _sweep(self) -> int: ...


class ThreadedState(AsyncState):
    """A (thread-safe) synchronous state, its calls run in the default executor."""

    def __init__(self, state: State) -> None:
        #: the synchronous state doing the work
        self.state = state
        self.url = state.url
        self.clock_resolution = state.clock_resolution

    def local_now(self) -> float | None:
        return self.state.local_now()

    async def _take(self, name: str, terms: Terms, cost: int) -> Taken:
        return await asyncio.to_thread(self.state._guarded, name, self.state._take, terms, cost)

    async def _try_start(self, name: str, terms: Terms, ticket: int, lead_us: int, cost: int) -> Outcome:
        state = self.state
        return await asyncio.to_thread(state._guarded, name, state._try_start, terms, ticket, lead_us, cost)

    async def _take_and_try(self, name: str, terms: Terms, lead_us: int, cost: int) -> Outcome:
        state = self.state
        return await asyncio.to_thread(state._guarded, name, state._take_and_try, terms, lead_us, cost)

    async def _retime(self, name: str, terms: Terms, ticket: int, lead_us: int) -> Outcome:
        state = self.state
        return await asyncio.to_thread(state._guarded, name, state._retime, terms, ticket, lead_us)

    async def _set_paused(self, name: str, terms: Terms, paused: bool) -> bool:
        state = self.state
        return await asyncio.to_thread(state._guarded, name, state._set_paused, terms, paused)

    async def _release(self, name: str, terms: Terms, ticket: int) -> bool:
        state = self.state
        return await asyncio.to_thread(state._guarded, name, state._release, terms, ticket)

    async def _renew(self, name: str, terms: Terms, ticket: int) -> bool:
        state = self.state
        return await asyncio.to_thread(state._guarded, name, state._renew, terms, ticket)

    async def _read(self, name: str) -> Snapshot:
        return await asyncio.to_thread(self.state.read, name)

    async def _reset(self, name: str) -> bool:
        return await asyncio.to_thread(self.state.reset, name)

    async def _names(self, prefix: str) -> list[str]:
        return await asyncio.to_thread(self.state.names, prefix)

    async def _sweep(self) -> int:
        return await asyncio.to_thread(self.state.sweep)

    async def close(self) -> None:
        await asyncio.to_thread(self.state.close)


#: what the asyncio limiters and queues accept as their state
AsyncStateLike = Union[str, "os.PathLike[str]", State, AsyncState, None]


def from_url(url: AsyncStateLike) -> AsyncState:
    """Open the state named by ``url`` for asyncio.

    ``redis://`` and ``mongodb://`` use the drivers' asyncio clients (the
    registry :data:`ratequeue.state.BACKENDS` names them); the memory and
    file states, and any synchronous :class:`State` object, run in a
    thread. Raises :class:`ConfigurationError` as :func:`ratequeue.state.from_url` does.
    """
    if isinstance(url, AsyncState):
        return url
    if isinstance(url, str):
        backend = backend_of(url)
        if backend.async_module is not None and backend.async_state is not None:
            with secrets_kept_out(url):
                state: AsyncState = opener(url, backend.async_module, backend.async_state, backend.extra)(url)
            return state
    return ThreadedState(sync_from_url(url))
