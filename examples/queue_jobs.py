"""A Queue runs jobs at one start per interval and hands back futures.

``queue.add(fn, *args)`` returns a ``concurrent.futures.Future`` at once. The
queue starts each job at its global turn, in the order the jobs were added,
in a thread of its own, so a slow job does not delay the next start.
``queue.join()`` waits until every job has finished. A job that raises does
not stop the others: its future holds the exception.

Run::

    python examples/queue_jobs.py [STATE_URL]

Without a URL the state is a JSON file in a new temporary directory.
"""

from __future__ import annotations

import itertools
import sys
import tempfile
import time
from concurrent.futures import Future
from pathlib import Path

import ratequeue

INTERVAL = 0.05  # seconds between two job starts
JOBS = 8
BROKEN = 3  # the job that raises


def run(url: str) -> int:
    t0 = time.monotonic()
    began: dict[int, float] = {}

    def resize(image: int) -> str:
        """Pretend to process one image; image BROKEN is unreadable."""
        began[image] = time.monotonic()
        print(f"job {image} began at {began[image] - t0:6.3f} s")
        time.sleep(0.1)  # longer than the interval: jobs overlap
        if image == BROKEN:
            raise ValueError(f"image {image} is unreadable")
        return f"image {image} resized"

    with ratequeue.Queue(url, name="examples-queue-jobs", interval=INTERVAL) as queue:
        futures: list[Future[str]] = [queue.add(resize, image) for image in range(JOBS)]
        print(f"added {JOBS} jobs at interval {INTERVAL * 1000:g} ms; {queue.pending} not started yet")
        finished = queue.join(timeout=30)
        print(f"join() returned {finished}")
    # leaving the with block closed the queue: it accepts no more jobs

    print()
    failed = 0
    for image, future in enumerate(futures):
        error = future.exception()
        if error is None:
            print(f"job {image}: {future.result()}")
        else:
            failed += 1
            print(f"job {image} failed: {type(error).__name__}: {error}")

    starts = sorted(began.values())
    gaps = [later - earlier for earlier, later in itertools.pairwise(starts)]
    print()
    print(
        f"{JOBS} jobs: {JOBS - failed} succeeded, {failed} failed; "
        f"average gap between starts {1000 * sum(gaps) / len(gaps):.3f} ms, "
        f"smallest {1000 * min(gaps):.3f} ms (local clock)"
    )
    return 0 if finished else 1


def main() -> int:
    if len(sys.argv) > 1:
        return run(sys.argv[1])
    with tempfile.TemporaryDirectory() as directory:
        return run((Path(directory) / "state.json").as_uri())


if __name__ == "__main__":
    sys.exit(main())
