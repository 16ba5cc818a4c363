"""Checks of user input, run at the API boundary before any state is touched."""

from __future__ import annotations

import datetime
import math

from .errors import ConfigurationError
from .protocol import MAX_LEAD_US, MAX_RUNNING, US
from .rates import parse_rate

#: the longest queue name accepted, in characters
MAX_NAME_LENGTH = 200

#: the largest lead accepted, in seconds (an hour): the furthest ahead the protocol grants a start
MAX_LEAD = MAX_LEAD_US / US

#: timeouts longer than this (s, about 31.7 years) wait for ever, as ``None`` and ``math.inf`` do
FOREVER = 1e9

#: the longest single wait (s) a limiter blocks for before it looks at its deadline again: well
#: under ``threading.TIMEOUT_MAX`` everywhere (about 49 days on Windows), so that any timeout works
MAX_WAIT = 3600.0


def interval(value: object) -> float:
    """``value`` as a positive, finite number of seconds."""
    seconds = _seconds("interval", value)
    if not (0.0 < seconds < math.inf):
        raise ConfigurationError(f"interval must be a finite number of seconds > 0, got {value!r}")
    return seconds


def interval_us(seconds: float) -> int:
    """An interval in seconds as whole microseconds, at least one."""
    micros = round(seconds * 1_000_000)
    if micros < 1:
        raise ConfigurationError(f"interval must be at least one microsecond, got {seconds!r} s")
    if micros >= 2**52:
        raise ConfigurationError(f"interval must be under about 142 years, got {seconds!r} s")
    return micros


def limiter(name_: object, interval_: object, lead_: object) -> tuple[str, float, int, float | None]:
    """A limiter's settings, checked: name, interval (s), interval (us) and lead (s or ``None``)."""
    seconds = interval(interval_)
    return name(name_), seconds, interval_us(seconds), lead(lead_)


def pace(interval_: object, rate_: object) -> float:
    """The interval (s) given as ``interval=`` or as ``rate=`` (exactly one of them)."""
    if rate_ is None:
        if interval_ is None:
            raise ConfigurationError("give interval= (seconds between starts) or rate= (such as '10/second')")
        return interval(interval_)
    if interval_ is not None:
        raise ConfigurationError(
            f"give interval= or rate=, not both (interval={interval_!r}, rate={rate_!r})"
        )
    return parse_rate(rate_).interval


def burst(value: object) -> int:
    """``value`` as a burst: a whole number >= 1."""
    return positive_int("burst", value)


def cost(value: object, burst_: int) -> int:
    """``value`` as the cost of one acquire: a whole number from 1 to the burst."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= burst_:
        more = "; a cost above 1 needs burst= at least as large" if burst_ == 1 else ""
        raise ConfigurationError(
            f"cost must be a whole number from 1 to the burst ({burst_}), got {value!r}{more}"
        )
    return value


def keep(value: object) -> float | None:
    """``value`` as ``None`` (keep a queue's record for ever) or a finite number of seconds >= 0."""
    if value is None:
        return None
    seconds = _seconds("keep", value)
    if not (0.0 <= seconds < 2**52 / US):
        raise ConfigurationError(
            f"keep must be None or a number of seconds >= 0 (under 142 years), got {value!r}"
        )
    return seconds


def max_running(value: object) -> int | None:
    """``value`` as ``None`` (no cap on running jobs) or a whole number from 1 to ``MAX_RUNNING``."""
    if value is None:
        return None
    if not (isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_RUNNING):
        raise ConfigurationError(
            f"max_running must be None (no cap) or a whole number from 1 to {MAX_RUNNING}, got {value!r}"
        )
    return value


def lease(value: object) -> float:
    """``value`` as a lease length: a number of seconds from 0.01 to a day."""
    seconds = _seconds("lease", value)
    if not (0.01 <= seconds <= 86_400):
        raise ConfigurationError(f"lease must be a number of seconds from 0.01 to 86400 (a day), got {value}")
    return seconds


def timeout(value: object) -> float | None:
    """``value`` as ``None`` (wait for ever) or a number of seconds >= 0.

    ``math.inf``, and any timeout over :data:`FOREVER`, also wait for ever: ``None``.
    """
    if value is None:
        return None
    seconds = _seconds("timeout", value)
    if math.isnan(seconds) or seconds < 0:
        raise ConfigurationError(f"timeout must be None or a number of seconds >= 0, got {value!r}")
    return None if seconds > FOREVER else seconds


def wait(seconds: float | None) -> float | None:
    """A wait of ``seconds`` (``None``: until woken) cut to :data:`MAX_WAIT`; the waiter then looks again."""
    return None if seconds is None else min(seconds, MAX_WAIT)


def lead(value: object) -> float | None:
    """``value`` as ``None`` (adaptive) or a number of seconds from 0 to :data:`MAX_LEAD` (an hour)."""
    if value is None:
        return None
    seconds = _seconds("lead", value)
    if not (0.0 <= seconds <= MAX_LEAD):
        raise ConfigurationError(
            f"lead must be None or a number of seconds from 0 to {MAX_LEAD:g} (an hour), got {value!r}"
        )
    return seconds


def max_late(value: object) -> float | None:
    """``value`` as ``None`` (no lateness check) or a finite number of seconds >= 0."""
    if value is None:
        return None
    seconds = _seconds("max_late", value)
    if not (0.0 <= seconds < math.inf):
        raise ConfigurationError(f"max_late must be None or a finite number of seconds >= 0, got {value!r}")
    return seconds


def checked_lateness(max_late: float | None, clock_resolution: float) -> float | None:
    """The ``max_late`` a shard checks: none when the state's clock is coarser than it."""
    return None if max_late is None or clock_resolution > max_late else max_late


def name(value: object) -> str:
    """``value`` as a queue name: a non-empty string of printable characters."""
    if not isinstance(value, str):
        raise ConfigurationError(f"name must be a string, got {type(value).__name__}")
    if not value:
        raise ConfigurationError("name must not be empty")
    if len(value) > MAX_NAME_LENGTH:
        raise ConfigurationError(f"name must be at most {MAX_NAME_LENGTH} characters, got {len(value)}")
    if not value.isprintable():
        raise ConfigurationError(f"name must hold printable characters only, got {value!r}")
    return value


def prefix(value: object) -> str:
    """``value`` as the beginning of queue names: a string, possibly empty, of printable characters."""
    if value == "":
        return ""
    if not isinstance(value, str):
        raise ConfigurationError(f"prefix must be a string, got {type(value).__name__}")
    return name(value)


def positive_int(what: str, value: object) -> int:
    """``value`` as an integer >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"{what} must be an integer >= 1, got {value!r}")
    return value


def _seconds(what: str, value: object) -> float:
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigurationError(
            f"{what} must be a number of seconds or a timedelta, got {type(value).__name__}"
        )
    return float(value)
