"""A PySpark pipeline calls a rate-limited HTTP API at one call per interval, across all its executors.

A DataFrame of 200 rows, in two partitions, runs on ``local[2]`` (two Python
worker processes working at once), or on the cluster that ``--master`` or
``spark-submit`` names. A column is computed by a UDF that calls a
local HTTP service standing in for the API: the strict referee of the
benchmarks (``bench/referee.py``, standard library only, in a process of its
own). It answers **429** to any call that *arrives* sooner than 20 ms after
the previous call it accepted, less a tolerance of only 0.5 ms; "arrives" is
the kernel's receive timestamp of the request, not when the referee got round
to reading it. The UDF is made with ``ratequeue.spark.throttled_udf``: every
row first takes its turn in one queue kept in Redis, shared by both workers,
so the calls begin one per interval in total and none is refused.

The limiter is given the API's limit plus a margin of 5 ms (25 ms): the
moments ``acquire()`` returns are at least ``interval - max_late`` apart
(G7; ``max_late`` is 0.3 ms by default), and each call then takes a moment
to reach the service, a little more for one call than for another (up to
4.4 ms on a two-core host, through Spark's Python workers). The margin
covers both.

It prints the rows processed, the 429s (must be 0), the gaps between calls as
the referee saw them, the gaps between the turns on the state's (Redis)
clock, and how long after its turn began each call reached the referee (both
on this host's ``CLOCK_REALTIME``, which Redis' ``TIME`` reads). It exits 1
if a row is lost, a call is refused, two turns are closer than the limiter's
interval, or a call came before its turn.

Run, from a checkout of the repository (the referee lives in ``bench/``)::

    python examples/spark_api_calls.py [--state REDIS_URL] [--master MASTER]

or submit it to a standalone cluster, whose master then applies::

    spark-submit --master spark://HOST:7077 examples/spark_api_calls.py --state REDIS_URL

The default state is ``redis://127.0.0.1:6379/15?prefix=spark-example:``;
the default master ``local[2]``, unless ``spark-submit`` gives one. The
state must be reachable from every executor. The referee listens on the
driver's loopback interface and the clock checks compare this host's clock
with Redis': on a cluster, the executors and Redis must run on the driver's
host (as in ``tests/test_spark_cluster.py``). It needs ``pip install
'ratequeue[spark,redis]'`` and Java 17 or later.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from pathlib import Path

from pyspark.sql import SparkSession

import ratequeue
from ratequeue.spark import current_turn, throttled_udf

# the referee is not part of the library: it is the benchmarks' stand-in for a strict API, in bench/
REFEREE = Path(__file__).resolve().parent.parent / "bench" / "referee.py"
sys.path.insert(0, str(REFEREE.parent))
from referee import Referee, RefereeClient  # noqa: E402

DEFAULT_URL = "redis://127.0.0.1:6379/15?prefix=spark-example:"
ROWS = 200
INTERVAL = 0.02  # the API's limit: seconds between two calls, across every worker
TOLERANCE = 0.0005  # how much sooner than INTERVAL the referee still accepts a call
#: the limiter's interval: the API's limit plus a margin. acquire() returns at least
#: LIMITER_INTERVAL - max_late (0.3 ms) apart (G7), and each call reaches the API a moment later
#: (the send); the margin covers max_late and the difference between two calls' sends, which
#: reached 4.4 ms through Spark's Python workers on a 2-core host
LIMITER_INTERVAL = INTERVAL + 0.005
NAME = "spark-example"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("url", nargs="?", help=argparse.SUPPRESS)  # the state, as first given
    parser.add_argument(
        "--state", help=f"the state's URL, reachable from every executor (default {DEFAULT_URL})"
    )
    parser.add_argument(
        "--master", help="Spark's master URL (default: spark-submit's --master, else local[2])"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    url = args.state or args.url or DEFAULT_URL
    # spark-submit runs this script with a gateway of its own: then its --master (and --conf) apply
    submitted = "PYSPARK_GATEWAY_PORT" in os.environ
    master = args.master or (None if submitted else "local[2]")
    if master is not None and master.startswith("local"):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # Spark binds and connects on loopback only
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # workers run this interpreter
    builder = SparkSession.builder.appName("ratequeue-spark-api-calls").config("spark.ui.enabled", "false")
    spark = (builder if master is None else builder.master(master)).getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    # the workers unpickle a RefereeClient (module referee): ship the module to them
    spark.sparkContext.addPyFile(str(REFEREE))
    limiter = ratequeue.Limiter(url, name=NAME, interval=LIMITER_INTERVAL)
    print(
        f"{ROWS} rows on {spark.sparkContext.master}; the API takes one call per {INTERVAL * 1000:g} ms "
        f"({TOLERANCE * 1000:g} ms tolerance), the limiter's interval is {LIMITER_INTERVAL * 1000:g} ms; "
        f"state {url}"
    )
    try:
        with Referee(INTERVAL, TOLERANCE) as referee:
            # pickled into the UDF: each Python worker opens one kept-alive connection of its own
            client = RefereeClient(str(referee.url))

            def call_api(row_id: int) -> tuple[int, int, int]:
                """Call the API for one row; runs in a worker, at the row's turn."""
                turn = current_turn()  # the turn this row was given
                assert turn is not None
                return client.call(str(row_id)), turn.ticket, turn.start_us

            api = throttled_udf(limiter, call_api, "struct<status:int,ticket:long,start_us:long>")
            # one partition per task slot: Spark's work between tasks delays the calls around it
            frame = spark.range(0, ROWS, numPartitions=2).withColumn("result", api("id"))
            began = time.monotonic()
            rows = frame.select("id", "result.*").collect()
            elapsed = time.monotonic() - began
            stats = referee.stats()
    finally:
        spark.stop()
        limiter.close()

    ids = sorted(row["id"] for row in rows)
    lost = ROWS - len(set(ids))
    refused = sum(1 for row in rows if row["status"] == 429)
    starts = sorted(row["start_us"] for row in rows)
    state_gaps = [b - a for a, b in itertools.pairwise(starts)]
    under = sum(1 for gap in state_gaps if gap < round(LIMITER_INTERVAL * 1_000_000))
    arrivals = {arrival.who: arrival.t_ns for arrival in stats.arrivals}
    arrival_gaps = [(b.t_ns - a.t_ns) / 1e6 for a, b in itertools.pairwise(stats.arrivals)]
    # when each call reached the referee after its turn began: both on CLOCK_REALTIME (Redis' TIME)
    after = [(arrivals[str(row["id"])] - row["start_us"] * 1000) / 1e6 for row in rows]
    early = sum(1 for delay in after if delay < 0)
    print(f"rows processed: {len(rows)} ({len(set(ids))} distinct ids, {lost} lost)")
    print(f"429s: {refused}")
    print(
        f"referee saw {len(stats.arrivals)} calls, {stats.accepted} accepted, {stats.rejected} answered 429; "
        f"smallest gap {min(arrival_gaps):.3f} ms, median gap {statistics.median(arrival_gaps):.3f} ms "
        f"({stats.timestamps})"
    )
    print(
        f"turns (state clock): smallest gap {min(state_gaps) / 1000:.3f} ms, "
        f"median gap {statistics.median(state_gaps) / 1000:.3f} ms, gaps under the interval: {under}"
    )
    span = (stats.arrivals[-1].t_ns - stats.arrivals[0].t_ns) / 1e9
    print(
        f"throughput: {len(rows) / elapsed:.1f} rows/s over the job ({elapsed:.2f} s), "
        f"{(len(stats.arrivals) - 1) / span:.1f} calls/s from the first call to the last "
        f"(the limiter's rate: {1 / LIMITER_INTERVAL:g}/s)"
    )
    print(
        f"calls after their turn began (this host's clock): {early} before it, "
        f"median {statistics.median(after):.3f} ms after, latest {max(after):.3f} ms after"
    )
    ok = len(rows) == len(stats.arrivals) == ROWS and lost == refused == stats.rejected == under == early == 0
    print("ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
