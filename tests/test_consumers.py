"""examples/consumers.py, run as written against the test session's own Redis.

The example starts real worker processes that drain a Redis list at one start
per interval. Each test runs it as a subprocess (bounded by a timeout), checks
its exit code and what it prints, then reads the results it left in Redis and
checks them independently: every item done exactly once, and no two starts
closer than the interval on the state clock.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import uuid
from collections import Counter
from pathlib import Path

import pytest
import redis

from .servers import Server, free_port

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "consumers.py"

#: seconds one run of the example may take; a healthy small run takes 2-4 s
TIMEOUT = 90


def run_example(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, str(EXAMPLE), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )


def consume(
    server: Server, tmp_path: Path, name: str, workers: int, items: int, interval: float
) -> tuple[str, redis.Redis]:
    """Run the example to success; its output and a client on the Redis it used."""
    url = f"redis://127.0.0.1:{server.port}/0"
    result = run_example(
        "--redis", url, "--workers", str(workers), "--items", str(items),
        "--interval", str(interval), "--name", name,
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    assert "Traceback" not in result.stderr, result.stderr
    return result.stdout, redis.Redis(host="127.0.0.1", port=server.port, db=0, decode_responses=True)


def search(pattern: str, output: str) -> re.Match[str]:
    match = re.search(pattern, output, re.MULTILINE)
    assert match, f"no line matching {pattern!r} in:\n{output}"
    return match


def check_output(output: str, workers: int, items: int, interval: float) -> None:
    """What the example prints: progress to 100 %, per-worker counts, exactly once, no short gap."""
    progress = re.findall(r"^progress: (\d+)/(\d+) items", output, re.MULTILINE)
    assert progress, output
    assert progress[-1] == (str(items), str(items)), "the progress ends at every item done"
    assert [int(done) for done, _ in progress] == sorted(int(done) for done, _ in progress)

    per_worker = {int(k): int(n) for k, n in re.findall(r"^worker (\d+): (\d+) items$", output, re.MULTILINE)}
    assert set(per_worker) == set(range(1, workers + 1))
    assert sum(per_worker.values()) == items

    done = search(r"^items: (\d+)/(\d+) done, (\d+) lost, (\d+) done twice, (\d+) unknown", output)
    assert done.groups() == (str(items), str(items), "0", "0", "0")
    gaps = search(
        r"^gaps \(state clock\): (\d+) gaps, smallest ([\d.]+) ms, .*"
        r"gaps under the interval: (\d+), tickets in start order: (\w+)$",
        output,
    )
    assert int(gaps[1]) == items - 1
    assert float(gaps[2]) >= interval * 1000
    assert (gaps[3], gaps[4]) == ("0", "yes")
    search(r"^OK: every item done exactly once", output)
    assert "FAILED" not in output


def check_redis(client: redis.Redis, name: str, workers: int, items: int, interval: float) -> None:
    """The results key itself: each item exactly once, from a known worker, starts >= interval apart."""
    records = [json.loads(raw) for raw in client.lrange(f"{name}:results", 0, -1)]
    width = len(str(items))
    expected = {f"item-{number:0{width}d}" for number in range(1, items + 1)}
    counts = Counter(record["item"] for record in records)
    assert set(counts) == expected
    assert set(counts.values()) == {1}, "every item done exactly once"
    assert {record["worker"] for record in records} <= set(range(1, workers + 1))
    assert len({record["ticket"] for record in records}) == items, "one ticket per item"
    starts = sorted(record["start_us"] for record in records)
    assert min(b - a for a, b in itertools.pairwise(starts)) >= round(interval * 1_000_000)
    assert client.llen(f"{name}:work") == 0
    assert not list(client.scan_iter(match=f"{name}:processing:*")), "no item left half done"


def test_consumers_do_every_item_once_at_the_rate(redis_server: Server, tmp_path: Path) -> None:
    """3 workers x 60 items at 20 ms: every item done exactly once, no gap under 20 ms."""
    name = f"test-consumers-{uuid.uuid4().hex[:8]}"
    output, client = consume(redis_server, tmp_path, name, workers=3, items=60, interval=0.02)
    with client:
        check_output(output, workers=3, items=60, interval=0.02)
        check_redis(client, name, workers=3, items=60, interval=0.02)


def test_consumers_rerun_starts_clean(redis_server: Server, tmp_path: Path) -> None:
    """A second run under the same name clears the first's keys, even with another interval."""
    name = f"test-consumers-{uuid.uuid4().hex[:8]}"
    consume(redis_server, tmp_path, name, workers=2, items=30, interval=0.02)[1].close()
    output, client = consume(redis_server, tmp_path, name, workers=4, items=20, interval=0.01)
    with client:
        check_output(output, workers=4, items=20, interval=0.01)
        check_redis(client, name, workers=4, items=20, interval=0.01)


def test_consumers_without_redis_says_so(tmp_path: Path) -> None:
    """Nothing listening at the URL: exit 2 and a message, no traceback."""
    result = run_example("--redis", f"redis://127.0.0.1:{free_port()}/0", "--items", "5", cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "cannot reach Redis" in result.stderr
    assert "Traceback" not in result.stderr
