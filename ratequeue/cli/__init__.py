"""The ``ratequeue`` command (also ``python -m ratequeue``); docs/cli.md is its reference.

``demo`` starts several processes that share one rate and shows their starts
live; ``status`` (``--watch``: live) and ``reset`` inspect and clear a queue's
shared record; ``list`` shows every queue of a state and ``keys`` their names
(a limiter group's live keys); ``pause`` and ``resume`` stop and restart a
queue's starts in every shard at once (the pause flag in its record);
``set-interval`` changes a queue's stored interval on purpose. The demo, the
watch and set-interval live in :mod:`.demo`, :mod:`.watch` and :mod:`.interval`.
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import sys
import textwrap
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from .. import __version__
from .._redact import redact, scrub
from ..core.operation import Terms, operation
from ..core.protocol import US, new_record
from ..errors import ConfigurationError, RateQueueError, StateCorrupted
from ..settings import Settings, check_hold, check_name, check_prefix, positive_int
from . import common, demo, interval, watch
from .common import DEFAULT_URL, Stopped, opened_state, queue_fields, say, say_json

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
  143  demo and set-interval: ended by SIGTERM (129: by SIGHUP), cleaned up as on Ctrl-C

docs/cli.md describes every command and its --json fields."""

#: how the top level and every command show their help: the exit statuses after it, as written
_PAGE: dict[str, Any] = {"epilog": EXIT_STATUS, "formatter_class": argparse.RawDescriptionHelpFormatter}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the process exit status."""
    args, unknown = _parser().parse_known_args(argv)
    if unknown:
        # reported by the command's own parser, with its usage (argparse would show the top level's)
        args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return int(args.run(args, sys.stdout))
    except RateQueueError as exc:
        # every error redacts the URLs it quotes; the URL given is scrubbed again, to be sure
        say(sys.stderr, f"ratequeue: error: {scrub(str(exc), args.url)}")
        return 2
    except Stopped as exc:  # SIGTERM or SIGHUP: the command cleaned up on its way out
        say(sys.stderr, f"ratequeue: ended by {signal.Signals(exc.signum).name}")
        return 128 + exc.signum
    except KeyboardInterrupt:
        say(sys.stderr, "ratequeue: interrupted")
        return 130
    except BrokenPipeError:
        # the reader of the output left (| head): end quietly, as a process killed by SIGPIPE would, and
        # leave Python nothing to flush into the closed pipe at exit (the recipe of the signal module's
        # docs); a demo stopped its workers and deleted its record on the way here
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13  # 128 + SIGPIPE, what a shell reports for a process SIGPIPE killed


def _status(args: argparse.Namespace, out: TextIO) -> int:
    if args.watch:
        return watch.run(args, out)
    if args.count is not None:
        raise ConfigurationError("--count counts the refreshes of --watch: give --watch too")
    name = check_name(args.name)
    with opened_state(args.url) as state:
        where = redact(state.url)
        fields = queue_fields(name, state.read(name))
    if args.json:
        say_json(out, {"state": where, **fields})
    else:
        say(out, *common.record_lines(where, fields))
    return 0


def _set_paused(args: argparse.Namespace, out: TextIO, paused: bool) -> int:
    """Set or clear the pause flag of queue ``args.name``, with the stored terms if it has a record."""
    name = check_name(args.name)
    interval_us = 0 if args.interval is None else Settings.checked(name, args.interval).terms.interval_us
    burst = 0 if args.burst is None else positive_int("burst", args.burst)
    with opened_state(args.url) as state:
        where = redact(state.url)
        record = state.read(name).record
        if record is None:
            if not paused:
                say(out, f"no record for queue {name!r} in {where}: it is not paused")
                return 0
            if not interval_us:
                how = "give --interval (and --burst, if not 1) to create it paused"
                raise ConfigurationError(f"queue {name!r} has no record in {where} yet: {how}")
            record = new_record(interval_us, burst or 1)
        # terms given must match a stored record (the state says so); left out, the stored ones apply
        changed = common.set_paused(state, name, record, paused, interval_us=interval_us, burst=burst)
        now = state.read(name).now
    done = f"{'paused' if paused else 'resumed'} queue {name!r} everywhere in {where}"
    kept = f"queue {name!r} in {where} was {'paused already' if paused else 'not paused'}"
    say(out, done if changed else kept, f"state clock: {now} us")
    return 0


#: what ``pause`` and ``resume`` run
_pause, _resume = functools.partial(_set_paused, paused=True), functools.partial(_set_paused, paused=False)


def _hold(args: argparse.Namespace, out: TextIO) -> int:
    """Hold queue ``args.name`` everywhere for ``args.seconds`` (or lift its hold, ``--lift``)."""
    name = check_name(args.name)
    if args.lift == (args.seconds is not None):
        raise ConfigurationError("give SECONDS to hold the queue, or --lift to end its hold (not both)")
    lead_us = 0 if args.lift else check_hold(args.seconds)
    with opened_state(args.url) as state:
        where = redact(state.url)
        record = state.read(name).record
        if record is None:
            say(out, f"no record for queue {name!r} in {where}: nothing to hold (its first start makes one)")
            return 0
        terms = Terms.checked(record.interval, record.burst, 0, record.max_running, 1)
        if args.lift:
            changed = bool(state.execute(operation("lift", name, terms)))
            said = (
                f"lifted the hold of queue {name!r} in {where}"
                if changed
                else (f"queue {name!r} in {where} was not held")
            )
        else:
            changed = bool(state.execute(operation("hold", name, terms, lead_us=lead_us)))
            said = (
                f"held queue {name!r} everywhere in {where} for {lead_us / US:g} s"
                if changed
                else (f"queue {name!r} in {where} was held longer already: kept")
            )
        now = state.read(name).now
    say(out, said, f"state clock: {now} us")
    return 0


def _keys(args: argparse.Namespace, out: TextIO) -> int:
    """The names with a record beginning with ``PREFIX``; stored names that are not queue names on stderr."""
    prefix = check_prefix(args.prefix)
    names: list[str] = []
    unreadable: list[str] = []
    with opened_state(args.url) as state:
        where = redact(state.url)
        for name in state.names(prefix):
            try:
                names.append(check_name(name))
            except ConfigurationError as exc:
                unreadable.append(_not_a_name(where, name, exc))
    if args.json:
        say_json(out, {"state": where, "prefix": prefix, "names": names, "unreadable": unreadable})
    else:
        say(out, *names)
        say(sys.stderr, f"{len(names)} queue(s) with a record beginning with {prefix!r}")
    say(sys.stderr, *(f"ratequeue: error: {problem}" for problem in unreadable))
    return 2 if unreadable else 0


def _not_a_name(where: str, name: str, exc: ConfigurationError) -> str:
    """What to say of a stored ``name`` no queue can have (a foreign key under a Redis prefix, say).

    Its repr shows its control characters, and the bytes of a Redis key that
    is not UTF-8 as lone surrogates (``\\xff`` as ``\\udcff``).
    """
    return f"{where} holds a record under {name!r}, not a valid queue name: {exc}"


#: the columns of ``list``: heading, and the text of a queue's fields
def _for(seconds: float | None) -> str:
    """How long, shortly: ``"(12.3s)"``, or ``""`` if not known."""
    return "" if seconds is None else f"({seconds:.1f}s)"  # ("yes(3.2s)": one word, as the columns are)


_COLUMNS: tuple[tuple[str, Callable[[dict[str, Any]], str]], ...] = (
    ("NAME", lambda f: f["name"]),
    ("INTERVAL", lambda f: f"{f['interval']:g} s"),
    ("BURST", lambda f: str(f["burst"])),
    ("TICKETS", lambda f: str(f["tickets"])),
    ("POS", lambda f: str(f["pos"])),
    ("UNSTARTED", lambda f: str(f["unstarted"])),
    ("LAST START", lambda f: common.ago(f["last_start_age"])),
    ("PAUSED", lambda f: "no" if not f["paused"] else f"yes{_for(f['paused_for'])}"),
    ("HELD", lambda f: "-" if f["held_for"] is None else f"{f['held_for']:.3f} s"),
    ("RUNNING", common.running_text),
)


def _list(args: argparse.Namespace, out: TextIO) -> int:
    """Every queue with a record (beginning with ``--prefix``), one row each; unreadable ones on stderr.

    A corrupt record, or a stored name that is not a valid queue name, is
    named on stderr (and in ``unreadable``), and the others are listed; the
    exit status is then 2.
    """
    prefix = check_prefix(args.prefix)
    rows: list[dict[str, Any]] = []
    unreadable: list[str] = []
    with opened_state(args.url) as state:
        where = redact(state.url)
        for name in state.names(prefix):
            try:
                snapshot = state.read(name)
            except StateCorrupted as exc:
                unreadable.append(scrub(str(exc), args.url))
            except ConfigurationError as exc:
                unreadable.append(_not_a_name(where, name, exc))
            else:
                if snapshot.record is not None:  # else deleted since names() listed it
                    rows.append(queue_fields(name, snapshot))
    if args.json:
        say_json(out, {"state": where, "prefix": prefix, "queues": rows, "unreadable": unreadable})
    else:
        table = [[heading for heading, _ in _COLUMNS]] + [[text(row) for _, text in _COLUMNS] for row in rows]
        widths = [max(map(len, column)) for column in zip(*table, strict=True)]
        for name, *cells in table:  # the name to the left, the numbers to the right
            say(out, "  ".join([name.ljust(widths[0]), *map(str.rjust, cells, widths[1:])]).rstrip())
        legend = "(last start on the state clock; running: live leases/max_running)"
        say(sys.stderr, f"{len(rows)} queue(s) with a record beginning with {prefix!r} in {where} {legend}")
    say(sys.stderr, *(f"ratequeue: error: {problem}" for problem in unreadable))
    return 2 if unreadable else 0


def _reset(args: argparse.Namespace, out: TextIO) -> int:
    with opened_state(args.url) as state:
        existed = state.reset(check_name(args.name))
        say(out, f"{'reset' if existed else 'no record for'} queue {args.name!r} in {redact(state.url)}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ratequeue", description="One start per interval, globally, in first-come order.", **_PAGE
    )
    parser.add_argument("--version", action="version", version=f"ratequeue {__version__}")
    commands = parser.add_subparsers(required=True, metavar="COMMAND")
    for (name, run, help), description, *arguments in _COMMANDS:
        # paragraphs wrapped here: the raw formatter keeps the epilog's table as written
        paragraphs = (textwrap.fill(part, 79) for part in (description or help).split("\n\n"))
        sub = commands.add_parser(name, help=help, description="\n\n".join(paragraphs), **_PAGE)
        sub.set_defaults(run=run, parser=sub)
        for argument, options in arguments:
            sub.add_argument(argument, **options)
    return parser


def _arg(name: str, help: str, **options: Any) -> tuple[str, dict[str, Any]]:
    """An argument of a command of :data:`_COMMANDS`: its name (or flag), and the keywords of
    ``add_argument(name, help=help, **options)``."""
    return name, {"help": help, **options}


_URL = _arg("url", f"state URL, or {DEFAULT_URL!r} for the per-user file", metavar="URL")
#: a URL that may be left out (the per-user file), where a command's other arguments tell it apart
_URL_OR_DEFAULT = _arg(
    "url",
    f"state URL (default: {DEFAULT_URL!r}, the per-user file, which a limiter without a URL uses)",
    metavar="URL",
    nargs="?",
    default=DEFAULT_URL,
)
#: the URL and NAME of a queue, as most commands take them
_QUEUE = (_URL, _arg("name", "queue name", metavar="NAME"))
_JSON = _arg("--json", "one JSON object", action="store_true")
#: what pause and resume take to create a missing record
_TERMS = (
    _arg(
        "--interval",
        "the queue's interval, to create a missing record (else the stored one; it must match)",
        type=float,
        metavar="SECONDS",
    ),
    _arg("--burst", "the queue's burst, to create a missing record (default 1)", type=int, metavar="N"),
)


#: the commands: (name, what runs it, help), description (paragraphs; the help if empty), arguments
_COMMANDS: tuple[tuple[Any, ...], ...] = (
    (
        ("demo", demo.run, "run several processes sharing one rate and show their starts"),
        "Start several processes that share one rate through one state, show every start as it "
        "happens, and summarise the gaps between starts. Two gaps are shown: the state-clock gap "
        "between two starts as the state recorded them (never under the interval: that decides the "
        "exit status), and the begin gap between two moments at which acquire() returned, read with "
        "time.monotonic() on this host (what a called service feels; one under the interval is "
        "reported, not a failure, since the OS can delay a process).\n\n"
        "Without --name the demo uses a fresh queue, ratequeue-demo-<random hex>, and deletes its "
        "record at the end. With --name it refuses a queue that already has a record (resetting it "
        "would break the shards using it) unless --reset is given, and keeps the record at the end.",
        _arg("--processes", "processes to start (default 4)", type=int, default=4),
        _arg("--jobs", "acquires per process (default 25)", type=int, default=25),
        _arg(
            "--interval", "seconds between starts (default 0.05)", type=float, default=0.05, metavar="SECONDS"
        ),
        _arg("--url", "state URL (default: the per-user state file)", default=DEFAULT_URL),
        _arg("--name", "queue name (default: a fresh ratequeue-demo-<hex>, deleted at the end)"),
        _arg("--reset", "reset the --name queue's record if it has one (else refused)", action="store_true"),
        _arg("--quiet", "print only the header and the summary", action="store_true"),
        _arg(
            "--plot",
            "draw the begins per process and the gap histogram into FILE (needs ratequeue[plot])",
            metavar="FILE.png",
        ),
    ),
    (
        ("status", _status, "show a queue's shared record (--watch: live)"),
        "Show a queue's shared record. With --watch, read it again every --every seconds until "
        "Ctrl-C (or --count refreshes) and show the rate of starts over the last minute, as the "
        "watcher observes the latest started ticket move between its refreshes.",
        _URL_OR_DEFAULT,
        _QUEUE[1],
        _arg("--json", "one JSON object (--watch: one per line)", action="store_true"),
        _arg("--watch", "refresh until Ctrl-C (exit status 0)", action="store_true"),
        _arg("--every", "seconds between refreshes (default 1)", type=float, default=1.0, metavar="SECONDS"),
        _arg("--count", "stop after N refreshes (with --watch)", type=int, metavar="N"),
    ),
    (
        ("list", _list, "show every queue of a state, one row each"),
        "Show every queue that has a record in the state (those beginning with --prefix): its "
        "interval, burst, tickets handed out, latest started ticket, unstarted tickets, the age of "
        "its last start on the state clock, the pause flag and its running jobs. A LimiterGroup "
        "named G keeps key K as queue 'G:K': --prefix G: lists the group's keys.",
        _URL_OR_DEFAULT,
        _arg("--prefix", "list only the names beginning with this", default=""),
        _JSON,
    ),
    (
        ("keys", _keys, "list the queue names that have a record (a group's live keys: PREFIX = 'GROUP:')"),
        "List, sorted, the names of the queues that have a record in the state and begin with "
        "PREFIX. A LimiterGroup named G keeps key K as queue 'G:K', so PREFIX 'G:' lists its live keys.",
        _URL,
        _arg("prefix", "beginning of the names (default: all)", metavar="PREFIX", nargs="?", default=""),
        _JSON,
    ),
    (
        ("pause", _pause, "pause a queue everywhere: no shard, in any process, starts a job until resumed"),
        "Set the pause flag in the queue's shared record: no shard starts a job while it is set "
        "(waiting shards ask again once a second), and tickets held meanwhile keep their places. "
        "The stored interval and burst are used; --interval (and --burst) are needed only to create "
        "the record of a queue that has none, paused.",
        *_QUEUE,
        *_TERMS,
    ),
    (
        ("resume", _resume, "resume a queue paused everywhere"),
        "Clear the pause flag in the queue's shared record: every waiting shard starts again "
        "within about a second, at the rate. A queue without a record is not paused.",
        *_QUEUE,
        *_TERMS,
    ),
    (
        ("hold", _hold, "hold a queue everywhere for SECONDS: no start, in any process, before then"),
        "Hold the queue in its shared record: no shard, in any process, starts a job for SECONDS "
        "from now on the state's clock (a day at most). Waiting shards keep their tickets and their "
        "order, and ask again when the hold ends; a hold only grows (a longer one is kept). --lift "
        "ends the hold now. What a service's 429 and Retry-After do through Limiter.heed().",
        *_QUEUE,
        _arg("seconds", "how long to hold, in seconds", metavar="SECONDS", type=float, nargs="?"),
        _arg("--lift", "end the queue's hold now instead", action="store_true"),
    ),
    (
        ("set-interval", interval.run, "change a queue's stored interval on purpose"),
        "Change the interval stored in a queue's record, keeping its burst, max_running and pause "
        "flag. Refused while tickets are handed out and not started, or jobs run (live leases). "
        "The queue is paused meanwhile, and the change waits until its last start is at least "
        "max(old, new) interval ago on the state clock, so that no two starts come closer than "
        "an interval across it. Shards whose code still names the old interval get a "
        "ConfigurationError on their next call: update their code.",
        *_QUEUE,
        _arg("seconds", "the new interval, in seconds", metavar="SECONDS", type=float),
        _JSON,
    ),
    (("reset", _reset, "delete a queue's shared record"), "", *_QUEUE),
)
