"""What the ``ratequeue`` commands share: opening a state, printing live, a queue's fields, signals."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, suppress
from typing import Any, TextIO

from ..core.operation import Terms, operation
from ..core.protocol import NEVER, US, Record, effective_interval, live_leases, new_record, waiting_tenants
from ..state import Snapshot, State, open_state

#: what the command line accepts for "the per-user default state file"
DEFAULT_URL = "default"


def opened_state(url: str) -> State:
    """The state at ``url``, or the per-user default state file for :data:`DEFAULT_URL`."""
    return open_state(None if url == DEFAULT_URL else url)


def set_paused(
    state: State, name: str, record: Record, paused: bool, *, interval_us: int = 0, burst: int = 0
) -> bool:
    """Set or clear queue ``name``'s pause flag; whether it changed.

    The operation names ``record``'s terms, or ``interval_us`` and ``burst``
    where given: a missing record is created with them, a stored one with
    others is refused (:class:`~ratequeue.errors.TermsMismatch`). Pausing
    takes no lease, so any lease length will do.
    """
    terms = Terms.checked(interval_us or record.interval, burst or record.burst, 0, record.max_running, 1)
    return bool(state.execute(operation("set_paused", name, terms, paused=paused)))


def say(out: TextIO, *lines: str) -> None:
    """Print ``lines`` to ``out``, one a line, and flush them, so that a pipe (``| tee``, a CI log) shows
    them at once; nothing for none."""
    if lines:
        print(*lines, sep="\n", file=out, flush=True)


def say_json(out: TextIO, value: dict[str, Any]) -> None:
    """Print ``value`` as one line of JSON, flushed."""
    say(out, json.dumps(value))


def plural(count: int, word: str) -> str:
    """``"1 process"``, ``"2 processes"``: ``count`` and ``word``, pluralised in English."""
    ending = "" if count == 1 else "es" if word.endswith(("s", "x", "ch", "sh")) else "s"
    return f"{count} {word}{ending}"


def queue_fields(name: str, snapshot: Snapshot) -> dict[str, Any]:
    """The fields of queue ``name``'s record as the commands' JSON shows them (docs/cli.md).

    Seconds are floats, counts integers, ``max_running`` 0 for no cap; a
    queue without a record has ``exists`` false and ``None`` for every field
    of the record but ``paused``.
    """
    record, now = snapshot
    shown = record or new_record(1)  # a stand-in for a missing record, whose fields are then None
    fields: dict[str, Any] = {
        "interval": shown.interval / US,
        "interval_us": shown.interval,
        "effective_interval": effective_interval(shown, now) / US,
        "burst": shown.burst,
        "tickets": shown.ticket - 1,
        "pos": shown.pos,
        "unstarted": shown.ticket - 1 - shown.pos,
        "last_start_age": None if shown.at == NEVER else (now - shown.at) / US,
        "paused": shown.paused,
        "paused_for": (now - shown.paused_at) / US if shown.paused and shown.paused_at != NEVER else None,
        "held_for": (shown.not_before - now) / US if shown.not_before > now else None,
        "running": None if shown.max_running is None else len(live_leases(shown, now)),
        "max_running": shown.max_running or 0,
        "fair": shown.fair,
        "tenants": {
            tenant: {"waiting": waiting, "holding": holding, "weight": weight}
            for tenant, (waiting, holding, weight) in waiting_tenants(shown).items()
        },
    }
    if record is None:
        fields = {**dict.fromkeys(fields), "paused": False}
    return {"name": name, "exists": record is not None, **fields, "now_us": now}


def ago(age: float | None) -> str:
    """The age of a last start, shortly: ``never``, ``1.234 s ago``, or ``in 0.002 s`` (started ahead)."""
    if age is None:
        return "never"
    return f"{age:.3f} s ago" if age >= 0 else f"in {-age:.3f} s"


def age_text(fields: dict[str, Any]) -> str:
    """The age of the last start in ``fields`` (from :func:`queue_fields`) as text, with its clock."""
    age = fields["last_start_age"]
    return "never" if age is None else f"{ago(age)} ({'started ahead, ' if age < 0 else ''}state clock)"


def paused_text(fields: dict[str, Any]) -> str:
    """``"no"``, or since when the queue is paused everywhere: ``"yes, for 12.345 s (until resumed)"``."""
    if not fields["paused"]:
        return "no"
    since = fields["paused_for"]
    return "yes (until resumed)" if since is None else f"yes, for {since:.3f} s (until resumed)"


def held_text(fields: dict[str, Any]) -> str:
    """``"no"``, or how long the queue's hold lasts yet: ``"for 1.234 s more"`` (state clock)."""
    held = fields["held_for"]
    return "no" if held is None else f"for {held:.3f} s more (no start before then)"


def running_text(fields: dict[str, Any]) -> str:
    """``"1/3"`` (live leases of at most ``max_running``), or ``"-"`` for a queue without a cap."""
    return "-" if fields["running"] is None else f"{fields['running']}/{fields['max_running']}"


def record_lines(where: str, fields: dict[str, Any], rate: str | None = None) -> list[str]:
    """The lines ``status`` shows for a queue's ``fields``; the watch's screen adds the ``rate``."""
    lines = [f"state:      {where}", f"queue:      {fields['name']}"]
    if not fields["exists"]:
        return [*lines, "record:     none (no ticket handed out yet)"]
    slowed = fields["effective_interval"] > fields["interval"]
    lines += [
        f"interval:   {fields['interval']:g} s"
        + (f" (now {fields['effective_interval']:g} s: slowed down, recovering)" if slowed else ""),
        f"burst:      {fields['burst']}",
        f"tickets:    {fields['tickets']} handed out, {fields['pos']} is the latest started",
        *([] if rate is None else [f"rate:       {rate}"]),
        f"last start: {age_text(fields)}",
        f"unstarted:  {fields['unstarted']} ticket(s) handed out and not started",
        f"paused everywhere: {paused_text(fields)}",
        f"held everywhere:   {held_text(fields)}",
    ]
    if fields["running"] is not None:
        lines.append(f"running:    {fields['running']} of at most {fields['max_running']} (live leases)")
    if fields["fair"]:
        tenants = fields["tenants"]
        total = sum(tenant["weight"] for tenant in tenants.values())
        lines.append(
            "tenants:    "
            + (
                ", ".join(
                    f"{name!r} {t['waiting']} waiting ({t['holding']} with a ticket, "
                    f"share {t['weight'] / total:.0%})"
                    for name, t in tenants.items()
                )
                if tenants
                else "none waiting (a fair queue)"
            )
        )
    return lines


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


def stopped_by_signals() -> AbstractContextManager[None]:
    """Meanwhile the first SIGTERM or SIGHUP raises :class:`Stopped`, later ones are ignored.

    The command then cleans up as on Ctrl-C (a demo stops its workers and
    deletes its fresh record, set-interval lifts its pause), where their
    default would end this process at once; the later signals are ignored so
    that they cannot cut that short. The handlers are restored afterwards.
    """

    def stop(signum: int, frame: object) -> None:
        for later in STOP_SIGNALS:
            signal.signal(later, signal.SIG_IGN)
        raise Stopped(signum)

    return handling(STOP_SIGNALS, stop)


@contextmanager
def handling(signums: Iterable[int], handler: Any) -> Iterator[None]:
    """Meanwhile ``handler`` handles the signals ``signums``; their handlers are restored afterwards.

    Outside the main thread nothing changes: signals are not its to handle.
    """
    previous: dict[int, Any] = {}
    with suppress(ValueError):  # not the main thread
        for signum in signums:
            previous[signum] = signal.signal(signum, handler)
    try:
        yield
    finally:
        for signum, before in previous.items():
            signal.signal(signum, before)
