"""``ratequeue set-interval URL NAME SECONDS``: change a queue's stored interval on purpose.

A record keeps the interval it was created with (TermsMismatch otherwise),
so the change is a reset followed by a new record with the new interval and
the old record's other terms (burst, max_running, the pause flag). To keep
the promise of one start per interval across it:

1. it is refused while jobs run (live leases) or tickets handed out wait to
   start (their holders would lose their places); tickets whose holders are
   gone (the next ``take`` would pass them, G4) do not count;
2. the queue is paused meanwhile (unless it is already), so that nothing
   starts between the last look and the reset; SIGTERM and SIGHUP end the
   command as Ctrl-C does, and every way out of it before the reset lifts
   the pause again (or says, loudly, that it could not);
3. before the reset it waits, on the state's clock, until the record is
   whole again under the longer of the two intervals: with ``u`` burst units
   in use at the last start ``at``, until ``at + u * max(old, new)``. A new
   record may start its whole burst at once, so any run of starts across
   the change keeps the spacing of the old terms and of the new ones;
4. the reset happens only if the record is still paused and unchanged since
   the pause (nobody resumed it, no other ``set-interval`` changed it).

A guard process (:mod:`.guard`) lifts the pause if the command is killed
where it cannot do so itself (SIGKILL, the OOM killer).

Shards still running with the old interval in their code get
:class:`~ratequeue.errors.TermsMismatch` on their next call: by design, as
the record no longer matches their code; update it. Do not pause or resume
the queue, or run a second ``set-interval`` on it, while one runs.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from contextlib import suppress
from typing import TextIO

from .._redact import redact
from ..core.protocol import NEVER, US, Record, live_leases, take
from ..errors import ConfigurationError, RateQueueError, TermsMismatch
from ..settings import Settings
from ..state import State
from .common import opened_state, say, say_json, set_paused, stopped_by_signals
from .guard import Guard

__all__ = ["run"]


def run(args: argparse.Namespace, out: TextIO) -> int:
    """Change queue ``args.name``'s interval to ``args.seconds``; print what was done."""
    name, new_us = args.name, Settings.checked(args.name, args.seconds).terms.interval_us
    with opened_state(args.url) as state, stopped_by_signals():
        where = redact(state.url)
        record, now = state.read(name)
        if record is None:
            first = "its first shard creates it with the interval in its code"
            raise ConfigurationError(f"queue {name!r} has no record in {where}: nothing to change ({first})")
        if record.interval == new_us:
            return _report(args, out, where, record, record, waited=None)
        _refuse_if_busy(name, where, record, now)
        pause = _Pause(state, name, where, record)
        # lifts the pause if this command is killed where it cannot (SIGKILL): see guard.py
        guard = Guard(args.url, name) if pause.ours else None
        try:
            if guard is not None:
                guard.pausing()
            pause.set()
            if guard is not None and not pause.ours:  # paused by someone else meanwhile: not ours to lift
                guard.done()
                guard = None
            record, waited = pause.wait_for_spacing(sys.stderr if args.json else out, new_us)
            if not state.reset(name):
                raise ConfigurationError(f"queue {name!r} lost its record in {where} meanwhile; run again")
            pause.ended = True  # the record holding the pause is gone: there is nothing to lift any more
            _create(state, name, where, record, new_us, paused=not pause.ours)
        finally:
            pause.lift_unless_ended()
            if guard is not None:
                guard.done()
        # the new record as read back, or as written if it cannot be
        new = state.read(name).record or record._replace(interval=new_us, paused=not pause.ours)
    return _report(args, out, where, record, new, waited=waited)


def _stored(exc: TermsMismatch) -> str:
    """The stored value a :class:`TermsMismatch` names, as text."""
    return "no cap" if exc.stored is None else f"{exc.stored:g}"


class _Pause:
    """The pause ``set-interval`` holds on a queue while it waits, and its lifting on every way out."""

    def __init__(self, state: State, name: str, where: str, record: Record) -> None:
        self.state, self.name, self.where, self.record = state, name, where, record
        #: whether this command sets the flag (a queue paused already stays so); set before it asks the
        #: state, since an interruption may come after the state applied it: lift_unless_ended looks
        self.ours = not record.paused
        #: the record just after the pause (what the reset may delete), once set
        self.since: Record = record
        #: whether the reset ended the pause (with the record holding it)
        self.ended = False

    def set(self) -> None:
        """Pause the queue everywhere (if it is not already) and read the record the pause holds."""
        if self.ours:
            try:
                self.ours = set_paused(self.state, self.name, self.record, True)
            except TermsMismatch as exc:
                self.ours = False
                raise ConfigurationError(
                    f"queue {self.name!r} in {self.where} changed its terms since it was read "
                    f"({exc.field} is now {_stored(exc)}; another set-interval or a reset?): nothing "
                    f"changed; run again"
                ) from None
        held = self.state.read(self.name).record
        if held is None or not held.paused:
            raise ConfigurationError(
                f"queue {self.name!r} in {self.where} was reset or resumed as it was being paused; "
                f"nothing changed; run again"
            )
        self.since = held

    def lift_unless_ended(self) -> None:
        """Lift the pause this command set, unless the reset ended it; say so if it cannot."""
        if self.ended or not self.ours:
            return
        for _ in range(3):  # tries before saying the pause is left on
            with suppress(RateQueueError, KeyboardInterrupt):  # then try again
                current = self.state.read(self.name).record
                if current is not None and current.paused:  # else gone or resumed meanwhile: nothing to lift
                    set_paused(self.state, self.name, self.record, False)
                return
        left = f"queue {self.name!r} is left PAUSED everywhere in {self.where}"
        resume = f"ratequeue resume {shlex.quote(self.where)} {shlex.quote(self.name)}"
        say(sys.stderr, f"ratequeue: {left}: the pause could not be lifted; run: {resume}")

    def wait_for_spacing(self, said: TextIO, new_us: int) -> tuple[Record, float]:
        """Wait until the record is whole again under ``max(old, new)``; the record and seconds waited.

        The queue is paused, so nothing starts meanwhile. The record must stay
        as the pause left it (:attr:`since`), but for tickets handed out
        meanwhile, which wait for the pause to end and take new ones after the reset.
        """
        name, where, began = self.name, self.where, time.monotonic()
        while True:
            record, now = self.state.read(name)
            if record is None:
                raise ConfigurationError(f"queue {name!r} lost its record in {where} meanwhile; run again")
            _refuse_if_running(name, where, record, now)  # a job that began just before the pause
            if _starts_and_terms(record) != _starts_and_terms(self.since):
                raise ConfigurationError(
                    f"queue {name!r} in {where} changed while set-interval waited (resumed, reset, or "
                    f"changed by another set-interval): nothing changed; run again"
                )
            spacing = max(record.interval, new_us)
            remaining = _whole_again(record, spacing) - now
            if remaining <= 0:
                return record, time.monotonic() - began
            longer = f"the longer interval ({spacing / US:g} s) on the state clock, its last start included"
            say(said, f"waiting {remaining / US:.3f} s until queue {name!r} is whole again under {longer}")
            time.sleep(remaining / US)


def _waiting_tickets(record: Record, now: int) -> int:
    """How many tickets handed out wait to start: 0 once ``take`` would pass them (their holders gone, G4).

    Counted in ticket numbers: a job of cost ``c`` holds ``c`` of them.
    """
    return record.ticket - 1 - take(record, now)[0].pos


def _refuse_if_busy(name: str, where: str, record: Record, now: int) -> None:
    """Refuse (ConfigurationError) a change that would take places from running jobs (live leases) or
    from holders of tickets that wait to start."""
    waiting = _waiting_tickets(record, now)
    if waiting:
        gone_in = (record.slot(record.ticket - 1) + record.interval - now) / US
        raise ConfigurationError(
            f"queue {name!r} in {where} has {waiting} ticket number(s) handed out and not started "
            f"(a job of cost c holds c): their holders may be waiting; stop its shards and run again "
            f"(tickets whose holders are gone stop counting in {max(gone_in, 0):.3f} s)"
        )
    _refuse_if_running(name, where, record, now)


def _refuse_if_running(name: str, where: str, record: Record, now: int) -> None:
    """Refuse (ConfigurationError) while jobs of the queue run (live leases)."""
    running = len(live_leases(record, now))
    if running > 0:
        raise ConfigurationError(
            f"queue {name!r} in {where} has {running} running job(s) (live leases): let them end "
            f"(or their leases expire) and run again"
        )


def _starts_and_terms(record: Record) -> tuple[int | None, ...]:
    """What must not change while the queue waits paused: its last start, its terms, the flag.

    Tickets may still be handed out (``take`` also passes those of gone
    holders, moving ``pos``), and leases expire: neither is a start.
    """
    return (record.at, record.due, record.interval, record.burst, record.max_running, record.paused)


def _whole_again(record: Record, spacing: int) -> int:
    """When (state clock, us) ``record`` is whole again under interval ``spacing`` (>= its own).

    The last start at ``at`` left ``u = ceil((due - at) / interval) + 1``
    burst units in use; under the longer interval they free up one per
    ``spacing``. With the old interval that is ``due + interval`` or later,
    when the old record's whole burst is free again.
    """
    if record.at == NEVER:
        return NEVER
    units = -(-(record.due - record.at) // record.interval) + 1  # ceil: a unit partly used
    return record.at + units * spacing


def _create(state: State, name: str, where: str, old: Record, new_us: int, *, paused: bool) -> None:
    """Create the record anew with ``new_us``, ``old``'s burst and cap, and the pause flag ``paused``."""
    try:
        set_paused(state, name, old, paused, interval_us=new_us)
    except TermsMismatch as exc:
        raise ConfigurationError(
            f"queue {name!r} in {where} was reset, but a shard created its record again at once with "
            f"its own {exc.field} ({_stored(exc)}): a shard still runs with the old terms; stop it "
            f"(or update its code) and run again"
        ) from None
    except RateQueueError as exc:
        raise ConfigurationError(
            f"queue {name!r} in {where} was reset, but its new record could not be written ({exc}): "
            f"the next shard creates it with the interval in its code; run again to set {new_us / US:g} s"
        ) from exc


def _report(
    args: argparse.Namespace, out: TextIO, where: str, old: Record, new: Record, *, waited: float | None
) -> int:
    """Print what was done (``--json``: one object; ``waited`` ``None``: nothing changed); exit status 0."""
    name, was, now = args.name, f"{old.interval / US:g} s", f"{new.interval / US:g} s"
    if args.json:
        fields = {
            "state": where,
            "name": name,
            "changed": waited is not None,
            "old_interval": old.interval / US,
            "interval": new.interval / US,
            "burst": new.burst,
            "max_running": new.max_running or 0,
            "paused": new.paused,
            "waited": waited or 0.0,
        }
        say_json(out, fields)
    elif waited is None:
        say(out, f"queue {name!r} in {where} has interval {was} already: nothing changed")
    else:
        cap = f"max_running {new.max_running}" if new.max_running else "no cap on running jobs"
        kept = f"kept: burst {new.burst}, {cap}, {'paused everywhere' if new.paused else 'not paused'}"
        say(out, f"set the interval of queue {name!r} in {where} to {now} (was {was}); {kept}")
        update = f"get a ConfigurationError (TermsMismatch) on their next call: update them to {now}"
        say(out, f"shards whose code still says interval {was} {update}")
    return 0
