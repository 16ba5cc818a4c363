"""Prometheus metrics for limiters and queues: an ``on_event`` hook that counts and times.

Needs ``prometheus_client`` (``pip install 'ratequeue[prometheus]'``)::

    from prometheus_client import start_http_server
    from ratequeue.prometheus import PrometheusMetrics

    metrics = PrometheusMetrics()            # registers in prometheus_client's default registry
    limiter = ratequeue.Limiter(name="api", interval=0.1, on_event=metrics)
    start_http_server(9100)                  # serves /metrics

One object serves any number of limiters and queues (each event carries
its queue name, the ``queue`` label). Make one per registry and pass it to
every limiter: a second one on the same registry would register the same
metric names twice, and raises :class:`~ratequeue.ConfigurationError`. The
metrics, with the default ``namespace="ratequeue"``:

==============================================  ===========  ======================================
name                                            labels       what it counts or times
==============================================  ===========  ======================================
``ratequeue_begins_total``                      queue        turns begun (``acquire()`` returned)
``ratequeue_timeouts_total``                    queue        callers that gave up
                                                             (``AcquireTimeout``)
``ratequeue_passed_tickets_total``              queue        held tickets the state answered as
                                                             passed
``ratequeue_late_wakeups_total``                queue,       wake-ups more than ``max_late`` after
                                                outcome      a turn's start: ``moved``,
                                                             ``given_up``, ``begun`` (a wake-up,
                                                             not a begin: a moved or given-up
                                                             turn did not begin late); ``sent``:
                                                             a call sent that late, the queue
                                                             held (``Limiter.sent``)
``ratequeue_state_errors_total``                queue,       state calls that raised, by error type
                                                operation,
                                                error
``ratequeue_retries_total``                     queue        queue jobs failed and retried
``ratequeue_dead_letters_total``                queue        queue jobs failed for good
``ratequeue_state_down``                        queue, mode  1 while the state is down and turns
                                                             begin locally (``when_down``), else 0
``ratequeue_holds_total``                       queue,       holds this process put on the whole
                                                cause        queue: ``429``, ``headers``,
                                                             ``refused``, ``call``
``ratequeue_slowdowns_total``                   queue,       slow-downs this process put on the
                                                cause        whole queue (``adaptive``)
``ratequeue_events_dropped_total``              (none)       events this process dropped, its
                                                             hooks being too slow for them
                                                             (:func:`ratequeue.events.dropped`)
``ratequeue_acquire_wait_seconds``              queue        histogram: from ``acquire()`` to the
                                                             begin
``ratequeue_begin_lateness_seconds``            queue        histogram: begin after the turn's start
``ratequeue_state_call_duration_seconds``       queue,       histogram: state calls answered, by
                                                operation    operation (its ``_count`` counts them)
``ratequeue_tenant_begins_total``               queue,       a fair queue's turns begun, by tenant
                                                tenant       (only with ``tenant_label``)
``ratequeue_tenant_timeouts_total``             queue,       a fair queue's callers that gave up,
                                                tenant       by tenant (only with ``tenant_label``)
``ratequeue_tenant_acquire_wait_seconds``       queue,       histogram: a fair queue's waits from
                                                tenant       ``acquire()`` to the begin, by tenant
                                                             (only with ``tenant_label``)
==============================================  ===========  ======================================

A fair queue's tenants (docs/fairness.md) are counted only if you say how
to label them, as each tenant is a time series: ``tenant_label=str`` for a
few tenants; for many, a function that names the ones worth a series and
folds the rest (``lambda t: t if t in BIG else "other"``). Each tenant's
share of the turns is ``rate(ratequeue_tenant_begins_total[5m])`` over
their sum.

The hook runs in ratequeue's reporter thread (asyncio: on the event loop),
never on a caller's acquire path: see :mod:`ratequeue.events`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .errors import ConfigurationError
from .events import Event, dropped

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

__all__ = ["BEGIN_LATENESS_BUCKETS", "STATE_CALL_BUCKETS", "WAIT_BUCKETS", "PrometheusMetrics"]

#: histogram buckets (s) of the wait from ``acquire()`` to the begin
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
#: histogram buckets (s) of a begin's lateness after its start: ``max_late`` is 0.0003 by default
BEGIN_LATENESS_BUCKETS = (0.00001, 0.00005, 0.0001, 0.0002, 0.0003, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.1)
#: histogram buckets (s) of a state call's duration, round-trip included
STATE_CALL_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)


class PrometheusMetrics:
    """Counters and histograms fed by the events of limiters and queues; pass it as ``on_event``.

    Thread-safe (``prometheus_client``'s metrics are), a few microseconds
    per event, and it never raises for an event.
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        namespace: str = "ratequeue",
        queue_label: Callable[[str], str] | None = None,
        wait_buckets: Sequence[float] = WAIT_BUCKETS,
        lateness_buckets: Sequence[float] = BEGIN_LATENESS_BUCKETS,
        call_buckets: Sequence[float] = STATE_CALL_BUCKETS,
        tenant_label: Callable[[str], str] | None = None,
    ) -> None:
        """
        :param registry: where the metrics are registered; ``None``: ``prometheus_client.REGISTRY``,
            the default one that ``start_http_server`` and ``generate_latest`` serve.
        :param namespace: put before every metric name (``ratequeue_begins_total``).
        :param queue_label: the ``queue`` label of a queue name (default: the name itself). A
            :class:`~ratequeue.LimiterGroup`'s keys are queues ``f"{group}:{key}"``: with many
            keys, ``lambda name: name.split(":")[0]`` labels them by group, keeping the number
            of time series small.
        :param wait_buckets: ``lateness_buckets``, ``call_buckets``: the histograms' buckets (s).
        :param tenant_label: the ``tenant`` label of a fair queue's tenant; given, begins, timeouts
            and waits are also counted by tenant (``ratequeue_tenant_*``). ``None`` (the default):
            not by tenant, as each tenant would be a time series of its own.
        :raises ConfigurationError: if ``prometheus_client`` is not installed, or if ``registry``
            has these metrics already (another ``PrometheusMetrics`` with this namespace on it).
        """
        try:
            from prometheus_client import REGISTRY, Counter, Gauge, Histogram
        except ImportError as exc:
            install = "pip install 'ratequeue[prometheus]'"
            raise ConfigurationError(f"ratequeue.prometheus needs prometheus_client: {install}") from exc
        if queue_label is not None and not callable(queue_label):
            raise ConfigurationError(f"queue_label must be None or a callable, got {queue_label!r}")
        if tenant_label is not None and not callable(tenant_label):
            raise ConfigurationError(f"tenant_label must be None or a callable, got {tenant_label!r}")
        self._tenant_label = tenant_label
        self._label: Callable[[str], str] = queue_label or str
        #: the labelled children made so far, by (metric, label values): as many as the series
        self._children: dict[tuple[Any, ...], Any] = {}
        #: how many limiters of each (queue label, mode) run without their state now
        self._down: dict[tuple[str, str], int] = {}
        # made unregistered, then registered all together below, or none: a clash leaves the registry as is
        common: dict[str, Any] = {"namespace": namespace, "registry": None}

        def counter(name: str, help: str, *labels: str) -> Counter:
            return Counter(name, help, ("queue", *labels), **common)

        def histogram(name: str, help: str, buckets: Sequence[float], *labels: str) -> Histogram:
            return Histogram(name, help, ("queue", *labels), buckets=tuple(buckets), **common)

        #: turns begun
        self.begins = counter("begins", "Turns begun (acquire() returned).")
        #: callers that gave up
        self.timeouts = counter("timeouts", "Callers that gave up waiting (AcquireTimeout).")
        #: held tickets answered as passed
        self.passed_tickets = counter(
            "passed_tickets", "Held tickets the state answered as passed; a new one was taken."
        )
        #: late wake-ups, by what was done
        self.late_wakeups = counter(
            "late_wakeups",
            "Wake-ups more than max_late after a turn's start, by outcome (moved, given_up, begun).",
            "outcome",
        )
        #: state calls that raised
        self.state_errors = counter(
            "state_errors", "State calls that raised, by error type.", "operation", "error"
        )
        #: queue jobs retried, and failed for good
        self.retries = counter("retries", "Queue jobs that failed and were retried.")
        self.dead_letters = counter("dead_letters", "Queue jobs that failed for good.")
        #: seconds from acquire() to the begin
        self.acquire_wait = histogram(
            "acquire_wait_seconds", "Seconds from acquire() to the begin.", wait_buckets
        )
        #: seconds a begin came after its turn's start
        self.begin_lateness = histogram(
            "begin_lateness_seconds",
            "Seconds a begin came after its turn's start (Turn.local_start).",
            lateness_buckets,
        )
        #: seconds a state call took
        self.state_call_duration = histogram(
            "state_call_duration_seconds",
            "Seconds a state call took, round-trip included, by operation.",
            call_buckets,
            "operation",
        )
        #: 1 while the state is down and turns begin locally (``when_down``), by mode
        self.state_down = Gauge(
            "state_down",
            "1 while the state is down and turns begin locally (when_down), by mode (open, local).",
            ("queue", "mode"),
            **common,
        )
        #: holds this process put on its queues, by what asked
        self.holds = counter(
            "holds",
            "Holds this process put on the whole queue, by what asked (429, headers, refused, call).",
            "cause",
        )
        #: slow-downs this process put on its queues, by what asked
        self.slowdowns = counter(
            "slowdowns", "Slow-downs this process put on the whole queue, by what asked.", "cause"
        )
        #: a fair queue's begins, timeouts and waits by tenant (with ``tenant_label`` only)
        self.tenant_begins: Counter | None = None
        self.tenant_timeouts: Counter | None = None
        self.tenant_acquire_wait: Histogram | None = None
        if tenant_label is not None:
            self.tenant_begins = counter("tenant_begins", "A fair queue's turns begun, by tenant.", "tenant")
            self.tenant_timeouts = counter(
                "tenant_timeouts", "A fair queue's callers that gave up waiting, by tenant.", "tenant"
            )
            self.tenant_acquire_wait = histogram(
                "tenant_acquire_wait_seconds",
                "Seconds from acquire() to the begin on a fair queue, by tenant.",
                wait_buckets,
                "tenant",
            )
        #: events this process dropped (read at each scrape: a dropped event never reaches this hook)
        self.events_dropped = _Dropped(namespace)
        metrics = [
            value for value in vars(self).values() if isinstance(value, (Counter, Gauge, Histogram, _Dropped))
        ]
        _register(registry or REGISTRY, namespace, metrics)

    def __call__(self, event: Event) -> None:
        """Count or time ``event``."""
        kind, queue = event.kind, event.queue
        if kind == "call":
            self._child(self.state_call_duration, queue, event.operation or "").observe(event.duration or 0.0)
        elif kind == "begin":
            self._child(self.begins, queue).inc()
            if event.wait is not None:
                self._child(self.acquire_wait, queue).observe(event.wait)
            if event.lateness is not None:
                self._child(self.begin_lateness, queue).observe(event.lateness)
            if event.tenant is not None and self._tenant_label is not None:
                tenant = self._tenant_label(event.tenant)
                self._child(self.tenant_begins, queue, tenant).inc()
                if event.wait is not None:
                    self._child(self.tenant_acquire_wait, queue, tenant).observe(event.wait)
        elif kind == "timeout":
            self._child(self.timeouts, queue).inc()
            if event.tenant is not None and self._tenant_label is not None:
                self._child(self.tenant_timeouts, queue, self._tenant_label(event.tenant)).inc()
        elif kind == "passed":
            self._child(self.passed_tickets, queue).inc()
        elif kind == "late":
            self._child(self.late_wakeups, queue, event.outcome or "").inc()
        elif kind == "state_error":
            self._child(self.state_errors, queue, event.operation or "", event.error or "").inc()
        elif kind == "retry":
            self._child(self.retries, queue).inc()
        elif kind == "dead_letter":
            self._child(self.dead_letters, queue).inc()
        elif kind == "hold":
            self._child(self.holds, queue, event.outcome or "").inc()
        elif kind == "slow":
            self._child(self.slowdowns, queue, event.outcome or "").inc()
        elif kind in ("state_down", "state_back"):
            key = (self._label(queue), event.outcome or "")
            down = self._down[key] = max(0, self._down.get(key, 0) + (1 if kind == "state_down" else -1))
            self._child(self.state_down, queue, key[1]).set(1 if down else 0)

    def _child(self, metric: Any, queue: str, *labels: str) -> Any:
        """``metric.labels(queue's label, *labels)``, kept: a dict look-up, not prometheus_client's checks."""
        key = (id(metric), self._label(queue), *labels)
        child = self._children.get(key)
        return self._children.setdefault(key, metric.labels(*key[1:])) if child is None else child


class _Dropped:
    """A collector of one counter: :func:`ratequeue.events.dropped`, as each scrape reads it."""

    def __init__(self, namespace: str) -> None:
        self.name = f"{namespace}_events_dropped" if namespace else "events_dropped"

    def describe(self) -> list[Any]:
        return self._families(None)

    def collect(self) -> list[Any]:
        return self._families(dropped())

    def _families(self, value: int | None) -> list[Any]:
        from prometheus_client.core import CounterMetricFamily

        help = "Events this process dropped, its on_event hooks being too slow for them."
        return [CounterMetricFamily(self.name, help, value=value)]


def _register(registry: CollectorRegistry, namespace: str, metrics: list[Any]) -> None:
    """Register every metric in ``registry``, or none: :class:`ConfigurationError` on a clash."""
    for done, metric in enumerate(metrics):
        try:
            registry.register(metric)
        except ValueError as exc:  # "Duplicated timeseries in CollectorRegistry"
            for registered in metrics[:done]:
                registry.unregister(registered)
            raise ConfigurationError(
                f"this registry has ratequeue's metrics (namespace {namespace!r}) already: one "
                f"PrometheusMetrics per registry; pass registry=... or reuse the object ({exc})"
            ) from None
