"""The contract every state backend fulfils.

A state keeps one :class:`~ratequeue.protocol.Record` per queue name and
offers the protocol's operations on it, each atomic and timed on the state's
own clock. Times, intervals and leads are whole microseconds, as in the
protocol. Everything else (which ticket to try, when to sleep) is decided by
the shard above it. Backends implement the underscored methods; the public
ones check their arguments first, so bad input never reaches a driver.
"""

from __future__ import annotations

import shlex
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlencode

from .. import _validate
from .._redact import redact
from ..errors import ConfigurationError, RateQueueError, StateCorrupted, StateUnavailable, TermsMismatch
from ..protocol import MAX_LEAD_US, MAX_RUNNING, NEVER, TICKET_LIMIT, US, Outcome, Record, Taken, Unwritten

#: larger times and intervals (us) are refused: about 142 years, so that every
#: slot stays exact in a double (Lua) and in an int64 (MongoDB)
MAX_US = TICKET_LIMIT

__all__ = [
    "Clock",
    "Snapshot",
    "State",
    "StateBase",
    "Terms",
    "check_interval_matches",
    "check_max_running_matches",
    "check_terms_match",
    "check_record",
    "interval_microseconds",
    "cost_units",
    "lead_microseconds",
    "paused_flag",
    "release_args",
    "renew_args",
    "terms",
    "ticket_number",
    "unwritten",
    "way_out",
]

R = TypeVar("R")

#: a function returning the current time in whole microseconds
Clock = Callable[[], int]


@dataclass(frozen=True)
class Snapshot:
    """A queue's record (``None`` if it does not exist) as read at state-clock time ``now`` (us)."""

    record: Record | None
    now: int


@dataclass(frozen=True)
class Terms:
    """What an operation expects of a queue's record, checked (:func:`terms` makes one).

    A record is created with the ``interval_us`` and ``burst`` of the first
    operation on its name; a later operation naming others is refused
    (:class:`ConfigurationError`) and changes nothing. ``keep_us`` is not
    stored: each write with ``keep_us > 0`` keeps the record until
    ``keep_us`` after the later of its ``now`` and
    :func:`ratequeue.protocol.expires`, so an idle record goes away by
    itself once forgetting it can change nothing; a write with
    ``keep_us == 0`` keeps it forever (it clears an earlier keep time).

    ``max_running`` (0: no cap) is stored with the record, as ``burst`` is;
    ``lease_us`` is not: each start (and renewal) takes a lease lasting that
    long, so it must be at least 1 when ``max_running`` is set.
    """

    #: microseconds between two starts of cost 1
    interval_us: int
    #: how many starts of cost 1 may come at once (1: none closer than the interval)
    burst: int = 1
    #: how long (us) an idle record is kept once it has expired; 0: forever
    keep_us: int = 0
    #: how many jobs may run at once across every shard; 0: no cap
    max_running: int = 0
    #: how long (us) a start's or a renewal's lease lasts; used only with ``max_running``
    lease_us: int = 0


class StateBase:
    """What the synchronous and the asyncio state contracts share: identity, clock, error mapping."""

    #: the URL this state was opened from; limiters pickle as this URL
    url: str

    #: how finely the state's clock ticks, in seconds; a limiter does not check begins for
    #: lateness (G7) more finely than this, since no start can be placed more finely
    clock_resolution: float = 1e-6

    #: the exceptions of the backend's driver; an operation raising one raises
    #: :meth:`_error_for` of it instead (chained), so callers see ratequeue's errors only
    _driver_errors: tuple[type[Exception], ...] = ()

    def _error_for(self, exc: Exception, name: str) -> RateQueueError:
        """The ratequeue error to raise for the driver's ``exc`` in an operation on queue ``name``."""
        return StateUnavailable(f"{self!r} failed: {exc}", where=redact(self.url))

    def local_now(self) -> float | None:
        """The state's clock in seconds, read on this host without a call; ``None`` for a server's clock.

        A state whose clock is this host's (file, memory) lets a shard
        convert its times to local ones exactly, instead of bounding the
        offset by the delay of each answer.
        """
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({redact(self.url)!r})"


class State(StateBase, ABC):
    """Where the shards of a queue keep their shared record.

    Every operation names the queue and the interval its caller expects. The
    first operation on a name creates its record with that interval; a later
    one with a different interval raises :class:`ConfigurationError` and
    changes nothing. Arguments are checked before anything is sent, and a
    driver's error is raised as :class:`StateUnavailable` or
    :class:`StateCorrupted`.
    """

    def take(
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
        """Hand out the next ticket of ``name``, for a job of ``cost`` (see :func:`ratequeue.protocol.take`).

        ``burst``, ``keep_us``, ``max_running`` and ``lease_us`` are the
        queue's :class:`Terms`; ``cost`` is from 1 to ``burst``.
        """
        args = take_args(interval_us, burst, cost, keep_us, max_running, lease_us)
        return self._guarded(name, self._take, *args)

    def try_start(
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
        """Start ``ticket`` (taken for ``cost``) if its earliest start is at most ``lead_us`` us away.

        See :func:`ratequeue.protocol.try_start`. A ticket the record never
        handed out (because it was reset) is answered as passed; the latest
        start asked for again is the same grant. With ``max_running``, a
        start takes a lease of ``lease_us`` and a full queue answers a wait.
        """
        args = try_start_args(interval_us, ticket, lead_us, burst, cost, keep_us, max_running, lease_us)
        return self._guarded(name, self._try_start, *args)

    def take_and_try(
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
        """:meth:`take` a ticket and :meth:`try_start` it, in one atomic step."""
        args = take_and_try_args(interval_us, lead_us, burst, cost, keep_us, max_running, lease_us)
        return self._guarded(name, self._take_and_try, *args)

    def retime(
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
        """Move the start of ``ticket``, if it is the latest, to ``now + lead_us`` at the earliest.

        See :func:`ratequeue.protocol.retime`: :class:`Started` with the new
        start, or :class:`Passed` once a later ticket has started.
        """
        args = retime_args(interval_us, ticket, lead_us, burst, keep_us, max_running, lease_us)
        return self._guarded(name, self._retime, *args)

    def release(
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
        """Release ``ticket``'s lease (its job ended); say whether it was live (see ``protocol.release``)."""
        args = release_args(interval_us, ticket, burst, keep_us, max_running, lease_us)
        return self._guarded(name, self._release, *args)

    def renew(
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
        """Make ``ticket``'s lease last ``lease_us`` from now; whether it was still live.

        See :func:`ratequeue.protocol.renew`: an expired lease is not renewed.
        """
        args = renew_args(interval_us, ticket, burst, keep_us, max_running, lease_us)
        return self._guarded(name, self._renew, *args)

    def set_paused(
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
        """Pause queue ``name`` for every shard (``paused=True``), or resume it; say whether that changed it.

        See :func:`ratequeue.protocol.set_paused`: while paused no ticket
        starts, whichever shard asks. A missing record is created with these
        :class:`Terms` (paused or not); a stored one must match them, and
        only its flag changes. A paused record is kept whatever ``keep_us``
        says, until it is resumed.
        """
        args = set_paused_args(interval_us, paused, burst, keep_us, max_running, lease_us)
        return self._guarded(name, self._set_paused, *args)

    def read(self, name: str) -> Snapshot:
        """The record of queue ``name`` and the state clock's time; changes nothing."""
        return self._guarded(name, self._read)

    def reset(self, name: str) -> bool:
        """Delete the record of queue ``name``; say whether there was one.

        An administrative act: the next operation creates a fresh record, with
        the interval it names. Shards holding old tickets take new ones.
        """
        return self._guarded(name, self._reset)

    def names(self, prefix: str = "") -> list[str]:
        """The names of the queues that have a record here and begin with ``prefix``, sorted.

        A record kept past its expiry (see :class:`Terms`) is listed until
        it is deleted, by the server or by :meth:`sweep`.
        """
        return sorted(self._mapped("", self._names, _validate.prefix(prefix)))

    def sweep(self) -> int:
        """Delete every record whose keep time (see :class:`Terms`) has passed; say how many.

        States whose server deletes them by itself (Redis) have nothing to do
        and answer 0; the others also sweep now and then as they create
        records, so calling this is never needed for correctness.
        """
        return self._mapped("", self._sweep)

    def close(self) -> None:
        """Release connections and files; the state may not be used afterwards."""

    def __enter__(self) -> State:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _guarded(self, name: str, operation: Callable[..., R], *args: Any) -> R:
        """``operation(name, *args)`` with ``name`` checked and the driver's errors mapped."""
        name = _validate.name(name)
        return self._mapped(name, operation, name, *args)

    def _mapped(self, name: str, call: Callable[..., R], *args: Any) -> R:
        """``call(*args)``, an operation on queue ``name`` (or ``""``), with the driver's errors mapped."""
        try:
            return call(*args)
        except TermsMismatch as exc:
            raise way_out(exc, self.url) from None
        except self._driver_errors as exc:
            raise self._error_for(exc, name) from exc

    @abstractmethod
    def _take(self, name: str, terms: Terms, cost: int) -> Taken: ...

    @abstractmethod
    def _try_start(self, name: str, terms: Terms, ticket: int, lead_us: int, cost: int) -> Outcome: ...

    @abstractmethod
    def _take_and_try(self, name: str, terms: Terms, lead_us: int, cost: int) -> Outcome: ...

    @abstractmethod
    def _retime(self, name: str, terms: Terms, ticket: int, lead_us: int) -> Outcome: ...

    @abstractmethod
    def _set_paused(self, name: str, terms: Terms, paused: bool) -> bool: ...

    @abstractmethod
    def _release(self, name: str, terms: Terms, ticket: int) -> bool: ...

    @abstractmethod
    def _renew(self, name: str, terms: Terms, ticket: int) -> bool: ...

    @abstractmethod
    def _read(self, name: str) -> Snapshot: ...

    @abstractmethod
    def _reset(self, name: str) -> bool: ...

    @abstractmethod
    def _names(self, prefix: str) -> list[str]: ...

    @abstractmethod
    def _sweep(self) -> int: ...


def take_args(
    interval_us: int, burst: int, cost: int, keep_us: int, max_running: int = 0, lease_us: int = 0
) -> tuple[Terms, int]:
    """The checked arguments of :meth:`State.take` after the name."""
    rule = terms(interval_us, burst, keep_us, max_running, lease_us)
    return rule, cost_units(cost, rule)


def try_start_args(
    interval_us: int,
    ticket: int,
    lead_us: int,
    burst: int,
    cost: int,
    keep_us: int,
    max_running: int = 0,
    lease_us: int = 0,
) -> tuple[Terms, int, int, int]:
    """The checked arguments of :meth:`State.try_start` after the name."""
    rule = terms(interval_us, burst, keep_us, max_running, lease_us)
    return rule, ticket_number(ticket), lead_microseconds(lead_us), cost_units(cost, rule)


def take_and_try_args(
    interval_us: int,
    lead_us: int,
    burst: int,
    cost: int,
    keep_us: int,
    max_running: int = 0,
    lease_us: int = 0,
) -> tuple[Terms, int, int]:
    """The checked arguments of :meth:`State.take_and_try` after the name."""
    rule = terms(interval_us, burst, keep_us, max_running, lease_us)
    return rule, lead_microseconds(lead_us), cost_units(cost, rule)


def retime_args(
    interval_us: int,
    ticket: int,
    lead_us: int,
    burst: int,
    keep_us: int,
    max_running: int = 0,
    lease_us: int = 0,
) -> tuple[Terms, int, int]:
    """The checked arguments of :meth:`State.retime` after the name."""
    rule = terms(interval_us, burst, keep_us, max_running, lease_us)
    return rule, ticket_number(ticket), lead_microseconds(lead_us)


def release_args(
    interval_us: int, ticket: int, burst: int, keep_us: int, max_running: int, lease_us: int
) -> tuple[Terms, int]:
    """The checked arguments of :meth:`State.release` after the name."""
    return terms(interval_us, burst, keep_us, max_running, lease_us), ticket_number(ticket)


def renew_args(
    interval_us: int, ticket: int, burst: int, keep_us: int, max_running: int, lease_us: int
) -> tuple[Terms, int]:
    """The checked arguments of :meth:`State.renew` after the name: ``max_running`` set, a lease."""
    rule = terms(interval_us, burst, keep_us, max_running, lease_us)
    if not rule.max_running:
        raise ConfigurationError(
            "renew needs max_running: a queue without a cap on running jobs has no leases"
        )
    return rule, ticket_number(ticket)


def set_paused_args(
    interval_us: int, paused: bool, burst: int, keep_us: int, max_running: int = 0, lease_us: int = 0
) -> tuple[Terms, bool]:
    """The checked arguments of :meth:`State.set_paused` after the name."""
    return terms(interval_us, burst, keep_us, max_running, lease_us), paused_flag(paused)


def interval_microseconds(value: int) -> int:
    """An operation's ``interval_us``, checked: a whole number of microseconds, at least 1."""
    return _check_us("interval_us", value, 1)


#: the largest burst: a record's ``burst * interval`` must stay below ``MAX_US`` as well
MAX_BURST = 2**31


def terms(
    interval_us: int, burst: int = 1, keep_us: int = 0, max_running: int = 0, lease_us: int = 0
) -> Terms:
    """An operation's :class:`Terms`, checked.

    ``burst * interval_us`` and ``keep_us`` under ``MAX_US``; ``max_running``
    from 0 (no cap) to :data:`~ratequeue.protocol.MAX_RUNNING`, and with it a
    ``lease_us`` of at least 1.
    """
    interval_us = interval_microseconds(interval_us)
    if not (_is_int(burst) and 1 <= burst <= MAX_BURST):
        raise ConfigurationError(f"burst must be a whole number from 1 to {MAX_BURST}, got {burst!r}")
    if burst * interval_us >= MAX_US:
        raise ConfigurationError(
            f"burst * interval must stay under {MAX_US} us (about 142 years), got {burst} * {interval_us} us"
        )
    if not (_is_int(max_running) and 0 <= max_running <= MAX_RUNNING):
        raise ConfigurationError(
            f"max_running must be a whole number from 1 to {MAX_RUNNING} (0: no cap), got {max_running!r}"
        )
    lease_us = _check_us("lease_us", lease_us, 1 if max_running else 0)
    return Terms(interval_us, burst, _check_us("keep_us", keep_us, 0), max_running, lease_us)


def cost_units(value: int, rule: Terms) -> int:
    """An operation's ``cost``, checked: a whole number from 1 to the queue's burst."""
    if not (_is_int(value) and 1 <= value <= rule.burst):
        raise ConfigurationError(
            f"cost must be a whole number from 1 to the burst ({rule.burst}), got {value!r}"
            + ("; a cost above 1 needs a burst at least as large" if rule.burst == 1 else "")
        )
    return value


def lead_microseconds(value: int) -> int:
    """An operation's ``lead_us``, checked: whole microseconds, from 0 to ``MAX_LEAD_US`` (an hour).

    A larger lead could grant a start further ahead than any reader accepts
    (:func:`ratequeue.protocol.check`).
    """
    _check_us("lead_us", value, 0)
    if value > MAX_LEAD_US:
        raise ConfigurationError(f"lead_us must be at most {MAX_LEAD_US} (an hour), got {value!r}")
    return value


def paused_flag(value: bool) -> bool:
    """An operation's ``paused``, checked: ``True`` or ``False``."""
    if not isinstance(value, bool):
        raise ConfigurationError(f"paused must be True or False, got {value!r}")
    return value


def ticket_number(value: int) -> int:
    """An operation's ``ticket``, checked: a whole number, at least 1."""
    return _check_us("ticket", value, 1)


def split_options(url: str, *names: str) -> tuple[str, dict[str, str]]:
    """``url`` without the query options ``names`` (ratequeue's own), and their values.

    The rest of the URL is kept as written (``unix:///path`` keeps its slashes)
    and the other options are passed on re-encoded; empty values are kept.
    """
    base, _, query = url.partition("?")
    pairs = parse_qsl(query, keep_blank_values=True)
    ours = {key: value for key, value in pairs if key in names}
    rest = urlencode([(key, value) for key, value in pairs if key not in names])
    return (f"{base}?{rest}" if rest else base), ours


def check_interval_matches(name: str, stored: int, wanted: int) -> None:
    """Raise :class:`TermsMismatch` if a queue's stored interval (us) is not ``wanted``."""
    if stored != wanted:
        raise TermsMismatch(
            f"queue {name!r} has interval {stored / US:g} s in this state, not {wanted / US:g} s; "
            f"use the stored interval or another name",
            name=name,
            field="interval",
            stored=stored / US,
            wanted=wanted / US,
        )


def check_terms_match(name: str, record: Record, wanted: Terms) -> None:
    """Raise :class:`TermsMismatch` unless ``record``'s interval, burst, max_running are ``wanted``'s."""
    check_interval_matches(name, record.interval, wanted.interval_us)
    if record.burst != wanted.burst:
        raise TermsMismatch(
            f"queue {name!r} has burst {record.burst} in this state, not {wanted.burst}; "
            f"use the stored burst or another name",
            name=name,
            field="burst",
            stored=record.burst,
            wanted=wanted.burst,
        )
    check_max_running_matches(name, record.max_running, wanted.max_running)


def check_max_running_matches(name: str, stored: int, wanted: int) -> None:
    """Raise :class:`TermsMismatch` if a queue's stored ``max_running`` is not ``wanted``."""
    if stored != wanted:

        def said(value: int) -> str:
            return str(value) if value else "no cap (0)"

        raise TermsMismatch(
            f"queue {name!r} has max_running {said(stored)} in this state, not {said(wanted)}; "
            f"use the stored max_running or another name",
            name=name,
            field="max_running",
            stored=stored,
            wanted=wanted,
        )


def way_out(error: TermsMismatch, url: str) -> TermsMismatch:
    """``error`` with the commands that change the stored term on purpose, for the state at ``url``.

    Said once: an error already carrying them is returned as it is. A
    password in ``url`` is shown as ``***`` (fill it in to run the command).
    """
    if error.way_out:
        return error
    where, name = shlex.quote(redact(url)), shlex.quote(error.name)
    if url.startswith("memory:"):
        # each process has its own memory state: a command in another process cannot reach it
        reset = f"state.reset({error.name!r})"
        how = f"memory:// lives in this process: delete the record there ({reset}) or restart it"
    elif error.field == "interval":
        change = f"ratequeue set-interval {where} {name} {error.wanted!r}"
        how = f"to change it on purpose, stop its shards and run: {change}"
    else:
        how = f"to change it, stop its shards and delete the record: ratequeue reset {where} {name}"
    error.args = (f"{error.args[0]}; {how}", *error.args[1:])
    error.way_out = how
    return error


def check_record(fields: Any, *, where: str) -> Record:
    """Turn stored fields into a :class:`Record`, or raise :class:`StateCorrupted`."""
    if not isinstance(fields, dict):
        raise StateCorrupted(f"record at {where} is {type(fields).__name__}, not an object", where=where)
    missing = {"ticket", "pos", "at", "interval"} - fields.keys()
    if missing:
        raise StateCorrupted(f"record at {where} lacks {', '.join(sorted(missing))}", where=where)
    ticket, pos, at, interval = fields["ticket"], fields["pos"], fields["at"], fields["interval"]
    if not (_is_int(ticket) and _is_int(pos) and 0 <= pos < ticket < MAX_US):
        raise StateCorrupted(
            f"record at {where} has ticket={ticket!r}, pos={pos!r}; want integers 0 <= pos < ticket < 2**52",
            where=where,
        )
    if at is None:
        at = NEVER
    if not (_is_int(at) and NEVER <= at < MAX_US):
        raise StateCorrupted(f"record at {where} has at={at!r}; want whole microseconds or null", where=where)
    if not (_is_int(interval) and 0 < interval < MAX_US):
        raise StateCorrupted(
            f"record at {where} has interval={interval!r}; want whole microseconds > 0", where=where
        )
    # records written before bursts lack these two: burst 1, and due is at
    burst, due = fields.get("burst", 1), fields.get("due", at)
    if due is None:
        due = NEVER
    if not (_is_int(burst) and 1 <= burst <= MAX_BURST and burst * interval < MAX_US):
        raise StateCorrupted(
            f"record at {where} has burst={burst!r}; want a whole number >= 1, burst * interval < 2**52",
            where=where,
        )
    if not (_is_int(due) and at <= due <= at + (burst - 1) * interval):
        raise StateCorrupted(
            f"record at {where} has due={due!r}; want whole microseconds, at to at + (burst - 1) * interval",
            where=where,
        )
    # records written before pauses lack it: not paused
    paused = fields.get("paused", False)
    if not isinstance(paused, bool):
        raise StateCorrupted(
            f"record at {where} has paused={paused!r}; want true, false or none", where=where
        )
    max_running, leases, held = _checked_leases(fields, ticket, where)
    return Record(
        ticket=ticket,
        pos=pos,
        at=at,
        interval=interval,
        burst=burst,
        due=due,
        paused=paused,
        max_running=max_running,
        leases=leases,
        held=held,
    )


def _checked_leases(
    fields: dict[str, Any], ticket: int, where: str
) -> tuple[int, tuple[tuple[int, int], ...], int]:
    """A record's ``max_running``, ``leases`` and ``held``, checked; records without a cap lack all three."""
    max_running, leases, held = fields.get("max_running", 0), fields.get("leases", []), fields.get("held")
    if not (_is_int(max_running) and 0 <= max_running <= MAX_RUNNING):
        raise StateCorrupted(
            f"record at {where} has max_running={max_running!r}; want a whole number from 0 to {MAX_RUNNING}",
            where=where,
        )
    pairs: list[tuple[int, int]] = []
    if isinstance(leases, (list, tuple)) and len(leases) <= max_running:
        for lease in leases:
            if not (isinstance(lease, (list, tuple)) and len(lease) == 2):
                break
            held_ticket, expiry = lease
            if not (
                _is_int(held_ticket)
                and 1 <= held_ticket < ticket
                and _is_int(expiry)
                and NEVER <= expiry < MAX_US
            ):
                break
            pairs.append((held_ticket, expiry))
    if len(pairs) != (len(leases) if isinstance(leases, (list, tuple)) else -1):
        raise StateCorrupted(
            f"record at {where} has leases={leases!r}; want at most max_running [ticket, expiry] pairs",
            where=where,
        )
    if held is None:
        held = NEVER
    if not (_is_int(held) and NEVER <= held < MAX_US):
        raise StateCorrupted(
            f"record at {where} has held={held!r}; want whole microseconds or null", where=where
        )
    return max_running, tuple(pairs), held


def unwritten(exc: Unwritten, place: str, where: str) -> StateCorrupted:
    """The :class:`StateCorrupted` to raise for :class:`~ratequeue.protocol.Unwritten` ``exc``.

    ``place`` names the record in the message (``"record at X"``), ``where``
    is the error's ``where``. The message names the field, its value and the
    state clock's ``now``, and the way out (a reset).
    """
    if exc.field == "at":
        why = (
            f"more than {MAX_LEAD_US // US} s ahead of the state clock (now={exc.now}): "
            f"not a record ratequeue wrote"
        )
    elif exc.field == "ticket":
        why = "the last ticket a record can hold: taking another would overflow it"
    else:  # pragma: no cover - the protocol names these two
        why = "not a record ratequeue writes"
    return StateCorrupted(f"{place} has {exc.field}={exc.value}, {why}; reset the queue", where=where)


def _check_us(what: str, value: int, low: int) -> int:
    if not (_is_int(value) and low <= value < MAX_US):
        raise ConfigurationError(f"{what} must be a whole number >= {low}, got {value!r}")
    return value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
