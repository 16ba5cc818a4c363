"""Secrets out of every message: the one function that hides a URL's passwords."""

from __future__ import annotations

from urllib.parse import urlsplit

__all__ = ["redact"]


def redact(url: str) -> str:
    """``url`` with any password replaced by ``***``, for messages and ``repr``."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return parts._replace(netloc=f"{user}:***@{host}").geturl()
