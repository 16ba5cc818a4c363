"""The leases one shard holds on a queue with ``max_running``: which to renew when, which to release.

Free of I/O, like the shard: the limiters' lease keeper (a thread, or a
task on the event loop) asks this book what to do next, calls the state,
and reports back. A lease is renewed every third of its length, so two
renewals may fail (the state briefly unreachable) before it runs out.
"""

from __future__ import annotations

from collections import deque

__all__ = ["RENEWALS_PER_LEASE", "Held", "LeaseBook"]

#: how many times a lease is renewed within its length
RENEWALS_PER_LEASE = 3


#: a lease as its shard names it: ``(ticket, token)`` (see :data:`~ratequeue.core.protocol.Lease`)
Held = tuple[int, int]


class LeaseBook:
    """The leases of the jobs this shard began, and the started turns nobody began."""

    def __init__(self, lease: float) -> None:
        #: how long (s) a lease lasts from its start or its latest renewal
        self.lease = lease
        #: ticket -> its token, and the local time of the start or the latest renewal
        self._renewed: dict[int, tuple[int, float]] = {}
        #: leases to release: started turns nobody began, and jobs whose end was reported
        self._to_release: deque[Held] = deque()

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

    def began(self, ticket: int, token: int, now: float) -> None:
        """A job began on ``ticket`` (its lease named ``token``) at local time ``now``: its lease is held."""
        self._renewed[ticket] = (token, now)

    def token_of(self, ticket: int) -> int | None:
        """The token of ``ticket``'s lease if a job holds it here, else ``None``."""
        held = self._renewed.get(ticket)
        return None if held is None else held[0]

    def ended(self, ticket: int, token: int) -> bool:
        """The job on ``ticket`` ended: stop renewing its lease; whether it was held here, named ``token``."""
        if self.token_of(ticket) != token:
            return False
        del self._renewed[ticket]
        return True

    def holds(self, ticket: int) -> bool:
        """Whether the job on ``ticket`` runs, holding its lease, as far as this shard knows."""
        return ticket in self._renewed

    def drain(self) -> list[Held]:
        """Every lease held or waiting to be released, taken off the book (the limiter is closing)."""
        held = [*self._to_release, *((ticket, token) for ticket, (token, _) in self._renewed.items())]
        self._to_release.clear()
        self._renewed.clear()
        return held

    def to_release(self, ticket: int, token: int) -> None:
        """Have the keeper release ``ticket``'s lease (no job runs on it any more)."""
        self.ended(ticket, token)
        self._to_release.append((ticket, token))

    def next_release(self) -> Held | None:
        """The next lease the keeper releases, taken off the list; ``None`` if none waits."""
        return self._to_release.popleft() if self._to_release else None

    def next_renewal(self, now: float) -> tuple[Held | None, float]:
        """The lease due for renewal at local time ``now`` (``None`` if none), and how long until the next is.

        Call only while :attr:`busy` holds leases (``len(self) > 0``).
        """
        ticket, (token, renewed) = min(self._renewed.items(), key=lambda item: item[1][1])
        due = renewed + self.period
        return ((ticket, token), 0.0) if due <= now else (None, due - now)

    def renewed(self, ticket: int, now: float, live: bool) -> None:
        """``ticket``'s lease was renewed at ``now`` (or, not ``live``, had run out: it is forgotten).

        A lease released while its renewal was under way stays released.
        """
        held = self._renewed.get(ticket)
        if held is not None:
            if live:
                self._renewed[ticket] = (held[0], now)
            else:
                del self._renewed[ticket]

    def failed(self, ticket: int, now: float) -> None:
        """A renewal of ``ticket`` failed (the state unreachable): try again a period's tenth from now."""
        held = self._renewed.get(ticket)
        if held is not None:
            self._renewed[ticket] = (held[0], now - self.period * 0.9)
