"""Shared code of the states that run the reference protocol in this process."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from typing import TypeVar

from .. import protocol
from .._redact import redact
from ..protocol import Outcome, Record, Taken, Unwritten
from .base import Clock, Snapshot, State, Terms, check_terms_match, unwritten

R = TypeVar("R")

#: one protocol operation as a transition: the record and ``now`` in, the new record and an answer out
Transition = Callable[[Record, int], "tuple[Record, R]"]


class LocalState(State):
    """A state that applies :mod:`ratequeue.protocol` itself, under an exclusive lock."""

    #: a test's clock in place of the host's (whole microseconds), if any
    _clock: Clock | None
    #: the host clock this state reads, in seconds (its ``now`` is this, in microseconds)
    _host_seconds: Callable[[], float] | None = None

    def local_now(self) -> float | None:
        if self._clock is not None or self._host_seconds is None:
            return None
        return self._host_seconds()

    @abstractmethod
    def _transact(
        self, name: str, terms: Terms | None, step: Transition[R] | None
    ) -> tuple[Record | None, int, R | None]:
        """Atomically read ``name``'s record, apply ``step`` and store the result.

        With ``terms``, a missing record is created with them and a stored
        one must match them; a record written is kept until ``terms.keep_us``
        after it expires (:func:`ratequeue.protocol.expires`), or forever.
        Without a ``step`` nothing is written. Returns the record as read,
        the clock's time, and the step's answer.
        """

    def _run(self, name: str, terms: Terms, step: Transition[R]) -> R:
        """``step`` applied to ``name``'s record; a record the protocol refuses is left as it is."""
        try:
            _, _, answer = self._transact(name, terms, step)
        except Unwritten as exc:  # raised by the step, before anything is stored
            raise self._unwritten(exc, name) from None
        assert answer is not None
        return answer

    def _unwritten(self, exc: Unwritten, name: str) -> Exception:
        where = f"{redact(self.url)}#{name}"
        return unwritten(exc, f"record at {where}", where)

    def _take(self, name: str, terms: Terms, cost: int) -> Taken:
        return self._run(name, terms, lambda r, now: protocol.take(r, now, cost))

    def _try_start(self, name: str, terms: Terms, ticket: int, lead_us: int, cost: int) -> Outcome:
        lease = terms.lease_us
        return self._run(name, terms, lambda r, now: protocol.try_start(r, ticket, lead_us, now, cost, lease))

    def _take_and_try(self, name: str, terms: Terms, lead_us: int, cost: int) -> Outcome:
        lease = terms.lease_us
        return self._run(name, terms, lambda r, now: protocol.take_and_try(r, lead_us, now, cost, lease))

    def _retime(self, name: str, terms: Terms, ticket: int, lead_us: int) -> Outcome:
        return self._run(name, terms, lambda r, now: protocol.retime(r, ticket, lead_us, now))

    def _set_paused(self, name: str, terms: Terms, paused: bool) -> bool:
        return self._run(name, terms, lambda r, now: protocol.set_paused(r, paused, now))

    def _release(self, name: str, terms: Terms, ticket: int) -> bool:
        return self._run(name, terms, lambda r, now: protocol.release(r, ticket, now))

    def _renew(self, name: str, terms: Terms, ticket: int) -> bool:
        return self._run(name, terms, lambda r, now: protocol.renew(r, ticket, terms.lease_us, now))

    def _read(self, name: str) -> Snapshot:
        record, now, _ = self._transact(name, None, None)
        if record is not None:
            try:
                protocol.check(record, now)
            except Unwritten as exc:
                raise self._unwritten(exc, name) from None
        return Snapshot(record=record, now=now)


def open_record(name: str, record: Record | None, terms: Terms) -> Record:
    """``record``, or a new one if it is missing; its interval, burst and max_running must be ``terms``'s."""
    if record is None:
        return protocol.new_record(terms.interval_us, terms.burst, terms.max_running)
    check_terms_match(name, record, terms)
    return record


def keep_until(record: Record, terms: Terms, now: int) -> int | None:
    """When (state clock, us) ``record``, written at ``now`` under ``terms``, may be deleted; ``None``: never.

    ``keep_us`` after the later of ``now`` and :func:`ratequeue.protocol.expires`:
    a record is kept at least ``keep_us`` after its last write. A paused
    record is kept until it is resumed: forgetting it would forget the pause.
    """
    if not terms.keep_us or record.paused:
        return None
    return max(protocol.expires(record), now) + terms.keep_us
