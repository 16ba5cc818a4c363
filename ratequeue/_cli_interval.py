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
from dataclasses import replace
from typing import Any, TextIO

from . import _validate
from ._cli_common import open_state, say, say_json, stopped_by_signals
from ._redact import redact
from .errors import ConfigurationError, RateQueueError, TermsMismatch
from .protocol import FULL_GRACE_US, NEVER, US, Record, live_leases
from .state import State

__all__ = ["run"]


def run(args: argparse.Namespace, out: TextIO) -> int:
    """Change queue ``args.name``'s interval to ``args.seconds``; print what was done."""
    name = _validate.name(args.name)
    new_us = _validate.interval_us(_validate.interval(args.seconds))
    with open_state(args.url) as state, stopped_by_signals():
        where = redact(state.url)
        first = state.read(name)
        record = first.record
        if record is None:
            raise ConfigurationError(
                f"queue {name!r} has no record in {where}: nothing to change (its first shard "
                f"creates it with the interval in its code)"
            )
        if record.interval == new_us:
            return _report(args, out, where, name, record, record, waited=0.0, changed=False)
        _refuse_if_busy(name, where, record, first.now)
        pause = _Pause(state, name, where, record)
        try:
            pause.set()
            record, waited = _wait_for_spacing(args, out, state, name, where, new_us, pause.since)
            if not state.reset(name):
                raise ConfigurationError(f"queue {name!r} lost its record in {where} meanwhile; run again")
            pause.ended_by_reset()
            _create(state, name, where, record, new_us, paused=not pause.ours)
        finally:
            pause.lift_unless_ended(out)
        created = state.read(name).record
    written = replace(record, interval=new_us, paused=not pause.ours)
    return _report(args, out, where, name, record, created or written, waited=waited, changed=True)


class _Pause:
    """The pause ``set-interval`` holds on a queue while it waits, and its lifting on every way out."""

    def __init__(self, state: State, name: str, where: str, record: Record) -> None:
        self.state, self.name, self.where, self.record = state, name, where, record
        #: whether this command set the flag (a queue paused already stays so)
        self.ours = False
        #: the record just after the pause (what the reset may delete), once set
        self.since: Record = record
        self._ended = False

    def set(self) -> None:
        """Pause the queue everywhere (if it is not already) and read the record the pause holds."""
        record = self.record
        if not record.paused:
            try:
                # an interruption may come after the state applied it: lift_unless_ended looks
                self.ours = True
                self.ours = self.state.set_paused(
                    self.name, record.interval, True, burst=record.burst, **_cap(record)
                )
            except TermsMismatch as exc:
                self.ours = False
                raise ConfigurationError(
                    f"queue {self.name!r} in {self.where} changed its terms since it was read "
                    f"({exc.field} is now {exc.stored:g}; another set-interval or a reset?): nothing "
                    f"changed; run again"
                ) from None
        held = self.state.read(self.name).record
        if held is None or not held.paused:
            raise ConfigurationError(
                f"queue {self.name!r} in {self.where} was reset or resumed as it was being paused; "
                f"nothing changed; run again"
            )
        self.since = held

    def ended_by_reset(self) -> None:
        """The record holding the pause is gone: there is nothing to lift any more."""
        self._ended = True

    def lift_unless_ended(self, out: TextIO) -> None:
        """Lift the pause this command set, unless the reset ended it; say so if it cannot."""
        if self._ended or not self.ours:
            return
        record = self.record
        for _ in range(_LIFT_TRIES):
            try:
                current = self.state.read(self.name).record
                if current is None or not current.paused:
                    return  # gone or resumed meanwhile: nothing of ours to lift
                self.state.set_paused(self.name, record.interval, False, burst=record.burst, **_cap(record))
                return
            except (RateQueueError, KeyboardInterrupt):
                continue
        print(
            f"ratequeue: queue {self.name!r} is left PAUSED everywhere in {self.where}: the pause could "
            f"not be lifted; run: ratequeue resume {shlex.quote(self.where)} {shlex.quote(self.name)}",
            file=sys.stderr,
            flush=True,
        )


#: how many times the pause is tried to be lifted before the command says it is left on
_LIFT_TRIES = 3


def _cap(record: Record) -> dict[str, int]:
    """The cap on running jobs to name with the record's terms (a pause takes no lease: any lease will do)."""
    return {"max_running": record.max_running, "lease_us": 1} if record.max_running else {}


def _waiting_tickets(record: Record, now: int) -> int:
    """How many tickets handed out wait to start: 0 once ``take`` would pass them (their holders gone, G4).

    Counted in ticket numbers: a job of cost ``c`` holds ``c`` of them.
    """
    last = record.ticket - 1
    if last <= record.pos:
        return 0
    gone = record.slot(last) + record.interval <= now and record.held + FULL_GRACE_US <= now
    return 0 if gone else last - record.pos


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


def _starts_and_terms(record: Record) -> tuple[int, ...]:
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
    units = -(-(max(record.due, record.at) - record.at) // record.interval) + 1  # ceil: a unit partly used
    return record.at + units * spacing


def _wait_for_spacing(
    args: argparse.Namespace, out: TextIO, state: State, name: str, where: str, new_us: int, since: Record
) -> tuple[Record, float]:
    """Wait until the record is whole again under ``max(old, new)``; the record and seconds waited.

    The queue is paused, so nothing starts meanwhile. The record must stay
    as the pause left it (``since``), but for tickets handed out meanwhile,
    which wait for the pause to end and take new ones after the reset.
    """
    began = time.monotonic()
    while True:
        snapshot = state.read(name)
        record = snapshot.record
        if record is None:
            raise ConfigurationError(f"queue {name!r} lost its record in {where} meanwhile; run again")
        _refuse_if_running(name, where, record, snapshot.now)  # a job that began just before the pause
        if _starts_and_terms(record) != _starts_and_terms(since):
            raise ConfigurationError(
                f"queue {name!r} in {where} changed while set-interval waited (resumed, reset, or "
                f"changed by another set-interval): nothing changed; run again"
            )
        spacing = max(record.interval, new_us)
        remaining = _whole_again(record, spacing) - snapshot.now
        if remaining <= 0:
            return record, time.monotonic() - began
        print(
            f"waiting {remaining / US:.3f} s until queue {name!r} is whole again under the longer "
            f"interval ({spacing / US:g} s) on the state clock, its last start included",
            file=sys.stderr if args.json else out,
            flush=True,
        )
        time.sleep(remaining / US)


def _create(state: State, name: str, where: str, old: Record, new_us: int, *, paused: bool) -> None:
    """Create the record anew with ``new_us``, ``old``'s burst and cap, and the pause flag ``paused``."""
    try:
        state.set_paused(name, new_us, paused, burst=old.burst, **_cap(old))
    except TermsMismatch as exc:
        raise ConfigurationError(
            f"queue {name!r} in {where} was reset, but a shard created its record again at once with "
            f"its own {exc.field} ({exc.stored:g}): a shard still runs with the old terms; stop it "
            f"(or update its code) and run again"
        ) from None
    except RateQueueError as exc:
        raise ConfigurationError(
            f"queue {name!r} in {where} was reset, but its new record could not be written ({exc}): "
            f"the next shard creates it with the interval in its code; run again to set {new_us / US:g} s"
        ) from exc


def _report(
    args: argparse.Namespace,
    out: TextIO,
    where: str,
    name: str,
    old: Record,
    new: Record,
    *,
    waited: float,
    changed: bool,
) -> int:
    """Print what was done (``--json``: one object); exit status 0."""
    if args.json:
        fields: dict[str, Any] = {
            "state": where,
            "name": name,
            "changed": changed,
            "old_interval": old.interval / US,
            "interval": new.interval / US,
            "burst": new.burst,
            "max_running": new.max_running,
            "paused": new.paused,
            "waited": waited,
        }
        say_json(out, fields)
        return 0
    if not changed:
        say(out, f"queue {name!r} in {where} has interval {old.interval / US:g} s already: nothing changed")
        return 0
    cap = f"max_running {new.max_running}" if new.max_running else "no cap on running jobs"
    say(
        out,
        f"set the interval of queue {name!r} in {where} to {new.interval / US:g} s "
        f"(was {old.interval / US:g} s); kept: burst {new.burst}, {cap}, "
        f"{'paused everywhere' if new.paused else 'not paused'}",
    )
    say(
        out,
        f"shards whose code still says interval {old.interval / US:g} s get a ConfigurationError "
        f"(TermsMismatch) on their next call: update them to {new.interval / US:g} s",
    )
    return 0
