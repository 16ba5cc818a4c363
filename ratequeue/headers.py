"""What a service's rate-limit headers say, read into one shape, and the advice they give.

:func:`parse_headers` reads the rate-limit fields providers send on a response
and returns a :class:`Feedback`: the ``Retry-After`` delay, one :class:`Quota`
per resource the fields name, and the advice the fields give by three rules
(docs/feedback.md):

- a quota whose remaining is 0 → hold until its reset (:attr:`Feedback.hold`);
- a 429 or 503 with ``Retry-After`` → hold for it (:attr:`Feedback.hold`);
- a quota lower than the limiter's → slow down to it (:attr:`Feedback.interval_floor`,
  :meth:`Feedback.slow_to`).

It is pure: no I/O, no state, no clock but the ``now`` it is given (or
``time.time()``), and it never raises on what a service sent: a value it cannot
read is left out and listed in :attr:`Feedback.ignored`, so that a header a
provider garbled cannot break the caller's request path.

The fields it reads (names are case-insensitive):

- ``Retry-After``: delay-seconds (a decimal is accepted, as Shopify sends
  ``2.0``) or an HTTP-date (RFC 9110, read with :mod:`email.utils`).
- ``X-RateLimit-Limit / -Remaining / -Reset / -Reset-After`` (GitHub, Discord
  and many others), ``X-Rate-Limit-*`` (X/Twitter) and unprefixed
  ``RateLimit-Limit / -Remaining / -Reset`` (IETF drafts up to -06): the quota
  ``"requests"``. ``-Reset-After`` (Discord, seconds from now, may have
  decimals) is preferred to ``-Reset`` when both are present.
- ``X-Shopify-Shop-Api-Call-Limit: used/limit``: the quota ``"requests"``.
- ``x-ratelimit-{limit,remaining,reset}-{resource}`` (OpenAI and other LLM
  APIs; the reset is a duration such as ``1s``, ``6m0s``, ``20ms``,
  ``1h2m3.5s``): one quota per resource (``"requests"``, ``"tokens"``).
- ``anthropic-ratelimit-{resource}-{limit,remaining,reset}`` (Anthropic; the
  reset is an RFC 3339 time): one quota per resource (``"requests"``,
  ``"tokens"``, ``"input-tokens"``, ``"output-tokens"``).
- ``RateLimit-Policy`` and ``RateLimit`` (IETF draft-ietf-httpapi-ratelimit-headers):
  the dictionary form of draft-07 (``RateLimit: limit=100, remaining=50,
  reset=5`` with ``RateLimit-Policy: 100;w=10``) and the structured lists of
  draft-08 and later (``RateLimit-Policy: "default";q=100;w=10`` with
  ``RateLimit: "default";r=50;t=30``), one quota per policy name.

**A reset value** (any of the resets above) is read, in this order, as: a
number; a duration (``1h2m3.5s``, units ``h m s ms us ns``); an RFC 3339 time;
an HTTP-date. A number is told apart by its magnitude: at least
:data:`EPOCH_MS_FROM` (1e11) is epoch milliseconds, at least
:data:`EPOCH_S_FROM` (1e9, September 2001) is epoch seconds (a decimal part
allowed, as Discord sends), anything smaller is seconds from now (no service
states a delay of 31 years, and no epoch time is below 1e9 after 2001). Times
are turned into seconds from ``now``; a reset already past is 0.
"""

from __future__ import annotations

import datetime
import email.utils
import math
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Union

from .errors import RateLimited

__all__ = [
    "Feedback",
    "HeadersLike",
    "Quota",
    "parse_headers",
    "refusal_of",
    "EPOCH_MS_FROM",
    "EPOCH_S_FROM",
    "REFUSAL_HOLD",
]

#: what :func:`parse_headers` takes: a mapping (a dict, or the header object of httpx, requests or
#: aiohttp) or an iterable of (name, value) pairs
HeadersLike = Union[Mapping[str, str], Iterable[tuple[str, str]]]

#: a reset number at least this large is epoch milliseconds (1e11 ms is March 1973)
EPOCH_MS_FROM = 1e11
#: a reset number at least this large (and below :data:`EPOCH_MS_FROM`) is epoch seconds (September 2001)
EPOCH_S_FROM = 1e9

#: the statuses whose Retry-After asks the client to hold (RFC 9110 §10.2.3, RFC 6585 §4)
HOLD_STATUSES = frozenset({429, 503})

#: seconds to hold after a 429 that names no wait (neither ``Retry-After`` nor a quota's reset)
REFUSAL_HOLD = 1.0


@dataclass(frozen=True)
class Quota:
    """One quota a service stated: how much of ``unit`` it allows, how much is left, when it resets.

    Every figure is ``None`` where the headers did not state it (or stated it unreadably).
    """

    #: the resource or policy the quota is for: ``"requests"``, ``"tokens"``, or a policy's name
    name: str
    #: what the quota counts: ``"requests"``, ``"tokens"``, or an IETF quota unit such as ``"content-bytes"``
    unit: str = "requests"
    #: how many units the quota allows in its window
    limit: int | None = None
    #: how many units are left
    remaining: int | None = None
    #: seconds from ``now`` until the quota resets (0 when the reset is past), never negative
    reset_after: float | None = None
    #: the quota's window in seconds, when a policy states it (IETF ``w``); never guessed
    window: float | None = None

    @property
    def exhausted(self) -> bool:
        """True when the service said nothing is left (remaining is 0)."""
        return self.remaining is not None and self.remaining <= 0

    @property
    def rate(self) -> float | None:
        """Units per second the quota allows over its window (limit / window), or None if either is unknown.

        None too for a limit of 0: that quota allows no pace at all, and what it asks for is a hold.
        """
        if self.limit is None or self.window is None or self.limit <= 0 or self.window <= 0:
            return None
        return self.limit / self.window


@dataclass(frozen=True)
class Feedback:
    """What one response's rate-limit headers said, and the advice that follows by the stated rules."""

    #: the HTTP status the caller passed, or None
    status: int | None = None
    #: seconds the ``Retry-After`` field asks to wait (0 when its date is past), whatever the status
    retry_after: float | None = None
    #: one quota per resource or policy the headers named, in the order first met
    quotas: tuple[Quota, ...] = ()
    #: (name, value) of each rate-limit field whose value could not be read, as received
    ignored: tuple[tuple[str, str], ...] = field(default=())

    def quota(self, name: str) -> Quota | None:
        """The quota called ``name`` (``"requests"``, ``"tokens"``, a policy name), or None."""
        for quota in self.quotas:
            if quota.name == name:
                return quota
        return None

    @property
    def hold(self) -> float | None:
        """Seconds the whole fleet should start nothing, or None when the headers ask for no hold.

        The larger of: ``Retry-After`` when the status is 429 or 503, and the reset of every quota whose
        remaining is 0 (whatever the status: GitHub answers 403 with remaining 0). Never negative. A
        quota at 0 whose reset is not stated asks for a hold of unknown length: it is not counted here.
        """
        holds: list[float] = []
        if self.retry_after is not None and self.status in HOLD_STATUSES:
            holds.append(self.retry_after)
        holds.extend(q.reset_after for q in self.quotas if q.exhausted and q.reset_after is not None)
        return max(0.0, *holds) if holds else None

    @property
    def rate(self) -> float | None:
        """Requests per second the slowest stated request quota allows (limit / window), or None.

        Only quotas counted in requests and whose window the headers state (IETF ``RateLimit-Policy``)
        give a rate: a token quota limits tokens, not starts, and a window is never guessed.
        """
        rates = [q.rate for q in self.quotas if q.unit == "requests"]
        known = [r for r in rates if r is not None]
        return min(known) if known else None

    @property
    def interval_floor(self) -> float | None:
        """The shortest interval between two starts the stated quotas allow (1 / :attr:`rate`), or None."""
        rate = self.rate
        return None if rate is None else 1.0 / rate

    def slow_to(self, interval: float) -> float | None:
        """The interval a limiter starting every ``interval`` seconds should slow to, or None if it need not.

        The rule "a quota lower than the limiter's → slow down to it": :attr:`interval_floor` when it is
        longer than ``interval``.
        """
        floor = self.interval_floor
        return floor if floor is not None and floor > interval else None


# --- reading values ---------------------------------------------------------------------------------

_NUMBER = re.compile(r"[+]?(?:\d+(?:\.\d*)?|\.\d+)")
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_DURATION_UNITS = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,
    "μs": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}
_RFC3339 = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})[Tt ](\d{2}):(\d{2}):(\d{2})(\.\d+)?\s*([Zz]|[+-]\d{2}:?\d{2})"
)


def _number(text: str) -> float | None:
    """A finite non-negative decimal number, or None."""
    text = text.strip()
    if not _NUMBER.fullmatch(text):
        return None
    value = float(text)
    return value if math.isfinite(value) else None


def _count(text: str) -> int | None:
    """A whole non-negative count (``"5"``, ``"5.0"``), or None."""
    value = _number(text)
    if value is None or not value.is_integer():
        return None
    return int(value)


def _duration(text: str) -> float | None:
    """Seconds in a Go-style duration (``6m0s``, ``20ms``, ``1h2m3.5s``), or None."""
    text = text.strip()
    if not text:
        return None
    total, at = 0.0, 0
    for match in _DURATION_PART.finditer(text):
        if match.start() != at:
            return None
        total += float(match.group(1)) * _DURATION_UNITS[match.group(2)]
        at = match.end()
    return total if at == len(text) and math.isfinite(total) else None


def _rfc3339(text: str) -> float | None:
    """Epoch seconds of an RFC 3339 time (``2025-08-21T12:40:59Z``), or None."""
    match = _RFC3339.fullmatch(text.strip())
    if not match:
        return None
    year, month, day, hour, minute, second = (int(g) for g in match.groups()[:6])
    fraction = float(match.group(7)) if match.group(7) else 0.0
    zone = match.group(8)
    offset = 0
    if zone not in ("Z", "z"):
        digits = zone[1:].replace(":", "")
        offset = (int(digits[:2]) * 60 + int(digits[2:])) * (1 if zone[0] == "+" else -1)
    try:
        moment = datetime.datetime(
            year,
            month,
            day,
            hour,
            minute,
            min(second, 59),
            tzinfo=datetime.timezone(datetime.timedelta(minutes=offset)),
        )
    except (ValueError, OverflowError):
        return None
    return moment.timestamp() + fraction + (1 if second == 60 else 0)  # a leap second is the next one


def _http_date(text: str) -> float | None:
    """Epoch seconds of an HTTP-date (``Wed, 21 Oct 2015 07:28:00 GMT``), or None."""
    try:
        moment = email.utils.parsedate_to_datetime(text.strip())
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if moment is None:  # pragma: no cover - Python < 3.10 returned None; kept for safety
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.timezone.utc)  # "-0000": UTC with no stated zone
    try:
        return moment.timestamp()
    except (ValueError, OverflowError):  # pragma: no cover - a date email.utils accepts is in range
        return None


def _retry_after(text: str, now: float) -> float | None:
    """Seconds a Retry-After value asks to wait: delay-seconds or an HTTP-date; None if unreadable."""
    seconds = _number(text)
    if seconds is not None:
        return seconds
    moment = _http_date(text)
    return None if moment is None else max(0.0, moment - now)


def _reset(text: str, now: float) -> float | None:
    """Seconds from ``now`` to a reset in any form the module's docstring lists; None if unreadable."""
    value = _number(text)
    if value is not None:
        if value >= EPOCH_MS_FROM:
            return max(0.0, value / 1000.0 - now)
        if value >= EPOCH_S_FROM:
            return max(0.0, value - now)
        return value
    seconds = _duration(text)
    if seconds is not None:
        return seconds
    moment = _rfc3339(text)
    if moment is None:
        moment = _http_date(text)
    return None if moment is None else max(0.0, moment - now)


# --- structured fields (RFC 8941), as much as the RateLimit fields use ------------------------------


def _split_members(text: str) -> list[str]:
    """The comma-separated members of a list, commas inside quoted strings kept."""
    members: list[str] = []
    current: list[str] = []
    quoted = escaped = False
    for char in text:
        if escaped:
            escaped = False
        elif char == "\\" and quoted:
            escaped = True
        elif char == '"':
            quoted = not quoted
        elif char == "," and not quoted:
            members.append("".join(current).strip())
            current = []
            continue
        current.append(char)
    members.append("".join(current).strip())
    return [m for m in members if m]


def _split_params(member: str) -> tuple[str, dict[str, str]]:
    """A list member's bare item (quotes removed) and its ``;key=value`` parameters (values unquoted)."""
    parts: list[str] = []
    current: list[str] = []
    quoted = False
    for char in member:
        if char == '"':
            quoted = not quoted
        elif char == ";" and not quoted:
            parts.append("".join(current).strip())
            current = []
            continue
        current.append(char)
    parts.append("".join(current).strip())
    params: dict[str, str] = {}
    for part in parts[1:]:
        key, _, value = part.partition("=")
        params[key.strip().lower()] = _unquote(value.strip()) if value else "?1"
    return _unquote(parts[0]), params


def _unquote(text: str) -> str:
    if len(text) >= 2 and text[0] == text[-1] == '"':
        return text[1:-1].replace('\\"', '"').replace("\\\\", "\\")
    return text


# --- the parser -------------------------------------------------------------------------------------

_SUFFIXED = re.compile(r"x-ratelimit-(limit|remaining|reset)-([a-z0-9_-]+)")
_ANTHROPIC = re.compile(r"anthropic-ratelimit-([a-z0-9_-]+?)-(limit|remaining|reset)")
_PREFIXES = ("x-ratelimit-", "x-rate-limit-", "ratelimit-")


class _Builder:
    """The quotas met so far, each field set by the first source that states it."""

    def __init__(self) -> None:
        self.quotas: dict[str, dict[str, object]] = {}

    def set(self, name: str, key: str, value: object) -> None:
        if value is None:
            return
        quota = self.quotas.setdefault(name, {"unit": _unit(name)})
        quota.setdefault(key, value)

    def build(self) -> tuple[Quota, ...]:
        quotas = []
        for name, fields in self.quotas.items():
            if set(fields) == {"unit"}:
                continue
            quotas.append(
                Quota(
                    name=name,
                    unit=str(fields["unit"]),
                    limit=_opt_int(fields.get("limit")),
                    remaining=_opt_int(fields.get("remaining")),
                    reset_after=_opt_float(fields.get("reset_after")),
                    window=_opt_float(fields.get("window")),
                )
            )
        return tuple(quotas)


def _opt_int(value: object) -> int | None:
    return value if isinstance(value, int) else None


def _opt_float(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) else None


def _unit(name: str) -> str:
    return "tokens" if "token" in name else "requests"


def _items(headers: object) -> list[tuple[str, str]]:
    """(lower-case name, value) of every field, duplicates kept; what is not text is left out."""
    multi = getattr(headers, "multi_items", None)  # httpx.Headers: items() would merge duplicates
    try:
        if callable(multi):
            pairs: Iterable[object] = multi()
        elif isinstance(headers, Mapping):
            pairs = headers.items()
        elif isinstance(headers, Iterable) and not isinstance(headers, (str, bytes)):
            pairs = headers
        else:
            return []
        out: list[tuple[str, str]] = []
        for pair in pairs:
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                continue
            name, value = (_text(part) for part in pair)
            if name is not None and value is not None:
                out.append((name.strip().lower(), value))
        return out
    except (TypeError, ValueError, AttributeError):
        return []


def _text(value: object) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, bytes):
        return value.decode("latin-1")
    return None


def parse_headers(headers: HeadersLike, *, status: int | None = None, now: float | None = None) -> Feedback:
    """Read the rate-limit fields of one response into a :class:`Feedback`; never raises on their values.

    ``headers``: a mapping (dict, or httpx/requests/aiohttp headers) or an iterable of (name, value)
    pairs; names are case-insensitive, and a field sent twice is read as one comma-joined list (RFC 9110
    §5.3). ``status``: the response's HTTP status, which :attr:`Feedback.hold` needs to honour
    ``Retry-After``. ``now``: the current wall-clock time in epoch seconds (default ``time.time()``), used
    only to turn HTTP-dates, RFC 3339 times and epoch resets into seconds from now.
    """
    when = time.time() if now is None or not isinstance(now, (int, float)) or not math.isfinite(now) else now
    fields: dict[str, list[str]] = {}
    for name, value in _items(headers):
        fields.setdefault(name, []).append(value)
    ignored: list[tuple[str, str]] = []

    def get(name: str) -> str | None:
        values = fields.get(name)
        return None if values is None else ", ".join(v.strip() for v in values)

    def read(name: str, reader: Callable[..., float | None], *args: float) -> float | None:
        value = get(name)
        if value is None:
            return None
        try:
            result = reader(value, *args)
        except (ValueError, TypeError, OverflowError, IndexError, ZeroDivisionError):
            result = None
        if result is None:
            ignored.append((name, value))
        return result

    builder = _Builder()
    retry_after = read("retry-after", _retry_after, when)

    # X-RateLimit-*, X-Rate-Limit-*, RateLimit-* (one quota, "requests"), first prefix present wins
    for prefix in _PREFIXES:
        keys = ("limit", "remaining", "reset", "reset-after")
        if not any(prefix + key in fields for key in keys):
            continue
        builder.set("requests", "limit", read(prefix + "limit", _count))
        builder.set("requests", "remaining", read(prefix + "remaining", _count))
        builder.set("requests", "reset_after", read(prefix + "reset-after", _reset, when))
        builder.set("requests", "reset_after", read(prefix + "reset", _reset, when))
        break

    # Shopify: used/limit
    shopify = get("x-shopify-shop-api-call-limit")
    if shopify is not None:
        used, slash, limit = shopify.partition("/")
        used_n, limit_n = _count(used), _count(limit)
        if slash and used_n is not None and limit_n is not None:
            builder.set("requests", "limit", limit_n)
            builder.set("requests", "remaining", max(0, limit_n - used_n))
        else:
            ignored.append(("x-shopify-shop-api-call-limit", shopify))

    # OpenAI-style x-ratelimit-{limit,remaining,reset}-{resource}; Anthropic's {resource}-{what}
    for name in fields:
        match = _SUFFIXED.fullmatch(name)
        if match and match.group(2) != "after":
            what, resource = match.groups()
        else:
            match = _ANTHROPIC.fullmatch(name)
            if not match:
                continue
            resource, what = match.groups()
        if what == "reset":
            builder.set(resource, "reset_after", read(name, _reset, when))
        else:
            builder.set(resource, what, read(name, _count))

    _ietf(get("ratelimit"), get("ratelimit-policy"), builder, ignored, when)

    return Feedback(
        status=status if isinstance(status, int) and not isinstance(status, bool) else None,
        retry_after=retry_after if isinstance(retry_after, float) else None,
        quotas=builder.build(),
        ignored=tuple(ignored),
    )


def _ietf(
    ratelimit: str | None,
    policy: str | None,
    builder: _Builder,
    ignored: list[tuple[str, str]],
    now: float,
) -> None:
    """The IETF ``RateLimit`` and ``RateLimit-Policy`` fields, draft-07 dictionary form or later lists."""
    if ratelimit is not None:
        bad = False
        members = _split_members(ratelimit)
        dictionary = bool(members) and all(
            "=" in m.split(";", 1)[0] and not m.startswith('"') for m in members
        )
        if dictionary:  # draft-07: RateLimit: limit=100, remaining=50, reset=5
            for member in members:
                key, _, value = member.split(";", 1)[0].partition("=")
                key = key.strip().lower()
                if key == "limit":
                    limit = _count(value)
                    builder.set("requests", "limit", limit)
                    bad |= limit is None
                elif key == "remaining":
                    remaining = _count(value)
                    builder.set("requests", "remaining", remaining)
                    bad |= remaining is None
                elif key == "reset":
                    reset = _number(value)  # delay-seconds: never an epoch in the drafts
                    builder.set("requests", "reset_after", reset)
                    bad |= reset is None
        else:  # draft-08 and later: RateLimit: "default";r=50;t=30
            for member in members:
                name, params = _split_params(member)
                remaining = _count(params["r"]) if "r" in params else None
                reset = _number(params["t"]) if "t" in params else None
                if not name or remaining is None or ("t" in params and reset is None):
                    bad = True
                    continue
                builder.set(name, "remaining", remaining)
                builder.set(name, "reset_after", reset)
        if bad:
            ignored.append(("ratelimit", ratelimit))
    if policy is not None:
        bad = False
        for member in _split_members(policy):
            item, params = _split_params(member)
            window = _number(params["w"]) if "w" in params else None
            if "w" in params and (window is None or window <= 0):
                bad = True
                continue
            count = _count(item)
            if count is not None:  # drafts up to -07: RateLimit-Policy: 100;w=10 (no name)
                # the policy of the RateLimit(-Limit) quota is the one whose quota is its limit; any other
                # unnamed policy is a quota of its own, named by its text ("50;w=60")
                current = builder.quotas.get("requests", {})
                fits = "window" not in current and current.get("limit", count) == count
                name = "requests" if fits else member
                builder.set(name, "limit", count)
                builder.set(name, "window", window)
                continue
            quota = _count(params["q"]) if "q" in params else None
            if not item or quota is None:
                bad = True
                continue
            builder.set(item, "limit", quota)
            builder.set(item, "window", window)
            if "qu" in params:
                builder.quotas[item]["unit"] = params["qu"]
        if bad:
            ignored.append(("ratelimit-policy", policy))


def refusal_of(exc: BaseException, *, now: float | None = None) -> float | None:
    """Seconds to hold the queue if ``exc`` says the service refused a call for its rate; else None.

    Read from a :class:`~ratequeue.errors.RateLimited`, or from the response an
    HTTP error carries: ``httpx.HTTPStatusError`` and ``requests.HTTPError``
    (``exc.response.status_code``, ``.headers``) and aiohttp's
    ``ClientResponseError`` (``exc.status``, ``exc.headers``). A 429 is a
    refusal (held for what its headers ask, or :data:`REFUSAL_HOLD` if they ask
    nothing); a 503 only when its headers ask for a wait.
    """
    if isinstance(exc, RateLimited):
        wait = exc.retry_after
        readable = isinstance(wait, (int, float)) and not isinstance(wait, bool) and 0 <= wait < math.inf
        return float(wait) if readable else REFUSAL_HOLD  # type: ignore[arg-type]
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    headers = getattr(response, "headers", None)
    if status is None:  # aiohttp: the status and headers are on the error itself
        status, headers = getattr(exc, "status", None), getattr(exc, "headers", None)
    if not isinstance(status, int) or status not in HOLD_STATUSES:
        return None
    held = parse_headers(headers or (), status=status, now=now).hold
    if held is None and status == 429:
        return REFUSAL_HOLD
    return held
