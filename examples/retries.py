"""Retries with backoff, and a dead-letter handler for the jobs that keep failing.

Six calls to a flaky service go through a queue at 20 starts per second:
each failure is retried (up to 3 times) after a backoff that doubles, and
each retry takes a turn of its own, so the retries count against the rate
as a polite client's would. A call that still fails goes to the dead-letter
handler, with its arguments and its last exception; its future fails too.

Run::

    python examples/retries.py [STATE_URL]

Without a URL the state is a JSON file in a new temporary directory.
"""

from __future__ import annotations

import itertools
import sys
import tempfile
import threading
import time
from pathlib import Path

import ratequeue

FAILURES = {1: 1, 2: 2, 3: 0, 4: 9, 5: 1, 6: 0}  # call -> how many times it fails before it works


class FlakyService:
    """Fails each call its first FAILURES[call] times."""

    def __init__(self) -> None:
        self.tries: dict[int, list[float]] = {call: [] for call in FAILURES}
        self.lock = threading.Lock()

    def fetch(self, call: int) -> str:
        with self.lock:
            self.tries[call].append(time.monotonic())
            attempt = len(self.tries[call])
        if attempt <= FAILURES[call]:
            raise ConnectionError(f"call {call}: try {attempt} refused")
        return f"call {call}: ok on try {attempt}"


def run(url: str) -> int:
    service = FlakyService()
    letters: list[ratequeue.DeadLetter] = []
    backoff = ratequeue.Backoff(base=0.05, factor=2, max=1.0)
    # (max_late=None: a busy host's late wake-up would give a turn up and take the next ticket,
    # which would hide what this shows, that each try takes one turn)
    queue = ratequeue.Queue(
        url,
        name="examples-retries",
        rate="20/second",
        retries=3,
        backoff=backoff,
        retry_on=ConnectionError,
        dead_letter=letters.append,
        max_late=None,
    )
    futures = {call: queue.add(service.fetch, call) for call in FAILURES}
    for call, future in futures.items():
        try:
            print(future.result(timeout=30))
        except ConnectionError as exc:
            print(f"call {call}: failed for good ({exc})")
    queue.close()
    for letter in letters:
        print(
            f"dead letter: {letter.fn.__name__}{letter.args} after {letter.attempts} tries: "
            f"{letter.exception}"
        )
    waited = [
        later - earlier >= backoff.least(retry)
        for tries in service.tries.values()
        for retry, (earlier, later) in enumerate(itertools.pairwise(tries), start=1)
    ]
    record = queue.state.read(queue.name).record
    turns = record.pos if record else 0
    print(
        f"{sum(len(t) for t in service.tries.values())} tries took {turns} turns; "
        f"every retry waited its backoff: {all(waited)}"
    )
    return 0 if all(waited) and len(letters) == 1 else 1


def main() -> int:
    if len(sys.argv) > 1:
        return run(sys.argv[1])
    with tempfile.TemporaryDirectory() as directory:
        return run((Path(directory) / "state.json").as_uri())


if __name__ == "__main__":
    sys.exit(main())
