"""Celery tasks at the fleet's turn: a real worker (prefork pool, Redis broker) against the quota referee.

The referee refuses everything for its first second (429, ``Retry-After: 1``)
and allows plenty after. Every task's first call is refused or held: the
whole fleet waits the refusal out together, each task runs again at its next
turn in the same execution, and none uses a Celery retry.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from .servers import Server

BENCH = str(Path(__file__).resolve().parents[1] / "bench")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)

from quota_referee import QuotaReferee  # noqa: E402

celery = pytest.importorskip("celery", reason="pip install celery (the test extra has it)")

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def worker(redis_server: Server, tmp_path: Path) -> Iterator[tuple[dict[str, str], QuotaReferee]]:
    broker = f"redis://127.0.0.1:{redis_server.port}/5"
    with QuotaReferee() as referee:
        env = {
            **os.environ,
            "RATEQUEUE_TEST_BROKER": broker,
            "RATEQUEUE_TEST_STATE": f"redis://127.0.0.1:{redis_server.port}/0?prefix=celery-test:",
            "RATEQUEUE_TEST_REFEREE": referee.url,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        }
        command = [sys.executable, "-m", "celery", "-A", "tests.celery_app", "worker", "--pool", "prefork"]
        command += ["--concurrency", "3", "--loglevel", "WARNING", "--without-gossip", "--without-mingle"]
        log = (tmp_path / "worker.log").open("wb")
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            yield env, referee
        finally:
            log.close()
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)


def test_a_refusal_holds_every_worker_and_uses_no_task_retry(
    worker: tuple[dict[str, str], QuotaReferee], monkeypatch: pytest.MonkeyPatch
) -> None:
    env, referee = worker
    for key in ("RATEQUEUE_TEST_BROKER", "RATEQUEUE_TEST_STATE", "RATEQUEUE_TEST_REFEREE"):
        monkeypatch.setenv(key, env[key])
    sys.modules.pop("tests.celery_app", None)
    from . import celery_app

    # (6 s refusing: the first calls of a busy host's workers may come seconds after this; with
    # 3 s, a clean-clone CI run saw none come while it refused)
    referee.reset(phases=((0.0, 6.0), (100.0, 100.0)), window=1.0)
    results = [celery_app.call_referee.delay(f"task-{i}") for i in range(9)]
    answers = [result.get(timeout=90) for result in results]
    assert [answer["status"] for answer in answers] == [200] * 9
    assert [answer["retries"] for answer in answers] == [0] * 9, "no Celery retry was used"
    assert len({answer["pid"] for answer in answers}) > 1, "the prefork pool's processes shared the work"
    stats = referee.stats()
    assert stats.refused >= 1
    # a call sent at a turn granted before the refusal was heard comes within an interval of it
    late = [after for after, _ in stats.early_calls() if after > 0.2]
    assert late == [], "no call of any worker while the Retry-After ran"
    celery_app.app.close()
