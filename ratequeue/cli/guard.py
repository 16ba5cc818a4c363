"""The guard of the pause ``set-interval`` holds: it lifts the pause if the command is killed (SIGKILL).

``set-interval`` pauses its queue everywhere while it waits, and lifts the
pause on every way out it sees (an error, Ctrl-C, SIGTERM, SIGHUP). A
SIGKILL, or the OOM killer, gives it none: before this guard, the queue then
stayed paused everywhere until someone ran ``ratequeue resume``.

The command starts the guard (a Python process running :func:`main`) in a
session of its own, so that a signal to the command's process group does
not reach it, and talks to it over the guard's stdin, one line each (the
state's URL never goes on a command line: it may hold a password):

1. the state's URL, then the queue's name;
2. ``pausing``: just before the command sets the pause;
3. ``done``: once nothing is left to guard (the pause lifted, the record
   reset, or the command never paused it).

The guard waits for the end of its stdin, which comes when the command
exits, however it exits. After ``pausing`` and before ``done``, it reads the
record: still paused, it lifts the pause (a record reset and not yet made
again, or resumed meanwhile, is left as it is), and says so on stderr.
A crash of the whole host still leaves the pause on: ``ratequeue resume``.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from typing import IO

from .._redact import redact
from ..errors import RateQueueError
from .common import opened_state, say, set_paused

__all__ = ["Guard", "main"]

#: what the guard process runs (not ``-m``: the package imports this module first)
_RUN = "import sys; from ratequeue.cli.guard import main; sys.exit(main())"


class Guard:
    """The command's end of a guard process: start it, tell it what it guards, tell it when it is done."""

    def __init__(self, url: str, name: str) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-c", _RUN],
            stdin=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self._tell(url, name)

    def pausing(self) -> None:
        """The command is about to pause the queue: from now on, its death lifts the pause."""
        self._tell("pausing")

    def done(self) -> None:
        """Nothing is left to guard: the guard ends without touching the queue."""
        self._tell("done")
        stdin: IO[str] | None = self._process.stdin
        if stdin is not None:
            with contextlib.suppress(OSError):
                stdin.close()
        self._process.wait()

    def _tell(self, *lines: str) -> None:
        """Write ``lines`` to the guard; a guard that died (a broken pipe) costs the command nothing."""
        stdin = self._process.stdin
        assert stdin is not None
        with contextlib.suppress(OSError):
            stdin.write("".join(f"{line}\n" for line in lines))
            stdin.flush()


def main() -> int:
    """Guard one pause, as told on stdin (see the module); 0 unless a pause it had to lift stays on."""
    url, name = sys.stdin.readline().rstrip("\n"), sys.stdin.readline().rstrip("\n")
    pausing = False
    for line in sys.stdin:  # until the command exits
        word = line.strip()
        if word == "done":
            return 0
        pausing = pausing or word == "pausing"
    if not pausing:
        return 0
    killed = f"ratequeue: set-interval was killed; queue {name!r} in {redact(url)}"
    try:
        state = opened_state(url)
        try:
            record = state.read(name).record
            if record is None or not record.paused:
                return 0
            set_paused(state, name, record, False)
        finally:
            state.close()
    except RateQueueError as exc:
        say(sys.stderr, f"{killed} is left PAUSED: {exc}; run: ratequeue resume URL {name}")
        return 1
    say(sys.stderr, f"{killed} is resumed: the guard of its pause lifted it")
    return 0
