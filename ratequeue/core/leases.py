"""The leases one shard holds on a queue with ``max_running``: which to renew when, which to release.

Free of I/O, like the shard: the limiters' lease keeper (a thread, or a
task on the event loop) asks this book what to do next, calls the state,
and reports back. A lease is renewed every third of its length, so two
renewals may fail (the state briefly unreachable) before it runs out.
"""

from __future__ import annotations

from collections import deque

__all__ = ["RENEWALS_PER_LEASE", "LeaseBook"]

#: how many times a lease is renewed within its length
RENEWALS_PER_LEASE = 3


class LeaseBook:
    """The leases of the jobs this shard began, and the started turns nobody began."""

    def __init__(self, lease: float) -> None:
        #: how long (s) a lease lasts from its start or its latest renewal
        self.lease = lease
        #: ticket -> local time of the start or the latest renewal
        self._renewed: dict[int, float] = {}
        #: leases to release: started turns nobody began, and jobs whose end was reported
        self._to_release: deque[int] = deque()

    @property
    def period(self) -> float:
        """How often (s) a held lease is renewed."""
        return self.lease / RENEWALS_PER_LEASE

    @property
    def busy(self) -> bool:
        """Whether a lease is held or waits to be released: a keeper is needed."""
        return bool(self._renewed or self._to_release)

    def __len__(self) -> int:
        """How many leases this shard holds for running jobs."""
        return len(self._renewed)

    def began(self, ticket: int, now: float) -> None:
        """A job began on ``ticket`` at local time ``now``: its lease is held from now on."""
        self._renewed[ticket] = now

    def ended(self, ticket: int) -> bool:
        """The job on ``ticket`` ended: stop renewing its lease; whether it was held here."""
        return self._renewed.pop(ticket, None) is not None

    def holds(self, ticket: int) -> bool:
        """Whether the job on ``ticket`` runs, holding its lease, as far as this shard knows."""
        return ticket in self._renewed

    def drain(self) -> list[int]:
        """Every lease held or waiting to be released, taken off the book (the limiter is closing)."""
        tickets = [*self._to_release, *self._renewed]
        self._to_release.clear()
        self._renewed.clear()
        return tickets

    def to_release(self, ticket: int) -> None:
        """Have the keeper release ``ticket``'s lease (no job runs on it any more)."""
        self._renewed.pop(ticket, None)
        self._to_release.append(ticket)

    def next_release(self) -> int | None:
        """The next lease the keeper releases, taken off the list; ``None`` if none waits."""
        return self._to_release.popleft() if self._to_release else None

    def next_renewal(self, now: float) -> tuple[int | None, float]:
        """The lease due for renewal at local time ``now`` (``None`` if none), and how long until the next is.

        Call only while :attr:`busy` holds leases (``len(self) > 0``).
        """
        ticket, renewed = min(self._renewed.items(), key=lambda item: item[1])
        due = renewed + self.period
        return (ticket, 0.0) if due <= now else (None, due - now)

    def renewed(self, ticket: int, now: float, live: bool) -> None:
        """``ticket``'s lease was renewed at ``now`` (or, not ``live``, had run out: it is forgotten).

        A lease released while its renewal was under way stays released.
        """
        if ticket in self._renewed:
            if live:
                self._renewed[ticket] = now
            else:
                del self._renewed[ticket]

    def failed(self, ticket: int, now: float) -> None:
        """A renewal of ``ticket`` failed (the state unreachable): try again a period's tenth from now."""
        if ticket in self._renewed:
            self._renewed[ticket] = now - self.period * 0.9
