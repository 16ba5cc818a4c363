"""Rates as people write them: ``"5000/hour"``, ``(10, timedelta(seconds=1))``, ``Rate(10, per=1)``.

A rate of ``count`` starts per ``per`` seconds is a queue whose interval is
``per / count``: its starts are spread evenly, one interval apart, and a
``burst`` lets up to that many come at once after an idle spell (see
docs/rates.md). :func:`parse_rate` is the one parser every API uses.
"""

from __future__ import annotations

import datetime
import math
import re
from dataclasses import dataclass
from typing import Union

from .core.clock import to_float
from .errors import ConfigurationError

__all__ = ["Rate", "RateLike", "parse_rate"]

#: seconds in each unit a rate may be written per, under every name it is accepted by
UNITS: dict[str, float] = {
    **dict.fromkeys(("ms", "millisecond", "milliseconds"), 0.001),
    **dict.fromkeys(("s", "sec", "secs", "second", "seconds"), 1.0),
    **dict.fromkeys(("m", "min", "mins", "minute", "minutes"), 60.0),
    **dict.fromkeys(("h", "hr", "hrs", "hour", "hours"), 3600.0),
    **dict.fromkeys(("d", "day", "days"), 86400.0),
}

#: what the error for a rate that cannot be read lists
ACCEPTED = (
    "'N/UNIT' or 'N per UNIT' with a whole N >= 1, optionally 'N/K UNIT' (e.g. '10/second', "
    "'5000/hour', '100/15min'; UNIT one of ms, s, m, h, d or their names), "
    "a tuple (N, seconds or timedelta), or ratequeue.Rate(N, per=seconds)"
)

_TEXT = re.compile(
    r"(?i)^\s*(?P<count>[-+]?\d+(?:\.\d*)?)\s*(?:/|\s+per\s+)\s*(?P<size>\d+(?:\.\d+)?)?\s*(?P<unit>[a-z]+)\s*$"
)

#: microseconds per second: a rate leaves at least one between starts (half of one rounds to none)
_US = 1_000_000

#: how :meth:`Rate.__str__` names a period of exactly one unit
_NAMES = {86400.0: "day", 3600.0: "hour", 60.0: "minute", 1.0: "second"}


@dataclass(frozen=True)
class Rate:
    """``count`` starts per ``per`` seconds, spread one :attr:`interval` apart."""

    #: how many starts
    count: int
    #: per how many seconds
    per: float

    def __post_init__(self) -> None:
        count = self.count
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ConfigurationError(f"a rate's count must be a whole number >= 1, got {count!r}; {ACCEPTED}")
        per = _seconds(self.per)
        object.__setattr__(self, "per", per)
        if count > 2 * per * _US:  # (compared as is: per / count would overflow for a count of 10**400)
            raise ConfigurationError(
                f"a rate's count must leave at least a microsecond between starts: at most "
                f"{2 * per * _US:g} per {per:g} s"
            )

    @property
    def interval(self) -> float:
        """Seconds between two starts: ``per / count``."""
        return self.per / self.count

    def __str__(self) -> str:
        """The rate as it may be written: ``"5000/hour"``, ``"100/900s"``."""
        unit = _NAMES.get(self.per)
        return f"{self.count}/{unit}" if unit else f"{self.count}/{self.per:g}s"


#: what the ``rate=`` arguments accept
RateLike = Union[str, Rate, "tuple[int, float | datetime.timedelta]"]


def parse_rate(value: object) -> Rate:
    """``value`` as a :class:`Rate`; :class:`ConfigurationError` naming the accepted forms if it is none."""
    if isinstance(value, Rate):
        return value
    if isinstance(value, str):
        match = _TEXT.match(value)
        if match is None:
            raise ConfigurationError(f"cannot read rate {value!r}; write {ACCEPTED}")
        unit = UNITS.get(match["unit"].lower())
        if unit is None:
            raise ConfigurationError(
                f"unknown unit {match['unit']!r} in rate {value!r}; the units are ms, s, m, h and d "
                f"(or their names: second, minute, hour, day, ...)"
            )
        whole, _, fraction = match["count"].partition(".")
        if fraction.strip("0") or int(whole) < 1:  # (read as a whole number: a float can overflow)
            raise ConfigurationError(
                f"a rate's count must be a whole number >= 1, got {match['count']} in {value!r}"
            )
        size = float(match["size"]) if match["size"] else 1.0
        return Rate(int(whole), per=size * unit)
    if isinstance(value, tuple) and len(value) == 2:
        return Rate(value[0], per=value[1])
    raise ConfigurationError(f"rate must be {ACCEPTED}; got {type(value).__name__} {value!r}")


def _seconds(value: object) -> float:
    """A rate's period, ``value``, as seconds (it may be a ``timedelta``): finite, > 0."""
    seconds = value.total_seconds() if isinstance(value, datetime.timedelta) else value
    if isinstance(value, bool) or not isinstance(seconds, (int, float)):
        kind = type(value).__name__
        raise ConfigurationError(f"a rate's period must be seconds or a timedelta, got {kind}")
    if not 0.0 < seconds < math.inf:
        raise ConfigurationError(f"a rate's period must be a finite number of seconds > 0, got {value!r}")
    return to_float("a rate's period", seconds)
