"""What the ``ratequeue`` commands share: opening a state, printing live, a queue's fields."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO

from .protocol import NEVER, US, live_leases
from .state import State, from_url
from .state.base import Snapshot

__all__ = [
    "DEFAULT_URL",
    "STOP_SIGNALS",
    "Stopped",
    "stopped_by_signals",
    "age_text",
    "open_state",
    "plural",
    "queue_fields",
    "running_text",
    "say",
    "say_json",
]

#: what the command line accepts for "the per-user default state file"
DEFAULT_URL = "default"


def open_state(url: str) -> State:
    """The state at ``url``, or the per-user default state file for :data:`DEFAULT_URL`."""
    return from_url(None if url == DEFAULT_URL else url)


def say(out: TextIO, text: str = "") -> None:
    """Print one line to ``out`` and flush it, so that a pipe (``| tee``, a CI log) shows it at once."""
    print(text, file=out, flush=True)


def say_json(out: TextIO, value: dict[str, Any]) -> None:
    """Print ``value`` as one line of JSON, flushed."""
    say(out, json.dumps(value, sort_keys=False))


def plural(count: int, word: str) -> str:
    """``"1 process"``, ``"2 processes"``: ``count`` and ``word``, pluralised in English."""
    if count == 1:
        return f"{count} {word}"
    return f"{count} {word}es" if word.endswith(("s", "x", "ch", "sh")) else f"{count} {word}s"


def queue_fields(name: str, snapshot: Snapshot) -> dict[str, Any]:
    """The fields of queue ``name``'s record as the commands' JSON shows them (docs/cli.md).

    Seconds are floats, counts integers; a queue without a record has
    ``exists`` false and ``None`` for every field of the record.
    """
    record, now = snapshot.record, snapshot.now
    if record is None:
        return {
            "name": name,
            "exists": False,
            "interval": None,
            "interval_us": None,
            "burst": None,
            "tickets": None,
            "pos": None,
            "unstarted": None,
            "last_start_age": None,
            "paused": False,
            "running": None,
            "max_running": None,
            "now_us": now,
        }
    return {
        "name": name,
        "exists": True,
        "interval": record.interval / US,
        "interval_us": record.interval,
        "burst": record.burst,
        "tickets": record.ticket - 1,
        "pos": record.pos,
        "unstarted": record.ticket - 1 - record.pos,
        "last_start_age": None if record.at == NEVER else (now - record.at) / US,
        "paused": record.paused,
        "running": len(live_leases(record, now)) if record.max_running else None,
        "max_running": record.max_running,
        "now_us": now,
    }


def age_text(fields: dict[str, Any]) -> str:
    """The age of the last start in ``fields`` (from :func:`queue_fields`) as text."""
    age = fields["last_start_age"]
    if age is None:
        return "never"
    if age < 0:
        return f"in {-age:.3f} s (granted ahead, state clock)"
    return f"{age:.3f} s ago (state clock)"


def running_text(fields: dict[str, Any]) -> str:
    """``"1/3"`` (live leases of at most ``max_running``), or ``"-"`` for a queue without a cap."""
    return "-" if fields["running"] is None else f"{fields['running']}/{fields['max_running']}"


#: the signals that end a command as Ctrl-C does (a demo stops its workers, set-interval lifts its pause)
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


class Stopped(KeyboardInterrupt):
    """A command was ended by a signal of :data:`STOP_SIGNALS`; it exits with 128 + ``signum``.

    A :class:`KeyboardInterrupt`, so that it passes every ``except Exception``
    and the command cleans up on its way out exactly as on Ctrl-C.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextmanager
def stopped_by_signals() -> Iterator[None]:
    """Meanwhile the first SIGTERM or SIGHUP raises :class:`Stopped`, later ones are ignored.

    The command then cleans up as on Ctrl-C (a demo stops its workers and
    deletes its fresh record, set-interval lifts its pause), where their
    default would end this process at once; the later signals are ignored so
    that they cannot cut that short. The handlers are restored afterwards.
    """
    fired = False

    def stop(signum: int, frame: object) -> None:
        nonlocal fired
        if not fired:
            fired = True
            raise Stopped(signum)

    previous: dict[int, Any] = {}
    try:
        for signum in STOP_SIGNALS:
            previous[signum] = signal.signal(signum, stop)
    except ValueError:  # not the main thread: signals are not ours to handle
        pass
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
