"""Control flows written once, carried out by a thread or by asyncio.

A *flow* is a generator that decides everything and does no I/O itself: it
yields what it needs done -- :class:`Call` a function, or :class:`Sleep` --
and is sent the result back, or has the exception thrown in at the
``yield``. :func:`run` carries a flow out in the calling thread; :func:`arun`
on the running event loop, awaiting what a call returns when it is
awaitable (a method of an asyncio client, or a driver's coroutine). So the
sync and asyncio drivers differ only in the functions their flows call::

    def fetch(client):                       # written once
        for attempt in range(3):
            try:
                return (yield Call(client.get, ("key",)))
            except ConnectionError:
                yield Sleep(0.1 * 2**attempt)
        raise Unreachable()

    run(fetch(sync_client))                  # in a thread
    await arun(fetch(asyncio_client))        # on the event loop

(h11 keeps its protocol free of I/O; this is the same line one level up.)
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable, Generator
from typing import Any, NamedTuple, TypeVar, Union

from ..errors import AcquireTimeout, ConfigurationError

__all__ = ["Call", "Effect", "Flow", "Sleep", "arun", "run"]

T = TypeVar("T")


class Call(NamedTuple):
    """Call ``fn(*args)`` and send its result back (awaited first under :func:`arun` if awaitable)."""

    fn: Callable[..., Any]
    args: tuple[Any, ...] = ()


class Sleep(NamedTuple):
    """Pause for ``seconds`` (``time.sleep`` or ``asyncio.sleep``), then go on."""

    seconds: float


#: what a flow yields
Effect = Union[Call, Sleep]

#: a flow returning ``T``: yields effects, is sent their results
Flow = Generator[Effect, Any, T]


#: the errors that reach a caller without ratequeue's own frames: they are about what the caller
#: asked (its terms, its input, its timeout), not about where inside ratequeue they were found
_SHORT = (ConfigurationError, AcquireTimeout)


def _shortened(exc: BaseException) -> BaseException:
    """``exc`` with its traceback cut where the flow was run: the caller sees its own call, then this."""
    return exc.with_traceback(None)


def run(flow: Flow[T]) -> T:
    """Carry ``flow`` out in this thread and return what it returns (or raise what it raises)."""
    send, throw = flow.send, flow.throw
    effect: Effect
    try:
        effect = send(None)
        while True:
            try:
                if type(effect) is Call:
                    result = effect.fn(*effect.args)
                else:
                    time.sleep(max(0.0, effect.seconds))  # type: ignore[union-attr]
                    result = None
            except BaseException as exc:
                effect = throw(exc)
            else:
                effect = send(result)
    except StopIteration as stop:
        value: T = stop.value
        return value
    except _SHORT as exc:
        raise _shortened(exc) from None


async def arun(flow: Flow[T]) -> T:
    """Carry ``flow`` out on the running event loop and return what it returns (or raise what it raises).

    A cancellation of the awaiting task is thrown into the flow at its
    ``yield``, like any other exception, so the flow can tidy up.
    """
    result: Any = None
    error: BaseException | None = None
    while True:
        try:
            effect = flow.send(result) if error is None else flow.throw(error)
        except StopIteration as stop:
            value: T = stop.value
            return value
        except _SHORT as exc:
            raise _shortened(exc) from None
        finally:
            error = None
        result = None
        try:
            if isinstance(effect, Call):
                result = effect.fn(*effect.args)
                if inspect.isawaitable(result):
                    result = await result
            else:
                await asyncio.sleep(max(0.0, effect.seconds))
        except BaseException as exc:
            error = exc
