"""ratequeue.spark on a real local Spark (``local[2]``) with a real Redis state and a strict referee.

One SparkSession serves the module (the example runs its own, in a
subprocess, before it starts). Each helper runs 200 rows through two Python
workers sharing one queue in the ``redis_server`` fixture, each row calling
the strict referee of the benchmarks (``bench/referee.py``, a process of its
own): it answers 429 to a call *arriving* (the kernel's receive timestamp)
less than 20 ms less 0.5 ms after the last call it accepted. The limiter's
interval is 25 ms (see ``LIMITER_INTERVAL``). Each test checks, strictly,
that every row is processed exactly once with a ticket of its own, that the
turns are at least the limiter's interval apart on the state's clock (G1
through Spark), that no call reached the referee before its turn began, and
that the calls' begins are at least the referee's interval apart and that the
referee refused no call, but for one whose gap was lost between its begin and
its arrival (a Python worker descheduled after ``acquire()`` returned, which
no limiter prevents: once, 6.8 ms in a clean-clone CI run). Any other refusal
fails the test, which then says where the gap was lost (``refusals``).

The checks (``check_*``), the session (``spark_session``), the example's
expected output (``check_example``) and the fixtures serve
``tests/test_spark_cluster.py`` too, which runs them on a standalone cluster.

Without PySpark or Java the tests are skipped locally and fail under CI.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

import ratequeue
from ratequeue import ConfigurationError

from .servers import Server, free_port, unavailable

try:
    import pyspark
except ImportError:  # pragma: no cover - CI installs it
    pyspark = None

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "spark_api_calls.py"
#: the referee, imported here as the top-level module ``referee``, the name the workers import
#: (the spark fixture ships the file to them with addPyFile)
REFEREE = ROOT / "bench" / "referee.py"
if str(REFEREE.parent) not in sys.path:
    sys.path.insert(0, str(REFEREE.parent))

from referee import Referee, RefereeClient, RefereeStats  # noqa: E402

ROWS = 200
#: one partition per task slot: both workers call at once from start to end, and Spark's own work
#: between tasks (which delays calls on two cores) happens only at the start and the end
PARTITIONS = 2
#: the referee's limit (the service's true limit): it answers 429 to a call arriving sooner than
#: INTERVAL - TOLERANCE after the last call it accepted
INTERVAL = 0.02
TOLERANCE = 0.0005
#: the limiter's interval: the referee's plus a 5 ms margin. G7 spaces the moments acquire()
#: returns at least LIMITER_INTERVAL - max_late (0.3 ms by default) apart, and each call reaches the
#: referee a moment after that (the send, a little longer for one call than another): the margin
#: covers max_late and that difference, which reached 1.46 ms through Spark's Python workers in a
#: clean-clone CI run (one call refused with a 0.5 ms margin), and then 4.4 ms (one call of 200
#: refused with a 2 ms margin, on an otherwise quiet 2-core host: the Python worker was descheduled
#: between acquire() returning and its send; issue 9 measures begins under load on their own)
LIMITER_INTERVAL = INTERVAL + 0.005
LIMITER_INTERVAL_US = round(LIMITER_INTERVAL * 1_000_000)

#: what a worker reports per call, see referee_call: (status, ticket, start_us, begin_ns, own_late_us, pid)
Reply = tuple[int, int, int, int, int, int]
#: a Reply's Spark fields, as mapInPandas' columns and as a UDF's struct
REPLY_NAMES = ("status", "ticket", "start_us", "begin_ns", "own_late_us", "pid")
REPLY_FIELDS = "status int, ticket long, start_us long, begin_ns long, own_late_us long, pid int"
REPLY_STRUCT = "struct<status:int,ticket:long,start_us:long,begin_ns:long,own_late_us:long,pid:int>"


class Call(NamedTuple):
    """One call made: the referee's ``who`` tag, then the worker's Reply."""

    who: str
    status: int
    ticket: int
    #: the turn's start, on the state's clock (us)
    start_us: int
    #: ``time.time_ns()`` in the worker just before it sent the call
    begin_ns: int
    #: how late the call began after its turn's start by the worker's own clock (``time.monotonic()``
    #: minus ``Turn.local_start``, us): what the limiter's lateness check sees
    own_late_us: int
    pid: int


pytestmark = [
    # PySpark 4 warns, on the driver, that it does not fully support pandas >= 3
    pytest.mark.filterwarnings("ignore:PySpark does not yet fully support pandas:FutureWarning"),
    pytest.mark.processes,
]


def require_spark(java: bool = True) -> None:
    """Skip (fail under CI) without PySpark, or without Java when ``java``."""
    if pyspark is None:
        unavailable("pyspark is not installed: pip install -e '.[spark,test]' to run the Spark tests")
    if java and shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        unavailable("java is not on PATH: install a JDK (17 or later) to run the Spark tests")


def example_url(redis_server: Server) -> str:
    """A state URL for the example on the Redis fixture, under a key prefix of its own."""
    return f"redis://127.0.0.1:{redis_server.port}/0?prefix=spark-example-{uuid.uuid4().hex[:8]}:"


def check_example(result: subprocess.CompletedProcess[str]) -> str:
    """What examples/spark_api_calls.py must print and exit with, however it ran; its output."""
    output = result.stdout

    def line(pattern: str) -> re.Match[str]:
        match = re.search(pattern, output, re.MULTILINE)
        assert match, f"no line matching {pattern!r} in:\n{output}\n{result.stderr[-3000:]}"
        return match

    line(r"^rows processed: 200 \(200 distinct ids, 0 lost\)$")
    line(r"^turns \(state clock\): smallest gap [\d.]+ ms, .*under the interval: 0$")
    line(r"^calls after their turn began \(this host's clock\): 0 before it, ")
    line(r"^throughput: [\d.]+ rows/s over the job ")
    refused = int(line(r"^429s: (\d+)$")[1])
    line(rf"^referee saw 200 calls, {200 - refused} accepted, {refused} answered 429; smallest gap ")
    assert refused == 0, f"the referee refused {refused} calls:\n{output}"
    assert result.returncode == 0, f"exited {result.returncode}\n{output}\n{result.stderr[-3000:]}"
    assert output.rstrip().endswith("ok")
    return output


def test_example_runs_against_the_fixture_redis(redis_server: Server) -> None:
    """examples/spark_api_calls.py in a subprocess (its own Spark, local[2]), on the fixture's Redis.

    First in the module, so that it runs before the module's SparkSession starts: one JVM at a time.
    """
    require_spark()
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), "--state", example_url(redis_server)],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    output = check_example(result)
    assert re.search(r"^200 rows on local\[2\];", output, re.MULTILINE), output


def spark_session(master: str, conf: dict[str, str] | None = None) -> Iterator[Any]:
    """A SparkSession on ``master`` with ``conf``, stopped after; its workers can import ``referee``.

    Spark binds to loopback, and the Python workers run this interpreter.
    """
    from pyspark.sql import SparkSession

    saved = {key: os.environ.get(key) for key in ("SPARK_LOCAL_IP", "PYSPARK_PYTHON")}
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    os.environ["PYSPARK_PYTHON"] = sys.executable
    builder = (
        SparkSession.builder.master(master)
        .appName("ratequeue-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
    )
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    session.sparkContext.addPyFile(str(REFEREE))
    try:
        yield session
    finally:
        session.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    """One SparkSession on ``local[2]`` for the module."""
    require_spark()
    yield from spark_session("local[2]")


@pytest.fixture
def limiter(redis_server: Server) -> Iterator[ratequeue.Limiter]:
    """A limiter at LIMITER_INTERVAL on the Redis fixture, under a key prefix of its own."""
    url = f"redis://127.0.0.1:{redis_server.port}/0?prefix=spark-{uuid.uuid4().hex[:8]}:"
    made = ratequeue.Limiter(url, name="api", interval=LIMITER_INTERVAL)
    yield made
    made.close()


@pytest.fixture(scope="module")
def referee_process() -> Iterator[Referee]:
    with Referee(INTERVAL, TOLERANCE) as started:
        yield started


@pytest.fixture
def referee(referee_process: Referee) -> Referee:
    """The module's referee, with no arrival recorded."""
    referee_process.reset()
    return referee_process


def referee_call(referee: Referee) -> Callable[..., Reply]:
    """A function for the workers: call the referee as ``who`` at the current turn; return a Reply.

    ``who`` is the turn's ticket unless given: the mapInPandas tests make the call before they read
    their frame, since reading a column of Spark's frame takes 0.2-0.3 ms, which would delay the
    call after its turn began (their rows are matched to the calls by ticket).

    Its class is nested, so Spark's cloudpickle ships it by value. The RefereeClient in it keeps one
    connection in each worker, opened when the worker unpickles its task, before any turn: so the
    first call of a worker does not open a TCP connection after its turn began, and every call's
    send is alike.
    """
    from ratequeue.spark import current_turn

    class Caller:
        def __init__(self, url: str) -> None:
            self.client = RefereeClient(url)

        def __setstate__(self, state: dict[str, Any]) -> None:
            self.__dict__.update(state)
            self.client.connect()

        def __call__(self, who: str | None = None) -> Reply:
            turn = current_turn()
            assert turn is not None
            begin_ns, own = time.time_ns(), time.monotonic()
            status = self.client.call(str(turn.ticket) if who is None else who)
            own_late_us = round((own - turn.local_start) * 1e6)
            return status, turn.ticket, turn.start_us, begin_ns, own_late_us, os.getpid()

    return Caller(str(referee.url))


def refusals(calls: list[Call], stats: RefereeStats) -> str:
    """Where each refused call lost its gap, compared with the accepted call before it.

    The turns' gap is on the state's clock; the begins' and the arrivals' on this host's
    CLOCK_REALTIME (which Redis' ``TIME`` reads too). Per call: "late" is its begin minus its turn's
    start, "own" the same by the worker's clock (what the limiter's lateness check sees; the
    difference is the error of the worker's estimate of the state's clock), "send" arrival - begin.
    """
    made = {call.who: call for call in calls}
    first = {}  # pid -> the worker's first call
    for call in sorted(calls, key=lambda call: call.start_us):
        first.setdefault(call.pid, call.who)

    def detail(call: Call, arrived: int) -> str:
        tag = ", its worker's first call" if first[call.pid] == call.who else ""
        return (
            f"{call.who} (pid {call.pid}{tag}) late {(call.begin_ns - call.start_us * 1000) / 1e6:.3f} ms "
            f"(own {call.own_late_us / 1000:.3f} ms), send {(arrived - call.begin_ns) / 1e6:.3f} ms"
        )

    lines = []
    accepted = None
    for arrival in stats.arrivals:
        if arrival.accepted:
            accepted = arrival
        elif accepted is None or arrival.who not in made or accepted.who not in made:
            lines.append(f"  {arrival.who} refused, after no call of this test")
        else:
            before, this = made[str(accepted.who)], made[str(arrival.who)]
            lines.append(
                f"  {this.who} refused: arrival gap {(arrival.t_ns - accepted.t_ns) / 1e6:.3f} ms, "
                f"turn gap {(this.start_us - before.start_us) / 1000:.3f} ms, "
                f"begin gap {(this.begin_ns - before.begin_ns) / 1e6:.3f} ms; "
                f"{detail(before, accepted.t_ns)}; {detail(this, arrival.t_ns)}"
            )
    late = [(call.begin_ns - call.start_us * 1000) / 1e6 for call in calls]
    sends = [(a.t_ns - made[a.who].begin_ns) / 1e6 for a in stats.arrivals if a.who in made]
    return (
        f"the referee refused {stats.rejected} of {len(stats.arrivals)} calls (late: median "
        f"{statistics.median(late):.3f} ms, largest {max(late):.3f} ms; send: median "
        f"{statistics.median(sends):.3f} ms, largest {max(sends):.3f} ms):\n" + "\n".join(lines)
    )


def unexplained_refusals(calls: list[Call], stats: RefereeStats) -> list[str]:
    """The refused calls whose begin came less than the referee's interval after the accepted call's.

    A refused call whose begin was that far from the accepted one's lost its
    gap in the sends (arrival - begin): the OS, not the limiter.
    """
    made = {call.who: call for call in calls}
    unexplained, accepted = [], None
    for arrival in stats.arrivals:
        if arrival.accepted:
            accepted = arrival
            continue
        if accepted is None or arrival.who not in made or accepted.who not in made:
            unexplained.append(str(arrival.who))
            continue
        before, this = made[str(accepted.who)], made[str(arrival.who)]
        if this.begin_ns - before.begin_ns < INTERVAL * 1e9:
            unexplained.append(str(arrival.who))
    return unexplained


def check_calls(calls: list[Call], stats: RefereeStats, keys: list[str]) -> None:
    """What ratequeue promises about the calls, then what the referee saw.

    ``calls`` holds one Call per call made; ``keys`` the keys expected, once each. Strict: each key
    called exactly once, one ticket per call, turns >= LIMITER_INTERVAL apart on the state's clock
    (G1), no call reaching the referee before its turn began (the Redis server's ``TIME`` and the
    referee's kernel timestamps read the same CLOCK_REALTIME on this host), and no call refused.
    """
    arrivals = {arrival.who: arrival for arrival in stats.arrivals}
    assert sorted(str(a.who) for a in stats.arrivals) == sorted(keys), "each call reached the referee once"
    assert sorted(call.who for call in calls) == sorted(keys), "each call made once"
    assert len({call.ticket for call in calls}) == len(calls), "one ticket per call"
    starts = sorted(call.start_us for call in calls)
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert min(gaps) >= LIMITER_INTERVAL_US, f"two turns {min(gaps)} us apart on the state's clock"
    early = {call.who: arrivals[call.who].t_ns - call.start_us * 1000 for call in calls}
    assert min(early.values()) >= 0, f"a call reached the referee {-min(early.values())} ns before its turn"
    assert [call.status for call in calls].count(429) == stats.rejected
    if sys.platform.startswith("linux"):
        assert stats.kernel_timestamps, stats.timestamps
    # G7 through Spark: the begins (acquire() returned) are the referee's interval apart and more
    begins = sorted(call.begin_ns for call in calls)
    begin_gap = min(b - a for a, b in itertools.pairwise(begins))
    assert begin_gap >= INTERVAL * 1e9, f"begins {begin_gap / 1e6:.3f} ms apart: " + refusals(calls, stats)
    # a refusal is allowed only where the begins were that far apart and the send (arrival - begin)
    # of one call lost the gap: a worker descheduled between acquire() returning and its request
    # reaching the referee, which no limiter prevents (6.8 ms once in a clean-clone CI run)
    assert not unexplained_refusals(calls, stats), refusals(calls, stats)


def test_partitions_call_each_row_once_at_its_turn(spark: Any, limiter: Any, referee: Referee) -> None:
    check_partitions(spark, limiter, referee)


def check_partitions(spark: Any, limiter: ratequeue.Limiter, referee: Referee) -> list[Call]:
    from ratequeue.spark import throttled_partitions

    call = referee_call(referee)

    def fetch(row: int) -> tuple[int, Reply]:
        return row, call(str(row))

    rdd = spark.sparkContext.parallelize(range(ROWS), PARTITIONS)
    out = rdd.mapPartitions(throttled_partitions(limiter, fetch)).collect()
    assert sorted(row for row, _ in out) == list(range(ROWS)), "every row processed exactly once"
    calls = [Call(str(row), *reply) for row, reply in out]
    check_calls(calls, referee.stats(), [str(row) for row in range(ROWS)])
    return calls


def test_batches_call_each_row_once_at_its_turn(spark: Any, limiter: Any, referee: Referee) -> None:
    check_batches(spark, limiter, referee)


def check_batches(spark: Any, limiter: ratequeue.Limiter, referee: Referee) -> list[Call]:
    from ratequeue.spark import throttled_batches

    call = referee_call(referee)

    def fetch(frame: Any) -> Any:
        reply = call()  # first the call, at the turn; then the frame's work (see referee_call)
        assert len(frame) == 1
        return frame.assign(**dict(zip(REPLY_NAMES, reply, strict=True)))

    frame = spark.range(0, ROWS, numPartitions=PARTITIONS)
    rows = frame.mapInPandas(
        throttled_batches(limiter, fetch, per="row"), f"id long, {REPLY_FIELDS}"
    ).collect()
    assert sorted(row["id"] for row in rows) == list(range(ROWS)), "every row processed exactly once"
    calls = [Call(str(row["ticket"]), *row[1:]) for row in rows]
    check_calls(calls, referee.stats(), [call.who for call in calls])
    return calls


def test_batches_per_batch_take_one_turn_each(spark: Any, limiter: Any, referee: Referee) -> None:
    """per="batch": one turn and one call per Arrow batch (10 rows here), every row once."""
    check_batches_per_batch(spark, limiter, referee)


def check_batches_per_batch(spark: Any, limiter: ratequeue.Limiter, referee: Referee) -> list[Call]:
    from ratequeue.spark import throttled_batches

    call = referee_call(referee)

    def fetch(frame: Any) -> Any:
        reply = call()  # first the call, at the turn; then the frame's work (see referee_call)
        ids = frame["id"].to_numpy()
        return frame.assign(first=ids.min(), last=ids.max(), **dict(zip(REPLY_NAMES, reply, strict=True)))

    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "10")
    try:
        frame = spark.range(0, ROWS, numPartitions=PARTITIONS)
        schema = f"id long, first long, last long, {REPLY_FIELDS}"
        rows = frame.mapInPandas(throttled_batches(limiter, fetch, per="batch"), schema).collect()
    finally:
        spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")
    assert sorted(row["id"] for row in rows) == list(range(ROWS)), "every row processed exactly once"
    batches = {row["ticket"]: (row["first"], row["last"]) for row in rows}
    expected = [(first, first + 9) for first in range(0, ROWS, 10)]  # 100 rows per partition
    assert sorted(batches.values()) == expected, "one call per batch of 10 rows"
    per_call = {row["ticket"]: Call(str(row["ticket"]), *row[3:]) for row in rows}
    calls = list(per_call.values())
    check_calls(calls, referee.stats(), [str(ticket) for ticket in batches])
    return calls


def test_udf_calls_each_row_once_at_its_turn(spark: Any, limiter: Any, referee: Referee) -> None:
    check_udf(spark, limiter, referee)


def check_udf(spark: Any, limiter: ratequeue.Limiter, referee: Referee) -> list[Call]:
    from ratequeue.spark import throttled_udf

    call = referee_call(referee)
    api = throttled_udf(limiter, lambda row: call(str(row)), REPLY_STRUCT)
    assert api.deterministic is False
    frame = spark.range(0, ROWS, numPartitions=PARTITIONS).withColumn("r", api("id"))
    rows = frame.select("id", "r.*").collect()
    assert sorted(row["id"] for row in rows) == list(range(ROWS)), "every row processed exactly once"
    calls = [Call(str(row["id"]), *row[1:]) for row in rows]
    check_calls(calls, referee.stats(), [str(row) for row in range(ROWS)])
    return calls


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
    check_acquire_timeout(spark, redis_server)


def check_acquire_timeout(spark: Any, redis_server: Server) -> None:
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
    check_unreachable_state(spark)


def check_unreachable_state(spark: Any) -> None:
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
