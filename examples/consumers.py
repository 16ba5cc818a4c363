"""Throttled consumers: worker processes drain a Redis list at one start per interval, globally.

The parent fills a Redis list with ``--items`` items and starts ``--workers``
worker processes. Each worker loops: wait for its global turn
(``limiter.acquire()``), then take one item from the list, do its work and
record it. Together the workers start one item per ``--interval``, whatever
their number, and every item is done exactly once. The parent shows progress
while they run, then prints the items each worker did, checks every item was
done exactly once (from the results in Redis), and summarises the gaps
between starts on the state's clock (Redis ``TIME``). It exits 1 if an item
was lost or done twice, or if two starts came closer than the interval.

Run (a Redis server must be listening; database 15 by default)::

    python examples/consumers.py [--redis URL] [--workers N] [--items M]
                                 [--interval S] [--name NAME]

Every key the run uses starts with ``NAME:`` (``examples-consumers:`` by
default), and the run clears them first:

* ``NAME:work`` -- the work list, filled with ``item-001``, ``item-002``, ...;
* ``NAME:processing:K`` -- the item worker K has taken and not yet finished;
* ``NAME:results`` -- one JSON record per item done: worker, item, ticket and
  start (``Turn.start_us``, microseconds on the state clock);
* ``NAME:ratequeue:starts`` -- the limiter's shared record (ratequeue's
  ``?prefix=NAME:ratequeue:``, queue name ``starts``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import multiprocessing
import random
import statistics
import sys
import time
import traceback
from collections import Counter
from multiprocessing.connection import Connection, wait
from typing import Any, cast
from urllib.parse import parse_qsl, urlencode, urlsplit

import redis

import ratequeue

#: the limiter's queue name, inside the run's own key prefix
LIMITER_NAME = "starts"

#: seconds any single wait (a worker getting ready, a turn) may take before the run is declared broken
WAIT = 60.0


def keys(name: str) -> dict[str, str]:
    """The Redis keys of a run named ``name`` (the processing lists are ``processing + K``)."""
    return {
        "work": f"{name}:work",
        "processing": f"{name}:processing:",
        "results": f"{name}:results",
        "ratequeue": f"{name}:ratequeue:",
    }


def urls(redis_url: str, name: str) -> tuple[str, str]:
    """The URL for plain Redis commands, and the limiter's state URL (with its key prefix)."""
    parts = urlsplit(redis_url)
    query = [(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if k != "prefix"]
    client_url = parts._replace(query=urlencode(query)).geturl()
    state_url = parts._replace(query=urlencode([*query, ("prefix", keys(name)["ratequeue"])])).geturl()
    return client_url, state_url


def do_work(item: str, interval: float) -> None:
    """Pretend to work on ``item``: up to one interval. The limiter spaces starts, not ends."""
    time.sleep(random.uniform(0.0, interval))


def worker(
    index: int, client_url: str, state_url: str, name: str, interval: float, conn: Connection, go: Any
) -> None:
    """One consumer process: for every turn, take one item and do it, until the list is empty."""
    key = keys(name)
    processing = f"{key['processing']}{index}"
    client = redis.Redis.from_url(client_url, decode_responses=True)
    limiter = ratequeue.Limiter(state_url, name=LIMITER_NAME, interval=interval)
    try:
        client.ping()
        conn.send("ready")
        if not go.wait(WAIT):
            raise TimeoutError(f"worker {index}: no go from the parent within {WAIT} s")
        while True:
            # Turn first, item second. A worker waiting for its turn then holds
            # only a ticket: if it dies or stalls there, the others lose at most
            # one interval, once (ratequeue's guarantee G4), and no item is stuck
            # with it. Taking the item first would hold every worker's next item
            # out of the list while it waits (up to one interval per worker),
            # where no other worker can take it, and a worker that died while
            # waiting would strand an item it never started. The price of this
            # order: when the list runs dry, each worker spends one turn finding
            # it empty, once.
            turn = limiter.acquire(timeout=WAIT)
            # LMOVE is atomic: exactly one worker gets each item, and until the
            # result is recorded the item sits in this worker's processing list,
            # so a worker that dies mid-item leaves it there to be recovered.
            item = client.lmove(key["work"], processing, "LEFT", "RIGHT")
            if item is None:
                break  # the list ran dry: this turn goes unused and the worker stops
            assert isinstance(item, str)  # decode_responses=True
            do_work(item, interval)
            record = json.dumps(
                {"worker": index, "item": item, "ticket": turn.ticket, "start_us": turn.start_us}
            )
            with client.pipeline(transaction=True) as pipe:  # done and recorded, atomically
                pipe.rpush(key["results"], record)
                pipe.lrem(processing, 1, item)
                pipe.execute()
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        limiter.close()
        client.close()
    conn.send("done")


def clear(client: redis.Redis, state_url: str, name: str) -> None:
    """Delete every key of the run named ``name``, the limiter's record included."""
    key = keys(name)
    pattern = "".join(f"\\{c}" if c in "*?[]\\" else c for c in key["processing"]) + "*"
    stale = list(client.scan_iter(match=pattern))
    client.delete(key["work"], key["results"], *stale)
    with ratequeue.open_state(state_url) as state:
        state.reset(LIMITER_NAME)


class Progress:
    """Shows ``done/total``: one updating line on a terminal, else a line at every 10 %."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.tty = sys.stdout.isatty()
        self.shown = -1

    def show(self, done: int) -> None:
        step = done if self.tty else done * 10 // self.total
        if step == self.shown:
            return
        self.shown = step
        line = f"progress: {done}/{self.total} items ({done * 100 // self.total} %)"
        if self.tty:
            print(f"\r{line}", end="", flush=True)
        else:
            print(line, flush=True)

    def end(self) -> None:
        if self.tty:
            print()


def run(args: argparse.Namespace) -> int:
    name, interval, workers, items = args.name, args.interval, args.workers, args.items
    key = keys(name)
    client_url, state_url = urls(args.redis, name)
    try:  # the workers' limiter, built once here to check the arguments
        ratequeue.Limiter(state_url, name=LIMITER_NAME, interval=interval).close()
    except ratequeue.ConfigurationError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    client = redis.Redis.from_url(client_url, decode_responses=True)
    try:
        client.ping()
    except redis.RedisError as exc:
        print(f"cannot reach Redis at {args.redis}: {exc}", file=sys.stderr)
        return 2

    clear(client, state_url, name)
    width = len(str(items))
    filled = [f"item-{number:0{width}d}" for number in range(1, items + 1)]
    client.rpush(key["work"], *filled)
    print(
        f"{workers} workers, {items} items, interval {interval * 1000:g} ms, "
        f"Redis {client_url}, keys {name}:*, results in {key['results']}",
        flush=True,
    )

    # "spawn" starts fresh interpreters: the workers share nothing with this
    # process but Redis (the work list, and the limiter's state)
    context = multiprocessing.get_context("spawn")
    go = context.Event()
    pipes = [context.Pipe(duplex=False) for _ in range(workers)]
    processes = [
        context.Process(
            target=worker,
            args=(index, client_url, state_url, name, interval, pipes[index - 1][1], go),
            name=f"consumer-{index}",
        )
        for index in range(1, workers + 1)
    ]
    problems: list[str] = []
    try:
        for process in processes:
            process.start()
        for _, writer in pipes:
            writer.close()  # the children hold their own ends
        readers = {reader: index for index, (reader, _) in enumerate(pipes, start=1)}
        problems += gather(readers, "ready", time.monotonic() + WAIT)
        if problems:  # a worker could not start: stop the others, which wait for "go"
            for process in processes:
                process.terminate()
        else:
            go.set()  # every worker is connected: start together
            progress = Progress(items)
            deadline = time.monotonic() + 2 * items * interval + WAIT
            while (alive := [p.sentinel for p in processes if p.is_alive()]) and time.monotonic() < deadline:
                wait(alive, timeout=0.1)  # wakes when a worker exits, or to update the progress
                progress.show(client.llen(key["results"]))
            progress.show(client.llen(key["results"]))
            progress.end()
            problems += gather(readers, "done", deadline)
    finally:
        end = time.monotonic() + 5.0  # gather() waited already: a worker still alive now is stuck
        for process in processes:
            process.join(max(0.0, end - time.monotonic()))
            if process.is_alive():
                problems.append(f"{process.name} did not exit; killed")
                process.kill()
                process.join()
        for process in processes:
            if (
                process.exitcode not in (0, None)
                and go.is_set()
                and not any(process.name in p for p in problems)
            ):
                problems.append(f"{process.name} exited with code {process.exitcode}")
        for reader, _ in pipes:
            reader.close()

    problems += report(client, name, filled, workers, interval)
    client.close()
    if problems:
        print()
        for problem in problems:
            print(f"FAILED: {problem}")
        return 1
    print("OK: every item done exactly once, no two starts closer than the interval")
    return 0


def gather(readers: dict[Connection, int], want: str, deadline: float) -> list[str]:
    """Receive ``want`` from every worker before ``deadline``; the problems met on the way."""
    problems: list[str] = []
    pending = dict(readers)
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            problems += [f"consumer-{index}: no {want!r} in time" for index in pending.values()]
            break
        for ready in wait(list(pending), timeout=remaining):
            reader = cast(Connection, ready)
            index = pending.pop(reader)
            try:
                message = reader.recv()
            except EOFError:
                problems.append(f"consumer-{index} died before {want!r}")
                continue
            if message != want:
                problems.append(
                    f"consumer-{index} failed:\n{message[1] if isinstance(message, tuple) else message}"
                )
    return problems


def report(client: redis.Redis, name: str, filled: list[str], workers: int, interval: float) -> list[str]:
    """Print per-worker counts, the exactly-once check and the gap summary; return the problems."""
    key = keys(name)
    records = [json.loads(raw) for raw in client.lrange(key["results"], 0, -1)]
    problems: list[str] = []

    print()
    per_worker = Counter(record["worker"] for record in records)
    for index in range(1, workers + 1):
        print(f"worker {index}: {per_worker[index]} items")

    done = Counter(record["item"] for record in records)
    wanted = set(filled)
    lost = [item for item in filled if item not in done]
    twice = sorted(item for item, count in done.items() if count > 1)
    unknown = sorted(item for item in done if item not in wanted)
    left = client.lrange(key["work"], 0, -1)
    stranded = {
        index: [str(item) for item in client.lrange(f"{key['processing']}{index}", 0, -1)]
        for index in range(1, workers + 1)
    }
    print(
        f"items: {len(done)}/{len(filled)} done, {len(lost)} lost, {len(twice)} done twice, "
        f"{len(unknown)} unknown, {len(left)} left in the work list, "
        f"{sum(map(len, stranded.values()))} left in processing lists"
    )
    if lost:
        problems.append(f"items never done ({len(lost)}): {', '.join(lost[:10])}")
    if twice:
        problems.append(f"items done more than once ({len(twice)}): {', '.join(twice[:10])}")
    if unknown:
        problems.append(f"items done that were never in the list ({len(unknown)}): {', '.join(unknown[:10])}")
    for index, items in stranded.items():
        if items:
            problems.append(f"worker {index} took {', '.join(items)} and never finished")

    tickets = [record["ticket"] for record in records]
    if len(set(tickets)) != len(tickets):
        problems.append("two items started on the same ticket")
    ordered = sorted(records, key=lambda record: record["start_us"])
    in_order = [record["ticket"] for record in ordered] == sorted(tickets)
    if not in_order:
        problems.append("tickets did not start in increasing order")
    starts = [record["start_us"] for record in ordered]
    interval_us = round(interval * 1_000_000)
    gaps = [later - earlier for earlier, later in itertools.pairwise(starts)]
    if not gaps:
        print("gaps (state clock): none, fewer than two items were done")
        return problems
    under = sum(1 for gap in gaps if gap < interval_us)
    rate = len(gaps) / ((starts[-1] - starts[0]) / 1_000_000)
    target = 1 / interval
    print(
        f"gaps (state clock): {len(gaps)} gaps, smallest {min(gaps) / 1000:.3f} ms, "
        f"median {statistics.median(gaps) / 1000:.3f} ms, largest {max(gaps) / 1000:.3f} ms, "
        f"rate {rate:.2f}/s of {target:.2f}/s target ({rate / target * 100:.1f} %), "
        f"gaps under the interval: {under}, tickets in start order: {'yes' if in_order else 'NO'}"
    )
    if under:
        problems.append(
            f"gaps under the interval of {interval * 1000:g} ms: {under} (smallest {min(gaps)} us)"
        )
    return problems


def parse(argv: list[str] | None) -> argparse.Namespace:
    def positive(kind: type) -> Any:
        def convert(text: str) -> Any:
            value = kind(text)
            if not (value > 0 and math.isfinite(value)):
                raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
            return value

        return convert

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--redis", default="redis://127.0.0.1:6379/15", help="Redis URL (default: %(default)s)"
    )
    parser.add_argument(
        "--workers", type=positive(int), default=4, help="worker processes (default: %(default)s)"
    )
    parser.add_argument(
        "--items", type=positive(int), default=200, help="items in the list (default: %(default)s)"
    )
    parser.add_argument(
        "--interval", type=positive(float), default=0.02, help="seconds between starts (default: %(default)s)"
    )
    parser.add_argument(
        "--name", default="examples-consumers", help="prefix of every key the run uses (default: %(default)s)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    try:
        return run(parse(argv))
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
