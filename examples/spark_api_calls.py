"""A PySpark pipeline calls a rate-limited HTTP API at one call per interval, across all its executors.

A DataFrame of 200 rows, in two partitions, runs on ``local[2]`` (two Python
worker processes working at once). A column is computed by a UDF that calls a local HTTP
service (``api_service.py``, standard library only). The service answers
**429** to any call that reaches it sooner than 20 ms after the previous one
it accepted (less a tolerance of 5 ms for the jitter of waking up and
connecting, see below). The UDF is made with ``ratequeue.spark.throttled_udf``:
every row first takes its turn in one queue kept in Redis, shared by both
workers, so the calls start one per 20 ms in total and none is refused.

It prints the rows processed, the 429s (must be 0), the gaps between calls
as the service saw them, the gaps between the turns on the state's (Redis)
clock, and how long after its turn began each call reached the service. It
exits 1 if a row is lost, a call is refused, two turns are closer than the
interval, or a call came before its turn.

The turns are exactly 20 ms apart or more; the service sees each call a
little after its turn began (a fraction of a millisecond on an idle host), so
its gaps scatter around 20 ms, about half of them a little under. On a host
whose CPUs are busy with other work, a worker can run a call several
milliseconds late, and the call after it then reaches the service that much
sooner than 20 ms after it: the last line shows that delay.

Run::

    python examples/spark_api_calls.py [REDIS_URL]

The default ``REDIS_URL`` is ``redis://127.0.0.1:6379/15?prefix=spark-example:``.
It needs ``pip install 'ratequeue[spark,redis]'`` and Java 17 or later.
"""

from __future__ import annotations

import itertools
import os
import statistics
import sys
from pathlib import Path

from api_service import ApiService, call
from pyspark.sql import SparkSession

import ratequeue
from ratequeue.spark import current_turn, throttled_udf

DEFAULT_URL = "redis://127.0.0.1:6379/15?prefix=spark-example:"
ROWS = 200
INTERVAL = 0.02  # seconds between two calls, across every worker
#: how much sooner than INTERVAL a call may reach the service and still be accepted: the jitter of
#: waking up and connecting on a busy host (see api_service.py and docs/spark.md)
TOLERANCE = 0.005
NAME = "spark-example"


def main() -> int:
    url = sys.argv[1] if len(sys.argv) > 1 else DEFAULT_URL
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # Spark binds and connects on loopback only
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # workers run this interpreter
    spark = (
        SparkSession.builder.master("local[2]")
        .appName("ratequeue-spark-api-calls")
        .config("spark.ui.enabled", "false")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    # the workers import api_service (the UDF calls api_service.call): ship it to them
    spark.sparkContext.addPyFile(str(Path(__file__).with_name("api_service.py")))
    limiter = ratequeue.Limiter(url, name=NAME, interval=INTERVAL)
    print(f"{ROWS} rows on local[2], one call per {INTERVAL * 1000:g} ms in total, state {url}")
    try:
        with ApiService(INTERVAL, tolerance=TOLERANCE) as service:
            base = service.url

            def call_api(row_id: int) -> tuple[int, int, int, float]:
                """Call the service for one row; runs in a worker, at the row's turn."""
                turn = current_turn()  # the turn this row was given
                assert turn is not None
                return call(base, row_id), turn.ticket, turn.start_us, turn.local_start

            api = throttled_udf(
                limiter, call_api, "struct<status:int,ticket:long,start_us:long,local_start:double>"
            )
            # one partition per task slot: Spark's work between tasks delays the calls around it
            frame = spark.range(0, ROWS, numPartitions=2).withColumn("result", api("id"))
            rows = frame.select("id", "result.*").collect()
            summary = service.summary()
            arrivals = {arrival.key: arrival.at for arrival in service.arrivals()}
    finally:
        spark.stop()
        limiter.close()

    ids = sorted(row["id"] for row in rows)
    lost = ROWS - len(set(ids))
    refused = sum(1 for row in rows if row["status"] == 429)
    starts = sorted(row["start_us"] for row in rows)
    state_gaps = [b - a for a, b in itertools.pairwise(starts)]
    under = sum(1 for gap in state_gaps if gap < round(INTERVAL * 1_000_000))
    # when each call reached the service after its turn began, both on this host's time.monotonic();
    # a worker places its turn on that clock to within one round-trip to the state (late, never early)
    after = [(arrivals[str(row["id"])] - row["local_start"]) * 1000 for row in rows]
    early = sum(1 for delay in after if delay < 0)
    print(f"rows processed: {len(rows)} ({len(set(ids))} distinct ids, {lost} lost)")
    print(f"429s: {refused}")
    print(summary.line())
    print(
        f"turns (state clock): smallest gap {min(state_gaps) / 1000:.3f} ms, "
        f"median gap {statistics.median(state_gaps) / 1000:.3f} ms, gaps under the interval: {under}"
    )
    print(
        f"calls after their turn began (this host's clock): {early} before it, "
        f"median {statistics.median(after):.3f} ms after, latest {max(after):.3f} ms after"
    )
    ok = len(rows) == summary.requests == ROWS and lost == refused == summary.rejected == under == early == 0
    print("ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
