"""A limiter's settings as one value, checked once at the boundary; and the checks of user input.

:meth:`Settings.checked` turns what a user passes to a limiter, queue or
group into a :class:`Settings`; the value is then handed on (to each key of a
group, to a queue's limiter, through pickling), never retyped or checked
again. Every check raises :class:`~ratequeue.errors.ConfigurationError`
before any state is touched.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal, TypedDict, Union

from .core.clock import to_float
from .core.jobs import Backoff, DeadLetter
from .core.operation import MAX_NAME_LENGTH, MAX_WEIGHT, Terms, check_name, check_tenant
from .core.protocol import MAX_DOUBT_US, MAX_HOLD_US, MAX_LEAD_US, MAX_RUNNING, MAX_US, US
from .core.shard import DEFAULT_MAX_LATE
from .errors import ConfigurationError
from .events import EventHook, check_hook
from .rates import RateLike, parse_rate

__all__ = [
    "DEFAULT_LEASE",
    "FOREVER",
    "MAX_NAME_LENGTH",
    "MAX_WAIT",
    "Options",
    "QueueOptions",
    "Seconds",
    "Settings",
    "check_cost",
    "check_name",
    "check_prefix",
    "check_timeout",
    "positive_int",
    "seconds",
    "wait",
]

#: a duration: seconds, or a ``timedelta``
Seconds = Union[float, datetime.timedelta]

#: how long (s) a lease lasts by default: a killed holder's place comes back within this
DEFAULT_LEASE = 10.0

#: timeouts longer than this (s, about 31.7 years) wait for ever, as ``None`` and ``math.inf`` do
FOREVER = 1e9

#: the longest single wait (s) a driver blocks for before it looks at its deadline again: well
#: under ``threading.TIMEOUT_MAX`` everywhere, so that any timeout works
MAX_WAIT = 3600.0


#: what ``when_down`` may be: ``"raise"``, ``"open"``, or the share of the rate each process keeps
WhenDown = Union[Literal["raise", "open"], float]


class Options(TypedDict, total=False):
    """The keyword arguments every limiter, queue and group takes beside ``name`` (docs/api.md).

    :param interval: seconds (or a ``timedelta``) between two starts; or give ``rate``.
    :param rate: the pace as a rate: ``"5000/hour"``, ``(10, timedelta(seconds=1))`` or a
        :class:`~ratequeue.Rate`; its interval is ``period / count``.
    :param burst: how many starts may come at once after an idle spell (1: none closer than
        the interval); any ``k`` consecutive starts span at least ``k - burst`` intervals.
    :param keep: seconds an idle queue's record is kept once forgetting it changes nothing
        (then deleted); ``None`` keeps it for ever.
    :param lead: how early a caller may reserve its slot before sleeping until it; ``None``
        adapts it to the state's round-trip time.
    :param max_late: seconds a caller may begin after its start (0.3 ms by default); a later
        wake-up moves the start, or gives the turn up, so that begins stay
        ``interval - max_late`` apart where the service feels them (G7). ``None`` turns it off.
    :param margin: seconds each start moves the next one later, beyond the interval, so that
        begins up to ``max_late`` late still come an interval apart where the service feels
        them: a rate as a service publishes it is kept against a strict or sliding-window
        service. By default ``max_late`` (0.3 ms: 0.3 % of the rate at 10/s, 3 % at 100/s)
        where the lateness is checked, none with a burst; 0 takes the rate exactly as
        written (docs/rates.md, "The margin").
    :param max_running: how many jobs may run at once across every shard (``None``: no cap);
        each holds a lease, renewed while it runs.
    :param lease: seconds a running job's lease lasts unless renewed (10): the longest a dead
        job's place stays taken.
    :param when_down: what calls do while the state cannot be reached (:mod:`ratequeue.fallback`):
        ``"raise"`` :class:`~ratequeue.StateUnavailable` (the default); ``"open"``: begin
        turns locally at this limiter's rate in each process; a share ``s`` (0 to 1): at
        ``s`` times the rate in each process. Rejoins the state without a burst once it answers.
    :param adaptive: a refusal heard by :meth:`~ratequeue.Limiter.heed` (a 429, a 503 naming a
        wait, a refused queue job) also slows the whole queue: its effective interval doubles (at
        most 64 times the interval), and the excess halves every 5 s without another refusal.
        Headers stating a slower quota slow it to that quota. Off by default.
    :param fair: serve tenants in turn (docs/fairness.md): a caller names its tenant
        (``acquire(tenant="acme")``); tenants with waiters take turns, first come first served
        inside each, every start still an interval apart. Fixed for the queue's name, as the
        interval is. Off by default: callers are served in the order they came.
    :param weights: a fair queue's tenants' weights (``{"acme": 3}``: up to 3 of acme's turns
        per round of the others'); a tenant not named has weight 1. Whole numbers from 1 to 1000.
    :param tenant_max_running: a fair queue's cap on one tenant's running jobs, across every
        shard (``None``: no cap); a tenant at its cap waits without holding a turn of the
        queue, so it delays no other tenant (docs/fairness.md, "Per-tenant caps").
    :param clock: this process's clock, ``time.monotonic`` by default (tests shift it).
    :param on_event: called with a :class:`~ratequeue.Event` for each begin, timeout, state call,
        passed ticket and late wake-up, off the acquire path (docs/api.md, "Event"). Not pickled.
    """

    interval: Seconds | None
    rate: RateLike | None
    burst: int
    keep: Seconds | None
    lead: Seconds | None
    max_late: Seconds | None
    margin: Seconds | None
    max_running: int | None
    lease: Seconds
    when_down: WhenDown
    adaptive: bool
    fair: bool
    weights: Mapping[str, int] | None
    tenant_max_running: int | None
    clock: Callable[[], float] | None
    on_event: EventHook | None


#: the keyword options a limiter takes (:class:`Options`): any other is refused by name
_OPTION_NAMES = frozenset(Options.__annotations__)


class QueueOptions(Options, total=False):
    """The keyword arguments of a queue beside ``name``: a limiter's (:class:`Options`), and these.

    :param retries: how many times a failed job is tried again (0: never); each try takes a
        new turn, after its ``backoff``. Jobs may set their own.
    :param backoff: the wait before each retry (:class:`~ratequeue.Backoff`; by default 1 s
        doubling up to 60 s, with jitter).
    :param retry_on: the exceptions that are retried (all by default); others fail the job at once.
    :param dead_letter: called with a :class:`~ratequeue.DeadLetter` when a job fails for good;
        its future fails all the same. On asyncio it may be a coroutine function.
    :param max_waiting: the most jobs one queue object holds waiting (``None``: no limit).
    :param overflow: when ``max_waiting`` jobs wait: ``"reject"`` the new one
        (:class:`~ratequeue.QueueFull`) or ``"drop_oldest"`` (its future fails with ``QueueFull``).
    :param on_refusal: a job whose call the service refused for its rate (a 429, a 503 naming a
        wait, :class:`~ratequeue.RateLimited`): ``"hold"`` (the default) holds the whole queue for
        the wait asked and tries the job again at its next turn without using a retry;
        ``"retry"`` treats it as any other failure.
    """

    retries: int
    backoff: Backoff | None
    retry_on: type[BaseException] | tuple[type[BaseException], ...]
    dead_letter: Callable[[DeadLetter], Any] | None
    max_waiting: int | None
    overflow: str
    on_refusal: str


@dataclass(frozen=True)
class Settings:
    """What one limiter (one shard) is: its queue's name and terms, and how it waits.

    Make one with :meth:`checked`. ``None`` means "none" for ``keep`` (keep
    the record for ever), ``lead`` (adapt it), ``max_late`` (no lateness
    check) and ``max_running`` (no cap).
    """

    #: the queue name
    name: str
    #: seconds between two starts (of cost 1)
    interval: float
    #: how many starts (of cost 1) may come at once after an idle spell
    burst: int = 1
    #: seconds an idle queue's record is kept once forgetting it changes nothing
    keep: float | None = None
    #: how early (s) a caller may reserve its slot before sleeping until it
    lead: float | None = None
    #: how late (s) a caller may begin after its start
    max_late: float | None = DEFAULT_MAX_LATE
    #: how many jobs may run at once across every shard
    max_running: int | None = None
    #: seconds a running job's lease lasts unless renewed (with ``max_running``)
    lease: float = DEFAULT_LEASE
    #: what calls do while the state is down: ``"raise"``, ``"open"``, or the share of the rate kept
    when_down: WhenDown = "raise"
    #: whether a refusal heard also slows the whole queue (:meth:`~ratequeue.Limiter.slow_down`)
    adaptive: bool = False
    #: whether tenants with waiters take turns (a fair queue)
    fair: bool = False
    #: a fair queue's tenants' weights, as ``(tenant, weight)`` pairs; a tenant not named has weight 1
    weights: tuple[tuple[str, int], ...] = ()
    #: how much later (s) than the interval each start moves the next; ``None``: ``max_late``
    margin: float | None = None
    #: how many of one tenant's jobs may run at once across every shard (a fair queue's); ``None``: no cap
    tenant_max_running: int | None = None
    #: the queue's terms as every operation carries them
    terms: Terms = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        keep_us = 0 if self.keep is None else max(1, round(self.keep * US))
        lease_us = round(self.lease * US) if self.max_running else 0
        terms = Terms.checked(
            _interval_us(self.interval), self.burst, keep_us, self.max_running, lease_us, self.fair
        )
        object.__setattr__(self, "terms", terms)

    def weight(self, tenant: str) -> int:
        """``tenant``'s weight in a fair queue (1 unless :attr:`weights` names it)."""
        for named, weight in self.weights:
            if named == tenant:
                return weight
        return 1

    @classmethod
    def checked(
        cls,
        name: object,
        interval: object = None,
        rate: object = None,
        burst: object = 1,
        keep: object = None,
        lead: object = None,
        max_late: object = DEFAULT_MAX_LATE,
        max_running: object = None,
        lease: object = DEFAULT_LEASE,
        when_down: object = "raise",
        adaptive: object = False,
        fair: object = False,
        weights: object = None,
        margin: object = None,
        tenant_max_running: object = None,
    ) -> Settings:
        """Settings from what a user passed: ``interval=`` or ``rate=`` (one of them), and the rest."""
        if rate is None:
            if interval is None:
                raise ConfigurationError(
                    "give interval= (seconds between starts) or rate= (such as '10/second')"
                )
            pace = seconds("interval", interval)
            if not 0.0 < pace < math.inf:
                raise ConfigurationError(f"interval must be a finite number of seconds > 0, got {interval!r}")
        elif interval is not None:
            raise ConfigurationError(
                f"give interval= or rate=, not both (interval={interval!r}, rate={rate!r})"
            )
        else:
            pace = parse_rate(rate).interval
        keep = _optional("keep", keep, MAX_US / US, "a number of seconds >= 0 (under 142 years)")
        lead = _optional("lead", lead, MAX_LEAD_US / US, _LEADS, upper=True)
        max_late = _optional("max_late", max_late, math.inf, "a finite number of seconds >= 0")
        margin = _optional("margin", margin, MAX_DOUBT_US / US, _MARGINS, upper=True)
        lease = seconds("lease", lease)
        if not 0.01 <= lease <= 86_400:
            raise ConfigurationError(
                f"lease must be a number of seconds from 0.01 to 86400 (a day), got {lease}"
            )
        checked_name, checked_burst = check_name(name), positive_int("burst", burst)
        down = check_when_down(when_down)
        if down != "raise" and max_running is not None:
            raise ConfigurationError(
                f"max_running needs the state (it holds the leases): when_down must be 'raise', got {down!r}"
            )
        if not isinstance(adaptive, bool):
            raise ConfigurationError(f"adaptive must be True or False, got {adaptive!r}")
        if not isinstance(fair, bool):
            raise ConfigurationError(f"fair must be True or False, got {fair!r}")
        checked_weights = check_weights(weights)
        if checked_weights and not fair:
            raise ConfigurationError("weights= are a fair queue's: give fair=True as well")
        tenant_cap = check_tenant_max_running(tenant_max_running, fair, down)
        # (max_running is checked with the other terms, by Terms.checked in __post_init__)
        return cls(
            checked_name,
            pace,
            checked_burst,
            keep,
            lead,
            max_late,
            max_running,  # type: ignore[arg-type]
            lease,
            down,
            adaptive,
            fair,
            checked_weights,
            margin,
            tenant_cap,
        )

    @classmethod
    def of(
        cls, name: object, options: Options
    ) -> tuple[Settings, Callable[[], float] | None, EventHook | None]:
        """The settings in ``options`` (checked), and the clock and hook beside them."""
        rest: dict[str, Any] = dict(options)
        unknown = sorted(set(rest) - _OPTION_NAMES)
        if unknown:
            said = ", ".join(map(repr, unknown))
            raise ConfigurationError(
                f"unknown option{'s' if len(unknown) > 1 else ''} {said}; the options are "
                + ", ".join(sorted(_OPTION_NAMES))
                + ("; the state is the first argument: Limiter(url, name=...)" if "state" in unknown else "")
            )
        clock = rest.pop("clock", None)
        hook = check_hook(rest.pop("on_event", None))
        if clock is not None and not callable(clock):
            raise ConfigurationError(f"clock must be a function returning seconds, got {clock!r}")
        return cls.checked(name, **rest), clock, hook

    def arguments(self) -> dict[str, Any]:
        """These settings as the keyword arguments of a limiter (the pace as ``interval``)."""
        arguments = {item.name: getattr(self, item.name) for item in fields(self) if item.init}
        arguments["weights"] = dict(self.weights) or None
        return arguments


def check_weights(value: object) -> tuple[tuple[str, int], ...]:
    """A fair queue's ``weights=``: a mapping of tenants to whole numbers from 1 to ``MAX_WEIGHT``."""
    if value is None:
        return ()
    if not isinstance(value, Mapping):
        raise ConfigurationError(f"weights must map tenants to whole numbers, got {type(value).__name__}")
    pairs = []
    for tenant, weight in value.items():
        check_tenant(tenant)
        if not (_is_int(weight) and 1 <= weight <= MAX_WEIGHT):
            raise ConfigurationError(
                f"weights[{tenant!r}] must be a whole number from 1 to {MAX_WEIGHT}, got {weight!r}"
            )
        pairs.append((tenant, weight))
    return tuple(sorted(pairs))


def check_tenant_max_running(value: object, fair: bool, when_down: WhenDown) -> int | None:
    """``tenant_max_running=``: ``None``, or a whole number from 1 to ``MAX_RUNNING`` on a fair queue."""
    if value is None:
        return None
    if not (_is_int(value) and 1 <= value <= MAX_RUNNING):  # type: ignore[operator]
        raise ConfigurationError(
            f"tenant_max_running must be None (no cap) or a whole number from 1 to {MAX_RUNNING}, "
            f"got {value!r}"
        )
    if not fair:
        raise ConfigurationError("tenant_max_running= caps a fair queue's tenants: give fair=True as well")
    if when_down != "raise":
        raise ConfigurationError(
            "tenant_max_running needs the state (it holds the leases): when_down must be 'raise', "
            f"got {when_down!r}"
        )
    return value  # type: ignore[return-value]


def not_with_caps(settings: Settings, what: str) -> None:
    """Refuse ``what`` on a limiter with ``tenant_max_running`` (:class:`ConfigurationError`)."""
    if settings.tenant_max_running is not None:
        raise ConfigurationError(
            f"{what} does not take tenant_max_running= yet (queue {settings.name!r}): "
            "use acquire(), try_acquire(), `with`, or the decorator"
        )


def check_tenant_for(settings: Settings, tenant: object) -> str:
    """``tenant`` (a caller's, or ``None``) checked for ``settings``' queue: it must be fair to name one."""
    if tenant is None:
        return ""
    if not settings.fair:
        raise ConfigurationError(
            f"tenant= needs a fair queue: give fair=True to every limiter of {settings.name!r}"
        )
    return check_tenant(tenant)


_LEADS = f"a number of seconds from 0 to {MAX_LEAD_US / US:g} (an hour)"
_MARGINS = f"a number of seconds from 0 to {MAX_DOUBT_US / US:g}"


def _optional(what: str, value: object, high: float, want: str, *, upper: bool = False) -> float | None:
    """``value``: ``None``, or seconds from 0 to ``high`` (``high`` itself only with ``upper``)."""
    if value is None:
        return None
    number = seconds(what, value)
    if not (0.0 <= number <= high if upper else 0.0 <= number < high):
        raise ConfigurationError(f"{what} must be None or {want}, got {number!r}")
    return number


def _interval_us(interval: float) -> int:
    micros = round(interval * US)
    if micros < 1:
        raise ConfigurationError(f"interval must be at least one microsecond, got {interval!r} s")
    if micros >= MAX_US:
        raise ConfigurationError(f"interval must be under about 142 years, got {interval!r} s")
    return micros


def check_when_down(value: object) -> WhenDown:
    """``value`` as a ``when_down`` setting: ``"raise"``, ``"open"``, or a share of the rate in (0, 1)."""
    if value in ("raise", "open") and isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < 1:
        return float(value)
    raise ConfigurationError(
        f'when_down must be "raise", "open" or the share of the rate each process keeps while the state '
        f"is down (a number between 0 and 1, such as 0.25), got {value!r}"
    )


def check_cost(value: object, burst: int) -> int:
    """``value`` as the cost of one acquire: a whole number from 1 to the burst."""
    if type(value) is int and 1 <= value <= burst:
        return value
    if not (_is_int(value) and 1 <= value <= burst):  # type: ignore[operator]
        more = "; a cost above 1 needs burst= at least as large" if burst == 1 else ""
        raise ConfigurationError(
            f"cost must be a whole number from 1 to the burst ({burst}), got {value!r}{more}"
        )
    return value  # type: ignore[return-value]


def check_settled(value: object, burst: int) -> int:
    """``value`` as what a call really cost (``Limiter.settle``): a whole number from 0 to the burst."""
    if _is_int(value) and 0 <= value <= burst:  # type: ignore[operator]
        return value  # type: ignore[return-value]
    raise ConfigurationError(
        f"a settled cost must be a whole number from 0 to the burst ({burst}), got {value!r}"
    )


def check_timeout(value: object) -> float | None:
    """``value`` as ``None`` (wait for ever) or seconds >= 0; over :data:`FOREVER` (or ``inf``): ``None``."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value > FOREVER):
        # (an integer too large for a float, 10**400, waits for ever as inf does)
        return None
    timeout = seconds("timeout", value)
    if math.isnan(timeout) or timeout < 0:
        raise ConfigurationError(f"timeout must be None or a number of seconds >= 0, got {value!r}")
    return None if timeout > FOREVER else timeout


def check_hold(value: object) -> int:
    """``value``, seconds from 0 to a day, as the whole microseconds of a hold (rounded up: never shorter)."""
    held = seconds("hold", value) if not (isinstance(value, int) and value > MAX_HOLD_US) else math.inf
    if not 0 <= held <= MAX_HOLD_US / US:
        raise ConfigurationError(
            f"a hold must be a number of seconds from 0 to {MAX_HOLD_US // US} (a day), got {value!r}"
        )
    return math.ceil(held * US)


def check_slow(value: object) -> int:
    """``value``, seconds between starts (over 0, at most an hour), as whole microseconds (rounded up)."""
    pace = (
        seconds("a slow-down's interval", value)
        if not (isinstance(value, int) and value > MAX_LEAD_US)
        else math.inf
    )
    if not 0 < pace <= MAX_LEAD_US / US:
        raise ConfigurationError(
            f"a slow-down's interval must be a number of seconds over 0, "
            f"at most {MAX_LEAD_US // US}, got {value!r}"
        )
    return max(1, math.ceil(pace * US))


def wait(timeout: float | None) -> float | None:
    """A wait of ``timeout`` s (``None``: until woken) cut to :data:`MAX_WAIT`; the waiter looks again."""
    return None if timeout is None else min(timeout, MAX_WAIT)


def check_prefix(value: object) -> str:
    """``value`` as the beginning of queue names: a string, possibly empty, of printable characters."""
    if value == "":
        return ""
    if not isinstance(value, str):
        raise ConfigurationError(f"prefix must be a string, got {type(value).__name__}")
    return check_name(value)


def positive_int(what: str, value: object) -> int:
    """``value`` as an integer >= 1."""
    if not _is_int(value) or value < 1:  # type: ignore[operator]
        raise ConfigurationError(f"{what} must be an integer >= 1, got {value!r}")
    return value  # type: ignore[return-value]


def seconds(what: str, value: object) -> float:
    """``value`` (a number or a ``timedelta``) as seconds; :class:`ConfigurationError` for anything else."""
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigurationError(
            f"{what} must be a number of seconds or a timedelta, got {type(value).__name__}"
        )
    return to_float(what, value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
