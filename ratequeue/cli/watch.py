"""``ratequeue status URL NAME --watch``: a queue's record, read again every few seconds.

The rate shown is **observed by the watcher**: the change of ``pos`` (the
latest started ticket) between the refreshes of the last minute, over the
watcher's own ``time.monotonic()``. It counts ticket numbers, so a job of
cost ``c`` counts ``c``, and tickets passed over (their holders gone) count
too. On a terminal the view is redrawn in place; piped, each refresh is one
line, flushed (``--json``: one JSON object per line).
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections import deque
from typing import Any, TextIO

from .._redact import redact
from ..errors import ConfigurationError
from ..settings import positive_int
from .common import (
    age_text,
    held_text,
    opened_state,
    paused_text,
    queue_fields,
    record_lines,
    running_text,
    say,
    say_json,
)

__all__ = ["WINDOW", "run"]

#: seconds of refreshes the rate is computed over
WINDOW = 60.0

#: the ANSI sequence that moves the cursor home and clears the terminal
CLEAR = "\x1b[H\x1b[2J"


class Rate:
    """The rate of starts seen over the last :data:`WINDOW` seconds of refreshes."""

    def __init__(self) -> None:
        #: ``(monotonic seconds, pos)`` of the refreshes within the window, and one just before it
        self.samples: deque[tuple[float, int]] = deque()

    def add(self, when: float, pos: int | None) -> tuple[float | None, float | None]:
        """Note ``pos`` seen at ``when``; the rate (per second) and the seconds it spans, if known."""
        if pos is None or (self.samples and pos < self.samples[-1][1]):
            self.samples.clear()  # no record, or a new one (reset): count afresh
        if pos is None:
            return None, None
        self.samples.append((when, pos))
        while len(self.samples) > 2 and self.samples[1][0] <= when - WINDOW:
            self.samples.popleft()
        first_when, first_pos = self.samples[0]
        span = when - first_when
        return ((pos - first_pos) / span, span) if span > 0 else (None, None)


def run(args: argparse.Namespace, out: TextIO) -> int:
    """Refresh every ``--every`` seconds, ``--count`` times or until Ctrl-C (then exit 0)."""
    every = float(args.every)
    if not 0 < every < 86400:
        raise ConfigurationError(f"--every must be a number of seconds > 0 (under a day), got {args.every!r}")
    count = None if args.count is None else positive_int("--count", args.count)
    live = out.isatty() and not args.json
    rate = Rate()
    try:
        with opened_state(args.url) as state:
            where = redact(state.url)
            if not args.json and not live:
                say(out, f"watching queue {args.name!r} in {where} every {every:g} s (Ctrl-C ends)")
            next_at = time.monotonic()
            for refresh in itertools.islice(itertools.count(1), count):  # count None: for ever
                fields = queue_fields(args.name, state.read(args.name))
                per_second, span = rate.add(time.monotonic(), fields["pos"])
                fields.update(refresh=refresh, rate=per_second, rate_window=span)
                if args.json:
                    say_json(out, {"state": where, **fields})
                else:
                    say(out, (CLEAR + _block(where, fields, every)) if live else _line(fields))
                if refresh == count:
                    break
                # on schedule, but never catching up on refreshes a slow read made late, in a burst
                next_at = max(next_at + every, time.monotonic())
                time.sleep(max(0.0, next_at - time.monotonic()))
    except KeyboardInterrupt:  # how a watch ends: exit status 0
        if not args.json:
            say(out, "")
    return 0


def _rate_text(fields: dict[str, Any]) -> str:
    rate, window = fields["rate"], fields["rate_window"]
    if rate is None:
        return "rate - (needs two refreshes)"
    return f"rate {rate:.2f}/s over the last {window:.1f} s (observed by the watcher)"


def _line(fields: dict[str, Any]) -> str:
    """One refresh as one line (piped output)."""
    head = f"{time.strftime('%H:%M:%S')} {fields['name']}:"
    if not fields["exists"]:
        return f"{head} no record"
    return (
        f"{head} pos {fields['pos']}, {_rate_text(fields)}, unstarted {fields['unstarted']}, running "
        f"{running_text(fields)}, last start {age_text(fields)}, "
        f"paused {paused_text(fields)}, held {held_text(fields)}"
    )


def _block(where: str, fields: dict[str, Any], every: float) -> str:
    """One refresh as a screen (a terminal)."""
    head = f"ratequeue status --watch  {time.strftime('%H:%M:%S')}  (every {every:g} s; Ctrl-C ends)"
    return "\n".join([head, *record_lines(where, fields, _rate_text(fields).removeprefix("rate "))])
