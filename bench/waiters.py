"""What waiting for a place costs the state: calls per second of a shard whose head waits on a full queue.

A queue with ``max_running=1`` is kept full by one holder (a limiter whose
job runs for ``--hold`` seconds, its lease renewed in the background).
Meanwhile ``--waiters`` other shards (limiter objects of their own, each a
thread here, as each would be a process) wait for a place. Every shard's
state is a counting proxy around a real state (``_common.CountingState``),
so the calls are counted where the limiters make them. The table shows, per
state: the calls per second each waiting shard made, the holder's calls
per second (its lease renewals), and how soon after the holder released its
place the first waiter began. An idle shard (no job) makes no call: that is
checked too.

Run::

    python bench/waiters.py                  # about 20 seconds
    python bench/waiters.py --quick          # a smoke run
    python bench/waiters.py --backends redis --waiters 8 --hold 10

It starts its own ``redis-server`` on a free port (or uses ``--redis-url``)
and keeps state files in a temporary directory.
"""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path

import _common

from ratequeue import AcquireTimeout, Limiter

STATES = ("memory", "file", "redis")


def measure(url: str, name: str, waiters: int, hold: float, lease: float) -> dict[str, float]:
    """One run: a holder keeps the place ``hold`` seconds while ``waiters`` shards wait; counts per second."""
    holder_state = _common.CountingState(_common.open_state(url))
    holder = Limiter(holder_state, name=name, interval=0.001, max_running=1, lease=lease)
    idle_state = _common.CountingState(_common.open_state(url))
    idle = Limiter(idle_state, name=name, interval=0.001, max_running=1, lease=lease)
    shards = [
        (state, Limiter(state, name=name, interval=0.001, max_running=1, lease=lease))
        for state in (_common.CountingState(_common.open_state(url)) for _ in range(waiters))
    ]
    turn = holder.acquire()
    holder_state.log.clear()
    began: list[float] = []
    lock = threading.Lock()

    def wait(limiter: Limiter) -> None:
        try:
            got = limiter.acquire(timeout=hold + 30)
        except AcquireTimeout:
            return
        with lock:
            began.append(time.monotonic())
        limiter.release(got)

    threads = [threading.Thread(target=wait, args=(limiter,)) for _, limiter in shards]
    for thread in threads:
        thread.start()
    time.sleep(hold)  # the measured span: the holder's job runs, the others wait
    calls = [state.log.total for state, _ in shards]
    renewals = holder_state.log.total
    released = time.monotonic()
    holder.release(turn)
    for thread in threads:
        thread.join(60)
    first = min(began) - released if began else float("nan")
    for state, limiter in shards:
        limiter.close()
        state.close()
    idle_calls = idle_state.log.total
    holder.close()
    idle.close()
    return {
        "per_waiter": sum(calls) / len(calls) / hold,
        "max_waiter": max(calls) / hold,
        "holder": renewals / hold,
        "first_after_release_ms": first * 1000,
        "idle_calls": idle_calls,
    }


def main() -> int:
    parser = _common.new_parser(__doc__)
    _common.add_backends(parser, STATES, "states to measure, comma-separated (default: all)")
    _common.add_common(parser, quick="a short smoke run", plot="(no plot: this benchmark prints a table)")
    parser.add_argument("--waiters", type=int, default=4, help="shards waiting for a place (default 4)")
    parser.add_argument(
        "--hold", type=float, default=5.0, help="seconds the holder keeps the place (default 5)"
    )
    parser.add_argument("--lease", type=float, default=3.0, help="the lease in seconds (default 3)")
    args = parser.parse_args()
    if args.quick:
        args.hold, args.waiters = 1.5, 2
    states = _common.chosen(parser, args.backends, STATES, "states")
    _common.print_machine()
    print(
        f"\n{args.waiters} shards wait {args.hold:g} s for the one place of a max_running=1 queue "
        f"(lease {args.lease:g} s, renewed every {args.lease / 3:g} s)\n"
    )
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        file_url = (Path(directory) / "state.json").as_uri()
        for backend in states:
            with _common.state_url(backend, args, file_url) as url:
                name = _common.unique_name(f"waiters-{backend}")
                figures = measure(url, name, args.waiters, args.hold, args.lease)
            rows.append(
                [
                    backend,
                    f"{figures['per_waiter']:.1f}",
                    f"{figures['max_waiter']:.1f}",
                    f"{figures['holder']:.2f}",
                    f"{figures['first_after_release_ms']:.1f}",
                    f"{figures['idle_calls']:.0f}",
                ]
            )
    print(
        _common.table(
            [
                "state",
                "calls/s per waiting shard",
                "most (one shard)",
                "holder calls/s (renewals)",
                "first begin after release (ms)",
                "idle shard's calls",
            ],
            rows,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
