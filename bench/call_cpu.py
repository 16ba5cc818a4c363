"""CPU time of one state call after an idle spell: what a waiting worker's calls cost.

In ``begin_gaps.py`` each of 8 processes sleeps about 80 ms between its
calls (its turn comes once in 8 intervals). This measures one process, on
its own, making one call after sleeping ``--sleeps`` milliseconds (0, 1, 10,
84), for:

* ratequeue's idle ``Limiter.acquire()`` on Redis (one round-trip; the
  interval is 1 us, so every call starts at once);
* redis-py's ``PING`` (the floor of any Redis call from Python);
* a local ``socket.socketpair`` echo of 8 bytes (the floor of any call at all:
  two system calls and a wake-up, no Redis).

It prints the CPU time (``time.process_time``, this process only) per call,
median and p90 over ``--calls`` calls. On a virtual machine whose idle vCPU
halts, a call made after a sleep of 10 ms or more can cost several times the
same call made back to back (caches and TLB refilled, the vCPU rescheduled):
that, not ratequeue's own code, sets the floor of CPU per start when every
worker waits most of the time.

Run::

    python bench/call_cpu.py            # about 30 s
    python bench/call_cpu.py --quick    # a smoke run
"""

from __future__ import annotations

import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import add_common, new_parser, numbers, print_machine, redis_server, table


def cpu_per_call(call: Callable[[], object], sleep: float, calls: int) -> tuple[float, float]:
    """Median and p90 CPU seconds of ``call`` made ``calls`` times, each after ``sleep`` s asleep."""
    spent: list[float] = []
    for _ in range(calls):
        if sleep:
            time.sleep(sleep)
        before = time.process_time()
        call()
        spent.append(time.process_time() - before)
    spent.sort()
    return statistics.median(spent), spent[int(0.9 * (len(spent) - 1))]


def main(argv: list[str] | None = None) -> int:
    parser = new_parser(__doc__)
    parser.add_argument("--sleeps", default="0,1,10,84", help="ms asleep before each call (0,1,10,84)")
    parser.add_argument("--calls", type=int, default=100, help="calls per cell (100)")
    add_common(parser, quick="a smoke run: 20 calls per cell", plot="(no plots)")
    args = parser.parse_args(argv)
    if args.quick:
        args.calls = 20
    sleeps = numbers(args.sleeps)
    if args.calls < 1 or any(s < 0 for s in sleeps):
        parser.error("--calls must be at least 1 and --sleeps at least 0")

    import redis

    import ratequeue

    print_machine()
    with redis_server(args.redis_url) as url:
        limiter = ratequeue.Limiter(url, name=f"call-cpu-{time.time_ns()}", interval=1e-6)
        client = redis.Redis.from_url(url)
        left, right = socket.socketpair()

        def echo() -> None:
            left.sendall(b"12345678")
            right.sendall(right.recv(8))
            left.recv(8)

        subjects: list[tuple[str, Callable[[], object]]] = [
            ("ratequeue acquire (Redis)", limiter.acquire),
            ("redis-py PING", client.ping),
            ("socketpair echo", echo),
        ]
        for _, call in subjects:  # connect and warm up
            call()
        rows = []
        for name, call in subjects:
            cells = [cpu_per_call(call, ms / 1000, args.calls) for ms in sleeps]
            rows.append([name, *(f"{median * 1e6:.0f} / {p90 * 1e6:.0f}" for median, p90 in cells)])
        limiter.state.reset(limiter.name)
        limiter.close()
        client.close()
        left.close()
        right.close()
    print(f"CPU µs per call (median / p90 of {args.calls}), after sleeping this long before each call:\n")
    print(table(["call", *(f"after {ms:g} ms" for ms in sleeps)], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
