"""The contract every state fulfils, synchronous and asyncio: one entry point for any operation.

A state keeps one :class:`~ratequeue.core.protocol.Record` per queue name and
carries out any :class:`~ratequeue.core.operation.Operation` on it,
atomically, on the state's own clock (:meth:`State.execute`), answering as
:func:`ratequeue.core.operation.apply` does. Besides: :meth:`~State.read`,
:meth:`~State.reset`, :meth:`~State.names`, :meth:`~State.sweep` and
:meth:`~State.close`.

A backend is written once for both APIs (filelock's model): a server's state
writes each of its five entry points as a :mod:`ratequeue.core.flow`
generator (``_execute_flow``, ``_read_flow``, ...), which :class:`State` runs
in the calling thread and :class:`AsyncState` on the event loop, so that its
asyncio class is only ``class AsyncRedisState(RedisBackend, AsyncState)``
with its client library's asyncio client. A state on this host (memory, file) overrides
``_execute`` and the others directly, and runs in a thread under asyncio
(:class:`ThreadedState`). The client libraries' errors are mapped once, here.
"""

from __future__ import annotations

import asyncio
import shlex
import time
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple, NoReturn, TypeVar
from urllib.parse import parse_qsl, urlencode

from .._redact import redact
from ..core.flow import Flow, arun, run
from ..core.operation import Operation
from ..core.protocol import Answer, Record
from ..errors import ConfigurationError, RateQueueError, StateUnavailable, TermsMismatch
from ..settings import check_name, check_prefix

__all__ = [
    "AsyncState",
    "Clock",
    "Snapshot",
    "State",
    "StateBase",
    "ThreadedState",
    "split_options",
    "way_out",
]

R = TypeVar("R")

#: a function returning the current time in whole microseconds (a test's clock in place of a state's)
Clock = Callable[[], int]


class Snapshot(NamedTuple):
    """A queue's record (``None`` if it does not exist) as read at state-clock time ``now`` (us)."""

    record: Record | None
    now: int


def no_fair_queues(state: StateBase) -> ConfigurationError:
    """The error for a fair queue on ``state``, which does not carry fair queues out (yet)."""
    return ConfigurationError(
        f"{type(state).__name__} does not carry out fair queues (yet): docs/fairness.md lists the "
        "states that do"
    )


class StateBase:
    """What the two contracts share: the URL, the clock's grain, the mapping of the client's errors."""

    #: the URL this state was opened from; limiters pickle as this URL
    url: str

    #: how finely the state's clock ticks (s); a limiter checks no lateness (G7) finer than this, and
    #: an answer's ``now`` may be this much behind the true time (it widens the offset's bounds)
    clock_resolution: float = 1e-6

    #: whether the state's clock is this process's ``time.monotonic`` (a memory state's): it
    #: never steps against a limiter's own clock
    reads_monotonic: bool = False

    #: whether :meth:`State.read_clock` is a cheap call (a server's clock read without an
    #: operation): a shard whose bounds of the state's clock are loose reads it while it waits
    reads_clock: bool = False

    #: whether the state carries out fair queues' operations (docs/fairness.md): the states that
    #: run the reference protocol themselves do; a fair limiter on another is refused when made
    fair_queues: bool = False

    #: how often (us) creating a record also sweeps the expired ones (see :meth:`_sweep_due`)
    sweep_every_us = 60_000_000
    #: when (:meth:`_sweep_clock`) this state last swept
    _swept = -(2**62)
    #: a test's clock in place of the state's (whole microseconds), if any
    _clock: Clock | None = None

    #: the exceptions of the state's client library: each is raised as :meth:`_error_for` of it
    _client_errors: tuple[type[Exception], ...] = ()

    def _error_for(self, exc: Exception, name: str) -> RateQueueError:
        """The ratequeue error to raise for the client library's ``exc`` in an operation on queue ``name``."""
        return StateUnavailable(f"{self!r} failed: {exc}", where=redact(self.url))

    def _raise_mapped(self, name: str, exc: Exception) -> NoReturn:
        """Raise ``exc`` as callers see it: a mismatch with its way out, a client library's error mapped."""
        if isinstance(exc, TermsMismatch):
            raise way_out(exc, self.url)
        if isinstance(exc, self._client_errors):
            raise self._error_for(exc, name) from exc
        raise exc

    def _sweep_clock(self) -> int:
        """The clock (us) that spaces automatic sweeps: a test's clock, or this host's monotonic one."""
        return self._clock() if self._clock is not None else time.monotonic_ns() // 1000

    def _sweep_due(self, now: int | None = None) -> bool:
        """Whether a record just created should sweep the others: the last sweep is old (it is noted now)."""
        now = self._sweep_clock() if now is None else now
        if now - self._swept < self.sweep_every_us:
            return False
        self._swept = now
        return True

    def local_now(self) -> float | None:
        """The state's clock in seconds, read on this host without a call; ``None`` for a server's clock."""
        return None

    def watch(self, name: str, freed: Callable[[], None]) -> Callable[[], None] | None:
        """Call ``freed`` (from any thread) when a place of queue ``name`` may have been freed elsewhere.

        For a shard waiting for a place on a full queue: it asks again at
        once rather than at its next recheck. Returns the function that
        stops the watch, or ``None`` where this state cannot tell (its
        waiters ask again within ``FULL_RECHECK_US``). A watch costs no call
        while nothing is freed.
        """
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({redact(self.url)!r})"

    # A server's state writes these as flows, run by State (threads) and AsyncState (asyncio).

    def _prepare_flow(self) -> Flow[None]:
        """Connect and set up now, so that the next call pays for neither (nothing by default)."""
        yield from ()

    def _execute_flow(self, op: Operation) -> Flow[Answer]:
        raise NotImplementedError

    def _read_clock_flow(self) -> Flow[int]:
        raise NotImplementedError

    def _read_flow(self, name: str) -> Flow[Snapshot]:
        raise NotImplementedError

    def _reset_flow(self, name: str) -> Flow[bool]:
        raise NotImplementedError

    def _names_flow(self, prefix: str) -> Flow[list[str]]:
        raise NotImplementedError

    def _sweep_flow(self) -> Flow[int]:
        raise NotImplementedError


class State(StateBase):
    """Where the shards of a queue keep their shared record (the thread API).

    Arguments are checked before anything is sent (an operation when it is
    made), and a client library's error is raised as :class:`StateUnavailable` or
    :class:`~ratequeue.errors.StateCorrupted`.
    """

    def execute(self, op: Operation) -> Answer:
        """Carry out ``op`` atomically on the state's clock, answering as ``core.operation.apply`` does.

        A missing record is created with the operation's terms; a stored one
        with another interval, burst, max_running or fairness raises
        :class:`~ratequeue.errors.TermsMismatch` and changes nothing. A fair
        queue's operation on a state without :attr:`fair_queues` raises
        :class:`~ratequeue.errors.ConfigurationError`.
        """
        if op.terms.fair and not self.fair_queues:
            raise no_fair_queues(self)
        try:  # (not through _guarded: one frame less on every acquire)
            return self._execute(op)
        except Exception as exc:
            self._raise_mapped(op.name, exc)

    def prepare(self) -> None:
        """Connect and set up now (a table, a function, a warmed connection), not in the next call.

        A limiter calls it before its first timed call, so that a round-trip it
        measures (its lead, its bound of the state's clock) is a call's, not
        a connection's. Nothing to do on most states; idempotent.
        """
        self._guarded("", self._prepare)

    def read_clock(self) -> int:
        """The state's clock (us), read by the cheapest call there is; only where :attr:`reads_clock`."""
        return self._guarded("", self._read_clock)

    def read(self, name: str) -> Snapshot:
        """The record of ``name`` (``None`` if it has none) and the state clock's ``now``; changes nothing."""
        name = check_name(name)
        return self._guarded(name, self._read, name)

    def reset(self, name: str) -> bool:
        """Delete the record of ``name``; whether there was one. Its shards' tickets are then passed."""
        name = check_name(name)
        return self._guarded(name, self._reset, name)

    def names(self, prefix: str = "") -> list[str]:
        """The names of the queues that have a record here and begin with ``prefix``, sorted."""
        return sorted(self._guarded("", self._names, check_prefix(prefix)))

    def sweep(self) -> int:
        """Delete every record whose keep time has passed; how many (a state may do it by itself too)."""
        return self._guarded("", self._sweep)

    def close(self) -> None:
        """Release connections; the state may not be used afterwards."""

    def __enter__(self) -> State:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _guarded(self, name: str, call: Callable[..., R], *args: Any) -> R:
        try:
            return call(*args)
        except Exception as exc:
            self._raise_mapped(name, exc)

    def _execute(self, op: Operation) -> Answer:
        return run(self._execute_flow(op))

    def _prepare(self) -> None:
        run(self._prepare_flow())

    def _read_clock(self) -> int:
        return run(self._read_clock_flow())

    def _read(self, name: str) -> Snapshot:
        return run(self._read_flow(name))

    def _reset(self, name: str) -> bool:
        return run(self._reset_flow(name))

    def _names(self, prefix: str) -> list[str]:
        return run(self._names_flow(prefix))

    def _sweep(self) -> int:
        return run(self._sweep_flow())


class AsyncState(StateBase):
    """Where the shards of a queue keep their shared record, used from asyncio.

    The operations, checks, errors and promises of :class:`State`, as coroutines.
    """

    async def execute(self, op: Operation) -> Answer:
        """As :meth:`State.execute`."""
        if op.terms.fair and not self.fair_queues:
            raise no_fair_queues(self)
        return await self._guarded(op.name, self._execute, op)

    async def prepare(self) -> None:
        """As :meth:`State.prepare`."""
        await self._guarded("", self._prepare)

    async def read_clock(self) -> int:
        """As :meth:`State.read_clock`."""
        return await self._guarded("", self._read_clock)

    async def read(self, name: str) -> Snapshot:
        """As :meth:`State.read`."""
        name = check_name(name)
        return await self._guarded(name, self._read, name)

    async def reset(self, name: str) -> bool:
        """As :meth:`State.reset`."""
        name = check_name(name)
        return await self._guarded(name, self._reset, name)

    async def names(self, prefix: str = "") -> list[str]:
        """As :meth:`State.names`."""
        return sorted(await self._guarded("", self._names, check_prefix(prefix)))

    async def sweep(self) -> int:
        """As :meth:`State.sweep`."""
        return await self._guarded("", self._sweep)

    async def close(self) -> None:
        """Release connections; the state may not be used afterwards."""

    async def __aenter__(self) -> AsyncState:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _guarded(self, name: str, call: Callable[..., Awaitable[R]], *args: Any) -> R:
        try:
            return await call(*args)
        except Exception as exc:
            self._raise_mapped(name, exc)

    async def _execute(self, op: Operation) -> Answer:
        return await arun(self._execute_flow(op))

    async def _prepare(self) -> None:
        await arun(self._prepare_flow())

    async def _read_clock(self) -> int:
        return await arun(self._read_clock_flow())

    async def _read(self, name: str) -> Snapshot:
        return await arun(self._read_flow(name))

    async def _reset(self, name: str) -> bool:
        return await arun(self._reset_flow(name))

    async def _names(self, prefix: str) -> list[str]:
        return await arun(self._names_flow(prefix))

    async def _sweep(self) -> int:
        return await arun(self._sweep_flow())


class ThreadedState(AsyncState):
    """A thread-safe :class:`State` used from asyncio: each call runs in the default executor."""

    def __init__(self, state: State) -> None:
        #: the synchronous state doing the work
        self.state = state
        self.url = state.url
        self.clock_resolution = state.clock_resolution
        self.reads_monotonic = state.reads_monotonic
        self.fair_queues = state.fair_queues
        self.reads_clock = state.reads_clock

    def local_now(self) -> float | None:
        return self.state.local_now()

    def watch(self, name: str, freed: Callable[[], None]) -> Callable[[], None] | None:
        return self.state.watch(name, freed)

    async def _execute(self, op: Operation) -> Answer:
        return await asyncio.to_thread(self.state.execute, op)

    async def _prepare(self) -> None:
        await asyncio.to_thread(self.state.prepare)

    async def _read_clock(self) -> int:
        return await asyncio.to_thread(self.state.read_clock)

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


def split_options(url: str, *names: str) -> tuple[str, dict[str, str]]:
    """``url`` without the query options ``names`` (ratequeue's own), and their values.

    The rest of the URL is kept as written and the other options passed on
    re-encoded; empty values are kept.
    """
    base, _, query = url.partition("?")
    pairs = parse_qsl(query, keep_blank_values=True)
    ours = {key: value for key, value in pairs if key in names}
    rest = urlencode([(key, value) for key, value in pairs if key not in names])
    return (f"{base}?{rest}" if rest else base), ours


def way_out(error: TermsMismatch, url: str) -> TermsMismatch:
    """``error`` with the commands that change the stored term on purpose, for the state at ``url``.

    Said once: an error already carrying them is returned as it is. A
    password in ``url`` is shown as ``***``.
    """
    if error.way_out:
        return error
    where, name = shlex.quote(redact(url)), shlex.quote(error.name)
    if url.startswith("memory:"):
        reset = f"state.reset({error.name!r})"
        how = f"memory:// lives in this process: delete the record there ({reset}) or restart it"
    elif error.field == "interval":
        command = f"ratequeue set-interval {where} {name} {error.wanted!r}"
        how = f"to change it on purpose, stop its shards and run: {command}"
    else:
        how = f"to change it, stop its shards and delete the record: ratequeue reset {where} {name}"
    error.args = (f"{error.args[0]}; {how}", *error.args[1:])
    error.way_out = how
    return error
