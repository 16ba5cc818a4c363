"""Secrets out of every message: the one place that hides a URL's passwords.

:func:`redact` is what every ``repr``, CLI line and exception shows of a
state URL; :func:`scrub` takes a URL's secrets out of any other text (a
driver's message, an error raised by code that echoed the URL). Neither
ever raises, whatever the URL: a malformed one (a port that is not a number,
an unclosed ``[``, an unknown scheme) is where a password is most often
echoed back.

What counts as a secret:

* the password of the user information, ``scheme://user:PASSWORD@host``
  (the user name stays: it says who connects). The user information runs to
  the last ``@`` before the query, so a password holding an unescaped ``@``
  or ``/`` is hidden whole;
* the value of every query option whose name holds ``password``, ``passwd``,
  ``pwd``, ``secret``, ``token``, ``credential`` or ``apikey`` (in any case,
  ``_`` and ``-`` ignored): ``?password=``, Redis' ``ssl_password`` and
  ``ssl_keyfile_password``, MongoDB's ``tlsCertificateKeyFilePassword`` and
  ``sslKeyPassword``...;
* in MongoDB's ``authMechanismProperties``, the value of every property whose
  name is such a word (``AWS_SESSION_TOKEN:...``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import unquote, unquote_plus

from .errors import RateQueueError

__all__ = ["MASK", "chained", "redact", "scrub", "scrub_error", "secrets", "secrets_kept_out"]

#: what a secret is replaced with
MASK = "***"

#: words that make an option (or a MongoDB auth property) a secret, matched in its lowercased name
#: with ``_`` and ``-`` removed
SECRET_WORDS = ("password", "passwd", "pwd", "secret", "token", "credential", "apikey")

#: the option whose value is a list of ``NAME:value`` properties, some of them secret
_PROPERTIES = "authmechanismproperties"

#: ``scheme://`` (or nothing: a string without one may still hold ``user:password@host``)
_HEAD = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")


def redact(url: str) -> str:
    """``url`` with every secret (see the module) replaced by ``***``, for messages and ``repr``."""
    before, password, after, query = _parts(url)
    if query:
        query = "?" + "&".join(_option(option)[0] for option in query[1:].split("&"))
    return before + ("" if password is None else MASK) + after + query


def secrets(url: str) -> list[str]:
    """The secrets :func:`redact` hides in ``url``, as written and percent-decoded, longest first."""
    _, password, _, query = _parts(url)
    found = [] if password is None else [password]
    for option in query[1:].split("&"):
        found += _option(option)[1]
    decoded = [variant for value in found for variant in (value, unquote(value), unquote_plus(value))]
    return sorted({value for value in decoded if value}, key=len, reverse=True)


def scrub(text: str, url: object) -> str:
    """``text`` with every secret of ``url`` (if it is a string) replaced by ``***``.

    For messages ratequeue did not write (a driver's) or wrote from parts of
    the URL: whatever shape the secret took there, as written or decoded.
    """
    if not isinstance(url, str):
        return text
    text = text.replace(url, redact(url))
    for secret in secrets(url):
        text = text.replace(secret, MASK)
    return text


def _parts(url: str) -> tuple[str, str | None, str, str]:
    """``url`` cut around its password: what comes before it, the password (``None`` without one),
    the rest up to the query, and the query (from its ``?``; a ``#`` is taken as text)."""
    start = head.end() if (head := _HEAD.match(url)) else 0
    query_at = (url + "?").find("?", start)  # no "?": the end
    user_end = url.rfind("@", start, query_at)
    colon = url.find(":", start, user_end)
    if user_end < 0 or colon < 0:
        return url[:query_at], None, "", url[query_at:]
    return url[: colon + 1], url[colon + 1 : user_end], url[user_end:query_at], url[query_at:]


def _option(option: str) -> tuple[str, list[str]]:
    """A query option with its secrets replaced by ``***``, and those secrets."""
    key, equals, value = option.partition("=")
    if equals and _is_secret(key):
        return f"{key}={MASK}", [value]
    if not equals or _normal(key) != _PROPERTIES:
        return option, []
    shown, found = [], []
    for prop in unquote_plus(value).split(","):
        name, colon, secret = prop.partition(":")
        if colon and _is_secret(name):
            found.append(secret)
            prop = f"{name}:{MASK}"
        shown.append(prop)
    return f"{key}=" + ",".join(shown), found


def _normal(key: str) -> str:
    return unquote_plus(key).lower().replace("_", "").replace("-", "")


def _is_secret(key: str) -> bool:
    return any(word in _normal(key) for word in SECRET_WORDS)


def scrub_error(error: BaseException, url: object) -> None:
    """Take ``url``'s secrets out of ``error``'s message and ``where``, and of the errors chained to it.

    For errors raised while opening a state from ``url``, by code that may
    have echoed it (or a driver's message quoting part of it): a traceback
    shows the chained errors too.
    """
    for current in chained(error):
        current.args = tuple(scrub(arg, url) if isinstance(arg, str) else arg for arg in current.args)
        where = getattr(current, "where", None)
        if isinstance(where, str):
            current.where = scrub(where, url)  # type: ignore[attr-defined]


def chained(error: BaseException) -> Iterator[BaseException]:
    """``error`` and the errors it came from (its ``__cause__``, else its ``__context__``), each once."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


@contextmanager
def secrets_kept_out(url: object) -> Iterator[None]:
    """Take ``url``'s secrets out of any ratequeue error raised inside (:func:`scrub_error`).

    Around the opening of a state from ``url``: every backend redacts the URL
    it quotes; this also covers the parts of it a driver's message quotes,
    chained errors, and any backend quoting the URL whole.
    """
    try:
        yield
    except RateQueueError as exc:
        scrub_error(exc, url)
        raise
