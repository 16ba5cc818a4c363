"""Logs and Prometheus metrics of a limiter shared by several threads.

Three threads each call ``limiter.acquire()`` four times; one more call
gives up at once (``timeout=0``, right after a start). The limiter reports every begin, state
call and timeout to its ``on_event`` hook, here
:class:`ratequeue.prometheus.PrometheusMetrics`, which ratequeue's reporter
thread calls off the acquire path; and it logs under the
``ratequeue`` logger: this script shows the INFO lines of every logger and
the DEBUG lines of ``ratequeue.limiter`` (a begin, and a state call on
``ratequeue.limiter.calls``), on stderr. It ends by printing the metrics in
Prometheus's text format, as a scrape of ``/metrics`` would see them (a
real service calls ``prometheus_client.start_http_server(PORT)`` instead:
docs/operating.md).

Run::

    pip install 'ratequeue[prometheus]'
    python examples/metrics_prometheus.py [STATE_URL]

Without a URL the state is the per-user default state file.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading

from prometheus_client import CollectorRegistry, generate_latest

import ratequeue
from ratequeue.prometheus import PrometheusMetrics

INTERVAL = 0.05  # seconds between two starts
THREADS = 3
CALLS_PER_THREAD = 4
LOG_FORMAT = "%(relativeCreated)5.0f ms %(name)s %(levelname)s %(message)s"


def main() -> int:
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)  # every ratequeue logger at INFO, on stderr
    logging.getLogger("ratequeue.limiter").setLevel(logging.DEBUG)  # and its child, ratequeue.limiter.calls

    registry = CollectorRegistry()  # a service would use the default one, prometheus_client.REGISTRY
    metrics = PrometheusMetrics(registry)
    url = sys.argv[1] if len(sys.argv) > 1 else None
    limiter = ratequeue.Limiter(url, name="examples-metrics", interval=INTERVAL, on_event=metrics)

    def worker(index: int) -> None:
        for call in range(CALLS_PER_THREAD):
            limiter.acquire()
            if index == call == 0:  # right after a start, the next turn is an interval away:
                with contextlib.suppress(ratequeue.AcquireTimeout):
                    limiter.acquire(timeout=0)  # only a turn free now would do, so this one gives up

    threads = [threading.Thread(target=worker, args=(index,)) for index in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    limiter.close()  # also waits (up to a second) for the events still on their way to the hook

    text = generate_latest(registry).decode()
    print(text)
    counted = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(("ratequeue_begins_total", "ratequeue_timeouts_total"))
    }
    starts, timeouts = counted.get("ratequeue_begins_total", 0), counted.get("ratequeue_timeouts_total", 0)
    print(f"{THREADS * CALLS_PER_THREAD} acquires: {starts:g} starts counted, {timeouts:g} timeout counted")
    return 0


if __name__ == "__main__":
    sys.exit(main())
