"""Several "hosts" share one rate through Redis.

Each worker process stands for a host: it builds its own ``Limiter`` from
the Redis URL and calls ``acquire()`` a few times. The workers share nothing
but the Redis server, yet their starts are spaced one interval apart on the
state's clock (Redis ``TIME``) and come in ticket order, whatever the clocks
of their hosts say. The parent then prints every start in order with the gap
before it, and a summary. It exits 1 if two starts came closer than the
interval, and 2 if Redis cannot be reached.

Run (a Redis server must be listening)::

    python examples/redis_hosts.py [REDIS_URL]

The default URL is ``redis://127.0.0.1:6379/15?prefix=example:``: database
15, and the queue's record is the hash ``example:examples-redis-hosts``. The
run resets that record first, so it can be repeated. On real hosts, each
would run ``worker()`` with the same URL.
"""

from __future__ import annotations

import itertools
import multiprocessing
import statistics
import sys

import ratequeue
from ratequeue.state.redis import RedisState

DEFAULT_URL = "redis://127.0.0.1:6379/15?prefix=example:"
INTERVAL = 0.05  # seconds between two starts, across all hosts
HOSTS = 4
CALLS_PER_HOST = 5
NAME = "examples-redis-hosts"


def worker(url: str, host: int) -> list[tuple[int, int, int]]:
    """Acquire CALLS_PER_HOST turns; return (start_us, ticket, host) for each."""
    limiter = ratequeue.Limiter(url, name=NAME, interval=INTERVAL)
    try:
        turns = [limiter.acquire() for _ in range(CALLS_PER_HOST)]
    finally:
        limiter.close()
    return [(turn.start_us, turn.ticket, host) for turn in turns]


def run(url: str) -> int:
    with ratequeue.open_state(url) as state:
        if not isinstance(state, RedisState):
            print(f"not a Redis URL: {url}", file=sys.stderr)
            return 2
        state.reset(NAME)  # a fresh record with this script's interval
        key = state.key(NAME)
    print(f"{HOSTS} hosts x {CALLS_PER_HOST} calls, interval {INTERVAL * 1000:g} ms, {url} (hash {key})")
    # "spawn" starts fresh interpreters: the workers share nothing with this
    # process, or with each other, but the Redis URL
    context = multiprocessing.get_context("spawn")
    with context.Pool(HOSTS) as pool:
        results = pool.starmap(worker, [(url, host) for host in range(1, HOSTS + 1)])

    starts = sorted(itertools.chain.from_iterable(results))  # by start time on the Redis clock
    gaps = [later[0] - earlier[0] for earlier, later in itertools.pairwise(starts)]
    for (start, ticket, host), gap in zip(starts, [None, *gaps], strict=True):
        shown = "" if gap is None else f"  gap {gap / 1000:7.3f} ms"
        print(f"host {host}  ticket {ticket:>4}  start {start / 1_000_000:.6f}{shown}")

    interval_us = round(INTERVAL * 1_000_000)
    under = sum(1 for gap in gaps if gap < interval_us)
    tickets = [ticket for _, ticket, _ in starts]
    in_order = tickets == sorted(tickets)
    span = (starts[-1][0] - starts[0][0]) / 1_000_000
    print()
    print(
        f"{len(starts)} starts from {HOSTS} hosts, smallest gap {min(gaps) / 1000:.3f} ms, "
        f"median gap {statistics.median(gaps) / 1000:.3f} ms (Redis clock), "
        f"rate {len(gaps) / span:.2f}/s of {1 / INTERVAL:.2f}/s, "
        f"gaps under the interval: {under}, tickets in start order: {'yes' if in_order else 'NO'}"
    )
    with ratequeue.open_state(url) as state:
        record = state.read(NAME).record
    print(f"record in Redis: {record}")
    return 0 if under == 0 and in_order else 1


def main() -> int:
    url = sys.argv[1] if len(sys.argv) > 1 else DEFAULT_URL
    try:
        return run(url)
    except ratequeue.RateQueueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
