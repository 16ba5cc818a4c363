"""The lease keeper: renews the leases of a shard's running jobs, and releases those that ended.

On a queue with ``max_running`` every start takes a lease on the state
(docs/design.md, "Leases"). The :class:`~ratequeue.core.leases.LeaseBook`
says which lease to renew when and which to release; the keeper, a flow run
in the background by the shard's driver (a daemon thread, or a task) only
while there is work, carries that out. A failed call is logged, never
raised: a lease not renewed expires by itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from .core.flow import Call, Flow
from .core.leases import Held, LeaseBook
from .core.operation import Operation
from .core.shard import Shard
from .drivers import Driver
from .reporting import Reporter
from .settings import Settings, wait

__all__ = ["LeaseKeeper"]


class Runner(Protocol):
    """What the keeper uses of the shard it keeps leases for (a :class:`~ratequeue.running.ShardRunner`)."""

    name: str
    settings: Settings
    shard: Shard
    driver: Driver
    reporter: Reporter
    clock: Callable[[], float]

    def call_flow(self, op: Operation, lost: Callable[[Any], None] | None = None) -> Flow[Any]:
        """``op`` carried out on the state, timed and reported."""


class LeaseKeeper:
    """The leases one shard holds; all its methods but the flows are called holding the driver's lock."""

    def __init__(self, runner: Runner) -> None:
        self._runner = runner
        self.book = LeaseBook(runner.settings.lease)
        #: whether the keeper flow runs
        self.running = False

    @property
    def busy(self) -> bool:
        """Whether a lease is held or waits to be released."""
        return self.book.busy or self.running

    def began(self, ticket: int, token: int, now: float) -> None:
        """The job on ``ticket`` (its lease named ``token``) began at local ``now``: its lease is renewed."""
        self.book.began(ticket, token, now)
        self._keep()

    def release_later(self, held: Held) -> None:
        """No job runs on ``held``'s ticket any more: the keeper releases its lease."""
        self.book.to_release(*held)
        self._keep()
        self._runner.driver.changed()  # a keeper sleeping until its next renewal releases it now

    def release_flow(self, held: Held) -> Flow[bool]:
        """Release ``held``'s lease now: whether it was live; the shard's waiting head asks again.

        Only the lease named by the token is released: another shard's lease
        on the same ticket number (another queue's turn) stays.
        """
        self.book.ended(*held)
        live = yield from self._runner.call_flow(self._operation("release", held))
        self.freed()
        return bool(live[0])

    def release_unused_flow(self, unused: list[Held]) -> Flow[None]:
        """Release, now, the leases of turns started that nobody began.

        One that fails is left to the keeper (which retries it, or the lease
        expires); an interrupted one too, and the interruption goes on.
        """
        while unused:
            held = unused.pop(0)
            try:
                yield from self._runner.call_flow(self._operation("release", held))
            except Exception:
                self.release_later(held)
            except BaseException:
                for left in (held, *unused):
                    self.release_later(left)
                raise

    def freed(self) -> None:
        """A lease was released here: this shard's waiting head asks again at once."""
        self._runner.shard.ask_again()
        self._runner.driver.changed()

    def drain(self) -> list[Held]:
        """Every lease held or waiting to be released, taken off the book (closing); the keeper stops."""
        held = self.book.drain()
        self._runner.driver.changed()
        return held

    def _keep(self) -> None:
        """Start the keeper if there is work for it and none runs."""
        if not self.running and self.book.busy:
            self.running = True
            try:
                self._runner.driver.start(self._flow(), f"ratequeue-leases-{self._runner.name}")
            except BaseException:  # no thread could be started: the next call tries again
                self.running = False
                raise

    def _operation(self, kind: Any, held: Held) -> Operation:
        runner = self._runner
        return Operation(kind, runner.name, runner.settings.terms, held[0], token=held[1])

    def _flow(self) -> Flow[None]:
        """Renew the leases while their jobs run, release those handed over; stop when none is left."""
        book, runner = self.book, self._runner
        clock: Callable[[], float] = runner.clock
        warn = runner.reporter.lease_warning
        try:
            while book.busy:
                held = book.next_release()
                if held is not None:
                    try:
                        yield from runner.call_flow(self._operation("release", held))
                    except Exception as exc:  # its lease expires by itself
                        warn("could not release lease %d of queue %r: %s", held[0], runner.name, exc)
                    self.freed()
                    continue
                now = clock()
                renewal, delay = book.next_renewal(now)
                if renewal is None:
                    yield Call(runner.driver.wait_for_change, (wait(delay),))
                    continue
                due = renewal[0]
                try:
                    live, *_ = yield from runner.call_flow(self._operation("renew", renewal))
                except Exception as exc:
                    warn("could not renew lease %d of queue %r: %s", due, runner.name, exc)
                    book.failed(due, clock())
                    continue
                if not live and book.holds(due):
                    warn(
                        "the lease of a job of queue %r ran out before it was renewed (ticket %d): "
                        "the job runs on uncounted; a longer lease (now %g s) avoids it",
                        runner.name,
                        due,
                        runner.settings.lease,
                    )
                book.renewed(due, now, bool(live))
        finally:
            self.running = False
            runner.driver.changed()  # a close() waiting for the keeper to finish goes on
