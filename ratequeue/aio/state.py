"""The asyncio state contract, and the adapter that runs a thread-safe state in a thread.

:class:`AsyncState` offers the same operations as :class:`ratequeue.state.State`,
as coroutines, with the same argument checks and errors. The memory and file
states have no asyncio driver: :class:`ThreadedState` runs them in the
default executor so the event loop never blocks on a file lock.
"""

from __future__ import annotations

import asyncio
import functools
import os
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from typing import Any, Concatenate, ParamSpec, TypeVar, Union, cast

from .. import _validate
from .._redact import secrets_kept_out
from ..errors import TermsMismatch
from ..protocol import Outcome, Taken
from ..state import State, backend_of, opener
from ..state import from_url as sync_from_url
from ..state.base import Snapshot, StateBase, Terms, way_out

__all__ = ["AsyncState", "AsyncStateLike", "ThreadedState", "from_url"]

R = TypeVar("R")


P = ParamSpec("P")


def _awaited(
    operation: Callable[Concatenate[State, P], R],
) -> Callable[Concatenate[AsyncState, P], Awaitable[R]]:
    """The asyncio twin of :class:`State`'s public ``operation``: the same checks, awaited.

    ``operation`` checks its arguments and calls ``self._guarded``; on an
    :class:`AsyncState` that is a coroutine function, so the call returns an
    awaitable of the answer, awaited here.
    """

    async def twin(self: AsyncState, /, *args: P.args, **kwargs: P.kwargs) -> R:
        pending: Any = operation(cast(State, self), *args, **kwargs)
        answer: R = await pending
        return answer

    functools.update_wrapper(twin, operation)
    return twin


class AsyncState(StateBase, ABC):
    """Where the shards of a queue keep their shared record, used from asyncio.

    The operations, their checks, errors and promises are those of
    :class:`ratequeue.state.State`, as coroutines.
    """

    # The operations are State's, written once: their bodies call self._guarded, which here is
    # a coroutine function, so each returns an awaitable, which the twin awaits.
    take = _awaited(State.take)
    try_start = _awaited(State.try_start)
    take_and_try = _awaited(State.take_and_try)
    retime = _awaited(State.retime)
    release = _awaited(State.release)
    renew = _awaited(State.renew)
    set_paused = _awaited(State.set_paused)
    read = _awaited(State.read)
    reset = _awaited(State.reset)

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
        except TermsMismatch as exc:
            raise way_out(exc, self.url) from None
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
