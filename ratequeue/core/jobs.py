"""A queue's jobs between ``add`` and their start: order, holds, retries and the bound on their number.

The order, stated once (docs/queues.md):

- a job is *held* until its ``not_before`` time, or until its retry's
  backoff has passed; a held job takes no turn and holds no ticket;
- among the jobs not held, the pacer starts the one of highest
  ``priority``, and among equal priorities the one added first; a retried
  job keeps the place it was added in;
- with ``max_waiting``, a queue holding that many jobs (held or not)
  refuses another (``overflow="reject"``: :class:`~ratequeue.QueueFull`) or
  drops its oldest to make room (``"drop_oldest"``: the dropped job's
  future fails with :class:`~ratequeue.QueueFull`). Only jobs waiting
  for their first try count, and only they are dropped: a retry's job was
  accepted already;
- a job of a ``group`` is *gated* until it holds its group's one place
  (a lease on the group's own record, across the fleet): the jobs of one
  group take that place one after another, in the order they asked for it
  (:class:`GroupGate`), and keep it until they end for good (a retry
  keeps it through its backoff). A gated job takes no turn of the queue.
  On a queue with ``tenant_max_running`` a job is gated, after its group's
  place if it has a group, until it holds a place under its tenant's cap
  as well (one of that many, taken in the same order and kept as long).
  A job added with ``not_before`` asks for its places once that time has
  come: a job for later holds none meanwhile.
"""

from __future__ import annotations

import datetime
import functools
import heapq
import itertools
import math
import random
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Generic, TypeVar, Union

from ..errors import ConfigurationError
from .clock import to_float
from .fair_order import FairOrder

__all__ = [
    "OVERFLOW_RULES",
    "Backoff",
    "DeadLetter",
    "GroupGate",
    "Job",
    "JobOptions",
    "PendingJobs",
    "check_group",
    "delay_until",
]

#: what ``overflow=`` accepts
OVERFLOW_RULES = ("reject", "drop_oldest")

F = TypeVar("F")

#: a ``not_before``: a wall-clock datetime, or seconds (or a timedelta) from now
NotBefore = Union[datetime.datetime, datetime.timedelta, float]


@dataclass(frozen=True)
class Backoff:
    """How long a failed job waits before its next try: ``base * factor ** (n - 1)`` s before try ``n + 1``.

    Never more than ``max`` seconds. With ``jitter``, up to half as much
    again is added at random (still never past ``max``), so that jobs that
    failed together do not all come back at once; a retry never comes
    sooner than its delay without jitter.
    """

    base: float = 1.0
    factor: float = 2.0
    max: float = 60.0
    jitter: bool = True

    def __post_init__(self) -> None:
        for name, value, low in (
            ("base", self.base, 0.0),
            ("factor", self.factor, 1.0),
            ("max", self.max, 0.0),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value < math.inf:
                raise ConfigurationError(f"Backoff {name} must be a finite number >= {low:g}, got {value!r}")
            to_float(f"Backoff {name}", value)  # (10**400: a delay added to a clock would overflow)
        if not isinstance(self.jitter, bool):
            raise ConfigurationError(f"Backoff jitter must be True or False, got {self.jitter!r}")

    def delay(self, retry: int, draw: Callable[[], float] = random.random) -> float:
        """Seconds to wait before retry number ``retry`` (1 for the first retry)."""
        plain = self.least(retry)
        if not self.jitter or plain >= self.max:
            return plain
        return min(self.max, plain * (1 + draw() / 2))

    def least(self, retry: int) -> float:
        """The shortest wait before retry number ``retry``, whatever the jitter draws."""
        try:
            return min(self.max, self.base * self.factor ** (retry - 1))
        except OverflowError:  # far past max
            return self.max


@dataclass(frozen=True)
class DeadLetter:
    """What a queue's dead-letter handler receives: a job whose retries ran out."""

    #: the function the job called, and its arguments
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    #: the exception of its last try
    exception: BaseException
    #: how many times it ran
    attempts: int


@dataclass(frozen=True)
class JobOptions:
    """A job's retry settings, checked when made: :class:`ConfigurationError` for anything wrong.

    ``backoff=None`` is the default :class:`Backoff`; ``retry_on`` may be one exception class.
    """

    #: how many times a failed job is tried again (0: never)
    retries: int = 0
    backoff: Backoff = field(default_factory=Backoff)
    #: the exceptions that are retried; others fail the job at once
    retry_on: tuple[type[BaseException], ...] = (Exception,)
    #: called with a :class:`DeadLetter` when a job fails for good after retries (or a coroutine function)
    dead_letter: Callable[[DeadLetter], Any] | None = None
    #: a try the service refused for its rate (:func:`ratequeue.headers.refusal_of`): ``"hold"`` the
    #: whole queue for the wait it asked and try the job again at its next turn without using a
    #: retry (up to ``queueing.MAX_REFUSALS`` times, 100; then a failure), or ``"retry"``: a
    #: failure like any other
    on_refusal: str = "hold"

    def __post_init__(self) -> None:
        retries, backoff, retry_on, dead_letter = self.retries, self.backoff, self.retry_on, self.dead_letter
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ConfigurationError(f"retries must be a whole number >= 0, got {retries!r}")
        if backoff is None:
            object.__setattr__(self, "backoff", Backoff())
        elif not isinstance(backoff, Backoff):
            raise ConfigurationError(f"backoff must be a ratequeue.Backoff, got {type(backoff).__name__}")
        if isinstance(retry_on, type):
            retry_on = (retry_on,)
            object.__setattr__(self, "retry_on", retry_on)
        if not (
            isinstance(retry_on, tuple)
            and retry_on
            and all(isinstance(kind, type) and issubclass(kind, BaseException) for kind in retry_on)
        ):
            raise ConfigurationError(
                f"retry_on must be an exception class or a tuple of them, got {retry_on!r}"
            )
        if dead_letter is not None and not callable(dead_letter):
            raise ConfigurationError(f"dead_letter must be callable, got {type(dead_letter).__name__}")
        if self.on_refusal not in ("hold", "retry"):
            raise ConfigurationError(f'on_refusal must be "hold" or "retry", got {self.on_refusal!r}')

    def overridden(self, **given: Any) -> JobOptions:
        """These options with each one ``given`` in place of its own, unless ``None``; checked."""
        return replace(self, **{name: value for name, value in given.items() if value is not None})


@dataclass(eq=False)
class Job(Generic[F]):
    """A job added to a queue: its call, its future, and where it stands."""

    future: F
    #: the function and its arguments
    call: functools.partial[Any]
    #: how many starts of the queue's rate it uses
    cost: int = 1
    priority: int = 0
    options: JobOptions = field(default_factory=JobOptions)
    #: local (monotonic) time before which it is held, or ``None``
    not_before: float | None = None
    #: how many times it has run
    attempts: int = 0
    #: how many of those runs the service refused for its rate and were tried again without
    #: using a retry (``on_refusal="hold"``)
    refused: int = 0
    #: the ticket of the turn the job's current attempt runs on (its lease, with ``max_running``)
    ticket: int | None = None
    #: the order it was added in
    seq: int = 0
    #: the group whose one place it needs, if any
    group: str | None = None
    #: whether it waits for its group's place (kept among the held jobs, for ever, until it has it)
    gated: bool = False
    #: the tickets of the places it holds, by gate (``"group"``, ``"cap"``): their leases, once it has them
    held: dict[str, int] = field(default_factory=dict)
    #: a fair queue's tenant of the job, and its place in the queue object's fair order
    #: (:meth:`PendingJobs.fair_tag`); 0 on a queue that is not fair
    tenant: str | None = None
    tag: float = 0.0

    def dead_letter(self, exception: BaseException) -> DeadLetter:
        """The :class:`DeadLetter` of this job failing for good with ``exception``."""
        call = self.call
        return DeadLetter(call.func, call.args, dict(call.keywords), exception, self.attempts)


class PendingJobs(Generic[F]):
    """The jobs of one queue object waiting to start, in the order of this module's rules."""

    def __init__(self) -> None:
        self._ready: list[tuple[tuple[int, float], int, Job[F]]] = []  # ((-priority, tag), seq, job)
        self._held: list[tuple[float, int, Job[F]]] = []  # (not_before, seq, job)
        self._gone: set[int] = set()  # seqs removed while still in a heap
        self._count = 0
        self._first_tries = 0
        self._seq = itertools.count()
        #: a fair queue's order: start-time fair queuing over tenants
        self._fair_order = FairOrder()

    def __len__(self) -> int:
        return self._count

    def first_tries(self) -> int:
        """How many of the jobs here wait for their first try (the ones ``max_waiting`` counts)."""
        return self._first_tries

    def number(self) -> int:
        """A new order number for a job added now."""
        return next(self._seq)

    def fair_tag(self, tenant: str, weight: int) -> float:
        """The fair order of a job of ``tenant`` added now: after the others' ``k * weight / theirs``-th.

        Among jobs of one priority, a fair queue starts them by this tag (then
        in the order added): tenants take turns, ``weight`` jobs at a time.
        """
        return self._fair_order.tag(tenant, weight, self._count)

    def push(self, job: Job[F]) -> None:
        """Add ``job`` (new, or back for a retry, keeping its order number)."""
        self._gone.discard(job.seq)
        self._first_tries += job.attempts == 0
        self._place(job)
        self._count += 1

    def ungate(self, job: Job[F]) -> None:
        """``job`` holds its group's place now: it is held (until its ``not_before``) or ready."""
        job.gated = False
        self._place(job)  # its entry among the held (for ever) is stale now: see _is_stale

    def _place(self, job: Job[F]) -> None:
        if job.gated:
            heapq.heappush(self._held, (math.inf, job.seq, job))
        elif job.not_before is not None:
            heapq.heappush(self._held, (job.not_before, job.seq, job))
        else:
            heapq.heappush(self._ready, ((-job.priority, job.tag), job.seq, job))

    def release_due(self, now: float, gated: Callable[[Job[F]], bool] | None = None) -> None:
        """Move the held jobs whose time has come (local time ``now``) among the ready ones.

        ``gated(job)`` says whether a job must first wait for a place (and
        put it in its gate's line): such a job stays held until :meth:`ungate`.
        """
        while self.next_due() <= now:
            _, seq, job = heapq.heappop(self._held)
            if gated is not None and gated(job):
                heapq.heappush(self._held, (math.inf, seq, job))
            else:
                heapq.heappush(self._ready, ((-job.priority, job.tag), seq, job))

    def head(self) -> Job[F] | None:
        """The ready job to start next, if any."""
        self._drop_gone(self._ready)
        return self._ready[0][2] if self._ready else None

    def next_due(self) -> float:
        """The local time the first held job is released (``inf`` if none is held, or only gated ones)."""
        self._drop_gone(self._held)
        return self._held[0][0] if self._held else math.inf

    def pop_head(self) -> Job[F]:
        """Take :meth:`head` out."""
        self._drop_gone(self._ready)
        _, _, job = heapq.heappop(self._ready)
        if job.tag:
            self._fair_order.serve(job.tag)
        self._count -= 1
        self._first_tries -= job.attempts == 0
        return job

    def remove(self, job: Job[F]) -> bool:
        """Take ``job`` out wherever it is; ``False`` if it is not here."""
        if job.seq in self._gone or not any(entry[2] is job for entry in self._entries()):
            return False
        self._gone.add(job.seq)
        self._count -= 1
        self._first_tries -= job.attempts == 0
        return True

    def drop_oldest(self) -> Job[F]:
        """Take out the job added first among those waiting for their first try (a retry is never dropped).

        Only while :meth:`first_tries` counts one at least.
        """
        first_tries = [entry[2] for entry in self._entries() if entry[2].attempts == 0]
        oldest = min(first_tries, key=lambda job: job.seq)
        self.remove(oldest)
        return oldest

    def drain(self) -> Iterator[Job[F]]:
        """Take every job out, in no particular order."""
        jobs = [entry[2] for entry in self._entries()]
        self._ready.clear()
        self._held.clear()
        self._gone.clear()
        self._count = self._first_tries = 0
        return iter(jobs)

    def _entries(self) -> Iterator[tuple[Any, int, Job[F]]]:
        """Every entry of a job here, once each (no removed job, no stale entry)."""
        for entry in itertools.chain(self._ready, self._held):
            if entry[1] not in self._gone and not self._is_stale(entry):
                yield entry

    @staticmethod
    def _is_stale(entry: tuple[Any, int, Job[F]]) -> bool:
        """Whether ``entry`` is the "for ever" held entry of a job that has its group's place now."""
        return entry[0] == math.inf and not entry[2].gated

    def _drop_gone(self, heap: list[Any]) -> None:
        while heap and (heap[0][1] in self._gone or self._is_stale(heap[0])):
            entry = heapq.heappop(heap)
            if not self._is_stale(entry):
                self._gone.discard(entry[1])


def delay_until(value: object, clock: Callable[[], float]) -> float | None:
    """A ``not_before`` (datetime, timedelta or seconds from now) as local time on ``clock``; checked."""
    if value is None:
        return None
    if isinstance(value, datetime.datetime):
        seconds = (value - datetime.datetime.now(value.tzinfo)).total_seconds()  # naive: local time
    elif isinstance(value, datetime.timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = to_float("not_before", value)
    else:
        raise ConfigurationError(
            f"not_before must be a datetime, a timedelta or seconds from now, got {type(value).__name__}"
        )
    if math.isnan(seconds) or seconds == math.inf:
        raise ConfigurationError(f"not_before must be a finite time, got {value!r}")
    if isinstance(value, (int, float, datetime.timedelta)) and seconds < 0:
        raise ConfigurationError(f"not_before in seconds from now must be >= 0, got {value!r}")
    return clock() + seconds if seconds > 0 else None


def check_priority(value: object) -> int:
    """``value`` as a job's priority: a whole number (higher starts first)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigurationError(f"priority must be a whole number (higher starts first), got {value!r}")
    return value


def check_bound(max_waiting: object, overflow: object) -> tuple[int | None, str]:
    """A queue's ``max_waiting`` and ``overflow`` rule, checked."""
    if max_waiting is not None and (
        isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 1
    ):
        raise ConfigurationError(f"max_waiting must be None or a whole number >= 1, got {max_waiting!r}")
    if overflow not in OVERFLOW_RULES:
        raise ConfigurationError(f"overflow must be one of {', '.join(OVERFLOW_RULES)}, got {overflow!r}")
    return max_waiting, str(overflow)


def check_group(value: object) -> str | None:
    """A job's ``group``: ``None``, or a non-empty string (the rest is checked as part of a queue name)."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ConfigurationError(f"group must be None or a non-empty string, got {value!r}")
    return value


def _group_of(job: Job[Any]) -> str | None:
    return job.group


class GroupGate(Generic[F]):
    """Which jobs of a queue object wait for a place of their key, in the order they asked.

    A key is a job's group (one place each) by default, or what ``key``
    says (a tenant, with its cap's places). Per key, the jobs wait in a
    line; the first of them is the one a waiter (a thread or a task of the
    queue) asks the key's place for. A key is *busy* from the moment a
    waiter starts for it: for a group, until its last job here has ended
    (so at most one waiter runs per group); for a key of several places,
    until its line is empty (its waiter asks for the next job's place as
    soon as one has its own).
    """

    def __init__(self, key: Callable[[Job[F]], str | None] = _group_of) -> None:
        #: the key of a job's place (``None``: it needs none)
        self.key = key
        self._lines: dict[str, deque[Job[F]]] = {}
        #: keys with a waiter running, or (a group) a job holding the place
        self._busy: set[str] = set()

    def enter(self, job: Job[F]) -> bool:
        """Put ``job`` (with a key) in its key's line; whether a waiter must start for the key."""
        key = self.key(job)
        assert key is not None
        job.gated = True
        self._lines.setdefault(key, deque()).append(job)
        idle = key not in self._busy
        self._busy.add(key)
        return idle

    def waits(self, job: Job[F]) -> bool:
        """Whether ``job`` is in its key's line."""
        return job in self._lines.get(self.key(job) or "", ())

    def first(self, group: str) -> Job[F] | None:
        """The job the key's place is asked for next; ``None`` (and the key is idle) if none waits."""
        line = self._lines.get(group)
        if line:
            return line[0]
        self._lines.pop(group, None)
        self._busy.discard(group)
        return None

    def granted(self, job: Job[F]) -> None:
        """``job``, the first of its key's line, has the place: it leaves the line."""
        first = self._lines[self.key(job) or ""].popleft()
        assert first is job

    def leave(self, job: Job[F]) -> bool:
        """Take ``job`` out of its key's line (it was cancelled or dropped); whether it was the first."""
        line = self._lines.get(self.key(job) or "")
        if not line or job not in line:
            return False
        first = line[0] is job
        line.remove(job)
        return first

    def ended(self, group: str) -> bool:
        """The job holding ``group``'s place here has ended for good; whether a waiter must start again."""
        return self.first(group) is not None
