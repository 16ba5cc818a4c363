"""``ratequeue set-interval URL NAME SECONDS``: change a queue's stored interval on purpose.

A record keeps the interval it was created with (TermsMismatch otherwise),
so the change is a reset followed by a new record with the new interval and
the old record's other terms (burst, max_running, the pause flag). To keep
the promise of one start per interval across it:

1. it is refused while the record shows tickets handed out and not started,
   or running jobs (live leases): their holders would lose their places;
2. the queue is paused meanwhile (unless it is already), so that nothing
   starts between the last look and the reset;
3. before the reset it waits, on the state's clock, until the last start is
   at least ``max(old, new)`` interval ago (and, with a burst, until the old
   record's whole burst is free again), so that the new record's first
   start, which may come at once, is at least that far from the old last one.

Shards still running with the old interval in their code get
:class:`~ratequeue.errors.TermsMismatch` on their next call: by design, as
the record no longer matches their code; update it.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, TextIO

from . import _validate
from ._cli_common import open_state, say, say_json
from ._redact import redact
from .errors import ConfigurationError
from .protocol import NEVER, US, Record, live_leases
from .state import State

__all__ = ["run"]


def run(args: argparse.Namespace, out: TextIO) -> int:
    """Change queue ``args.name``'s interval to ``args.seconds``; print what was done."""
    name = _validate.name(args.name)
    new_us = _validate.interval_us(_validate.interval(args.seconds))
    with open_state(args.url) as state:
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
        _refuse_if_busy(name, where, record, first.now, tickets=True)
        cap = _cap(record)
        # paused meanwhile (unless it is already), so that nothing starts between the wait and the reset
        paused_here = state.set_paused(name, record.interval, True, burst=record.burst, **cap)
        done = False
        try:
            record, waited = _wait_for_spacing(args, out, state, name, where, new_us)
            if not state.reset(name):
                raise ConfigurationError(f"queue {name!r} lost its record in {where} meanwhile; run again")
            done = True
            # the pause flag as it was before ours
            _create(state, name, where, record, new_us, paused=not paused_here)
        finally:
            if paused_here and not done and state.read(name).record is not None:
                # nothing changed: the queue goes on as it was (a record gone meanwhile is not recreated)
                state.set_paused(name, record.interval, False, burst=record.burst, **cap)
        created = state.read(name).record
    assert created is not None
    return _report(args, out, where, name, record, created, waited=waited, changed=True)


def _cap(record: Record) -> dict[str, int]:
    """The cap on running jobs to name with the record's terms (a pause takes no lease: any lease will do)."""
    return {"max_running": record.max_running, "lease_us": 1} if record.max_running else {}


def _refuse_if_busy(name: str, where: str, record: Record, now: int, *, tickets: bool) -> None:
    """Refuse (ConfigurationError) a change that would take places from running jobs (live leases), and
    with ``tickets`` from holders of tickets handed out and not started."""
    unstarted = record.ticket - 1 - record.pos
    running = len(live_leases(record, now))
    if tickets and unstarted > 0:
        raise ConfigurationError(
            f"queue {name!r} in {where} has {unstarted} ticket(s) handed out and not started: their "
            f"holders are waiting; stop its shards and run again (if their holders are gone, the "
            f"next acquire passes their tickets over, or `ratequeue reset` deletes the record)"
        )
    if running > 0:
        raise ConfigurationError(
            f"queue {name!r} in {where} has {running} running job(s) (live leases): let them end "
            f"(or their leases expire) and run again"
        )


def _wait_for_spacing(
    args: argparse.Namespace, out: TextIO, state: State, name: str, where: str, new_us: int
) -> tuple[Record, float]:
    """Wait until the last start is ``max(old, new)`` ago on the state clock; the record and seconds waited.

    The queue is paused, so nothing starts meanwhile; a start that came just
    before the pause is seen here and waited for too.
    """
    began = time.monotonic()
    waited = False
    while True:
        snapshot = state.read(name)
        record = snapshot.record
        if record is None:
            raise ConfigurationError(f"queue {name!r} lost its record in {where} meanwhile; run again")
        # tickets handed out meanwhile wait for the pause to end: they take new ones after the reset
        _refuse_if_busy(name, where, record, snapshot.now, tickets=False)
        spacing = max(record.interval, new_us)
        # due is the slot the last start took: its start (at) or, if that used the burst, later.
        # From due + the old interval the old record's whole burst is free again, as a new one's
        # is, and from at + the new interval a new record's first start keeps the spacing
        last = max(record.at, record.due)
        remaining = 0 if record.at == NEVER else last + spacing - snapshot.now
        if remaining <= 0:
            return record, time.monotonic() - began if waited else 0.0
        waited = True
        print(
            f"waiting {remaining / US:.3f} s until the last start of queue {name!r} is at least "
            f"{spacing / US:g} s (the longer interval) ago on the state clock"
            + (" and its burst is whole again" if record.due > record.at else ""),
            file=sys.stderr if args.json else out,
            flush=True,
        )
        time.sleep(remaining / US)


def _create(state: State, name: str, where: str, old: Record, new_us: int, *, paused: bool) -> None:
    """Create the record anew with ``new_us``, ``old``'s burst and cap, and the pause flag ``paused``."""
    try:
        state.set_paused(name, new_us, paused, burst=old.burst, **_cap(old))
    except ConfigurationError as exc:
        raise ConfigurationError(
            f"queue {name!r} in {where} was reset, but a shard created its record again at once with "
            f"other terms ({exc}): a shard still runs with the old interval ({old.interval / US:g} s); "
            f"stop it (or update its code) and run again"
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
