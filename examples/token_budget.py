"""A token budget, as an LLM API counts it: each call is known to cost its tokens only once it answered.

The budget: 2,000 tokens a second, up to 400 at once. Four threads make
calls whose answers use 10 to 100 tokens. Each takes its turn for the most
a call may use (100, like ``max_tokens``) and settles what the answer says
it used: the saving goes back to the fleet, so more calls fit. Run once
without settling and once with, on the same budget; both keep to it
(checked on the state's clock: no run of calls over ``burst + its length /
interval`` tokens).

Run::

    python examples/token_budget.py [STATE_URL]

Without a URL the state is a JSON file in a new temporary directory.
"""

from __future__ import annotations

import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import ratequeue

RATE = "2000/second"  # tokens
BURST = 400  # tokens at once
MOST = 100  # the most one call may use: its estimate
THREADS = 4
SECONDS = 1.5


def run_calls(url: str, name: str, settle: bool) -> tuple[int, int, float, int]:
    """Calls for SECONDS from THREADS threads.

    The calls, their tokens, the tokens the budget allowed over their starts
    (the burst, plus the rate over the first to the last), and how many runs
    of starts used more than the budget allowed over them.
    """
    limiter = ratequeue.Limiter(url, name=name, rate=RATE, burst=BURST)
    interval_us = limiter.interval * 1_000_000
    calls: list[tuple[int, int]] = []  # (start on the state's clock, tokens used)
    lock = threading.Lock()
    until = time.monotonic() + SECONDS

    def caller(seed: int) -> None:
        tokens = random.Random(seed)
        while time.monotonic() < until:
            turn = limiter.acquire(cost=MOST)
            used = tokens.randint(10, MOST)  # the call itself, and the usage its answer reports
            if settle:
                limiter.settle(turn, used)
            with lock:
                calls.append((turn.start_us, used))

    threads = [threading.Thread(target=caller, args=(seed,)) for seed in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    limiter.close()
    calls.sort()
    over = 0
    for k in range(len(calls)):  # every run of starts i..k: tokens <= burst + its length in intervals
        tokens = 0
        for i in range(k, -1, -1):
            tokens += calls[i][1]
            if tokens > BURST + (calls[k][0] - calls[i][0]) / interval_us:
                over += 1
    allowed = BURST + (calls[-1][0] - calls[0][0]) / interval_us
    return len(calls), sum(used for _, used in calls), allowed, over


def run(url: str) -> int:
    broken = 0
    for settle in (False, True):
        calls, tokens, allowed, over = run_calls(url, f"examples-tokens-{settle}", settle)
        said = "settled after each call" if settle else "never settled          "
        print(
            f"{said}: {calls:3d} calls used {tokens:5d} of the {allowed:5.0f} tokens the budget allowed "
            f"({100 * tokens / allowed:3.0f} %), runs of calls over the budget: {over}"
        )
        broken += over
    return 0 if broken == 0 else 1


def main() -> int:
    if len(sys.argv) > 1:
        return run(sys.argv[1])
    with tempfile.TemporaryDirectory() as directory:
        return run((Path(directory) / "state.json").as_uri())


if __name__ == "__main__":
    sys.exit(main())
