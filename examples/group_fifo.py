"""One job per customer at a time, in order, across processes: ``queue.add(fn, group=customer)``.

Two worker processes share a queue of 100 starts a second. Each adds
orders for three customers; a customer's orders must be handled one at a
time and in the order they came (an account that must not be updated
twice at once), while different customers go side by side. Every process
writes when each order begins and ends to a shared log; the parent reads
it and prints, per customer, the most orders that ever ran at once and
whether each process's orders of that customer ran in the order added.

Run::

    python examples/group_fifo.py [STATE_URL]

Without a URL the state is a JSON file in a new temporary directory.
"""

from __future__ import annotations

import multiprocessing
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import ratequeue

CUSTOMERS = ("ada", "grace", "linus")


def worker(url: str, process: int, log: str) -> None:
    """Add 4 orders per customer, each taking 20 ms, and wait for them all."""

    def handle(customer: str, order: int) -> None:
        with open(log, "a", buffering=1) as out:
            out.write(f"begin {customer} {process} {order} {time.monotonic()!r}\n")
            time.sleep(0.02)
            out.write(f"end {customer} {process} {order} {time.monotonic()!r}\n")

    queue = ratequeue.Queue(url, name="examples-orders", rate="100/second")
    futures = [queue.add(handle, c, order, group=c) for order in range(4) for c in CUSTOMERS]
    for future in futures:
        future.result(timeout=60)
    queue.close()


def run(url: str, directory: Path) -> int:
    log = directory / "orders.log"
    ctx = multiprocessing.get_context("spawn")
    workers = [ctx.Process(target=worker, args=(url, number, str(log))) for number in range(2)]
    for child in workers:
        child.start()
    for child in workers:
        child.join(60)
    events: dict[str, list[tuple[float, int]]] = defaultdict(list)
    begun: dict[str, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
    for line in log.read_text().splitlines():
        kind, customer, process, order, at = line.split()
        events[customer].append((float(at), 1 if kind == "begin" else -1))
        if kind == "begin":
            begun[customer][int(process)].append(int(order))
    ok = True
    for customer in CUSTOMERS:
        running = most = 0
        for _, change in sorted(events[customer]):
            running += change
            most = max(most, running)
        in_order = all(orders == sorted(orders) for orders in begun[customer].values())
        count = sum(len(orders) for orders in begun[customer].values())
        print(f"{customer}: {count} orders, at most {most} at once, each process's in order: {in_order}")
        ok = ok and most == 1 and in_order and count == 8
    return 0 if ok else 1


def main() -> int:
    with tempfile.TemporaryDirectory() as directory:
        url = sys.argv[1] if len(sys.argv) > 1 else (Path(directory) / "state.json").as_uri()
        return run(url, Path(directory))


if __name__ == "__main__":
    sys.exit(main())
