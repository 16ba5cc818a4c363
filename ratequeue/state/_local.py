"""What the states on this host share: they apply :mod:`ratequeue.core.protocol` themselves, under a lock."""

from __future__ import annotations

from collections.abc import Callable

from .._redact import redact
from ..core import protocol
from ..core.operation import STEPS, Operation, Terms
from ..core.protocol import Answer, Record, Unwritten
from .base import Clock, Snapshot, State
from .records import check_terms, unwritten

__all__ = ["Clock", "LocalState", "keep_until"]


class LocalState(State):
    """A state that runs the reference protocol in this process."""

    fair_queues = True

    #: a test's clock in place of the host's (whole microseconds), if any
    _clock: Clock | None
    #: the host clock this state reads, in seconds (its ``now`` is this, in microseconds)
    _host_seconds: Callable[[], float] | None = None

    def local_now(self) -> float | None:
        if self._clock is not None or self._host_seconds is None:
            return None
        return self._host_seconds()

    def _applied(self, op: Operation, record: Record | None, now: int) -> tuple[Record, Answer]:
        """``op`` applied to ``record`` (``None``: a new one); a record the protocol refuses is kept."""
        terms = op.terms
        if record is None:
            record = protocol.new_record(terms.interval_us, terms.burst, terms.max_running, terms.fair)
        else:
            check_terms(op.name, record, terms)
        try:
            return STEPS[op.kind](record, op, now)
        except Unwritten as exc:
            raise self._unwritten(exc, op.name) from None

    def _unwritten(self, exc: Unwritten, name: str) -> Exception:
        where = f"{redact(self.url)}#{name}"
        return unwritten(exc, f"record at {where}", where)

    def _checked(self, name: str, record: Record | None, now: int) -> Snapshot:
        """The snapshot of a record read at ``now``, refused if the protocol could not have written it."""
        if record is not None:
            try:
                protocol.check(record, now)
            except Unwritten as exc:
                raise self._unwritten(exc, name) from None
        return Snapshot(record, now)


def keep_until(record: Record, terms: Terms, now: int) -> int | None:
    """When (state clock, us) ``record``, written at ``now`` under ``terms``, may be deleted; ``None``: never.

    ``keep_us`` after the later of ``now`` and :func:`~ratequeue.core.protocol.expires`.
    A paused record is kept until it is resumed: forgetting it would forget the pause.
    """
    if not terms.keep_us or record.paused:
        return None
    return max(protocol.expires(record), now) + terms.keep_us
