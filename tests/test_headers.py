"""ratequeue.headers: real header sets from providers' documentation, the advice they give, and garbage.

Every row of :data:`DOCUMENTED` is a header set as a provider's (or the IETF draft's) documentation
shows it, with the page it was copied from in the comment above it; ``now`` is fixed (to the example's
own ``Date`` where it has one) so that its epoch resets and HTTP-dates read the same on every run.
"""

from __future__ import annotations

import email.utils
import math
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ratequeue.headers import Feedback, Quota, parse_headers


def http_date(text: str) -> float:
    """Epoch seconds of an HTTP-date, to use an example's own Date header as ``now``."""
    return email.utils.parsedate_to_datetime(text).timestamp()


@dataclass(frozen=True)
class Row:
    """One documented header set, and what the parser must read from it."""

    headers: dict[str, str]
    now: float
    quotas: tuple[Quota, ...]
    status: int | None = None
    retry_after: float | None = None
    hold: float | None = None
    rate: float | None = None


DOCUMENTED: dict[str, Row] = {
    # GitHub REST API. docs.github.com "Rate limits for the REST API" (github/docs,
    # content/rest/using-the-rest-api/rate-limits-for-the-rest-api.md) lists x-ratelimit-limit,
    # -remaining, -used, -reset ("in UTC epoch seconds") and -resource but shows no example values; this
    # set is the example of the former developer.github.com/v3 "Rate limiting" section
    # (`curl -I https://api.github.com/users/octocat`), as quoted verbatim in many public READMEs.
    "github": Row(
        headers={
            "Date": "Mon, 01 Jul 2013 17:27:06 GMT",
            "X-RateLimit-Limit": "60",
            "X-RateLimit-Remaining": "56",
            "X-RateLimit-Reset": "1372700873",
        },
        now=http_date("Mon, 01 Jul 2013 17:27:06 GMT"),
        quotas=(Quota("requests", limit=60, remaining=56, reset_after=1247.0),),
    ),
    # GitHub, the same former v3 page: the response once the limit is exceeded (403, remaining 0).
    # The current page says: "you will receive a 403 or 429 response, and the x-ratelimit-remaining
    # header will be 0. You should not retry your request until after the time specified by the
    # x-ratelimit-reset header."
    "github-exceeded": Row(
        headers={
            "Date": "Tue, 20 Aug 2013 14:50:41 GMT",
            "X-RateLimit-Limit": "60",
            "X-RateLimit-Remaining": "0",
            "X-RateLimit-Reset": "1377013266",
        },
        status=403,
        now=http_date("Tue, 20 Aug 2013 14:50:41 GMT"),
        quotas=(Quota("requests", limit=60, remaining=0, reset_after=1377013266 - 1377010241),),
        hold=3025.0,
    ),
    # Discord. discord/discord-api-docs docs/topics/rate-limits.md, "Rate Limit Header Examples"
    # (docs.discord.com/developers/topics/rate-limits). Reset-After is preferred to Reset.
    "discord": Row(
        headers={
            "X-RateLimit-Limit": "5",
            "X-RateLimit-Remaining": "0",
            "X-RateLimit-Reset": "1470173023",
            "X-RateLimit-Reset-After": "1",
            "X-RateLimit-Bucket": "abcd1234",
        },
        now=1470173022.0,
        quotas=(Quota("requests", limit=5, remaining=0, reset_after=1.0),),
        hold=1.0,
    ),
    # Discord, same page, "Example Exceeded User Rate Limit Response" (429).
    "discord-429-user": Row(
        headers={
            "Content-Type": "application/json",
            "Retry-After": "65",
            "X-RateLimit-Limit": "10",
            "X-RateLimit-Remaining": "0",
            "X-RateLimit-Reset": "1470173023.123",
            "X-RateLimit-Reset-After": "64.57",
            "X-RateLimit-Bucket": "abcd1234",
            "X-RateLimit-Scope": "user",
        },
        status=429,
        now=1470172958.553,
        quotas=(Quota("requests", limit=10, remaining=0, reset_after=64.57),),
        retry_after=65.0,
        hold=65.0,
    ),
    # Discord, same page, "Example Exceeded Resource Rate Limit Response" (429, scope shared).
    "discord-429-shared": Row(
        headers={
            "Content-Type": "application/json",
            "Retry-After": "1337",
            "X-RateLimit-Limit": "10",
            "X-RateLimit-Remaining": "9",
            "X-RateLimit-Reset": "1470173023.123",
            "X-RateLimit-Reset-After": "64.57",
            "X-RateLimit-Bucket": "abcd1234",
            "X-RateLimit-Scope": "shared",
        },
        status=429,
        now=1470172958.553,
        quotas=(Quota("requests", limit=10, remaining=9, reset_after=64.57),),
        retry_after=1337.0,
        hold=1337.0,
    ),
    # Discord, same page, "Example Exceeded Global Rate Limit Response" (429, no per-route fields).
    "discord-429-global": Row(
        headers={
            "Content-Type": "application/json",
            "Retry-After": "65",
            "X-RateLimit-Global": "true",
            "X-RateLimit-Scope": "global",
        },
        status=429,
        now=1470172958.0,
        quotas=(),
        retry_after=65.0,
        hold=65.0,
    ),
    # X (Twitter) API v2. docs.x.com/fundamentals/rate-limits (and /x-api/fundamentals/rate-limits),
    # "Checking your limits": x-rate-limit-reset is a "Unix timestamp when the limit resets".
    "x": Row(
        headers={
            "x-rate-limit-limit": "900",
            "x-rate-limit-remaining": "847",
            "x-rate-limit-reset": "1705420800",
        },
        now=1705420800.0 - 600,
        quotas=(Quota("requests", limit=900, remaining=847, reset_after=600.0),),
    ),
    # Shopify REST Admin API. shopify.dev/docs/api/admin-rest/usage/rate-limits: the
    # X-Shopify-Shop-Api-Call-Limit header counts used/limit (example 32/40). The values were read from
    # a copy of that page's example (the stored copy of the page itself was cut before the example).
    "shopify": Row(
        headers={"X-Shopify-Shop-Api-Call-Limit": "32/40"},
        now=0.0,
        quotas=(Quota("requests", limit=40, remaining=8),),
    ),
    # Shopify, same page: a 429 carries Retry-After in seconds, with a decimal ("Retry-After: 2.0").
    "shopify-429": Row(
        headers={"X-Shopify-Shop-Api-Call-Limit": "40/40", "Retry-After": "2.0"},
        status=429,
        now=0.0,
        quotas=(Quota("requests", limit=40, remaining=0),),
        retry_after=2.0,
        hold=2.0,
    ),
    # OpenAI. platform.openai.com/docs/guides/rate-limits, "Rate limits in headers": the "Sample Value"
    # column of the header table (read from a stored copy of the page's source, guides/rate-limits.md).
    "openai": Row(
        headers={
            "x-ratelimit-limit-requests": "60",
            "x-ratelimit-limit-tokens": "150000",
            "x-ratelimit-remaining-requests": "59",
            "x-ratelimit-remaining-tokens": "149984",
            "x-ratelimit-reset-requests": "1s",
            "x-ratelimit-reset-tokens": "6m0s",
        },
        now=0.0,
        quotas=(
            Quota("requests", limit=60, remaining=59, reset_after=1.0),
            Quota("tokens", unit="tokens", limit=150000, remaining=149984, reset_after=360.0),
        ),
    ),
    # Anthropic. docs.anthropic.com/en/api/rate-limits, "Response headers", documents the names
    # anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-{limit,remaining,reset}, the
    # resets "in RFC 3339 format", and retry-after on a 429 — as a table, WITHOUT example values. NOT
    # COPIED: this set is written in the documented format, with made-up values.
    "anthropic-format": Row(
        headers={
            "retry-after": "60",
            "anthropic-ratelimit-requests-limit": "50",
            "anthropic-ratelimit-requests-remaining": "0",
            "anthropic-ratelimit-requests-reset": "2025-01-01T00:01:00Z",
            "anthropic-ratelimit-tokens-limit": "48000",
            "anthropic-ratelimit-tokens-remaining": "46000",
            "anthropic-ratelimit-tokens-reset": "2025-01-01T00:00:02Z",
            "anthropic-ratelimit-input-tokens-limit": "40000",
            "anthropic-ratelimit-input-tokens-remaining": "39000",
            "anthropic-ratelimit-input-tokens-reset": "2025-01-01T00:00:02Z",
            "anthropic-ratelimit-output-tokens-limit": "8000",
            "anthropic-ratelimit-output-tokens-remaining": "7000",
            "anthropic-ratelimit-output-tokens-reset": "2025-01-01T00:00:08.5+00:00",
        },
        status=429,
        now=http_date("Wed, 01 Jan 2025 00:00:00 GMT"),
        quotas=(
            Quota("requests", limit=50, remaining=0, reset_after=60.0),
            Quota("tokens", unit="tokens", limit=48000, remaining=46000, reset_after=2.0),
            Quota("input-tokens", unit="tokens", limit=40000, remaining=39000, reset_after=2.0),
            Quota("output-tokens", unit="tokens", limit=8000, remaining=7000, reset_after=8.5),
        ),
        retry_after=60.0,
        hold=60.0,
    ),
    # IETF draft-ietf-httpapi-ratelimit-headers-06 (ietf-wg-httpapi/ratelimit-headers, tag -06),
    # "Security Considerations": separate RateLimit-Limit/-Remaining/-Reset fields and a policy.
    "ietf-06": Row(
        headers={
            "RateLimit-Limit": "10000",
            "RateLimit-Policy": "10000;w=1000",
            "RateLimit-Remaining": "10000",
            "RateLimit-Reset": "10",
        },
        now=0.0,
        quotas=(Quota("requests", limit=10000, remaining=10000, reset_after=10.0, window=1000.0),),
        rate=10.0,
    ),
    # draft-06, "RateLimit-Policy": several policies at once; the slowest (5000 a day) sets the pace.
    "ietf-06-policies": Row(
        headers={"RateLimit-Policy": "10;w=1, 50;w=60, 1000;w=3600, 5000;w=86400"},
        now=0.0,
        quotas=(
            Quota("requests", limit=10, window=1.0),
            Quota("50;w=60", limit=50, window=60.0),
            Quota("1000;w=3600", limit=1000, window=3600.0),
            Quota("5000;w=86400", limit=5000, window=86400.0),
        ),
        rate=5000 / 86400,
    ),
    # draft-ietf-httpapi-ratelimit-headers-07, "RateLimit-Policy" example: the dictionary form.
    "ietf-07": Row(
        headers={"RateLimit-Policy": "100;w=10", "RateLimit": "limit=100, remaining=50, reset=5"},
        now=0.0,
        quotas=(Quota("requests", limit=100, remaining=50, reset_after=5.0, window=10.0),),
        rate=10.0,
    ),
    # draft-07, "Service limit": a 301 with remaining 0; the draft says a client could wait 10 s.
    "ietf-07-redirect": Row(
        headers={"Location": "/foo/123", "RateLimit": "limit=10, remaining=0, reset=10"},
        status=301,
        now=0.0,
        quotas=(Quota("requests", limit=10, remaining=0, reset_after=10.0),),
        hold=10.0,
    ),
    # draft-07, "Throttling with a Retry-After" example: a 429 whose Retry-After is an HTTP-date.
    "ietf-07-429": Row(
        headers={
            "Content-Type": "application/json",
            "Date": "Mon, 05 Aug 2019 09:27:00 GMT",
            "Retry-After": "Mon, 05 Aug 2019 09:27:05 GMT",
            "RateLimit": "limit=100, remaining=0, reset=5",
        },
        status=429,
        now=http_date("Mon, 05 Aug 2019 09:27:00 GMT"),
        quotas=(Quota("requests", limit=100, remaining=0, reset_after=5.0),),
        retry_after=5.0,
        hold=5.0,
    ),
    # draft-07, "Dynamic limits for pushing back and slowing down": wait 20 s, then 15 per 20 s.
    "ietf-07-pushback": Row(
        headers={"RateLimit": "limit=0, remaining=0, reset=20", "RateLimit-Policy": "15;w=20"},
        status=429,
        now=0.0,
        quotas=(
            Quota("requests", limit=0, remaining=0, reset_after=20.0),
            Quota("15;w=20", limit=15, window=20.0),
        ),
        hold=20.0,
        rate=0.75,
    ),
    # draft-ietf-httpapi-ratelimit-headers-10 (the same example is in -08 and -09), "Throttling
    # window specified via parameter": structured fields, a named policy.
    "ietf-10": Row(
        headers={
            "Content-Type": "application/json",
            "RateLimit": '"fixedwindow";r=99;t=50',
            "RateLimit-Policy": '"fixedwindow";q=100;w=60',
        },
        status=200,
        now=0.0,
        quotas=(Quota("fixedwindow", limit=100, remaining=99, reset_after=50.0, window=60.0),),
        rate=100 / 60,
    ),
    # draft-10, "Dynamic limits for pushing back and slowing down".
    "ietf-10-pushback": Row(
        headers={"RateLimit-Policy": '"dynamic";q=15;w=20', "RateLimit": '"dynamic";r=0;t=20'},
        status=429,
        now=0.0,
        quotas=(Quota("dynamic", limit=15, remaining=0, reset_after=20.0, window=20.0),),
        hold=20.0,
        rate=0.75,
    ),
    # draft-10, "Throttling with a Retry-After" (a 429 with an HTTP-date Retry-After and a Date).
    "ietf-10-429": Row(
        headers={
            "Content-Type": "application/problem+json",
            "Date": "Mon, 05 Aug 2019 09:27:00 GMT",
            "Retry-After": "Mon, 05 Aug 2019 09:27:05 GMT",
            "RateLimit": '"default";r=0;t=5',
        },
        status=429,
        now=http_date("Mon, 05 Aug 2019 09:27:00 GMT"),
        quotas=(Quota("default", remaining=0, reset_after=5.0),),
        retry_after=5.0,
        hold=5.0,
    ),
    # draft-10, "RateLimit Policy Field Examples": two policies; the hourly one is the slower.
    "ietf-10-policies": Row(
        headers={"RateLimit-Policy": '"permin";q=50;w=60,"perhr";q=1000;w=3600'},
        now=0.0,
        quotas=(Quota("permin", limit=50, window=60.0), Quota("perhr", limit=1000, window=3600.0)),
        rate=1000 / 3600,
    ),
    # draft-10, same section: a partition key and a quota unit; bytes give no pace of starts.
    "ietf-10-bytes": Row(
        headers={"RateLimit-Policy": '"peruser";q=65535;qu="content-bytes";w=10;pk=:sdfjLJUOUH==:'},
        now=0.0,
        quotas=(Quota("peruser", unit="content-bytes", limit=65535, window=10.0),),
    ),
}


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_documented_header_sets(name: str) -> None:
    """Each documented set reads as its provider documents it, and gives the advice the rules give."""
    row = DOCUMENTED[name]
    feedback = parse_headers(row.headers, status=row.status, now=row.now)
    assert feedback.ignored == ()
    assert feedback.status == row.status
    assert _same(feedback.quotas, row.quotas)
    assert feedback.retry_after == _approx(row.retry_after)
    assert feedback.hold == _approx(row.hold)
    assert feedback.rate == _approx(row.rate)
    assert feedback.interval_floor == _approx(None if row.rate is None else 1 / row.rate)


def _approx(value: float | None) -> Any:
    return None if value is None else pytest.approx(value, abs=1e-6)


def _same(got: tuple[Quota, ...], want: tuple[Quota, ...]) -> bool:
    """Equal quotas, reset_after and window compared to the microsecond."""
    assert [q.name for q in got] == [q.name for q in want]
    for g, w in zip(got, want, strict=True):
        assert (g.unit, g.limit, g.remaining) == (w.unit, w.limit, w.remaining), g.name
        assert g.reset_after == _approx(w.reset_after), g.name
        assert g.window == _approx(w.window), g.name
    return True


def test_headers_as_pairs_case_insensitive_and_split_fields() -> None:
    """Pairs, any case; a structured field split over two lines is one list (RFC 9110 §5.3)."""
    feedback = parse_headers(
        [
            ("ratelimit-policy", '"permin";q=50;w=60'),
            ("RATELIMIT-POLICY", '"perhr";q=1000;w=3600'),
            ("RateLimit", '"permin";r=0;t=12'),
        ],
        status=200,
    )
    assert [q.name for q in feedback.quotas] == ["permin", "perhr"]
    assert feedback.quota("permin") == Quota("permin", limit=50, remaining=0, reset_after=12.0, window=60.0)
    assert feedback.hold == 12.0
    assert feedback.quota("missing") is None


def test_multi_items_are_read_one_by_one() -> None:
    """A header object with ``multi_items`` (httpx.Headers) is read field by field."""

    class Headers(dict[str, str]):
        def multi_items(self) -> list[tuple[str, str]]:
            return [("RateLimit-Policy", '"a";q=10;w=1'), ("RateLimit-Policy", '"b";q=60;w=60')]

    assert parse_headers(Headers()).rate == 1.0


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("1s", 1.0),
        ("6m0s", 360.0),
        ("20ms", 0.02),
        ("1h2m3.5s", 3723.5),
        ("0s", 0.0),
        ("4m12.172s", 252.172),
        ("30", 30.0),  # seconds from now
        ("2.5", 2.5),
    ],
)
def test_reset_durations_and_deltas(value: str, seconds: float) -> None:
    """LLM-style durations and plain seconds-from-now resets."""
    feedback = parse_headers({"x-ratelimit-reset-requests": value, "x-ratelimit-remaining-requests": "0"})
    assert feedback.hold == pytest.approx(seconds)


NOW = 1_700_000_000.0


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (str(int(NOW) + 42), 42.0),  # epoch seconds (GitHub, X)
        (f"{NOW + 4.25:.3f}", 4.25),  # epoch seconds with decimals (Discord)
        (str(int(NOW * 1000) + 1500), 1.5),  # epoch milliseconds
        (str(int(NOW) - 100), 0.0),  # a reset already past
        ("Tue, 14 Nov 2023 22:14:20 GMT", 60.0),  # an HTTP-date (NOW is 22:13:20 GMT)
        ("2023-11-14T22:14:20Z", 60.0),  # RFC 3339
        ("2023-11-14T23:14:20.5+01:00", 60.5),  # RFC 3339 with an offset and a fraction
    ],
)
def test_reset_epochs_and_dates(value: str, seconds: float) -> None:
    """Epoch seconds, epoch milliseconds and dates, told apart by form and magnitude, against a fixed now."""
    feedback = parse_headers({"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": value}, now=NOW)
    assert feedback.quotas[0].reset_after == pytest.approx(seconds)
    assert feedback.hold == pytest.approx(seconds)


def test_retry_after_http_date_and_status() -> None:
    """Retry-After as an HTTP-date; it asks for a hold on 429 and 503 only."""
    headers = {"Retry-After": "Tue, 14 Nov 2023 22:15:20 GMT"}  # two minutes after NOW
    assert parse_headers(headers, status=503, now=NOW).hold == pytest.approx(120.0)
    assert parse_headers(headers, status=429, now=NOW).retry_after == pytest.approx(120.0)
    ok = parse_headers(headers, status=200, now=NOW)
    assert ok.retry_after == pytest.approx(120.0)
    assert ok.hold is None
    assert parse_headers(headers, status=429, now=NOW + 3600).hold == 0.0  # a date already past
    assert parse_headers({}, status=429).hold is None  # nothing said: no hold (the caller backs off)


def test_slow_to() -> None:
    """A quota lower than the limiter's: slow down to it; a faster one changes nothing."""
    feedback = parse_headers({"RateLimit-Policy": '"default";q=100;w=10'})
    assert feedback.interval_floor == pytest.approx(0.1)
    assert feedback.slow_to(0.05) == pytest.approx(0.1)
    assert feedback.slow_to(0.5) is None
    assert parse_headers({}).slow_to(0.05) is None


def test_token_quotas_give_no_pace() -> None:
    """A token quota limits tokens, not starts: no rate, but a hold when it is spent."""
    feedback = parse_headers(
        {"RateLimit-Policy": '"tpm";q=1000;qu="tokens";w=60', "RateLimit": '"tpm";r=0;t=7'}
    )
    assert feedback.quotas[0].unit == "tokens"
    assert feedback.rate is None
    assert feedback.hold == 7.0


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("X-RateLimit-Remaining", "lots"),
        ("X-RateLimit-Limit", "-1"),  # Azure OpenAI has been seen sending -1
        ("X-RateLimit-Reset", "soon"),
        ("Retry-After", "in a while"),
        ("Retry-After", "-5"),
        ("Retry-After", "Mon, 99 Foo 2019 99:99:99 GMT"),
        ("x-ratelimit-reset-tokens", "6m0x"),
        ("anthropic-ratelimit-requests-reset", "2025-13-45T99:00:00Z"),
        ("X-Shopify-Shop-Api-Call-Limit", "40"),
        ("RateLimit", '"default";r=lots;t=5'),
        ("RateLimit", "limit=ten, remaining=0, reset=5"),
        ("RateLimit-Policy", '"default";w=60'),
        ("RateLimit-Policy", '"default";q=10;w=0'),
        ("X-RateLimit-Remaining", "1e999"),
        ("X-RateLimit-Remaining", "9" * 5000),
    ],
)
def test_malformed_values_are_ignored_and_listed(name: str, value: str) -> None:
    """A value that cannot be read is left out and listed in ``ignored``: the parser does not raise."""
    feedback = parse_headers({name: value, "X-Unrelated": "whatever"}, status=429, now=NOW)
    assert feedback.ignored == ((name.lower(), value),)
    assert feedback.hold is None or feedback.hold >= 0


def test_one_bad_field_spoils_nothing_else() -> None:
    """Readable fields beside an unreadable one are still read."""
    feedback = parse_headers(
        {"X-RateLimit-Limit": "60", "X-RateLimit-Remaining": "0", "X-RateLimit-Reset": "garbage"}, now=NOW
    )
    assert feedback.quotas == (Quota("requests", limit=60, remaining=0),)
    assert feedback.hold is None  # spent, but when it comes back was not said
    assert feedback.ignored == (("x-ratelimit-reset", "garbage"),)


def test_not_headers_at_all() -> None:
    """Whatever is passed, the answer is a Feedback, empty when nothing could be read."""
    for junk in (None, 42, "Retry-After: 5", b"raw", [("only-one",)], [(1, 2)], {1: 2}):
        assert parse_headers(junk) == Feedback()  # type: ignore[arg-type]
    assert parse_headers([(b"Retry-After", b"5")], status=429).hold == 5.0


_NAMES = [
    "retry-after",
    "x-ratelimit-limit",
    "x-ratelimit-remaining",
    "x-ratelimit-reset",
    "x-ratelimit-reset-after",
    "x-rate-limit-reset",
    "ratelimit-reset",
    "ratelimit",
    "ratelimit-policy",
    "x-shopify-shop-api-call-limit",
    "x-ratelimit-reset-tokens",
    "x-ratelimit-remaining-requests",
    "anthropic-ratelimit-tokens-reset",
    "anthropic-ratelimit-requests-remaining",
]
_VALUE_BITS = st.sampled_from(
    ['"', ";", ",", "=", "/", ":", "-", ".", "e", "q", "r", "t", "w", "s", "ms", "h", "Z", "T", " ", "0", "9"]
)
_values = st.one_of(
    st.text(),
    st.lists(st.one_of(_VALUE_BITS, st.integers(-(10**20), 10**20).map(str)), max_size=12).map("".join),
    st.floats(allow_nan=True, allow_infinity=True).map(str),
    st.datetimes().map(lambda d: email.utils.format_datetime(d)),
    st.datetimes().map(lambda d: d.isoformat() + "Z"),
)


@given(
    headers=st.lists(st.tuples(st.one_of(st.sampled_from(_NAMES), st.text()), _values), max_size=8),
    status=st.one_of(st.none(), st.integers(100, 599), st.sampled_from([429, 503])),
    now=st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True), st.floats(0, 4e9)),
)
def test_never_raises_and_never_holds_negative(
    headers: list[tuple[str, str]], status: int | None, now: float | None
) -> None:
    """Whatever the names and values, the parser answers, and no hold or reset is negative."""
    feedback = parse_headers(headers, status=status, now=now)
    assert feedback.hold is None or (feedback.hold >= 0 and not math.isnan(feedback.hold))
    assert feedback.retry_after is None or feedback.retry_after >= 0
    for quota in feedback.quotas:
        assert quota.reset_after is None or quota.reset_after >= 0
        assert quota.limit is None or quota.limit >= 0
        assert quota.remaining is None or quota.remaining >= 0
    assert feedback.rate is None or feedback.rate > 0
    assert all(isinstance(name, str) and isinstance(value, str) for name, value in feedback.ignored)
