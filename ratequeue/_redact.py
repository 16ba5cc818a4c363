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

__all__ = ["MASK", "redact", "scrub", "scrub_error", "secrets", "secrets_kept_out"]

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
    head = _HEAD.match(url)
    start = head.end() if head else 0
    query_at = _query_start(url, start)
    authority, rest = url[start:query_at], url[query_at:]
    user_end = authority.rfind("@")
    if user_end >= 0:
        user, colon, _ = authority[:user_end].partition(":")
        if colon:
            authority = f"{user}:{MASK}{authority[user_end:]}"
    if rest:
        rest = "?" + "&".join(_redact_option(option) for option in rest[1:].split("&"))
    return url[:start] + authority + rest


def secrets(url: str) -> list[str]:
    """The secrets :func:`redact` hides in ``url``, as written and percent-decoded, longest first."""
    found: list[str] = []
    head = _HEAD.match(url)
    start = head.end() if head else 0
    query_at = _query_start(url, start)
    authority = url[start:query_at]
    user_end = authority.rfind("@")
    if user_end >= 0:
        _, colon, password = authority[:user_end].partition(":")
        if colon:
            found.append(password)
    for option in url[query_at + 1 :].split("&"):
        key, equals, value = option.partition("=")
        if not equals:
            continue
        if _is_secret(key):
            found.append(value)
        elif _normal(key) == _PROPERTIES:
            for prop in unquote_plus(value).split(","):
                name, colon, secret = prop.partition(":")
                if colon and _is_secret(name):
                    found.append(secret)
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


def _query_start(url: str, start: int) -> int:
    """Where the query (``?``) of ``url`` begins, or its end; a ``#`` is taken as text."""
    at = url.find("?", start)
    return at if at >= 0 else len(url)


def _redact_option(option: str) -> str:
    key, equals, value = option.partition("=")
    if not equals:
        return option
    if _is_secret(key):
        return f"{key}={MASK}"
    if _normal(key) == _PROPERTIES:
        props = unquote_plus(value).split(",")
        return f"{key}=" + ",".join(_redact_property(prop) for prop in props)
    return option


def _redact_property(prop: str) -> str:
    name, colon, _ = prop.partition(":")
    return f"{name}:{MASK}" if colon and _is_secret(name) else prop


def _normal(key: str) -> str:
    return unquote_plus(key).lower().replace("_", "").replace("-", "")


def _is_secret(key: str) -> bool:
    name = _normal(key)
    return any(word in name for word in SECRET_WORDS)


def scrub_error(error: BaseException, url: object) -> None:
    """Take ``url``'s secrets out of ``error``'s message and ``where``, and of the errors chained to it.

    For errors raised while opening a state from ``url``, by code that may
    have echoed it (or a driver's message quoting part of it): a traceback
    shows the chained errors too.
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        current.args = tuple(scrub(arg, url) if isinstance(arg, str) else arg for arg in current.args)
        where = getattr(current, "where", None)
        if isinstance(where, str):
            current.where = scrub(where, url)  # type: ignore[attr-defined]
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
