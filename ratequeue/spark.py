"""PySpark helpers: every row (or batch) of an RDD or DataFrame waits for its global turn.

Each helper takes a :class:`~ratequeue.Limiter` built on the driver and a
function, and returns what Spark expects: a function for ``rdd.mapPartitions``
(:func:`throttled_partitions`), a function for ``DataFrame.mapInPandas``
(:func:`throttled_batches`), or a UDF (:func:`throttled_udf`). On the
executors, each row (or batch) acquires its turn, and the function is called
right after, at the start of that turn.

**How the limiter reaches the executors.** The helpers keep the limiter's
pickled configuration (state URL, queue name, interval, lead), never a
connection. In each Python worker process, the first row builds one
:class:`~ratequeue.Limiter` from it, which connects lazily on its first
acquire; every later task that this worker runs, from any helper given a
limiter of the same configuration, reuses it (:func:`process_limiter`). So
each Python worker process is one shard (docs/design.md, "A shard") of the queue that the
driver's limiter names, and all of them, together with any other process
using that queue, start one call per interval in first-come order.

**Errors.** An error raised in an executor reaches the driver wrapped by
Spark, as ``pyspark.errors.PythonException`` (PySpark 4, RDD and DataFrame
actions alike; older PySpark may give a ``Py4JJavaError``), whose message
holds the worker's traceback as text, ending in, for example,
``ratequeue.errors.AcquireTimeout: no turn in queue 'api' within 0.5 s``.
The helpers add to each ratequeue error a note with its type and context, so
that :func:`unwrap_errors` (or :func:`original_error`) can raise it on the
driver again as the same ratequeue type.

Importing this module without PySpark installed raises
:class:`~ratequeue.errors.ConfigurationError`: ``pip install 'ratequeue[spark]'``.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from typing import TYPE_CHECKING, Any, Literal, TypeVar, cast

from . import errors
from ._redact import chained, redact
from .core.shard import Turn
from .errors import ConfigurationError, RateQueueError
from .limiter import Limiter
from .settings import check_timeout

try:
    import pyspark  # noqa: F401 - only to fail early, with a useful message
except ImportError as exc:  # pragma: no cover - the tests run with PySpark
    raise ConfigurationError("ratequeue.spark needs PySpark: pip install 'ratequeue[spark]'") from exc

if TYPE_CHECKING:
    import pandas as pd
    from pyspark.sql._typing import DataTypeOrString, UserDefinedFunctionLike

__all__ = [
    "current_turn",
    "original_error",
    "process_limiter",
    "throttled_batches",
    "throttled_partitions",
    "throttled_udf",
    "unwrap_errors",
]

T = TypeVar("T")
R = TypeVar("R")

#: what a note added to a ratequeue error raised in an executor starts with
ERROR_NOTE_PREFIX = "ratequeue.spark error: "

_NOTE = re.compile(re.escape(ERROR_NOTE_PREFIX) + r"(\{.*\})\s*$", re.MULTILINE)
#: the last line of a worker's traceback, for Pythons that do not print notes
_LAST_LINE = re.compile(r"^ratequeue\.errors\.(\w+): (.*)$", re.MULTILINE)

#: this process's limiters: pickled configuration -> (pid that built it, limiter)
_limiters: dict[bytes, tuple[int, Limiter]] = {}
_limiters_lock = threading.Lock()

#: the turn of the row (or batch) being processed, per thread
_current = threading.local()


def throttled_partitions(
    limiter: Limiter, fn: Callable[[T], R], *, timeout: float | None = None
) -> Callable[[Iterable[T]], Iterator[R]]:
    """A function for ``rdd.mapPartitions`` that calls ``fn(row)`` for each row at the row's global turn.

    The returned function takes a partition's rows and yields ``fn(row)`` for
    each, in order; before each call it acquires a turn from this worker
    process's limiter (see :func:`process_limiter`). Rows are taken lazily,
    one turn per row, so the whole partition is never held in memory::

        results = rdd.mapPartitions(throttled_partitions(limiter, fetch)).collect()

    For a DataFrame, use ``df.rdd.mapPartitions(...)``.

    :param limiter: the limiter whose queue the rows share (not ``memory://``).
    :param fn: called once per row, in the executor, right after the row's turn begins.
    :param timeout: seconds each row waits for its turn at most; ``None`` waits
        for ever. A row that waits longer raises :class:`~ratequeue.AcquireTimeout`,
        which fails the task.
    :raises ConfigurationError: at once, on the driver, for a bad argument.
    """
    config, seconds = _prepare(limiter, fn, timeout)

    def partition(rows: Iterable[T]) -> Iterator[R]:
        shard = process_limiter(config)
        for row in rows:
            yield _at_turn(shard, seconds, fn, row)

    return partition


def throttled_batches(
    limiter: Limiter,
    fn: Callable[[pd.DataFrame], pd.DataFrame],
    *,
    per: Literal["row", "batch"] = "row",
    timeout: float | None = None,
) -> Callable[[Iterator[pd.DataFrame]], Iterator[pd.DataFrame]]:
    """A function for ``DataFrame.mapInPandas`` that calls ``fn`` at a global turn.

    ``fn`` maps a pandas DataFrame to a pandas DataFrame with the output
    schema given to ``mapInPandas``::

        out = df.mapInPandas(throttled_batches(limiter, fetch_rows), schema="id long, status int")

    With ``per="row"`` (the default), each batch is cut into one-row
    DataFrames; each acquires its own turn before ``fn`` is called on it, and
    the results of one batch are concatenated and yielded together. With
    ``per="batch"``, each batch acquires one turn and ``fn`` gets the whole
    batch, for a service that takes many rows per call; the batch size is
    Spark's ``spark.sql.execution.arrow.maxRecordsPerBatch`` (10 000 rows by
    default). Empty batches are skipped: no turn, no call.

    :param per: ``"row"`` or ``"batch"``: what takes one turn.
    :param timeout: seconds each turn is waited for at most (see :func:`throttled_partitions`).
    :raises ConfigurationError: at once, on the driver, for a bad argument.
    """
    config, seconds = _prepare(limiter, fn, timeout)
    if per not in ("row", "batch"):
        raise ConfigurationError(f"per must be 'row' or 'batch', got {per!r}")

    def batches(frames: Iterator[pd.DataFrame]) -> Iterator[pd.DataFrame]:
        import pandas

        shard = process_limiter(config)
        for frame in filter(len, frames):  # an empty frame takes no turn and makes no call
            if per == "batch":
                yield _at_turn(shard, seconds, fn, frame)
            else:
                results = [_at_turn(shard, seconds, fn, frame.iloc[i : i + 1]) for i in range(len(frame))]
                yield pandas.concat(results, ignore_index=True)

    return batches


def throttled_udf(
    limiter: Limiter,
    fn: Callable[..., Any],
    returnType: DataTypeOrString = "string",
    *,
    timeout: float | None = None,
) -> UserDefinedFunctionLike:
    """A PySpark UDF that calls ``fn(*columns)`` at each row's global turn::

        status = throttled_udf(limiter, fetch, "int")
        df.withColumn("status", status("url"))

    The UDF is marked non-deterministic (``asNondeterministic()``), so Spark's
    optimizer neither calls it twice for one row nor drops calls it thinks it
    can reuse: each row evaluated is one turn and one call (null inputs too).

    :param returnType: the UDF's return type, a ``DataType`` or a DDL string.
    :param timeout: seconds each row waits for its turn at most (see :func:`throttled_partitions`).
    :raises ConfigurationError: at once, on the driver, for a bad argument.
    """
    from pyspark.sql.functions import udf

    config, seconds = _prepare(limiter, fn, timeout)

    def call(*args: Any) -> Any:
        return _at_turn(process_limiter(config), seconds, fn, *args)

    call.__name__ = getattr(fn, "__name__", "throttled_udf")  # the name Spark shows in plans
    return udf(call, returnType).asNondeterministic()


def process_limiter(limiter: Limiter | bytes) -> Limiter:
    """This process's one :class:`~ratequeue.Limiter` for ``limiter``'s configuration.

    ``limiter`` is a limiter or its pickled configuration
    (``pickle.dumps(limiter)``). The first call in a process builds a limiter
    from the configuration, and later calls with an equal configuration
    return that same object, so a Python worker process that runs many tasks
    is one shard of the queue and opens the state once, lazily. A process
    forked after building one builds its own. The helpers use this; call it
    in your own executor code (``foreachPartition``, ...) to share the shard.
    """
    config = limiter if isinstance(limiter, bytes) else pickle.dumps(limiter)
    with _limiters_lock:
        entry = _limiters.get(config)
        if entry is None or entry[0] != os.getpid():
            built = pickle.loads(config)  # our own limiter's configuration
            if not isinstance(built, Limiter):
                raise ConfigurationError(f"not a pickled Limiter: {type(built).__name__}")
            entry = _limiters[config] = (os.getpid(), built)
        return entry[1]


def current_turn() -> Turn | None:
    """The :class:`~ratequeue.Turn` that the row (or batch) being processed in this thread acquired.

    Call it inside ``fn``: it tells the row's ``ticket`` and when its turn
    began (``start``, on the state's clock; ``local_start``, on this
    process's ``time.monotonic()``), for a log line or an idempotency key.
    ``None`` outside a helper's call.
    """
    return cast("Turn | None", getattr(_current, "turn", None))


def original_error(error: BaseException) -> RateQueueError | None:
    """The ratequeue error raised in an executor that Spark's ``error`` reports, or ``None``.

    Spark reports an executor's Python error as its own exception holding the
    worker's traceback as text. This reads that text (of ``error`` and the
    errors it was chained from) and, if it reports a ratequeue error, builds
    a new one of the same type with the same message and context (``name``,
    ``timeout``, ``where``). Without the note the helpers add (an error raised
    outside them, or Python 3.10, which prints no notes), the type and message
    are read from the traceback's last line, and the context is left empty.
    """
    text = _error_text(error)
    notes, lines = _NOTE.findall(text), _LAST_LINE.findall(text)
    rebuilt = _from_note(notes[-1]) if notes else None
    if rebuilt is None and lines:
        name, message = lines[-1]
        rebuilt = _rebuilt(name, [message], {})
    return rebuilt


@contextmanager
def unwrap_errors() -> Iterator[None]:
    """Raise a ratequeue error raised in an executor as itself on the driver.

    Inside ``with unwrap_errors():``, a Spark error that reports a ratequeue
    error (see :func:`original_error`) is replaced by that error, rebuilt,
    chained from Spark's error (``__cause__``), which keeps the executor's
    full traceback. Other errors pass unchanged::

        with ratequeue.spark.unwrap_errors():
            rdd.mapPartitions(throttled_partitions(limiter, fetch)).collect()
        # raises ratequeue.AcquireTimeout, StateUnavailable, ... as raised in the executor
    """
    try:
        yield
    except RateQueueError:
        raise
    except Exception as exc:
        original = original_error(exc)
        if original is None:
            raise
        raise original from exc


def _prepare(limiter: Limiter, fn: Callable[..., Any], timeout: object) -> tuple[bytes, float | None]:
    """Check a helper's arguments on the driver; return the pickled limiter and the timeout."""
    if not isinstance(limiter, Limiter):
        raise ConfigurationError(f"limiter must be a ratequeue.Limiter, got {type(limiter).__name__}")
    if not callable(fn):
        raise ConfigurationError(f"fn must be callable, got {type(fn).__name__}")
    if limiter.state.url.startswith("memory:"):
        raise ConfigurationError(
            f"a {redact(limiter.state.url)} state lives inside one process, so each Spark worker would "
            "have a rate of its own; use a state every executor reaches (redis://, mongodb://, "
            "file:// on one host)"
        )
    return pickle.dumps(limiter), check_timeout(timeout)


def _at_turn(limiter: Limiter, timeout: float | None, fn: Callable[..., R], *args: Any) -> R:
    """``fn(*args)`` once a turn of ``limiter`` begins; :func:`current_turn` tells that turn meanwhile."""
    try:
        _current.turn = turn = limiter.acquire(timeout)
        try:
            return fn(*args)
        finally:
            if limiter.holds_places:  # (``max_running``: the job's place goes back, a failure logged)
                limiter._release_quietly((turn.ticket, turn.token))
    except RateQueueError as exc:  # the acquire's, or one of fn's own limiters
        _add_note(exc)
        raise
    finally:
        _current.turn = None


def _add_note(error: RateQueueError) -> None:
    """Note ``error``'s type and context on it, so the driver can rebuild it from Spark's text."""
    if any(str(note).startswith(ERROR_NOTE_PREFIX) for note in getattr(error, "__notes__", ())):
        return
    cls = next((c for c in type(error).__mro__ if _error_class(c.__name__) is c), RateQueueError)
    payload = {
        "type": cls.__name__,
        "args": [_plain(arg) for arg in error.args],
        "attrs": {key: _plain(value) for key, value in vars(error).items() if not key.startswith("_")},
    }
    note = ERROR_NOTE_PREFIX + json.dumps(payload, ensure_ascii=True, separators=(",", ":"))
    if hasattr(error, "add_note"):  # Python >= 3.11
        error.add_note(note)


def _from_note(raw: str) -> RateQueueError | None:
    try:
        payload = json.loads(raw)
        name, args, attrs = str(payload["type"]), list(payload["args"]), dict(payload["attrs"])
    except (ValueError, KeyError, TypeError):
        return None
    return _rebuilt(name, args, {str(key): value for key, value in attrs.items()})


def _rebuilt(name: str, args: list[Any], attrs: dict[str, Any]) -> RateQueueError | None:
    """The public ratequeue error named ``name``, with ``args`` and ``attrs``, built without ``__init__``."""
    cls = _error_class(name)
    if cls is None:
        return None
    error = cls.__new__(cls)
    Exception.__init__(error, *args)
    error.__dict__.update(attrs)
    return error


def _error_class(name: str) -> type[RateQueueError] | None:
    """The class called ``name`` among ratequeue's public errors (never anything else)."""
    cls = getattr(errors, name) if name in errors.__all__ else None
    return cls if isinstance(cls, type) and issubclass(cls, RateQueueError) else None


def _plain(value: object) -> Any:
    """``value`` if JSON can carry it as it is, else its ``str``."""
    return value if value is None or isinstance(value, (str, int, float, bool)) else str(value)


def _error_text(error: BaseException) -> str:
    """The text of ``error`` and of the errors it came from (Spark puts the worker's traceback there)."""
    parts: list[str] = []
    for current in chained(error):
        parts.append(str(current))
        java = getattr(current, "java_exception", None)  # py4j's Py4JJavaError
        if java is not None:
            with suppress(Exception):  # the gateway may be gone
                parts.append(str(java.toString()))
    return "\n".join(parts)
