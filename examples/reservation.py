"""Reservations: take a place in the queue now, wait for its turn later, or give it up.

A worker reserves a place for each request as it arrives (``limiter.reserve()``),
then waits for the turn (``reservation.wait()``). A request that is withdrawn
while it waits -- here, from another thread, as a shutdown or a client that
hung up would -- is cancelled: its wait returns ``None`` and the turn it would
have used goes to the next request, so no slot is spent on it.

Run::

    python examples/reservation.py [STATE_URL]

Without a URL the state is a JSON file in a new temporary directory.
"""

from __future__ import annotations

import itertools
import sys
import tempfile
import threading
from pathlib import Path

import ratequeue

INTERVAL = 0.05  # seconds between two starts
REQUESTS = 6
WITHDRAWN = 2  # the request cancelled while it waits


def run(url: str) -> int:
    # (max_late=None: a busy host's late wake-up would give a turn up and take the next ticket,
    # which would hide what this shows, that the withdrawn request's turn goes to the next one)
    limiter = ratequeue.Limiter(url, name="examples-reservation", interval=INTERVAL, max_late=None)
    reservations = [limiter.reserve() for _ in range(REQUESTS)]  # places taken in arrival order
    starts: list[int] = []

    def serve(index: int, reservation: ratequeue.Reservation) -> None:
        turn = reservation.wait(timeout=10)
        if turn is None:
            print(f"request {index}: withdrawn before its turn, no slot used")
            return
        starts.append(turn.start_us)
        print(f"request {index}: ticket {turn.ticket}")

    threads = [threading.Thread(target=serve, args=(i, r)) for i, r in enumerate(reservations)]
    for thread in threads:
        thread.start()
    reservations[WITHDRAWN].cancel()  # from this thread, while request 2 waits for its turn
    for thread in threads:
        thread.join()
    limiter.close()

    starts.sort()
    gaps = [(b - a) / 1000 for a, b in itertools.pairwise(starts)]
    tickets = sorted(r.turn.ticket for r in reservations if r.turn is not None)
    print(
        f"{len(starts)} starts for {REQUESTS} requests, 1 withdrawn; tickets {tickets}; "
        f"smallest gap {min(gaps):.3f} ms (state clock)"
    )
    return 0


def main() -> int:
    if len(sys.argv) > 1:
        return run(sys.argv[1])
    with tempfile.TemporaryDirectory() as directory:
        return run(f"file://{Path(directory) / 'state.json'}")


if __name__ == "__main__":
    sys.exit(main())
