"""Per-tenant caps: at most ``tenant_max_running`` of one tenant's jobs run at once, across every shard.

A fair queue's cap on a tenant is a queue of its own, one per tenant
(:func:`cap_queue_name`): ``max_running`` is the cap, the interval 1 us (it
paces nothing), and the lease and keep time are the limiter's, so that an
idle tenant's record expires. A caller first takes a place there, first
come inside its tenant, waiting while its tenant has the cap's jobs running
anywhere; only then does it wait for its turn in the fair queue. So a
tenant at its cap holds no ticket of the fair queue and delays no other
tenant. The job's end gives both places back. The cap's place is a lease
like any ``max_running`` job's: renewed while the job runs, expiring when
its process dies (docs/fairness.md, "Per-tenant caps").

The flows are written once for threads and asyncio; the limiters run them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from .core.flow import Flow
from .core.leases import Held
from .core.shard import Place, Turn
from .errors import AcquireTimeout, ConfigurationError
from .grouping import DEFAULT_KEEP, SEPARATOR, GroupBase, key_part
from .running import ShardRunner, runner_of
from .settings import (
    MAX_NAME_LENGTH,
    Seconds,
    Settings,
    check_cost,
    check_name,
    check_tenant_for,
    check_timeout,
)

__all__ = ["CAP_INTERVAL", "CapGroup", "TenantCaps", "cap_queue_name"]

#: the interval of a tenant's cap queue (s): the smallest, as it paces nothing
CAP_INTERVAL = 1e-6

#: a cap queue's name: the fair queue's, this, and the tenant (:func:`cap_queue_name`)
_PART = "running"


def cap_queue_name(name: str, tenant: str) -> str:
    """The queue holding ``tenant``'s places under fair queue ``name``'s cap.

    ``f"{name}:running:{tenant}"``, the tenant written as a group's key is
    (``%`` as ``%25``, ``:`` as ``%3A``), and the default tenant ``""`` as
    ``%``, which no tenant's name is written as.
    """
    return f"{name}{SEPARATOR}{_PART}{SEPARATOR}{key_part(tenant) if tenant else '%'}"


class CapGroup(GroupBase[Any]):
    """The cap queues of one fair limiter's tenants, one limiter each; the drivers say which class."""

    def __init__(self, state: object, settings: Settings, clock: Callable[[], float]) -> None:
        assert settings.tenant_max_running is not None
        super().__init__(
            state,
            name=f"{settings.name}{SEPARATOR}{_PART}",
            interval=CAP_INTERVAL,
            max_running=settings.tenant_max_running,
            lease=settings.lease,
            keep=DEFAULT_KEEP if settings.keep is None else settings.keep,
            lead=settings.lead,
            max_late=None,  # nothing is paced: no begin is late
            margin=0.0,
            clock=clock,
        )
        self._fair_name = settings.name
        #: the cap: how many of one tenant's jobs may run at once
        self.cap: int = settings.tenant_max_running

    def _queue_name(self, key: object) -> str:
        assert isinstance(key, str)  # (a tenant checked already)
        name = cap_queue_name(self._fair_name, key)
        if len(name) > MAX_NAME_LENGTH:
            room = MAX_NAME_LENGTH - len(cap_queue_name(self._fair_name, "x")) + 1
            raise ConfigurationError(
                f"tenant {key[:50]!r}... is too long for tenant_max_running on queue {self._fair_name!r}: "
                f"its places are the queue {_PART!r} + the tenant, at most {MAX_NAME_LENGTH} characters, "
                f"so a tenant of at most {room} (with % and : written as 3 each)"
            )
        return check_name(name)


class TenantCaps:
    """The tenants' caps of one fair limiter: their cap queues, and which turn holds which place.

    Every method but the flows may be called from any thread.
    """

    def __init__(self, group: CapGroup) -> None:
        self.group = group
        self.cap = group.cap
        #: the turns begun under a cap: a turn's ``(ticket, token)`` to its cap queue's runner and place
        self._held: dict[Held, tuple[ShardRunner, Held]] = {}
        #: how many callers are between a cap queue and the fair one (their places not in ``_held`` yet)
        self._calling = 0
        self._guard = threading.Lock()

    @property
    def busy(self) -> bool:
        """Whether a turn of this limiter holds a tenant's place, or a caller is on its way to one."""
        return bool(self._held) or self._calling > 0

    def runner(self, tenant: str) -> ShardRunner:
        """The runner of ``tenant``'s cap queue."""
        return runner_of(self.group[tenant])

    def acquire_flow(
        self, runner: ShardRunner, timeout: Seconds | None, cost: int, tenant: str | None
    ) -> Flow[Turn]:
        """A place under ``tenant``'s cap, then its turn of ``runner``'s fair queue, by one deadline.

        :raises AcquireTimeout: the tenant's place or the turn did not come in time (no place is
            kept: one taken goes back, in the background).
        """
        settings, clock = runner.settings, runner.clock
        seconds = check_timeout(timeout)
        cost = check_cost(cost, settings.burst)
        mine = check_tenant_for(settings, tenant)
        since = clock()
        self._count(1)
        try:
            return (yield from self._acquire_flow(runner, seconds, cost, tenant, mine, since))
        finally:
            self._count(-1)

    def _acquire_flow(
        self,
        runner: ShardRunner,
        seconds: float | None,
        cost: int,
        tenant: str | None,
        mine: str,
        since: float,
    ) -> Flow[Turn]:
        clock = runner.clock
        capper = self.runner(mine)
        try:
            with capper.driver.lock:
                place = yield from capper.acquire_flow(capper.place(seconds, 1))
        except AcquireTimeout:
            timed_out = Place(None if seconds is None else since + seconds, seconds, cost)
            timed_out.tenant = mine
            runner.reporter.timeout(timed_out, clock() - since)
            raise AcquireTimeout(
                f"no turn in queue {runner.name!r} within {seconds} s: tenant {mine!r} had "
                f"tenant_max_running={self.cap} jobs running all along",
                name=runner.name,
                timeout=seconds,
            ) from None
        assert place is not None, "only a withdrawn place has no turn, and this one is nobody else's"
        placed = clock()
        try:
            left = None if seconds is None else max(0.0, since + seconds - placed)
            with runner.driver.lock:
                turn = yield from runner.acquire_flow(runner.place(left, cost, tenant))
        except AcquireTimeout as exc:  # (its message names the time left: the caller's is said too)
            _end(capper, place)
            took = f"{placed - since:.3g}"
            raise AcquireTimeout(
                f"{exc}; the timeout was {seconds} s, of which tenant {mine!r}'s place took {took} s",
                name=runner.name,
                timeout=seconds,
            ) from None
        except BaseException:
            _end(capper, place)
            raise
        assert turn is not None
        self._hold(turn, capper, place)
        return turn

    def attempt_flow(self, runner: ShardRunner, cost: int, tenant: str | None) -> Flow[Turn | None]:
        """A place under ``tenant``'s cap and a turn of ``runner``'s queue, if both are free now.

        ``None`` otherwise: a place taken for a turn that is not free goes back at once (one more
        call), so a try without a turn keeps nothing of its tenant's cap.
        """
        settings = runner.settings
        cost = check_cost(cost, settings.burst)
        mine = check_tenant_for(settings, tenant)
        self._count(1)
        try:
            return (yield from self._attempt_flow(runner, cost, tenant, mine))
        finally:
            self._count(-1)

    def _attempt_flow(
        self, runner: ShardRunner, cost: int, tenant: str | None, mine: str
    ) -> Flow[Turn | None]:
        capper = self.runner(mine)
        with capper.driver.lock:
            place = (yield from capper.attempt_flow(1))[0]
        if place is None:
            return None
        try:
            with runner.driver.lock:
                turn = (yield from runner.attempt_flow(cost, tenant))[0]
        except BaseException:
            _end(capper, place)
            raise
        if turn is None:
            yield from _release_flow(capper, (place.ticket, place.token))
            return None
        self._hold(turn, capper, place)
        return turn

    def release_flow(self, turn: Held) -> Flow[bool | None]:
        """Give back, now, the place of turn ``(ticket, token)``: whether it was live; ``None``: none held."""
        held = self._take(turn)
        if held is None:
            return None
        capper, place = held
        return (yield from _release_flow(capper, place))

    def end(self, turn: Held) -> None:
        """Give back the place the turn ``(ticket, token)`` holds, in the background (its job ended)."""
        held = self._take(turn)
        if held is not None:
            capper, place = held
            with capper.driver.lock:
                capper.end(*place)

    def limiters(self) -> list[Any]:
        """The cap queues' limiters this process keeps (to close them: they release what they hold)."""
        return list(self.group.limiters())

    def _count(self, step: int) -> None:
        with self._guard:
            self._calling += step

    def _hold(self, turn: Turn, capper: ShardRunner, place: Turn) -> None:
        with self._guard:
            self._held[(turn.ticket, turn.token)] = (capper, (place.ticket, place.token))

    def _take(self, turn: Held) -> tuple[ShardRunner, Held] | None:
        with self._guard:
            return self._held.pop(turn, None)


def _end(capper: ShardRunner, place: Turn) -> None:
    """``place``'s job will not run: its lease goes back in the background."""
    with capper.driver.lock:
        capper.end(place.ticket, place.token)


def _release_flow(capper: ShardRunner, place: Held) -> Flow[bool]:
    """Release ``place``'s lease now; on failure or interruption the keeper releases it later."""
    leases = capper.leases
    assert leases is not None, "a cap queue has max_running"
    try:
        with capper.driver.lock:
            return (yield from leases.release_flow(place))
    except Exception:
        with capper.driver.lock:
            leases.release_later(place)
        return False
    except BaseException:
        with capper.driver.lock:
            leases.release_later(place)
        raise
