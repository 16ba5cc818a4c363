"""ratequeue.spark on a standalone Spark cluster that the tests start: a master and two workers.

The checks of ``tests/test_spark.py`` (imported from there, with its referee
and limiter fixtures), run on a real cluster instead of ``local[2]``: a
master and two workers of one core each (:mod:`tests.spark_cluster`, one
cluster per session), each worker launching an executor JVM of its own,
whose Python workers unpickle the limiter as configuration and connect to
the Redis fixture themselves. Every row is processed exactly once, at its
own turn, by both executors, and the strict referee (20 ms, 0.5 ms
tolerance; the limiter's interval 25 ms) refuses no call. Then
``examples/spark_api_calls.py`` is submitted to the cluster with
``spark-submit --master spark://...``, first, before this module's
SparkSession holds the cluster's two cores.

Everything runs on this host: Redis' ``TIME``, the workers' clocks and the
referee's kernel timestamps read the same clock, as the checks need. Without
PySpark or Java the tests are skipped locally and fail under CI.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

import ratequeue

from . import test_spark
from .servers import Server, unavailable
from .spark_cluster import SparkCluster, spark_home
from .test_spark import (
    EXAMPLE,
    ROOT,
    Call,
    check_acquire_timeout,
    check_batches,
    check_batches_per_batch,
    check_example,
    check_partitions,
    check_udf,
    example_url,
    require_spark,
    spark_session,
)

#: test_spark's fixtures, the same here: a limiter on the Redis fixture under a key prefix of its
#: own, per test; the strict referee, one process per module, reset for each test
if TYPE_CHECKING:
    from referee import Referee  # bench/referee.py, on the path once test_spark is imported

limiter = test_spark.limiter
referee_process = test_spark.referee_process
referee = test_spark.referee

WORKERS = 2
#: what each application asks of the cluster: one executor of one core on each worker, with the
#: worker's 512 MiB (Spark refuses less than 450 MiB); the first job waits until both executors
#: have registered, so that every job runs on both
APP_CONF = {
    "spark.executor.cores": "1",
    "spark.executor.memory": "512m",
    "spark.cores.max": str(WORKERS),
    "spark.scheduler.minRegisteredResourcesRatio": "1.0",
    "spark.scheduler.maxRegisteredResourcesWaitingTime": "60s",
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    # JVMs that start sooner and use fewer threads on a small host: the client compiler, one GC thread
    "spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC",
    "spark.executor.extraJavaOptions": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC",
    # a checkout without ratequeue installed works too: the executors' Python workers import it from here
    "spark.executorEnv.PYTHONPATH": str(ROOT),
}

pytestmark = [
    # PySpark 4 warns, on the driver, that it does not fully support pandas >= 3
    pytest.mark.filterwarnings("ignore:PySpark does not yet fully support pandas:FutureWarning"),
    pytest.mark.processes,
    # the first test starts the cluster, the second a session with two executor JVMs: each takes
    # 10-30 s on a 2-core host, more when other work shares it
    pytest.mark.timeout(240),
]


@pytest.fixture(scope="session")
def spark_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SparkCluster]:
    """A master and two workers (1 core, 512 MiB each) on 127.0.0.1, for the whole session."""
    require_spark()
    if spark_home() is None:
        unavailable(
            "pyspark's bin/spark-class or jars are missing: reinstall pyspark to run the cluster tests"
        )
    cluster = SparkCluster(tmp_path_factory.mktemp("spark-cluster"), workers=WORKERS, cores=1, memory="512m")
    try:
        cluster.start()
    except RuntimeError as exc:
        unavailable(f"the standalone Spark cluster did not start: {exc}")
    yield cluster
    cluster.stop()


def test_example_submitted_to_the_cluster(spark_cluster: SparkCluster, redis_server: Server) -> None:
    """``spark-submit --master spark://... examples/spark_api_calls.py --state ...`` on the Redis fixture.

    First in the module: the application holds both of the cluster's cores until it ends.
    """
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    result = spark_cluster.submit(
        EXAMPLE, ["--state", example_url(redis_server)], conf=APP_CONF, env={"PYTHONPATH": path}, timeout=200
    )
    output = check_example(result)
    assert re.search(rf"^200 rows on {re.escape(spark_cluster.master_url)};", output, re.MULTILINE), output


#: how long (s) the session waits for an executor on each worker
EXECUTORS_WAIT = 60.0


@pytest.fixture(scope="module")
def spark(spark_cluster: SparkCluster) -> Iterator[Any]:
    """One SparkSession on the cluster for the module, with an executor on each worker."""
    for session in spark_session(spark_cluster.master_url, APP_CONF):
        status = session.sparkContext._jsc.sc().getExecutorMemoryStatus
        deadline = time.monotonic() + EXECUTORS_WAIT
        while (executors := status().size() - 1) < WORKERS and time.monotonic() < deadline:  # less the driver
            time.sleep(0.1)  # the second executor registers a moment after the session starts
        assert executors == WORKERS, f"{executors} executors\n{spark_cluster.log_tails()}"
        yield session


def on_both_executors(calls: list[Call]) -> None:
    """Each partition ran on an executor of its own: two Python worker processes made the calls."""
    assert len({call.pid for call in calls}) == WORKERS, sorted({call.pid for call in calls})


def test_partitions_on_the_cluster(spark: Any, limiter: ratequeue.Limiter, referee: Referee) -> None:
    on_both_executors(check_partitions(spark, limiter, referee))


def test_batches_on_the_cluster(spark: Any, limiter: ratequeue.Limiter, referee: Referee) -> None:
    on_both_executors(check_batches(spark, limiter, referee))


def test_batches_per_batch_on_the_cluster(spark: Any, limiter: ratequeue.Limiter, referee: Referee) -> None:
    on_both_executors(check_batches_per_batch(spark, limiter, referee))


def test_udf_on_the_cluster(spark: Any, limiter: ratequeue.Limiter, referee: Referee) -> None:
    on_both_executors(check_udf(spark, limiter, referee))


def test_acquire_timeout_on_the_cluster_reaches_the_driver(spark: Any, redis_server: Server) -> None:
    """The executor's AcquireTimeout, after Spark's task retries on a cluster, rebuilt on the driver."""
    check_acquire_timeout(spark, redis_server)
