"""Operations on a state as the tests read best: ``do(state, "try_start", name, interval, ticket, lead)``.

Each builds its :class:`~ratequeue.Terms` and :class:`~ratequeue.Operation`
with the library's own checked constructors, then calls the state's one
entry point, ``execute``. Positional arguments after the interval follow
the kind (see :data:`POSITIONAL`); the terms and ``cost`` are keywords.
"""

from __future__ import annotations

from typing import Any

from ratequeue.core import protocol
from ratequeue.core.clock import OffsetEstimator
from ratequeue.core.operation import Kind, Operation, Terms, operation
from ratequeue.core.protocol import US, Answer, Record
from ratequeue.core.shard import Shard

__all__ = ["POSITIONAL", "Step", "ado", "do", "flag_step", "is_step", "make_shard", "op", "stored_fields"]

#: the arguments of each kind, in the order the tests pass them after the name and interval
POSITIONAL: dict[str, tuple[str, ...]] = {
    "take": (),
    "try_start": ("ticket", "lead_us", "doubt_us"),
    "take_and_try": ("lead_us", "doubt_us"),
    "try_take": ("lead_us", "doubt_us"),
    "retime": ("ticket", "lead_us", "doubt_us"),
    "set_paused": ("paused",),
    "release": ("ticket",),
    "renew": ("ticket",),
    "hold": ("lead_us",),
    "lift": (),
    "slow": ("lead_us",),
    "settle": ("ticket", "cost", "lead_us"),
}

_TERMS = ("burst", "keep_us", "max_running", "lease_us")


def op(kind: Kind, name: str, interval_us: int, *args: Any, **kwargs: Any) -> Operation:
    """The checked operation ``kind`` on ``name``; ``max_running=0`` means no cap, as in the records."""
    terms = {key: kwargs.pop(key) for key in _TERMS if key in kwargs}
    if terms.get("max_running") == 0:
        terms["max_running"] = None
    names = POSITIONAL[kind]
    assert len(args) <= len(names), f"{kind} takes {names}, got {args}"
    arguments = dict(zip(names, args, strict=False), **kwargs)  # (trailing ones may be left out)
    return operation(kind, name, Terms.checked(interval_us, **terms), **arguments)


def do(state: Any, kind: Kind, name: str, interval_us: int, *args: Any, **kwargs: Any) -> Any:
    """``state.execute`` of :func:`op`."""
    answer: Answer = state.execute(op(kind, name, interval_us, *args, **kwargs))
    return answer


def flag_step(
    reference: Record, step: tuple[object, ...], now: int
) -> tuple[Record, Kind, tuple[Any, ...], bool]:
    """A generated ``("pause",)``, ``("resume",)``, ``("hold", lead)`` or ``("lift",)`` step on the reference.

    The new reference record, and the kind and positional arguments for
    :func:`do` with the answer it must give.
    """
    kind = step[0]
    if kind in ("pause", "resume"):
        record, changed = protocol.set_paused(reference, kind == "pause", now)
        return record, "set_paused", (kind == "pause",), changed
    if kind == "hold":
        lead = int(step[1])  # type: ignore[call-overload]
        record, changed = protocol.hold(reference, lead, now)
        return record, "hold", (lead,), changed
    if kind == "slow":
        interval = int(step[1])  # type: ignore[call-overload]
        record, changed = protocol.slow(reference, interval, now)
        return record, "slow", (interval,), changed
    assert kind == "lift", kind
    record, changed = protocol.lift(reference, now)
    return record, "lift", (), changed


async def ado(state: Any, kind: Kind, name: str, interval_us: int, *args: Any, **kwargs: Any) -> Any:
    """``await state.execute`` of :func:`op`."""
    answer: Answer = await state.execute(op(kind, name, interval_us, *args, **kwargs))
    return answer


class Step:
    """Equal to an :class:`Operation` step of ``kind`` whose named fields hold these values (shard tests)."""

    def __init__(self, kind: str, **fields: Any) -> None:
        self.kind, self.fields = kind, fields

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Operation)
            and other.kind == self.kind
            and all(getattr(other, key) == value for key, value in self.fields.items())
        )

    def __repr__(self) -> str:
        return f"Step({self.kind!r}, {self.fields!r})"


def is_step(step: object, *kinds: str) -> bool:
    """Whether ``step`` is an operation of one of ``kinds``."""
    return isinstance(step, Operation) and step.kind in kinds


def make_shard(interval: float, *, burst: int = 1, same_clock: bool = False, **options: Any) -> Shard:
    """A shard of queue "q" with an interval in seconds, as the shard tests think of it."""
    terms = Terms.checked(round(interval * US), burst)
    return Shard("q", terms, estimator=OffsetEstimator(same_clock=same_clock), **options)


def stored_fields(ticket: int, pos: Any, at: int | None, interval: int, **fields: Any) -> dict[str, Any]:
    """A record's fields as the file state stores them: every one, those not given as in a fresh record."""
    return {
        "ticket": ticket,
        "pos": pos,
        "at": at,
        "interval": interval,
        "due": at,
        "burst": 1,
        "paused": False,
        "max_running": 0,
        "leases": [],
        "held": None,
        "not_before": None,
        "pace": 0,
        "paced_at": None,
        "settled": 0,
        **fields,
    }
