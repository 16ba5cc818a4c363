"""Which job starts next: priorities, not-before times, and a bounded queue.

A paused queue is filled with jobs of different priorities, one held until
0.2 s from now, then resumed: the held job takes no turn until its time,
the others start highest priority first, then in the order added. A second
queue bounded to two waiting jobs shows both overflow rules.

Run::

    python examples/scheduling.py [STATE_URL]

Without a URL the state is a JSON file in a new temporary directory.
"""

from __future__ import annotations

import sys
import tempfile
import threading
from pathlib import Path

import ratequeue


def run(url: str) -> int:
    queue = ratequeue.Queue(url, name="examples-scheduling", rate="50/second")
    queue.pause()
    order: list[str] = []
    queue.add(order.append, "report (held 0.2 s, priority 9)", not_before=0.2, priority=9)
    queue.add(order.append, "newsletter (priority 0)")
    queue.add(order.append, "password reset (priority 5)", priority=5)
    queue.add(order.append, "invoice (priority 5)", priority=5)
    queue.resume()
    queue.join(timeout=30)
    queue.close()
    for place, job in enumerate(order, start=1):
        print(f"{place}. {job}")

    release = threading.Event()
    bounded = ratequeue.Queue(
        url, name="examples-bounded", rate="50/second", max_running=1, max_waiting=2, overflow="drop_oldest"
    )
    bounded.add(release.wait)  # runs and holds the only running place
    while bounded.pending:  # until it has started
        release.wait(0.001)
    first, second, third = (bounded.add(lambda n=n: n) for n in (1, 2, 3))
    try:
        first.result(timeout=5)
    except ratequeue.QueueFull as exc:
        print(f"job 1: {exc}")
    release.set()
    print(f"jobs 2 and 3 ran: {second.result(timeout=30)}, {third.result(timeout=30)}")
    bounded.close()
    expected = ["password reset (priority 5)", "invoice (priority 5)", "newsletter (priority 0)"]
    return 0 if order[:3] == expected and order[3].startswith("report") else 1


def main() -> int:
    if len(sys.argv) > 1:
        return run(sys.argv[1])
    with tempfile.TemporaryDirectory() as directory:
        return run((Path(directory) / "state.json").as_uri())


if __name__ == "__main__":
    sys.exit(main())
