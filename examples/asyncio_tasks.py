"""Many asyncio tasks sharing one rate through ``ratequeue.aio``.

Twenty tasks call a pretend API, one start every 50 ms in total: fifteen
through ``async with limiter``, five through a second limiter on the same
state and name (standing for another process), and a decorated coroutine
shows the decorator. Prints every start and the gaps on the state's clock.

Run: ``python examples/asyncio_tasks.py [STATE_URL]`` (default: a state file
in a new temporary directory).
"""

from __future__ import annotations

import asyncio
import itertools
import sys
import tempfile
from pathlib import Path

from ratequeue import Turn, aio

INTERVAL = 0.05


async def call_api(page: int) -> str:
    """Stand-in for a rate-limited API call."""
    await asyncio.sleep(0.01)
    return f"page {page}"


async def main(url: str) -> int:
    limiter = aio.Limiter(url, name="asyncio-example", interval=INTERVAL)
    other = aio.Limiter(url, name="asyncio-example", interval=INTERVAL)  # e.g. another process

    async def fetch(via: aio.Limiter, who: str, page: int) -> Turn:
        async with via as turn:
            await call_api(page)
            print(f"{who:<7} ticket {turn.ticket:>3}  page {page}")
        return turn

    @limiter
    async def decorated(page: int) -> str:
        """Every call waits for its turn first."""
        return await call_api(page)

    turns = await asyncio.gather(
        *(fetch(limiter, "one", p) for p in range(15)), *(fetch(other, "other", p) for p in range(15, 20))
    )
    print(await decorated(20), "via the decorator", decorated.__name__, "-", decorated.__doc__)
    await limiter.close()
    await other.close()

    starts = sorted(turn.start_us for turn in turns)
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    under = sum(gap < INTERVAL * 1_000_000 for gap in gaps)
    print(
        f"{len(starts)} starts, smallest gap {min(gaps) / 1000:.3f} ms (state clock), "
        f"gaps under the interval: {under}"
    )
    return 0 if len(starts) == 20 and under == 0 else 1


if __name__ == "__main__":
    state_url = sys.argv[1] if len(sys.argv) > 1 else (Path(tempfile.mkdtemp()) / "state.json").as_uri()
    raise SystemExit(asyncio.run(main(state_url)))
