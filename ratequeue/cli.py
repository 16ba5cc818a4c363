"""The ``ratequeue`` command (also ``python -m ratequeue``); docs/cli.md is its reference.

``demo`` starts several processes that share one rate and shows their starts
live; ``status`` (``--watch``: live) and ``reset`` inspect and clear a queue's
shared record; ``list`` shows every queue of a state and ``keys`` their names
(a limiter group's live keys); ``pause`` and ``resume`` stop and restart a
queue's starts in every shard at once (the pause flag in its record);
``set-interval`` changes a queue's stored interval on purpose. The demo, the
watch and set-interval live in ``_cli_demo``, ``_cli_watch`` and
``_cli_interval``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import textwrap
from collections.abc import Sequence
from typing import Any, TextIO

from . import __version__, _cli_demo, _cli_interval, _cli_watch, _validate
from ._cli_common import (
    DEFAULT_URL,
    Stopped,
    age_text,
    open_state,
    queue_fields,
    running_text,
    say,
    say_json,
)
from ._redact import redact, scrub
from .errors import ConfigurationError, RateQueueError, StateCorrupted

__all__ = ["main"]

#: the exit statuses, as ``--help`` and docs/cli.md state them
EXIT_STATUS = """\
exit status:
  0    done (for demo: no state-clock gap under the interval, no failure, every start came)
  1    demo only: a state-clock gap under the interval, a failed process, or a missing start
       (begin gaps under the interval are reported, not failures: the OS may delay a process)
  2    bad input, or an error of the state (unreachable, corrupted, terms that differ)
  130  interrupted (Ctrl-C); status --watch ends with 0 on Ctrl-C
  141  the output was closed early (a pipe, as in: | head); nothing more is printed
  143  demo only: ended by SIGTERM (129: by SIGHUP), cleaned up as on Ctrl-C

docs/cli.md describes every command and its --json fields."""

_URL_HELP = f"state URL, or {DEFAULT_URL!r} for the per-user file"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the process exit status."""
    parser = _parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # reported by the command's own parser, with its usage (argparse would show the top level's)
        getattr(args, "parser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return int(args.run(args, sys.stdout))
    except RateQueueError as exc:
        # every error redacts the URLs it quotes; the URL given is scrubbed again, to be sure
        print(f"ratequeue: error: {scrub(str(exc), args.url)}", file=sys.stderr, flush=True)
        return 2
    except Stopped as exc:  # SIGTERM or SIGHUP: the command cleaned up on its way out
        print(f"ratequeue: ended by {signal.Signals(exc.signum).name}", file=sys.stderr, flush=True)
        return 128 + exc.signum
    except KeyboardInterrupt:
        print("ratequeue: interrupted", file=sys.stderr, flush=True)
        return 130
    except BrokenPipeError:
        # the reader of the output left (| head): end quietly, as a process killed by SIGPIPE would, and
        # leave Python nothing to flush into the closed pipe at exit (the recipe of the signal module's
        # docs); a demo stopped its workers and deleted its record on the way here
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13  # 128 + SIGPIPE, what a shell reports for a process SIGPIPE killed


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ratequeue",
        description="One start per interval, globally, in first-come order.",
        epilog=EXIT_STATUS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"ratequeue {__version__}")
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    def command(name: str, run: Any, help: str, description: str = "", epilog: str = EXIT_STATUS) -> Any:
        sub = commands.add_parser(
            name,
            help=help,
            # paragraphs wrapped here: the raw formatter keeps the epilog's table as written
            description="\n\n".join(textwrap.fill(part, 79) for part in (description or help).split("\n\n")),
            epilog=epilog,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        sub.set_defaults(run=run, parser=sub)
        return sub

    demo = command(
        "demo",
        _cli_demo.run,
        "run several processes sharing one rate and show their starts",
        "Start several processes that share one rate through one state, show every start as it "
        "happens, and summarise the gaps between starts. Two gaps are shown: the state-clock gap "
        "between two starts as the state recorded them (never under the interval: that decides the "
        "exit status), and the begin gap between two moments at which acquire() returned, read with "
        "time.monotonic() on this host (what a called service feels; one under the interval is "
        "reported, not a failure, since the OS can delay a process).\n\n"
        "Without --name the demo uses a fresh queue, ratequeue-demo-<random hex>, and deletes its "
        "record at the end. With --name it refuses a queue that already has a record (resetting it "
        "would break the shards using it) unless --reset is given, and keeps the record at the end.",
    )
    demo.add_argument("--processes", type=int, default=4, help="processes to start (default 4)")
    demo.add_argument("--jobs", type=int, default=25, help="acquires per process (default 25)")
    demo.add_argument(
        "--interval",
        type=float,
        default=0.05,
        metavar="SECONDS",
        help="seconds between starts (default 0.05)",
    )
    demo.add_argument("--url", default=DEFAULT_URL, help="state URL (default: the per-user state file)")
    demo.add_argument("--name", help="queue name (default: a fresh ratequeue-demo-<hex>, deleted at the end)")
    demo.add_argument(
        "--reset", action="store_true", help="reset the --name queue's record if it has one (else refused)"
    )
    demo.add_argument("--quiet", action="store_true", help="print only the header and the summary")
    demo.add_argument(
        "--plot",
        metavar="FILE.png",
        help="draw the begins per process and the gap histogram into FILE (needs ratequeue[plot])",
    )

    status = command(
        "status",
        _status,
        "show a queue's shared record (--watch: live)",
        "Show a queue's shared record. With --watch, read it again every --every seconds until "
        "Ctrl-C (or --count refreshes) and show the rate of starts over the last minute, as the "
        "watcher observes the latest started ticket move between its refreshes.",
    )
    status.add_argument("url", metavar="URL", help=_URL_HELP)
    status.add_argument("name", metavar="NAME", help="queue name")
    status.add_argument("--json", action="store_true", help="one JSON object (--watch: one per line)")
    status.add_argument("--watch", action="store_true", help="refresh until Ctrl-C (exit status 0)")
    status.add_argument(
        "--every", type=float, default=1.0, metavar="SECONDS", help="seconds between refreshes (default 1)"
    )
    status.add_argument("--count", type=int, metavar="N", help="stop after N refreshes (with --watch)")

    listing = command(
        "list",
        _list,
        "show every queue of a state, one row each",
        "Show every queue that has a record in the state (those beginning with --prefix): its "
        "interval, burst, tickets handed out, latest started ticket, unstarted tickets, the age of "
        "its last start on the state clock, the pause flag and its running jobs. A LimiterGroup "
        "named G keeps key K as queue 'G:K': --prefix G: lists the group's keys.",
    )
    listing.add_argument("url", metavar="URL", help=_URL_HELP)
    listing.add_argument("--prefix", default="", help="list only the names beginning with this")
    listing.add_argument("--json", action="store_true", help="one JSON object")

    keys = command(
        "keys",
        _keys,
        "list the queue names that have a record (a group's live keys: PREFIX = 'GROUP:')",
        "List, sorted, the names of the queues that have a record in the state and begin with "
        "PREFIX. A LimiterGroup named G keeps key K as queue 'G:K', so PREFIX 'G:' lists its live keys.",
    )
    keys.add_argument("url", metavar="URL", help=_URL_HELP)
    keys.add_argument(
        "prefix", metavar="PREFIX", nargs="?", default="", help="beginning of the names (default: all)"
    )
    keys.add_argument("--json", action="store_true", help="one JSON object")

    for verb, paused in (("pause", True), ("resume", False)):
        pausing = command(
            verb,
            _pause if paused else _resume,
            (
                "pause a queue everywhere: no shard, in any process, starts a job until resumed"
                if paused
                else "resume a queue paused everywhere"
            ),
            (
                "Set the pause flag in the queue's shared record: no shard starts a job while it is "
                "set (waiting shards ask again once a second), and tickets held meanwhile keep their "
                "places. The stored interval and burst are used; --interval (and --burst) are needed "
                "only to create the record of a queue that has none, paused."
                if paused
                else "Clear the pause flag in the queue's shared record: every waiting shard starts "
                "again within about a second, at the rate. A queue without a record is not paused."
            ),
        )
        pausing.add_argument("url", metavar="URL", help=_URL_HELP)
        pausing.add_argument("name", metavar="NAME", help="queue name")
        pausing.add_argument(
            "--interval",
            type=float,
            metavar="SECONDS",
            help="the queue's interval, to create a missing record (else the stored one; it must match)",
        )
        pausing.add_argument(
            "--burst", type=int, metavar="N", help="the queue's burst, to create a missing record (default 1)"
        )

    setting = command(
        "set-interval",
        _cli_interval.run,
        "change a queue's stored interval on purpose",
        "Change the interval stored in a queue's record, keeping its burst, max_running and pause "
        "flag. Refused while tickets are handed out and not started, or jobs run (live leases). "
        "The queue is paused meanwhile, and the change waits until its last start is at least "
        "max(old, new) interval ago on the state clock, so that no two starts come closer than "
        "an interval across it. Shards whose code still names the old interval get a "
        "ConfigurationError on their next call: update their code.",
    )
    setting.add_argument("url", metavar="URL", help=_URL_HELP)
    setting.add_argument("name", metavar="NAME", help="queue name")
    setting.add_argument("seconds", metavar="SECONDS", type=float, help="the new interval, in seconds")
    setting.add_argument("--json", action="store_true", help="one JSON object")

    reset = command("reset", _reset, "delete a queue's shared record")
    reset.add_argument("url", metavar="URL", help=_URL_HELP)
    reset.add_argument("name", metavar="NAME", help="queue name")
    return parser


def _status(args: argparse.Namespace, out: TextIO) -> int:
    if args.watch:
        return _cli_watch.run(args, out)
    if args.count is not None:
        raise ConfigurationError("--count counts the refreshes of --watch: give --watch too")
    name = _validate.name(args.name)
    with open_state(args.url) as state:
        where = redact(state.url)
        fields = queue_fields(name, state.read(name))
    if args.json:
        say_json(out, {"state": where, **fields})
        return 0
    say(out, f"state:      {where}")
    say(out, f"queue:      {name}")
    if not fields["exists"]:
        say(out, "record:     none (no ticket handed out yet)")
        return 0
    say(out, f"interval:   {fields['interval']:g} s")
    say(out, f"burst:      {fields['burst']}")
    say(out, f"tickets:    {fields['tickets']} handed out, {fields['pos']} is the latest started")
    say(out, f"last start: {age_text(fields)}")
    say(out, f"unstarted:  {fields['unstarted']} ticket(s) handed out and not started")
    say(out, f"paused everywhere: {'yes' if fields['paused'] else 'no'}")
    if fields["max_running"]:
        say(out, f"running:    {fields['running']} of at most {fields['max_running']} (live leases)")
    return 0


def _pause(args: argparse.Namespace, out: TextIO) -> int:
    return _set_paused(args, out, True)


def _resume(args: argparse.Namespace, out: TextIO) -> int:
    return _set_paused(args, out, False)


def _set_paused(args: argparse.Namespace, out: TextIO, paused: bool) -> int:
    """Set or clear the pause flag of queue ``args.name``, with the stored terms if it has a record."""
    name = _validate.name(args.name)
    interval_us = None if args.interval is None else _validate.interval_us(_validate.interval(args.interval))
    burst = None if args.burst is None else _validate.burst(args.burst)
    with open_state(args.url) as state:
        where = redact(state.url)
        record = state.read(name).record
        if record is None and not paused:
            say(out, f"no record for queue {name!r} in {where}: it is not paused")
            return 0
        if record is None and interval_us is None:
            raise ConfigurationError(
                f"queue {name!r} has no record in {where} yet: give --interval (and --burst, if not 1) "
                f"to create it paused"
            )
        # given terms must match a stored record (set_paused says so); left out, the stored ones apply
        interval = interval_us if interval_us is not None else record.interval if record else 0
        burst = burst if burst is not None else record.burst if record else 1
        # a stored cap on running jobs is kept (the pause takes no lease: any lease length will do)
        cap = {"max_running": record.max_running, "lease_us": 1} if record and record.max_running else {}
        changed = state.set_paused(name, interval, paused, burst=burst, **cap)
        now = state.read(name).now
    verb = "paused" if paused else "resumed"
    if changed:
        say(out, f"{verb} queue {name!r} everywhere in {where}")
    else:
        say(out, f"queue {name!r} in {where} was {'paused already' if paused else 'not paused'}")
    say(out, f"state clock: {now} us")
    return 0


def _keys(args: argparse.Namespace, out: TextIO) -> int:
    prefix = _validate.prefix(args.prefix)
    with open_state(args.url) as state:
        where = redact(state.url)
        names = state.names(prefix)
    if args.json:
        say_json(out, {"state": where, "prefix": prefix, "names": names})
        return 0
    for name in names:
        say(out, name)
    print(f"{len(names)} queue(s) with a record beginning with {prefix!r}", file=sys.stderr, flush=True)
    return 0


#: the columns of ``list``: heading, and the text of a queue's fields
_COLUMNS: tuple[tuple[str, Any], ...] = (
    ("NAME", lambda f: f["name"]),
    ("INTERVAL", lambda f: f"{f['interval']:g} s"),
    ("BURST", lambda f: str(f["burst"])),
    ("TICKETS", lambda f: str(f["tickets"])),
    ("POS", lambda f: str(f["pos"])),
    ("UNSTARTED", lambda f: str(f["unstarted"])),
    ("LAST START", lambda f: _ago(f["last_start_age"])),
    ("PAUSED", lambda f: "yes" if f["paused"] else "no"),
    ("RUNNING", running_text),
)


def _ago(age: float | None) -> str:
    """The age of a last start, shortly: ``never``, ``1.234 s ago``, or ``in 0.002 s`` (granted ahead)."""
    if age is None:
        return "never"
    return f"{age:.3f} s ago" if age >= 0 else f"in {-age:.3f} s"


def _list(args: argparse.Namespace, out: TextIO) -> int:
    """Every queue with a record (beginning with ``--prefix``), one row each; unreadable ones on stderr.

    A corrupt record, or a stored name that is not a valid queue name, is
    named on stderr (and in ``unreadable``), and the others are listed; the
    exit status is then 2.
    """
    prefix = _validate.prefix(args.prefix)
    rows: list[dict[str, Any]] = []
    unreadable: list[str] = []
    with open_state(args.url) as state:
        where = redact(state.url)
        for name in state.names(prefix):
            try:
                snapshot = state.read(name)
            except StateCorrupted as exc:
                unreadable.append(scrub(str(exc), args.url))
                continue
            except ConfigurationError as exc:
                # a stored name no queue can have (a foreign key under a Redis prefix, say): repr shows
                # its control characters
                unreadable.append(f"{where} holds a record under {name!r}, not a valid queue name: {exc}")
                continue
            if snapshot.record is not None:  # else deleted since names() listed it
                rows.append(queue_fields(name, snapshot))
    if args.json:
        say_json(out, {"state": where, "prefix": prefix, "queues": rows, "unreadable": unreadable})
    else:
        table = [[heading for heading, _ in _COLUMNS]] + [[text(row) for _, text in _COLUMNS] for row in rows]
        widths = [max(len(line[column]) for line in table) for column in range(len(_COLUMNS))]
        for line in table:
            cells = [
                cell.ljust(width) if column == 0 else cell.rjust(width)
                for column, (cell, width) in enumerate(zip(line, widths, strict=True))
            ]
            say(out, "  ".join(cells).rstrip())
        print(
            f"{len(rows)} queue(s) with a record beginning with {prefix!r} in {where} "
            f"(last start on the state clock; running: live leases/max_running)",
            file=sys.stderr,
            flush=True,
        )
    for problem in unreadable:
        print(f"ratequeue: error: {problem}", file=sys.stderr, flush=True)
    return 2 if unreadable else 0


def _reset(args: argparse.Namespace, out: TextIO) -> int:
    with open_state(args.url) as state:
        existed = state.reset(_validate.name(args.name))
        say(out, f"{'reset' if existed else 'no record for'} queue {args.name!r} in {redact(state.url)}")
    return 0
