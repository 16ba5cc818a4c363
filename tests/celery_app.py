"""A Celery app whose task calls the quota referee at the fleet's turn (tests/test_celery.py runs it).

Configured from the environment the test sets: ``RATEQUEUE_TEST_BROKER`` (a
Redis URL: broker and result backend), ``RATEQUEUE_TEST_STATE`` (the
ratequeue state) and ``RATEQUEUE_TEST_REFEREE`` (the referee's base URL).
"""

from __future__ import annotations

import os
from typing import Any

import httpx
from celery import Celery

from ratequeue.celery import TaskTurns

BROKER = os.environ.get("RATEQUEUE_TEST_BROKER", "redis://127.0.0.1:1/0")
app = Celery("ratequeue_test", broker=BROKER, backend=BROKER)
app.conf.update(task_acks_late=False, worker_prefetch_multiplier=1, broker_connection_retry_on_startup=True)

turns = TaskTurns(os.environ.get("RATEQUEUE_TEST_STATE"), name="celery-calls", interval=0.2)


@app.task(bind=True, max_retries=0)
@turns
def call_referee(task: Any, who: str) -> dict[str, Any]:
    """One call of the referee; a 429 raises (and is waited out by ``turns``, using no Celery retry)."""
    response = httpx.get(f"{os.environ['RATEQUEUE_TEST_REFEREE']}/call?who={who}", timeout=30)
    response.raise_for_status()
    return {"status": response.status_code, "retries": task.request.retries, "pid": os.getpid()}
