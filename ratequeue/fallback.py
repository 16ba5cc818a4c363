"""What a limiter does while its state is down: raise (the default), or begin turns locally.

A limiter's ``when_down`` setting chooses (docs/operating.md, "When the
state is down"):

- ``"raise"`` (the default): a call the state cannot answer raises
  :class:`~ratequeue.StateUnavailable` after the state's own retries.
- ``"open"``: calls go through. Each process begins its turns at most at
  the limiter's own rate (one per interval, no burst): across N processes
  at most N times the rate.
- a share ``s`` (``0 < s < 1``): each process begins its turns at ``s``
  times the rate, so N processes begin at most ``N * s`` times it (give
  ``1 / N`` to stay within the rate).

The first call the state fails puts the limiter *down*: that caller, the
ones waiting behind it and every later one get a local turn, spaced on this
host's clock in the order they came (:data:`LOCAL_TICKET`, its start on
this host's clock). Meanwhile a probe reads the state every
:data:`PROBE_EVERY` seconds, in the background. Once the state answers, the
limiter **rejoins without a burst**: it first takes one turn of the whole
burst through the state (so the record's burst credit, built up while
nobody used it, is spent), its callers still beginning locally until that
turn begins, and then uses the state again. That turn costs the fleet
``burst`` starts per process rejoining.

Each change is reported: a ``"state_down"`` event (``outcome`` names the
mode) and a WARNING; a ``"state_back"`` event (``wait``: seconds down) and
an INFO line. Leases need the state, so ``max_running`` takes no
``when_down`` but ``"raise"``, and ``all_of`` takes limiters with ``"raise"`` only.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any, ClassVar, Protocol

from .core.flow import Call, Flow, Sleep
from .core.protocol import US
from .core.shard import Place, Shard, Turn
from .drivers import Driver
from .errors import AcquireTimeout, StateUnavailable
from .reporting import QUIET_STARTS, Reporter
from .settings import Settings, WhenDown


class Runner(Protocol):
    """What the fallback uses of a shard's runner (``running.ShardRunner``; named here, not imported)."""

    name: str
    settings: Settings
    shard: Shard
    state: Any
    driver: Driver
    reporter: Reporter
    clock: Callable[[], float]

    def place(self, timeout: float | None, cost: int) -> Place: ...

    def acquire_flow(self, place: Place, *, attempt: bool = False) -> Flow[Turn | None]: ...

    def changed(self) -> None: ...


__all__ = ["LOCAL_TICKET", "PROBE_EVERY", "PROBE_TASK", "REJOIN_TASK", "Fallback", "Runner"]

#: the ticket of a turn begun locally while the state was down (no state gave it)
LOCAL_TICKET = -1

#: seconds between two reads of a state that is down
PROBE_EVERY = 1.0
#: how the probe's and the rejoin's threads or tasks are named (then the queue name)
PROBE_TASK = "ratequeue-probe-"
REJOIN_TASK = "ratequeue-rejoin-"

_log = logging.getLogger("ratequeue.limiter")
_DOWN = (
    "queue %r: the state is down (%s); turns begin locally, %s, until it answers again "
    "(when_down=%r; probed every %g s)"
)
_BACK = "queue %r: the state answers again after %.1f s; turns come from it again"


class Fallback:
    """The local turns of one limiter while its state is down, and the probe that ends them."""

    def __init__(self, when_down: WhenDown, interval: float) -> None:
        self.when_down = when_down
        self.mode = "open" if when_down == "open" else "local"
        #: seconds between two local begins (of cost 1)
        self.spacing = interval if when_down == "open" else interval / float(when_down)
        #: when (local time) the state went down, while it is
        self.down_since: float | None = None
        #: set once the state answered the probe: new callers queue for the state (behind the rejoin)
        self.rejoining = False
        #: the earliest local time the next local turn may begin
        self._next = -math.inf
        #: set by the limiter's close: the probe and the rejoin stop
        self.stopped = False
        #: the process whose probe runs (a child forked while down starts its own)
        self._probing: int | None = None

    def went_down(self, runner: Runner, error: Exception) -> None:
        """The state failed a call (holding the driver's lock): begin locally, probe in the background."""
        if self.down_since is not None:
            return
        self.down_since = runner.clock()
        pace = f"one every {self.spacing:g} s" if self.mode == "local" else "at this limiter's own rate"
        _log.warning(_DOWN, runner.name, error, pace, self.when_down, PROBE_EVERY)
        runner.reporter.state_down(self.mode, type(error).__name__)
        self._probe(runner)

    def stop(self, runner: Runner) -> None:
        """The limiter closes: no probe, no rejoin; while down, ``state_back`` says it runs no longer."""
        if self.stopped:
            return
        self.stopped = True
        if self.down_since is not None:
            runner.reporter.state_back(self.mode, runner.clock() - self.down_since)

    def turn_flow(
        self, runner: Runner, place: Place, since: float, *, attempt: bool = False
    ) -> Flow[Turn | None]:
        """``place``'s turn begun locally (holding the lock), spaced on this host's clock, in order.

        ``None`` if the place is withdrawn (its reservation cancelled) before
        it begins; a slot given up so, or by an interruption, goes back if
        nobody took a later one.
        """
        if self._probing != os.getpid() and not self.stopped:
            self._probe(runner)  # a child forked while the state was down
        now = runner.clock()
        at = max(now, self._next)
        if place.deadline is not None and at > max(now, place.deadline):
            if not attempt:  # (a try_acquire that gets no turn is no timeout)
                runner.reporter.timeout(place, now - since)
            raise AcquireTimeout(
                f"no turn in queue {runner.name!r} within {place.timeout} s (the state is down: "
                f"turns begin locally, one every {self.spacing:g} s)",
                name=runner.name,
                timeout=place.timeout,
            )
        self._next = end = at + self.spacing * place.cost
        try:
            while not place.withdrawn:
                now = runner.clock()
                if now >= at:
                    break
                yield Call(runner.driver.wait_for_change, (at - now,))  # (a cancel wakes it)
            else:
                self._give_back(at, end)
                return None
        except BaseException:
            self._give_back(at, end)
            raise
        place.turn = turn = Turn(LOCAL_TICKET, round(at * US), at)
        if runner.reporter.begins:
            runner.reporter.begin(turn, runner.clock(), since)
        return turn

    def _give_back(self, at: float, end: float) -> None:
        """A local slot from ``at`` to ``end`` was not used: free it, if it is still the last one."""
        if self._next == end:
            self._next = at

    def _probe(self, runner: Runner) -> None:
        """Have the state probed until it answers, then rejoin: one probe per state, however many wait."""
        self._probing = os.getpid()
        _Probe.of(runner.state).wait(self, runner)

    def rejoin(self, runner: Runner) -> None:
        """The state answered the probe: rejoin it, in the background (unless the limiter closed)."""
        if not self.stopped:
            runner.driver.start(self._rejoin_flow(runner), f"{REJOIN_TASK}{runner.name}")

    def _rejoin_flow(self, runner: Runner) -> Flow[None]:
        """Take one turn of the whole burst through the state, then leave the fallback (holding the lock).

        New callers queue behind that turn, which is taken no sooner than
        the last local turn's spacing allows: so the first turn from the
        state comes at least an interval after the last local one, and
        ``burst`` intervals after the record's last start.
        """
        if self.stopped:
            return
        QUIET_STARTS.set(True)  # (this thread's or task's own context) the rejoin is no caller's begin
        place = runner.place(None, runner.settings.burst)
        place.rejoin = self.rejoining = True
        try:
            if self._next > runner.clock():
                yield Call(runner.driver.wait_until, (self._next, False, False))
            if self.stopped:
                raise _Stopped
            yield from runner.acquire_flow(place)
        except BaseException as exc:  # down again: probe again; closed or cancelled: stop
            runner.shard.abandon(place)  # (the callers behind it go on)
            self.rejoining = False
            runner.changed()
            if not isinstance(exc, Exception):
                raise
            if not isinstance(exc, _Stopped):
                _log.debug("queue %r: rejoining failed: %s", runner.name, exc)
            if not self.stopped:
                self._probe(runner)
            return
        self.rejoining = False
        since, self.down_since = self.down_since, None
        down_for = 0.0 if since is None else runner.clock() - since
        _log.info(_BACK, runner.name, down_for)
        runner.reporter.state_back(self.mode, down_for)
        runner.changed()


class _Probe:
    """The probe of one state object (in one process): it reads the state for every limiter down on it.

    A group's keys share one state: while it is down, one thread (or task)
    reads it once a second, not one per key. The probe runs on the driver
    of the limiter that asked first; if that one stops it (closed, its task
    cancelled), the next limiter waiting starts it again on its own.
    """

    _of: ClassVar[weakref.WeakKeyDictionary[Any, _Probe]] = weakref.WeakKeyDictionary()
    _guard = threading.Lock()

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._lock = threading.Lock()
        #: the limiters waiting for the state, and whether a probe runs for them
        self._waiting: dict[int, tuple[Fallback, Runner]] = {}
        self._running = False

    @classmethod
    def of(cls, state: Any) -> _Probe:
        """The probe of ``state`` in this process."""
        with cls._guard:
            probe = cls._of.get(state)
            if probe is None or probe.pid != os.getpid():
                probe = cls._of[state] = cls()
            return probe

    def wait(self, fallback: Fallback, runner: Runner) -> None:
        """``fallback`` waits for the state: it rejoins once the state answers."""
        with self._lock:
            self._waiting[id(fallback)] = (fallback, runner)
            start, self._running = not self._running, True
        if start:
            runner.driver.start(self._flow(fallback, runner), f"{PROBE_TASK}{runner.name}", locked=False)

    def _flow(self, owner: Fallback, runner: Runner) -> Flow[None]:
        """Read the state every :data:`PROBE_EVERY` s until it answers; then the waiting rejoin (no lock)."""
        answered = False
        try:
            while True:
                yield Sleep(PROBE_EVERY)
                with self._lock:
                    waiting = [item for item in self._waiting.values() if not item[0].stopped]
                    if not waiting:
                        self._waiting.clear()
                        return
                try:
                    yield Call(runner.state.read, (waiting[0][1].name,))
                except StateUnavailable as exc:
                    _log.debug("queue %r: the state is still down: %s", runner.name, exc)
                    continue
                except Exception:  # it answers, with an error of the record: its callers will see it
                    pass
                answered = True
                return
        finally:
            # Also when the task running it was cancelled: if its limiter closed, another one
            # waiting goes on probing on its own driver (a loop that ends cancels them all).
            with self._lock:
                ready = list(self._waiting.values()) if answered else []
                if answered:
                    self._waiting.clear()
                left = [item for item in self._waiting.values() if not item[0].stopped]
                go_on = left[0] if left and owner.stopped else None
                self._running = go_on is not None
            for fallback, waiter in ready:
                fallback.rejoin(waiter)
            if go_on is not None:
                fallback, waiter = go_on
                waiter.driver.start(self._flow(fallback, waiter), f"{PROBE_TASK}{waiter.name}", locked=False)


class _Stopped(Exception):
    """The limiter closed while its rejoin waited."""
