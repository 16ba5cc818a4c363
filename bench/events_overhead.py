"""Events overhead: what ``on_event`` and DEBUG logging add to an idle ``acquire()``.

One process, one limiter whose interval (1 µs) has always passed, so every
``acquire()`` finds the queue idle: one state call and a begin, the
cheapest acquire there is, where a fixed cost shows the most. Each state
(``memory://``, which shows the library's own cost, and a state file) is
timed with:

* ``none``: ``on_event=None``, the default (the baseline);
* ``no-op``: ``on_event=`` a function that does nothing (the cost of making
  and passing the events);
* ``prometheus``: ``on_event=ratequeue.prometheus.PrometheusMetrics`` on a
  registry of its own (counters and histograms updated per event);
* ``debug log``: ``on_event=None`` and the ``ratequeue`` logger at DEBUG
  into a handler that drops the records (the cost of building the lines).

The variants take turns in rounds of ``--acquires`` each, so a change of
the machine's load during the run falls on all of them alike; the table
gives each variant's median round (µs per acquire) and its ratio to
``none`` measured in the same run. Compare the ratios, not the absolute
numbers, which follow the machine and its load (printed first).

Run::

    python bench/events_overhead.py              # about 20 s
    python bench/events_overhead.py --quick      # a few seconds
"""

from __future__ import annotations

import gc
import logging
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _common import new_parser, print_machine

import ratequeue
from ratequeue.events import Event

VARIANTS = ("none", "no-op", "prometheus", "debug log")


def noop(event: Event) -> None:
    """An ``on_event`` hook that does nothing."""


class Drop(logging.Handler):
    """A handler that formats nothing and keeps nothing: what remains is the cost of making the records."""

    def emit(self, record: logging.LogRecord) -> None:
        pass


def limiter_for(url: str, variant: str, index: int) -> tuple[ratequeue.Limiter, Callable[[], None]]:
    """A limiter of ``variant`` on its own queue name, and what undoes the variant's setup."""
    logger = logging.getLogger("ratequeue")
    hook: Any = None
    undo: Callable[[], None] = lambda: None  # noqa: E731
    if variant == "no-op":
        hook = noop
    elif variant == "prometheus":
        from prometheus_client import CollectorRegistry

        from ratequeue.prometheus import PrometheusMetrics

        hook = PrometheusMetrics(CollectorRegistry())
    elif variant == "debug log":
        handler, level, propagate = Drop(), logger.level, logger.propagate
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
        logger.propagate = False

        def undo() -> None:
            logger.removeHandler(handler)
            logger.setLevel(level)
            logger.propagate = propagate

    name = f"bench-events-{variant.replace(' ', '-')}-{index}"
    return ratequeue.Limiter(url, name=name, interval=1e-6, on_event=hook), undo


def one_round(url: str, variant: str, index: int, acquires: int) -> tuple[float, float]:
    """CPU and wall-clock seconds per acquire over ``acquires`` idle acquires of a limiter of ``variant``."""
    limiter, undo = limiter_for(url, variant, index)
    try:
        for _ in range(min(50, acquires)):  # warm up: the record exists, the lead has settled
            limiter.acquire()
        gc.collect()
        cpu, wall = time.thread_time(), time.perf_counter()
        for _ in range(acquires):
            limiter.acquire()
        return (time.thread_time() - cpu) / acquires, (time.perf_counter() - wall) / acquires
    finally:
        undo()
        limiter.close()


def main() -> None:
    parser = new_parser(__doc__)
    parser.add_argument("--acquires", type=int, default=2000, help="acquires per round on memory")
    parser.add_argument("--file-acquires", type=int, default=300, help="acquires per round on the file state")
    parser.add_argument("--rounds", type=int, default=7, help="rounds per variant (default 7)")
    parser.add_argument("--quick", action="store_true", help="a smoke run of a few seconds")
    args = parser.parse_args()
    if args.quick:
        args.acquires, args.file_acquires, args.rounds = 300, 50, 3
    print_machine()
    with tempfile.TemporaryDirectory() as directory:
        states = [
            ("memory", "memory://bench-events", args.acquires),
            ("file", (Path(directory) / "state.json").as_uri(), args.file_acquires),
        ]
        print(
            f"Idle acquire: median of {args.rounds} rounds, the variants taking turns. CPU: of the acquiring "
            f"thread (time.thread_time), which others' load on the machine disturbs least; wall: elapsed.\n"
        )
        print("| state | variant | CPU µs/acquire | CPU ratio | wall µs/acquire | wall ratio |")
        print("|---|---|---:|---:|---:|---:|")
        for state, url, acquires in states:
            cpu: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
            wall: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
            for index in range(args.rounds):
                for variant in VARIANTS:
                    used, elapsed = one_round(url, variant, index, acquires)
                    cpu[variant].append(used)
                    wall[variant].append(elapsed)
            cpu_base, wall_base = statistics.median(cpu["none"]), statistics.median(wall["none"])
            for variant in VARIANTS:
                used, elapsed = statistics.median(cpu[variant]), statistics.median(wall[variant])
                print(
                    f"| {state} | {variant} | {used * 1e6:.2f} | {used / cpu_base:.3f} "
                    f"| {elapsed * 1e6:.2f} | {elapsed / wall_base:.3f} |"
                )


if __name__ == "__main__":
    main()
