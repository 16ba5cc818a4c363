"""ratequeue.spark on a real local Spark (``local[2]``) with a real Redis state and a real HTTP service.

One SparkSession serves the module (the example runs its own, in a
subprocess, before it starts). Each helper runs 200 rows at 20 ms through
two Python workers sharing one queue in the ``redis_server`` fixture, each
row calling ``examples/api_service.py``. Each test checks, strictly, that
every row is processed exactly once with a ticket of its own, that the turns
are at least 20 ms apart on the state's clock (G1 through Spark), and that
no call reached the service before its turn began; then that the service
refused no call. The service sees each call after its worker woke up and
connected, so it accepts calls up to ``TOLERANCE`` early; a call it still
refuses can only follow one that the host ran later than that (the turns
being exact and no call early): then the test says so and skips, reporting
the delays — a loaded host's wake-up jitter, not a ratequeue fault. See
``check_calls`` and docs/spark.md for the measured delays.

Without PySpark or Java the tests are skipped locally and fail under CI.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import ratequeue
from ratequeue import ConfigurationError

from .servers import Server, free_port, unavailable

try:
    import pyspark
except ImportError:  # pragma: no cover - CI installs it
    pyspark = None

ROOT = Path(__file__).resolve().parent.parent
API_SERVICE = ROOT / "examples" / "api_service.py"
EXAMPLE = ROOT / "examples" / "spark_api_calls.py"

ROWS = 200
#: one partition per task slot: both workers call at once from start to end, and Spark's own work
#: between tasks (which delays calls on two cores) happens only at the start and the end
PARTITIONS = 2
INTERVAL = 0.02
INTERVAL_US = 20_000
#: how much sooner than INTERVAL the service accepts a call: the wake-up and connection jitter of
#: two calls from different processes on a busy two-core host (measured, docs/spark.md)
TOLERANCE = 0.005

pytestmark = [
    # PySpark 4 warns, on the driver, that it does not fully support pandas >= 3
    pytest.mark.filterwarnings("ignore:PySpark does not yet fully support pandas:FutureWarning"),
    pytest.mark.processes,
]


def _load_api_service() -> Any:
    """examples/api_service.py as the top-level module ``api_service``, the name the workers import."""
    spec = importlib.util.spec_from_file_location("api_service", API_SERVICE)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["api_service"] = module
    spec.loader.exec_module(module)
    return module


api_service = _load_api_service()


def require_spark(java: bool = True) -> None:
    """Skip (fail under CI) without PySpark, or without Java when ``java``."""
    if pyspark is None:
        unavailable("pyspark is not installed: pip install -e '.[spark,test]' to run the Spark tests")
    if java and shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        unavailable("java is not on PATH: install a JDK (17 or later) to run the Spark tests")


def test_example_runs_against_the_fixture_redis(redis_server: Server) -> None:
    """examples/spark_api_calls.py in a subprocess (its own Spark), on the fixture's Redis.

    First in the module, so that it runs before the module's SparkSession starts: one JVM at a time.
    """
    require_spark()
    url = f"redis://127.0.0.1:{redis_server.port}/0?prefix=spark-example-{uuid.uuid4().hex[:8]}:"
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), url],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    output = result.stdout

    def line(pattern: str) -> re.Match[str]:
        match = re.search(pattern, output, re.MULTILINE)
        assert match, f"no line matching {pattern!r} in:\n{output}\n{result.stderr[-3000:]}"
        return match

    line(r"^rows processed: 200 \(200 distinct ids, 0 lost\)$")
    line(r"^turns \(state clock\): smallest gap [\d.]+ ms, .*under the interval: 0$")
    line(r"^calls after their turn began \(this host's clock\): 0 before it, ")
    refused = int(line(r"^429s: (\d+)$")[1])
    line(rf"^service saw 200 requests, {200 - refused} accepted, {refused} answered 429; ")
    if refused:  # turns were exact and no call came early: the host ran some late (see check_calls)
        pytest.skip(f"this host ran calls too late for the service-side check:\n{output}")
    assert result.returncode == 0, f"exited {result.returncode}\n{output}\n{result.stderr[-3000:]}"
    assert output.rstrip().endswith("ok")


def test_api_service_runs_as_a_script() -> None:
    """examples/api_service.py on its own: a burst is refused, calls through a limiter are not."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, str(API_SERVICE)], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    output = result.stdout
    burst = re.search(r"^8 calls back-to-back: +statuses \[(.*)\]$", output, re.MULTILINE)
    paced = re.search(r"^8 calls through a limiter: statuses \[(.*)\]$", output, re.MULTILINE)
    assert burst, output + result.stderr
    assert paced, output + result.stderr
    assert burst[1].startswith("200, 429")
    if "429" in paced[1]:  # the script does not report delays: a loaded host's jitter is the only cause
        pytest.skip(f"this host ran calls too late for the service-side check:\n{output}")
    assert paced[1] == ", ".join(["200"] * 8)
    assert re.search(r"^gaps between them at the service: smallest [\d.]+ ms", output, re.MULTILINE)
    assert result.returncode == 0, output + result.stderr


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    """One SparkSession on ``local[2]`` for the module; the workers can import ``api_service``."""
    require_spark()
    from pyspark.sql import SparkSession

    saved = {key: os.environ.get(key) for key in ("SPARK_LOCAL_IP", "PYSPARK_PYTHON")}
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    os.environ["PYSPARK_PYTHON"] = sys.executable
    session = (
        SparkSession.builder.master("local[2]")
        .appName("ratequeue-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    session.sparkContext.addPyFile(str(API_SERVICE))
    try:
        yield session
    finally:
        session.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture
def limiter(redis_server: Server) -> Iterator[ratequeue.Limiter]:
    """A limiter at 20 ms on the Redis fixture, under a key prefix of its own."""
    url = f"redis://127.0.0.1:{redis_server.port}/0?prefix=spark-{uuid.uuid4().hex[:8]}:"
    made = ratequeue.Limiter(url, name="api", interval=INTERVAL)
    yield made
    made.close()


@pytest.fixture
def service() -> Iterator[Any]:
    with api_service.ApiService(INTERVAL, tolerance=TOLERANCE) as running:
        yield running


def check_calls(calls: list[tuple[str, int, int, int]], service: Any, keys: list[str]) -> None:
    """What ratequeue promises about the calls, then what the service saw.

    ``calls`` holds (key, status, ticket, start_us) per call made; ``keys`` the keys expected, once each.
    Strict: each key called exactly once, one ticket per call, turns >= 20 ms apart on the state's
    clock (G1), and no call reaching the service before its turn began (the Redis server's ``TIME``
    and the service's ``time.time()`` read the same clock on this host). The service's gaps are then
    the turns' gaps plus the difference between two calls' delays after their turns, so a call it
    refuses came after one that the host ran more than the tolerance late: then the test skips,
    naming the delays.
    """
    arrivals = {arrival.key: arrival for arrival in service.arrivals()}
    assert sorted(a.key for a in service.arrivals()) == sorted(keys), "each call reached the service once"
    assert sorted(key for key, *_ in calls) == sorted(keys), "each call made once"
    assert len({ticket for _, _, ticket, _ in calls}) == len(calls), "one ticket per call"
    starts = sorted(start for *_, start in calls)
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert min(gaps) >= INTERVAL_US, f"two turns {min(gaps)} us apart on the state's clock"
    delays = {key: arrivals[key].wall - start / 1e6 for key, _, _, start in calls}
    assert min(delays.values()) >= 0, f"a call reached the service {-min(delays.values())} s before its turn"
    summary = service.summary()
    assert [status for _, status, _, _ in calls].count(429) == summary.rejected
    if summary.rejected:
        pytest.skip(
            f"this host ran calls too late for the service-side check: {summary.line()}; the latest call "
            f"reached the service {max(delays.values()) * 1000:.1f} ms after its turn began (tolerance "
            f"{TOLERANCE * 1000:g} ms), while rows, tickets and turns on the state clock were all right"
        )


def test_partitions_call_each_row_once_at_its_turn(spark: Any, limiter: Any, service: Any) -> None:
    from ratequeue.spark import current_turn, throttled_partitions

    base = service.url

    def fetch(row: int) -> tuple[int, int, int, int]:
        turn = current_turn()
        assert turn is not None
        return row, api_service.call(base, row), turn.ticket, turn.start_us

    rdd = spark.sparkContext.parallelize(range(ROWS), PARTITIONS)
    out = rdd.mapPartitions(throttled_partitions(limiter, fetch)).collect()
    assert sorted(row for row, *_ in out) == list(range(ROWS)), "every row processed exactly once"
    calls = [(str(row), status, ticket, start) for row, status, ticket, start in out]
    check_calls(calls, service, [str(row) for row in range(ROWS)])


def test_batches_call_each_row_once_at_its_turn(spark: Any, limiter: Any, service: Any) -> None:
    from ratequeue.spark import current_turn, throttled_batches

    base = service.url

    def fetch(frame: Any) -> Any:
        turn = current_turn()
        assert turn is not None
        assert len(frame) == 1
        out = frame.copy()
        out["status"] = api_service.call(base, int(frame["id"].iloc[0]))
        out["ticket"] = turn.ticket
        out["start_us"] = turn.start_us
        return out

    frame = spark.range(0, ROWS, numPartitions=PARTITIONS)
    schema = "id long, status int, ticket long, start_us long"
    rows = frame.mapInPandas(throttled_batches(limiter, fetch, per="row"), schema).collect()
    assert sorted(row["id"] for row in rows) == list(range(ROWS)), "every row processed exactly once"
    calls = [(str(row["id"]), row["status"], row["ticket"], row["start_us"]) for row in rows]
    check_calls(calls, service, [str(row) for row in range(ROWS)])


def test_batches_per_batch_take_one_turn_each(spark: Any, limiter: Any, service: Any) -> None:
    """per="batch": one turn and one call per Arrow batch (10 rows here), every row once."""
    from ratequeue.spark import current_turn, throttled_batches

    base = service.url

    def fetch(frame: Any) -> Any:
        turn = current_turn()
        assert turn is not None
        out = frame.copy()
        out["first"], out["last"] = frame["id"].min(), frame["id"].max()
        out["status"] = api_service.call(base, f"{frame['id'].min()}-{frame['id'].max()}")
        out["ticket"] = turn.ticket
        out["start_us"] = turn.start_us
        return out

    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "10")
    try:
        frame = spark.range(0, ROWS, numPartitions=PARTITIONS)
        schema = "id long, first long, last long, status int, ticket long, start_us long"
        rows = frame.mapInPandas(throttled_batches(limiter, fetch, per="batch"), schema).collect()
    finally:
        spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")
    assert sorted(row["id"] for row in rows) == list(range(ROWS)), "every row processed exactly once"
    per_call = {
        row["ticket"]: (f"{row['first']}-{row['last']}", row["status"], row["ticket"], row["start_us"])
        for row in rows
    }
    assert len(per_call) == ROWS // 10
    keys = [f"{first}-{first + 9}" for first in range(0, ROWS, 10)]  # 100 rows per partition
    check_calls(list(per_call.values()), service, keys)


def test_udf_calls_each_row_once_at_its_turn(spark: Any, limiter: Any, service: Any) -> None:
    from ratequeue.spark import current_turn, throttled_udf

    base = service.url

    def fetch(row: int) -> tuple[int, int, int]:
        turn = current_turn()
        assert turn is not None
        return api_service.call(base, row), turn.ticket, turn.start_us

    api = throttled_udf(limiter, fetch, "struct<status:int,ticket:long,start_us:long>")
    assert api.deterministic is False
    frame = spark.range(0, ROWS, numPartitions=PARTITIONS).withColumn("r", api("id"))
    rows = frame.select("id", "r.status", "r.ticket", "r.start_us").collect()
    assert sorted(row["id"] for row in rows) == list(range(ROWS)), "every row processed exactly once"
    calls = [(str(row["id"]), row["status"], row["ticket"], row["start_us"]) for row in rows]
    check_calls(calls, service, [str(row) for row in range(ROWS)])


def test_docs_snippets_run_as_written(
    spark: Any, redis_server: Server, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/spark.md's Python blocks, in order, as one script, on the fixture's Redis.

    The script runs in this process: its ``getOrCreate()`` gets the module's session (local[2] too).
    The only change made: the Redis address the page uses becomes the fixture's. Every
    ``print(...)  # expected`` line must print what its comment says, in order.
    """
    text = (ROOT / "docs" / "spark.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    script = "\n\n".join(blocks)
    assert "redis://127.0.0.1:6379/0" in script
    script = script.replace("redis://127.0.0.1:6379/0", f"redis://127.0.0.1:{redis_server.port}/0")
    expected = re.findall(r"^\s*print\(.*\)\s+# (.*)$", script, re.MULTILINE)
    assert len(expected) >= 6
    capsys.readouterr()
    namespace = {"__name__": "spark_docs"}  # not importable: the workers get its functions by value
    exec(compile(script, "docs/spark.md", "exec"), namespace)
    assert capsys.readouterr().out.splitlines() == expected


def test_acquire_timeout_in_an_executor_reaches_the_driver(spark: Any, redis_server: Server) -> None:
    """A row that cannot get its turn in time fails its task; the driver sees AcquireTimeout."""
    from ratequeue.spark import original_error, throttled_partitions, unwrap_errors

    url = f"redis://127.0.0.1:{redis_server.port}/0?prefix=spark-{uuid.uuid4().hex[:8]}:"
    slow = ratequeue.Limiter(url, name="slow", interval=30.0)
    slow.acquire()  # the driver takes the free turn: the next one is 30 s away
    rdd = spark.sparkContext.parallelize(range(4), 2).mapPartitions(
        throttled_partitions(slow, str, timeout=0.2)
    )

    with pytest.raises(Exception) as raised:  # noqa: PT011 - Spark's own exception type is checked below
        rdd.collect()
    spark_error = raised.value
    assert not isinstance(spark_error, ratequeue.RateQueueError)
    text = str(spark_error)
    assert "ratequeue.errors.AcquireTimeout: no turn in queue 'slow' within 0.2 s" in text
    rebuilt = original_error(spark_error)
    assert isinstance(rebuilt, ratequeue.AcquireTimeout)
    assert (rebuilt.name, rebuilt.timeout, str(rebuilt)) == (
        "slow",
        0.2,
        "no turn in queue 'slow' within 0.2 s",
    )

    with pytest.raises(ratequeue.AcquireTimeout) as unwrapped, unwrap_errors():
        rdd.collect()
    assert unwrapped.value.name == "slow"
    assert isinstance(unwrapped.value, TimeoutError)
    assert unwrapped.value.__cause__ is not None  # Spark's error, with the executor's traceback
    slow.close()


def test_unreachable_state_in_an_executor_reaches_the_driver(spark: Any) -> None:
    """No Redis at the URL: the UDF's rows fail with StateUnavailable, which the driver can unwrap."""
    from ratequeue.spark import throttled_udf, unwrap_errors

    port = free_port()  # nothing listens there
    nowhere = ratequeue.Limiter(f"redis://127.0.0.1:{port}/0", name="api", interval=INTERVAL)
    api = throttled_udf(nowhere, lambda row: row, "long")
    frame = spark.range(0, 2, numPartitions=1).select(api("id"))

    with pytest.raises(ratequeue.StateUnavailable) as unwrapped, unwrap_errors():
        frame.collect()
    assert unwrapped.value.where == f"127.0.0.1:{port}"
    assert "StateUnavailable" in str(unwrapped.value.__cause__)


def test_bad_arguments_fail_on_the_driver(tmp_path: Path) -> None:
    """No Spark needed: the helpers check their arguments where they are called."""
    require_spark(java=False)
    from ratequeue.spark import throttled_batches, throttled_partitions, throttled_udf

    shared = ratequeue.Limiter((tmp_path / "state.json").as_uri(), name="api", interval=INTERVAL)
    with pytest.raises(ConfigurationError, match="lives inside one process"):
        throttled_partitions(ratequeue.Limiter("memory://", name="api", interval=INTERVAL), str)
    with pytest.raises(ConfigurationError, match=r"must be a ratequeue\.Limiter"):
        throttled_partitions("redis://localhost", str)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="fn must be callable"):
        throttled_udf(shared, 42)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="per must be"):
        throttled_batches(shared, str, per="column")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="timeout"):
        throttled_partitions(shared, str, timeout=-1)


def test_process_limiter_is_one_per_configuration(tmp_path: Path) -> None:
    require_spark(java=False)
    import pickle

    from ratequeue.spark import process_limiter

    url = (tmp_path / "state.json").as_uri()
    first = ratequeue.Limiter(url, name="api", interval=INTERVAL)
    same = ratequeue.Limiter(url, name="api", interval=INTERVAL)
    other = ratequeue.Limiter(url, name="other", interval=INTERVAL)
    shard = process_limiter(first)
    assert shard is process_limiter(same) is process_limiter(pickle.dumps(same))
    assert shard is not first
    assert process_limiter(other) is not shard
