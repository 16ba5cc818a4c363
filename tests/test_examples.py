"""Every script in examples/ runs as written, exits 0 and prints what it claims.

Each example runs in a subprocess with its default (a state file in a new
temporary directory); ``RATEQUEUE_STATE_FILE`` points into the test's
temporary directory so that nothing can touch the user's default state.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from .servers import Server

ROOT = Path(__file__).resolve().parent.parent
ALL_EXAMPLES = sorted((ROOT / "examples").glob("*.py"))

#: examples that need a Redis: run against the tests' own server, with these arguments
REDIS_EXAMPLES: dict[str, Callable[[str], list[str]]] = {
    "redis_hosts.py": lambda url: [url],
    "consumers.py": lambda url: ["--redis", url, "--workers", "2", "--items", "30"],
}

#: files in examples/ run by another test (named), or not scripts at all
ELSEWHERE = {
    "spark_api_calls.py": "tests/test_spark.py runs it against the tests' Redis",
}

#: examples that run with no server and no argument
EXAMPLES = [p for p in ALL_EXAMPLES if p.name not in REDIS_EXAMPLES and p.name not in ELSEWHERE]

#: the interval every example uses, in milliseconds
INTERVAL_MS = 50.0

#: an average gap seen on a local clock may fall short of the interval by the
#: wake-up lateness of the first start, spread over all gaps; this is ample
AVERAGE_TOLERANCE = 0.9


def run_example(path: Path, tmp_path: Path, *args: str) -> str:
    env = dict(os.environ)
    env["RATEQUEUE_STATE_FILE"] = str(tmp_path / "default-state.json")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, str(path), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, f"{path.name} exited {result.returncode}\n{result.stdout}\n{result.stderr}"
    assert "Traceback" not in result.stderr, result.stderr
    return result.stdout


def search(pattern: str, output: str) -> re.Match[str]:
    match = re.search(pattern, output)
    assert match, f"no line matching {pattern!r} in:\n{output}"
    return match


def check_limiter_basic(output: str) -> None:
    match = search(
        r"state clock: (\d+) starts, smallest gap ([\d.]+) ms, .*gaps under the interval: (\d+)", output
    )
    assert int(match[1]) == 20
    assert float(match[2]) >= INTERVAL_MS
    assert int(match[3]) == 0
    assert len(re.findall(r"^thread \d+  ticket", output, re.MULTILINE)) == 20


def check_decorator(output: str) -> None:
    assert search(r"(\d+) results", output)[1] == "12"
    assert len(re.findall(r"^fetch\(\s*\d+\) began", output, re.MULTILINE)) == 12
    assert float(search(r"average ([\d.]+) ms", output)[1]) >= AVERAGE_TOLERANCE * INTERVAL_MS
    search(r"name and docstring: fetch: Pretend", output)
    latest = search(r"ticket (\d+) is the latest started, next ticket (\d+)", output)
    # 12 starts; a turn given up for a late wake-up (G7) on a loaded host takes one more ticket
    assert int(latest[1]) >= 12
    assert int(latest[2]) == int(latest[1]) + 1


def check_queue_jobs(output: str) -> None:
    search(r"join\(\) returned True", output)
    search(r"job 3 failed: ValueError: image 3 is unreadable", output)
    search(r"job 7: image 7 resized", output)
    search(r"8 jobs: 7 succeeded, 1 failed", output)
    assert float(search(r"average gap between starts ([\d.]+) ms", output)[1]) >= (
        AVERAGE_TOLERANCE * INTERVAL_MS
    )


def check_multi_process(output: str) -> None:
    match = search(
        r"(\d+) starts from (\d+) processes, smallest gap ([\d.]+) ms \(state clock\), "
        r"gaps under the interval: (\d+), tickets in start order: (\w+)",
        output,
    )
    assert (int(match[1]), int(match[2])) == (15, 3)
    assert float(match[3]) >= INTERVAL_MS
    assert (match[4], match[5]) == ("0", "yes")
    assert {int(index) for index in re.findall(r"^process (\d+)", output, re.MULTILINE)} == {1, 2, 3}


def check_asyncio_tasks(output: str) -> None:
    match = search(
        r"(\d+) starts, smallest gap ([\d.]+) ms \(state clock\), gaps under the interval: (\d+)", output
    )
    assert int(match[1]) == 20
    assert float(match[2]) >= INTERVAL_MS
    assert int(match[3]) == 0
    assert len(re.findall(r"^other +ticket", output, re.MULTILINE)) == 5
    search(r"page 20 via the decorator decorated - Every call waits", output)


def check_reservation(output: str) -> None:
    search(r"request 2: withdrawn before its turn, no slot used", output)
    match = search(
        r"(\d+) starts for 6 requests, 1 withdrawn; tickets \[([\d, ]+)\]; smallest gap ([\d.]+) ms", output
    )
    assert int(match[1]) == 5
    assert match[2] == "1, 2, 3, 4, 5", "the withdrawn request's turn went to the next one"
    assert float(match[3]) >= INTERVAL_MS


def check_rates_and_bursts(output: str) -> None:
    match = search(r"(\d+) starts, (\d+) in the first interval, windows over the bound: (\d+)", output)
    assert int(match[1]) == 10
    assert 1 <= int(match[2]) <= 5, "at most the burst in the first interval"
    assert int(match[3]) == 0
    # consecutive starts of total cost C span at least (C - burst) intervals: the cost-1 start comes
    # at least (3 + 1 - 3) = 1 interval after the cost-3 one, the cost-2 start (3 + 1 + 2 - 3) = 3
    # (exactly, unless a busy host made a wake-up late and a start moved later)
    match = search(
        r"cost 3, then 1, then 2: the 1 starts ([\d.]+) and the 2 ([\d.]+) intervals after the 3", output
    )
    assert float(match[1]) >= 1
    assert float(match[2]) >= 3
    search(r"try_acquire right after: None \(no turn free, no wait\)", output)


def check_per_key(output: str) -> None:
    assert len(re.findall(r"^\w+ +4 starts", output, re.MULTILINE)) == 3
    assert float(search(r"smallest gap within one customer: ([\d.]+) ms", output)[1]) >= INTERVAL_MS
    search(r"live keys: acme, globex, initech", output)
    search(r"after the keep time: 0 live keys", output)


def check_several_limits(output: str) -> None:
    search(r"10 calls, none deadlocked", output)
    for name, interval in (("fast", 50.0), ("slow", 100.0)):
        match = search(rf"{name}: (\d+) starts for 10 calls, smallest gap ([\d.]+) ms", output)
        assert int(match[1]) >= 10
        assert float(match[2]) >= interval


def check_retries(output: str) -> None:
    assert len(re.findall(r"^call \d+: ok on try \d+$", output, re.MULTILINE)) == 5
    search(r"call 4: failed for good \(call 4: try 4 refused\)", output)
    search(r"dead letter: fetch\(4,\) after 4 tries: call 4: try 4 refused", output)
    search(r"13 tries took 13 turns; every retry waited its backoff: True", output)


def check_max_running(output: str) -> None:
    search(r"24 requests from 3 processes, at most 2 running at once \(max_running=2\)", output)
    waited = float(search(r"a killed holder's place came back after ([\d.]+) s \(lease 1 s\)", output)[1])
    assert 0.6 <= waited <= 1.5  # renewed at most a third of the lease before the kill


def check_group_fifo(output: str) -> None:
    for customer in ("ada", "grace", "linus"):
        search(rf"(?m)^{customer}: 8 orders, at most 1 at once, each process's in order: True$", output)


def check_pause_everywhere(output: str) -> None:
    found = search(r"(\d+) starts before the pause, 0 during it, (\d+) after the resume", output)
    assert int(found[1]) >= 10
    assert int(found[2]) >= 1
    assert float(search(r"longest gap ([\d.]+) s \(the pause\)", output)[1]) >= 0.9


def check_scheduling(output: str) -> None:
    lines = re.findall(r"^\d\. (.*)$", output, re.MULTILINE)
    assert lines == [
        "password reset (priority 5)",
        "invoice (priority 5)",
        "newsletter (priority 0)",
        "report (held 0.2 s, priority 9)",
    ]
    search(r"job 1: dropped from queue 'examples-bounded'", output)
    search(r"jobs 2 and 3 ran: 2, 3", output)


def check_metrics_prometheus(output: str) -> None:
    search(r"12 acquires: 12 starts counted, 1 timeout counted", output)
    search(r'(?m)^ratequeue_begins_total\{queue="examples-metrics"\} 12\.0$', output)
    search(r'(?m)^ratequeue_acquire_wait_seconds_count\{queue="examples-metrics"\} 12\.0$', output)
    search(r"(?m)^# TYPE ratequeue_state_call_duration_seconds histogram$", output)


def check_http_feedback(output: str) -> None:
    match = search(r"(\d+) of (\d+) calls answered 200, (\d+) refused \(429\)", output)
    assert (match[1], match[2], match[3]) == ("15", "15", "0"), "the headers held every thread in time"
    counts = [int(n) for n in search(r"calls per window: ([\d ]+)", output)[1].split()]
    assert max(counts) <= 5


def check_token_budget(output: str) -> None:
    shares = {}
    for said in ("never settled", "settled after each call"):
        match = search(
            said + r" *: +\d+ calls used +\d+ of the +\d+ tokens the budget allowed \( *(\d+) %\), "
            r"runs of calls over the budget: (\d+)",
            output,
        )
        assert match[2] == "0", f"{said}: the budget was exceeded"
        shares[said] = int(match[1])
    assert shares["settled after each call"] > shares["never settled"], "the refunds were used"


def check_fair_tenants(output: str) -> None:
    unfair = float(search(r"in arrival order: small's 5 calls took ([\d.]+) s", output)[1])
    fair = float(search(r"fair=True: +small's 5 calls took ([\d.]+) s", output)[1])
    assert fair < unfair
    search(r"tenants waiting \(waiters, weight\): \{'big': \(\d, 1\)\}", output)
    assert float(search(r"smallest gap between any two starts: ([\d.]+) ms", output)[1]) >= INTERVAL_MS


def check_tenant_caps(output: str) -> None:
    search(r"big: +at most 2 calls running at once \(tenant_max_running=2, 6 workers\)", output)
    # each of small's quick calls waits behind one of big's turns at most (about 0.05 s), not at big's cap
    assert float(search(r"small: 5 calls took ([\d.]+) s", output)[1]) < 2.0
    search(r"big's places are held in the queue \['examples-caps:running:big'\]", output)
    assert float(search(r"smallest gap between big's starts: ([\d.]+) ms", output)[1]) >= INTERVAL_MS


CHECKS: dict[str, Callable[[str], None]] = {
    "tenant_caps.py": check_tenant_caps,
    "fair_tenants.py": check_fair_tenants,
    "http_feedback.py": check_http_feedback,
    "token_budget.py": check_token_budget,
    "metrics_prometheus.py": check_metrics_prometheus,
    "retries.py": check_retries,
    "max_running.py": check_max_running,
    "group_fifo.py": check_group_fifo,
    "pause_everywhere.py": check_pause_everywhere,
    "scheduling.py": check_scheduling,
    "rates_and_bursts.py": check_rates_and_bursts,
    "per_key.py": check_per_key,
    "several_limits.py": check_several_limits,
    "reservation.py": check_reservation,
    "asyncio_tasks.py": check_asyncio_tasks,
    "limiter_basic.py": check_limiter_basic,
    "decorator.py": check_decorator,
    "queue_jobs.py": check_queue_jobs,
    "multi_process.py": check_multi_process,
}


def test_every_checked_example_exists() -> None:
    assert set(CHECKS) <= {path.name for path in EXAMPLES}
    assert set(REDIS_EXAMPLES) | set(ELSEWHERE) <= {path.name for path in ALL_EXAMPLES}


@pytest.mark.processes
@pytest.mark.parametrize("path", EXAMPLES, ids=[path.name for path in EXAMPLES])
def test_example_runs(path: Path, tmp_path: Path) -> None:
    output = run_example(path, tmp_path)
    assert output.strip(), f"{path.name} printed nothing"
    check = CHECKS.get(path.name)
    if check is not None:
        check(output)


@pytest.mark.processes
def test_multi_process_with_the_default_state_file(tmp_path: Path) -> None:
    output = run_example(ROOT / "examples" / "multi_process.py", tmp_path, "default")
    check_multi_process(output)
    assert (tmp_path / "default-state.json").is_file()


@pytest.mark.parametrize("name", ["limiter_basic.py", "decorator.py", "queue_jobs.py", "asyncio_tasks.py"])
def test_thread_examples_accept_a_memory_state(name: str, tmp_path: Path) -> None:
    CHECKS[name](run_example(ROOT / "examples" / name, tmp_path, "memory://"))


@pytest.mark.processes
@pytest.mark.parametrize("name", sorted(REDIS_EXAMPLES))
def test_redis_examples_run(name: str, tmp_path: Path, redis_server: Server) -> None:
    url = f"redis://127.0.0.1:{redis_server.port}/0"
    output = run_example(ROOT / "examples" / name, tmp_path, *REDIS_EXAMPLES[name](url))
    assert re.search(r"gaps under the interval: 0\b", output), output
