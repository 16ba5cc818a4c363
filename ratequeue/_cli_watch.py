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
import datetime
import time
from collections import deque
from typing import Any, TextIO

from ._cli_common import age_text, open_state, queue_fields, running_text, say, say_json
from ._redact import redact
from .errors import ConfigurationError

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
        if span <= 0:
            return None, None
        return (pos - first_pos) / span, span


def run(args: argparse.Namespace, out: TextIO) -> int:
    """Refresh every ``--every`` seconds, ``--count`` times or until Ctrl-C (then exit 0)."""
    every = float(args.every)
    if not 0 < every < 86400:
        raise ConfigurationError(f"--every must be a number of seconds > 0 (under a day), got {args.every!r}")
    count = args.count
    if count is not None and count < 1:
        raise ConfigurationError(f"--count must be an integer >= 1, got {count!r}")
    live = out.isatty() and not args.json
    rate = Rate()
    try:
        with open_state(args.url) as state:
            where = redact(state.url)
            refresh = 0
            if not args.json and not live:
                say(out, f"watching queue {args.name!r} in {where} every {every:g} s (Ctrl-C ends)")
            next_at = time.monotonic()
            while count is None or refresh < count:
                refresh += 1
                snapshot = state.read(args.name)
                seen = time.monotonic()
                fields = queue_fields(args.name, snapshot)
                per_second, span = rate.add(seen, fields["pos"])
                fields.update(refresh=refresh, rate=per_second, rate_window=span)
                if args.json:
                    say_json(out, {"state": where, **fields})
                elif live:
                    out.write(CLEAR + _block(where, fields, every) + "\n")
                    out.flush()
                else:
                    say(out, _line(fields))
                if count is not None and refresh >= count:
                    break
                # on schedule, but never catching up on refreshes a slow read made late, in a burst
                next_at = max(next_at + every, time.monotonic())
                time.sleep(max(0.0, next_at - time.monotonic()))
    except KeyboardInterrupt:
        if not args.json:
            say(out)
        return 0  # Ctrl-C is how a watch ends
    return 0


def _rate_text(fields: dict[str, Any]) -> str:
    if fields["rate"] is None:
        return "rate - (needs two refreshes)"
    return (
        f"rate {fields['rate']:.2f}/s over the last {fields['rate_window']:.1f} s (observed by the watcher)"
    )


def _line(fields: dict[str, Any]) -> str:
    """One refresh as one line (piped output)."""
    stamp = datetime.datetime.now().strftime("%H:%M:%S")
    if not fields["exists"]:
        return f"{stamp} {fields['name']}: no record"
    return (
        f"{stamp} {fields['name']}: pos {fields['pos']}, {_rate_text(fields)}, "
        f"unstarted {fields['unstarted']}, running {running_text(fields)}, "
        f"last start {age_text(fields)}, paused {'yes' if fields['paused'] else 'no'}"
    )


def _block(where: str, fields: dict[str, Any], every: float) -> str:
    """One refresh as a screen (a terminal)."""
    stamp = datetime.datetime.now().strftime("%H:%M:%S")
    head = [
        f"ratequeue status --watch  {stamp}  (every {every:g} s; Ctrl-C ends)",
        f"state:      {where}",
        f"queue:      {fields['name']}",
    ]
    if not fields["exists"]:
        return "\n".join([*head, "record:     none (no ticket handed out yet)"])
    return "\n".join(
        [
            *head,
            f"interval:   {fields['interval']:g} s",
            f"burst:      {fields['burst']}",
            f"tickets:    {fields['tickets']} handed out, {fields['pos']} is the latest started",
            f"rate:       {_rate_text(fields).removeprefix('rate ')}",
            f"unstarted:  {fields['unstarted']} ticket(s) handed out and not started (waiting)",
            "running:    "
            + (
                "no cap on running jobs"
                if fields["running"] is None
                else f"{fields['running']} of at most {fields['max_running']} (live leases)"
            ),
            f"last start: {age_text(fields)}",
            f"paused everywhere: {'yes' if fields['paused'] else 'no'}",
        ]
    )
