"""An operation on a queue's record, as a value: its kind, the queue's name and terms, its arguments.

Every state carries out any operation through one entry point,
:meth:`ratequeue.state.State.execute`; :func:`apply` is the reference answer,
made of :mod:`ratequeue.core.protocol`'s steps. :func:`operation` and :meth:`Terms.checked` check
their input once, when the value is made, so that nothing a state sends to
its server was left unchecked. Adding an operation means one kind here, its
protocol function, one branch in each state's script, and one row of the
contract test (docs/design.md, "Adding an operation").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, NamedTuple, get_args

from ..errors import ConfigurationError
from .protocol import (
    MAX_BURST,
    MAX_DOUBT_US,
    MAX_HOLD_US,
    MAX_LEAD_US,
    MAX_LEASE_US,
    MAX_RUNNING,
    MAX_US,
    Answer,
    Micros,
    Record,
    enqueue,
    enqueue_and_try,
    hold,
    lift,
    release,
    renew,
    retime,
    set_paused,
    settle,
    slow,
    take,
    take_and_try,
    try_start,
    try_take,
    try_turn,
)

__all__ = [
    "ARGUMENTS",
    "KINDS",
    "STEPS",
    "MAX_NAME_LENGTH",
    "MAX_TENANT_LENGTH",
    "MAX_WEIGHT",
    "Kind",
    "Operation",
    "Terms",
    "apply",
    "check_name",
    "check_tenant",
    "operation",
]

#: the operations a state carries out
Kind = Literal[
    "take",
    "try_start",
    "take_and_try",
    "try_take",
    "retime",
    "set_paused",
    "release",
    "renew",
    "hold",
    "lift",
    "slow",
    "settle",
]

#: every kind of operation
KINDS: tuple[Kind, ...] = get_args(Kind)

#: the arguments each kind takes beyond the queue's name and terms (the others keep their defaults)
ARGUMENTS: dict[str, tuple[str, ...]] = {
    "take": ("cost", "tenant"),
    "try_start": ("ticket", "lead_us", "cost", "token", "doubt_us"),
    "take_and_try": ("lead_us", "cost", "token", "doubt_us", "tenant"),
    "try_take": ("lead_us", "cost", "token", "doubt_us", "tenant"),
    "retime": ("ticket", "lead_us", "doubt_us"),
    "set_paused": ("paused",),
    "release": ("ticket", "token"),
    "renew": ("ticket", "token"),
    "hold": ("lead_us",),
    "lift": (),
    "slow": ("lead_us",),
    "settle": ("ticket", "cost", "lead_us"),
}


class Terms(NamedTuple):
    """What an operation expects of its queue's record; make checked ones with :meth:`checked`.

    A record is created with the ``interval_us``, ``burst`` and
    ``max_running`` of the first operation on its name; a later operation
    naming others is refused (:class:`~ratequeue.errors.TermsMismatch`) and
    changes nothing. ``keep_us`` and ``lease_us`` are not stored: a write
    with ``keep_us > 0`` keeps the record until ``keep_us`` after the later
    of its ``now`` and :func:`~ratequeue.core.protocol.expires` (0: for
    ever), and each start or renewal under ``max_running`` takes a lease of
    ``lease_us``.
    """

    #: microseconds between two starts of cost 1
    interval_us: int
    #: how many starts of cost 1 may come at once (1: none closer than the interval)
    burst: int = 1
    #: how long (us) an idle record is kept once it has expired; 0: for ever
    keep_us: int = 0
    #: how many jobs may run at once across every shard; ``None``: no cap
    max_running: int | None = None
    #: how long (us) a start's or a renewal's lease lasts; used with ``max_running`` only
    lease_us: int = 0
    #: whether tickets go to tenants in turn (a fair queue), fixed when the record is created
    fair: bool = False

    @classmethod
    def checked(
        cls,
        interval_us: int,
        burst: int = 1,
        keep_us: int = 0,
        max_running: int | None = None,
        lease_us: int = 0,
        fair: bool = False,
    ) -> Terms:
        """Terms whose every field is checked: :class:`~ratequeue.errors.ConfigurationError` if one is bad."""
        _whole("interval_us", interval_us, 1)
        if not (_is_int(burst) and 1 <= burst <= MAX_BURST):
            raise ConfigurationError(f"burst must be a whole number from 1 to {MAX_BURST}, got {burst!r}")
        if burst * interval_us >= MAX_US:
            raise ConfigurationError(
                f"burst * interval must stay under {MAX_US} us (about 142 years), "
                f"got {burst} * {interval_us} us"
            )
        if max_running is not None and not (_is_int(max_running) and 1 <= max_running <= MAX_RUNNING):
            raise ConfigurationError(
                f"max_running must be None (no cap) or a whole number from 1 to {MAX_RUNNING}, "
                f"got {max_running!r}"
            )
        _whole("keep_us", keep_us, 0)
        _whole("lease_us", lease_us, 0 if max_running is None else 1)
        if lease_us > MAX_LEASE_US:
            raise ConfigurationError(f"lease_us must be at most {MAX_LEASE_US} (a day), got {lease_us!r}")
        if not isinstance(fair, bool):
            raise ConfigurationError(f"fair must be True or False, got {fair!r}")
        return cls(interval_us, burst, keep_us, max_running, lease_us, fair)


class Operation(NamedTuple):
    """One operation on queue ``name``'s record; :func:`operation` makes checked ones.

    A field the kind does not take (see :data:`ARGUMENTS`) keeps its default.
    """

    kind: Kind
    name: str
    terms: Terms
    #: the ticket tried, re-timed, released or renewed
    ticket: int = 0
    #: how far ahead (us) a start may lie (try_start, take_and_try, try_take), be moved (retime) or be held
    #: (hold); for slow, the interval to slow to at least (0: twice the effective one); for settle,
    #: not a time but the job's actual cost (0 to the burst)
    lead_us: int = 0
    #: how many units of the rate the ticket takes or was taken for (1 to the burst)
    cost: int = 1
    #: set_paused: pause (``True``) or resume
    paused: bool = False
    #: the shard's number for the ticket (1 to ``MAX_US - 1``; 0: none), which names its lease on a
    #: queue with ``max_running`` (:data:`~ratequeue.core.protocol.Lease`)
    token: int = 0
    #: try_start, take_and_try, try_take, retime: how much (us) a start moves the next, for its starter's
    #: doubt of the state's clock (0 to :data:`~ratequeue.core.protocol.MAX_DOUBT_US`)
    doubt_us: int = 0
    #: take, take_and_try, try_take on a fair queue: the waiter's tenant, and its weight (1 to
    #: :data:`MAX_WEIGHT`): how many of the tenant's waiters may hold tickets at once
    tenant: str = ""
    weight: int = 1


#: the largest weight of a fair queue's tenant
MAX_WEIGHT = 1000

#: the longest tenant name accepted, in characters
MAX_TENANT_LENGTH = 200


def operation(
    kind: Kind,
    name: str,
    terms: Terms,
    *,
    ticket: int = 0,
    lead_us: int = 0,
    cost: int = 1,
    paused: bool = False,
    token: int = 0,
    doubt_us: int = 0,
    tenant: str = "",
    weight: int = 1,
) -> Operation:
    """An :class:`Operation` of ``kind`` on queue ``name``, every argument checked.

    ``terms`` must come from :meth:`Terms.checked`. A ticket is a whole
    number >= 1, a lead from 0 to :data:`~ratequeue.core.protocol.MAX_LEAD_US`
    (a hold's to :data:`~ratequeue.core.protocol.MAX_HOLD_US`),
    a cost from 1 to the burst; ``renew`` needs ``max_running`` in its terms.
    """
    if kind not in ARGUMENTS:
        raise ConfigurationError(f"unknown operation {kind!r}: one of {', '.join(KINDS)}")
    if not isinstance(terms, Terms):
        raise ConfigurationError(f"an operation's terms are a Terms, got {type(terms).__name__}")
    takes = ARGUMENTS[kind]
    if "ticket" in takes:
        _whole("ticket", ticket, 1)
    if kind == "settle":
        if not (_is_int(lead_us) and 0 <= lead_us <= terms.burst):
            raise ConfigurationError(
                f"a settled cost must be a whole number from 0 to the burst ({terms.burst}), got {lead_us!r}"
            )
    elif "lead_us" in takes:
        _whole("lead_us", lead_us, 0)
        most, said = (MAX_HOLD_US, "a day") if kind == "hold" else (MAX_LEAD_US, "an hour")
        if lead_us > most:
            raise ConfigurationError(f"lead_us must be at most {most} ({said}), got {lead_us!r}")
    if "cost" in takes and not (_is_int(cost) and 1 <= cost <= terms.burst):
        raise ConfigurationError(
            f"cost must be a whole number from 1 to the burst ({terms.burst}), got {cost!r}"
            + ("; a cost above 1 needs a burst at least as large" if terms.burst == 1 else "")
        )
    if "token" in takes:
        _whole("token", token, 0)
    if "doubt_us" in takes and not (_is_int(doubt_us) and 0 <= doubt_us <= MAX_DOUBT_US):
        raise ConfigurationError(
            f"doubt_us must be a whole number from 0 to {MAX_DOUBT_US}, got {doubt_us!r}"
        )
    if "paused" in takes and not isinstance(paused, bool):
        raise ConfigurationError(f"paused must be True or False, got {paused!r}")
    if kind == "renew" and terms.max_running is None:
        raise ConfigurationError(
            "renew needs max_running: a queue without a cap on running jobs has no leases"
        )
    if "tenant" in takes:
        check_tenant(tenant)
        if not (_is_int(weight) and 1 <= weight <= MAX_WEIGHT):
            raise ConfigurationError(f"weight must be a whole number from 1 to {MAX_WEIGHT}, got {weight!r}")
    return Operation(
        kind, check_name(name), terms, ticket, lead_us, cost, paused, token, doubt_us, tenant, weight
    )


def check_tenant(value: object) -> str:
    """``value`` as a fair queue's tenant: a string of printable characters ("" is the default tenant)."""
    if type(value) is str and len(value) <= MAX_TENANT_LENGTH and value.isprintable():
        return value
    if not isinstance(value, str):
        raise ConfigurationError(f"tenant must be a string, got {type(value).__name__}")
    if len(value) > MAX_TENANT_LENGTH:
        raise ConfigurationError(f"tenant must be at most {MAX_TENANT_LENGTH} characters, got {len(value)}")
    raise ConfigurationError(f"tenant must hold printable characters only, got {value!r}")


#: the longest queue name accepted, in characters
MAX_NAME_LENGTH = 200


def check_name(value: object) -> str:
    """``value`` as a queue name: a non-empty string of printable characters."""
    if type(value) is str and 0 < len(value) <= MAX_NAME_LENGTH and value.isprintable():
        return value
    if not isinstance(value, str):
        raise ConfigurationError(f"name must be a string, got {type(value).__name__}")
    if not value:
        raise ConfigurationError("name must not be empty")
    if len(value) > MAX_NAME_LENGTH:
        raise ConfigurationError(f"name must be at most {MAX_NAME_LENGTH} characters, got {len(value)}")
    if not value.isprintable():
        raise ConfigurationError(f"name must hold printable characters only, got {value!r}")
    return value


def _whole(what: str, value: object, low: int) -> None:
    if not (_is_int(value) and low <= value < MAX_US):  # type: ignore[operator]
        raise ConfigurationError(f"{what} must be a whole number >= {low}, got {value!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def apply(record: Record, op: Operation, now: Micros) -> tuple[Record, Answer]:
    """Carry out ``op`` on ``record`` at state-clock time ``now``: the new record and the answer."""
    return STEPS[op.kind](record, op, now)


#: each kind of operation as a step of the record (:func:`apply` without the call)
STEPS: dict[str, Callable[[Record, Operation, Micros], tuple[Record, Answer]]] = {
    "take": lambda rec, op, now: (
        enqueue(rec, now, op.tenant, op.weight, op.cost) if rec.fair else take(rec, now, op.cost)
    ),
    "try_start": lambda rec, op, now: (try_turn if rec.fair else try_start)(
        rec, op.ticket, op.lead_us, now, op.cost, op.terms.lease_us, op.token, op.doubt_us
    ),
    "take_and_try": lambda rec, op, now: (
        enqueue_and_try(
            rec, op.tenant, op.weight, op.lead_us, now, op.cost, op.terms.lease_us, op.token, op.doubt_us
        )
        if rec.fair
        else take_and_try(rec, op.lead_us, now, op.cost, op.terms.lease_us, op.token, op.doubt_us)
    ),
    "try_take": lambda rec, op, now: try_take(
        rec, op.lead_us, now, op.cost, op.terms.lease_us, op.token, op.doubt_us, op.tenant, op.weight
    ),
    "retime": lambda rec, op, now: retime(rec, op.ticket, op.lead_us, now, op.doubt_us),
    "set_paused": lambda rec, op, now: set_paused(rec, op.paused, now),
    "release": lambda rec, op, now: release(rec, op.ticket, now, op.token),
    "renew": lambda rec, op, now: renew(rec, op.ticket, op.terms.lease_us, now, op.token),
    "hold": lambda rec, op, now: hold(rec, op.lead_us, now),
    "lift": lambda rec, op, now: lift(rec, now),
    "slow": lambda rec, op, now: slow(rec, op.lead_us, now),
    "settle": lambda rec, op, now: settle(rec, op.ticket, op.cost, op.lead_us, now),
}
