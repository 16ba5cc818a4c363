"""Costs known after the call: 4 processes against a token budget, with ``acquire(cost=)`` and ``settle()``.

A :mod:`token_referee` keeps a token bucket of 200 tokens per second and 400
tokens (``--rate``, ``--capacity``); each call costs what the referee draws
(uniform whole numbers 10 to 100, seeded), charged when it arrives (a 429
with ``Retry-After`` and no charge if the bucket lacks it), and is answered
50 to 250 ms later with the cost in ``X-Tokens-Used``, so that calls overlap
and finish out of order. The clients know the budget only through their
limiter's configuration, at exactly the referee's numbers (``interval`` of
1/rate s per token, ``burst`` of the capacity). 4 processes (``--processes``),
each making its calls one after another (``--threads``: more per process,
sharing its limiter), for 20 s (``--seconds``). Compared in one run:

* ``plain``: no ratequeue; each process paces itself at rate / processes /
  the mean cost (55) calls per second, and sleeps a 429's ``Retry-After``;
* ``max-no-settle``: a ratequeue ``Limiter`` per process,
  ``acquire(cost=100)`` (the most a call costs), never settled;
* ``max-settle``: ``acquire(cost=100)``, then ``settle(turn, actual)`` with
  the cost the answer gives (0 for a 429: the referee charged nothing);
* ``low-settle``: ``acquire(cost=40)``, an underestimate for two calls in
  three, then ``settle``: an overrun moves later starts.

The limiters go on at their own pace after a 429 (no sleep, no retry).

Reported, at the referee: the calls accepted and refused; the tokens charged
per second and their share of what the budget allowed (``capacity + rate *
seconds``); and the bound: the most that the arrivals in any window of W
seconds (1, 2, 5) cost, at the costs drawn (refused calls included), beyond
``capacity + rate * W``. ratequeue's guarantee (G8) is that any run of starts
i..k costs, as known when k started, at most ``burst + (s_k - s_i) /
interval``: with costs never underestimated (``max-*``) that bounds what the
referee is asked for; with ``low-settle`` the excess is at most what the
fleet did not know yet, the overruns of the calls still in flight (and a
refused call, settled at 0, at its draw): checked window by window at the
referee. G8 itself is checked on the state's clock: each turn's start
(``Turn.start``), the instant the state started it (the ``now`` of its
``Started`` answer: the costs known then are those G8 counts; the start
itself may lie a lead later) and each settlement's time as its process saw
it (the file state's clock and a local Redis's are this host's
``time.time()``). Also the state calls per acquire (a counting proxy around
the state, which also counts the state's answers) and per call for
``settle``.

    python bench/token_budget.py                      # file and Redis (a redis-server of its own)
    python bench/token_budget.py --states file --quick
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _common
from token_referee import Settings, TokenReferee, TokenStats

MODES = ("plain", "max-no-settle", "max-settle", "low-settle")
STATES = ("file", "redis")
WINDOWS = (1.0, 2.0, 5.0)


@dataclass(frozen=True)
class Call:
    """One call as its process saw it (times in seconds on this host's ``time.time()``).

    The file state's clock is this host's ``time.time()``, and so is the
    ``TIME`` of a Redis on this host: the state's times and the others compare.
    """

    who: str
    ticket: int  # its turn's ticket (0: plain, no turn)
    start_us: int  # its turn's start on the state's clock, in µs (plain: when the call was sent)
    decided_us: int  # when the state started it, on its clock, in µs (``Started.now``; plain: start_us)
    estimate: int  # the cost the turn was taken for (0: plain, no turn)
    settling: float | None  # when settle() was called (None: never settled)
    settled: float | None  # when settle() returned
    actual: int  # what the answer said the call cost (0 for a 429)


class DecisionState(_common.CountingState):
    """A counting state that also notes, for each ticket started, when the state started it (its clock, µs).

    That instant (the answer's ``now``), not the turn's start (which may lie
    a lead ahead), is when the state decided the start: G8 counts the costs
    known then.
    """

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.decided: dict[int, int] = {}
        self.given: set[int] = set()  # every ticket the state gave this process (taken, waiting or started)

    def execute(self, op: Any) -> Any:
        answer: Any = super().execute(op)
        kind = type(answer).__name__
        if kind in ("Taken", "Wait", "Started"):
            self.given.add(answer.ticket)
        if kind == "Started":
            self.decided[answer.ticket] = answer.now
        return answer


def _estimate(mode: str, args: dict[str, Any]) -> int:
    if mode == "plain":
        return 0
    return int(args["low"] if mode == "low-settle" else args["high"])


def worker(index: int, arg: dict[str, Any], gate: _common.Gate) -> dict[str, Any]:
    """One process: call the referee for ``arg["seconds"]`` as ``arg["mode"]`` says, from its threads."""
    import httpx

    import ratequeue

    mode, seconds, threads = arg["mode"], arg["seconds"], arg["threads"]
    estimate = _estimate(mode, arg)
    limiter, state = None, None
    if mode != "plain":
        state = DecisionState(_common.open_state(arg["url"]))
        limiter = ratequeue.Limiter(
            state, name=arg["name"], interval=1 / arg["rate"], burst=int(arg["capacity"])
        )
    clients = [httpx.Client(timeout=30) for _ in range(threads)]
    for client in clients:
        client.get(f"{arg['referee']}/stats")  # the connections are open before the start
    calls: list[Call] = []
    acquires = [0]
    late: list[int] = []  # the tickets of turns taken after the end, not used
    lock = threading.Lock()
    t0 = gate.wait()
    end = t0 + seconds
    # plain: each thread sends one call every `step` s, the fleet's threads evenly staggered
    fleet = arg["processes"] * threads
    step = fleet * arg["mean_cost"] / arg["rate"]

    def run(thread: int, client: httpx.Client) -> None:
        slot = t0 + (index * threads + thread) * step / fleet
        n = 0
        while True:
            turn = None
            if limiter is None:
                slot = max(slot + step, time.monotonic()) if n else slot
                if slot >= end:
                    break
                time.sleep(max(0.0, slot - time.monotonic()))
            else:
                turn = limiter.acquire(timeout=60, cost=estimate)
                with lock:
                    acquires[0] += 1
                if time.monotonic() >= end:
                    with lock:
                        late.append(turn.ticket)
                    break
            who = f"{mode}-{index}-{thread}-{n}"
            n += 1
            start_us = round(time.time() * 1e6) if turn is None else turn.start_us
            decided_us = start_us if turn is None else state.decided.get(turn.ticket, start_us)  # type: ignore[union-attr]
            response = client.get(f"{arg['referee']}/call", params={"who": who, "max": estimate})
            actual = int(response.headers["X-Tokens-Used"])
            settling = settled = None
            if turn is not None and mode != "max-no-settle":
                settling = time.time()
                limiter.settle(turn, actual)  # type: ignore[union-attr]
                settled = time.time()
            with lock:
                calls.append(
                    Call(
                        who,
                        turn.ticket if turn else 0,
                        start_us,
                        decided_us,
                        estimate,
                        settling,
                        settled,
                        actual,
                    )
                )
            if limiter is None and response.status_code == 429:
                time.sleep(float(response.headers.get("Retry-After", "1")))
            if time.monotonic() >= end:
                break

    runners = [threading.Thread(target=run, args=(k, client)) for k, client in enumerate(clients)]
    for runner in runners:
        runner.start()
    for runner in runners:
        runner.join()
    for client in clients:
        client.close()
    state_calls: dict[str, int] = {}
    answers: dict[str, int] = {}
    if limiter is not None and state is not None:
        limiter.close()
        state_calls, answers = dict(state.log.calls), dict(state.log.answers)
    return {
        "calls": [dataclasses.astuple(call) for call in calls],
        "acquires": acquires[0],
        "state": state_calls,
        "answers": answers,
        # the tickets the state gave this process that no call used, nor came after the end: passed
        # (a later ticket started first) or started and given up; each holds its cost of the budget
        "given_up": sorted(state.given - {c.ticket for c in calls} - set(late)) if state else [],
    }


# --------------------------------------------------------------------------- the figures


def known_at(call: Call, when_us: int, settles: bool, strict: bool) -> int:
    """The cost the fleet knew ``call`` by at ``when_us`` (the state's clock): its estimate until settled.

    A settlement is known from when settle() returned; while the call was
    under way at ``when_us`` it may or may not have been: then the smaller of
    the estimate and the actual cost (the lenient count: a sum above the
    bound is a sure breach), or with ``strict`` the larger (a sum within the
    bound surely held).
    """
    if not settles or call.settling is None or call.settled is None:
        return call.estimate
    when = when_us / 1e6
    if call.settled <= when:
        return call.actual
    if call.settling <= when:
        return max(call.actual, call.estimate) if strict else min(call.actual, call.estimate)
    return call.estimate


def window_checks(
    stats: TokenStats, calls: dict[str, Call], settles: bool, window: float
) -> tuple[float, float, float]:
    """For windows of ``window`` s at the referee: the most excess, and the most excess beyond what the fleet
    did not know.

    Each window ``[a_i, a_i + window]`` (starting at an arrival) holds
    arrivals i..m at their drawn costs; when the state started the last of
    their calls (``when``), the fleet knew each at :func:`known_at`
    (lenient); what it did not know
    is the sum of ``max(0, drawn - known)``: the overruns of the calls still
    in flight, and a refused call, settled at 0, at its draw. Answers (the
    most excess, the most of excess minus that, the most charged excess: the
    bucket's own check, never above 0). A call with no record of its process
    (plain, or none expected) counts at its draw.
    """
    s = stats.settings
    ordered = sorted(stats.arrivals, key=lambda a: a.t)
    limit = s.capacity + s.rate * window
    worst, worst_unknown = -math.inf, -math.inf
    high = 0
    for low, first in enumerate(ordered):
        high = max(high, low)
        while high < len(ordered) and ordered[high].t <= first.t + window:
            high += 1
        inside = ordered[low:high]
        sent = sum(a.cost for a in inside)
        worst = max(worst, sent - limit)
        ours = [(a, calls[a.who]) for a in inside if a.who in calls]
        when = max((c for _, c in ours), key=lambda c: c.start_us).decided_us if ours else 0
        unknown = sum(max(0, a.cost - known_at(c, when, settles, False)) for a, c in ours)
        worst_unknown = max(worst_unknown, sent - limit - unknown)
    return worst, worst_unknown, stats.excess(window, charged=True)[0]


def g8_check(calls: list[Call], settles: bool, rate: float, capacity: float, strict: bool) -> float:
    """G8 on the state's clock: the most, over runs of starts i..k (in ticket order), of their costs as known
    when the state started k (:func:`known_at`, lenient or ``strict``) minus ``capacity + rate * (s_k -
    s_i)``. G8 says at most 0."""
    ordered = sorted(calls, key=lambda c: c.ticket)
    worst = -math.inf
    for k, last in enumerate(ordered):
        total = 0
        for i in range(k, -1, -1):
            total += known_at(ordered[i], last.decided_us, settles, strict)
            worst = max(worst, total - capacity - rate * (last.start_us - ordered[i].start_us) / 1e6)
    return worst


def run(mode: str, state: str, url: str, referee: TokenReferee, args: argparse.Namespace) -> dict[str, Any]:
    settings = _settings(args)
    arg = {
        "mode": mode,
        "url": url,
        "name": _common.unique_name(f"token-budget-{mode}"),
        "referee": referee.url,
        "seconds": args.seconds,
        "rate": args.rate,
        "capacity": args.capacity,
        "processes": args.processes,
        "threads": args.threads,
        "mean_cost": settings.mean_cost,
        "high": settings.cost_max,
        "low": args.low,
    }
    results = _common.run_processes(
        worker, [arg] * args.processes, before_start=lambda _: referee.reset(settings)
    )
    time.sleep(0.05)  # (the last answers are noted just after they are sent)
    stats = referee.stats()
    calls = {c.who: c for result in results for c in (Call(*row) for row in result["calls"])}
    state_calls: dict[str, int] = {}
    answers: dict[str, int] = {}
    for result in results:
        for kind, count in result["state"].items():
            state_calls[kind] = state_calls.get(kind, 0) + count
        for kind, count in result["answers"].items():
            answers[kind] = answers.get(kind, 0) + count
    row = figures(mode, state, stats, calls, sum(r["acquires"] for r in results), state_calls, args)
    row["answers"] = answers
    row["given_up"] = sum(len(r["given_up"]) for r in results)
    return row


def figures(
    mode: str,
    state: str,
    stats: TokenStats,
    calls: dict[str, Call],
    acquires: int,
    state_calls: dict[str, int],
    args: argparse.Namespace,
) -> dict[str, Any]:
    s = stats.settings
    until = stats.started + args.seconds
    charged = stats.charged(until)
    settles = mode in ("max-settle", "low-settle")
    checks = {w: window_checks(stats, calls, settles, w) for w in WINDOWS}
    made = len(stats.arrivals)
    settle_calls = state_calls.get("settle", 0)
    return {
        "mode": mode,
        "state": state,
        "ok": stats.accepted(until),
        "ok_all": sum(1 for a in stats.arrivals if a.status == 200),
        "refused": stats.refused,
        "made": made,
        "tokens_per_s": charged / args.seconds,
        "use": charged / (s.capacity + s.rate * args.seconds),
        "excess": {w: c[0] for w, c in checks.items()},
        "beyond_unknown": {w: c[1] for w, c in checks.items()},
        "charged_excess": max(c[2] for c in checks.values()),
        "g8": g8_check(list(calls.values()), settles, s.rate, s.capacity, False)
        if mode != "plain"
        else math.nan,
        "g8_strict": (
            g8_check(list(calls.values()), settles, s.rate, s.capacity, True) if mode != "plain" else math.nan
        ),
        "underestimated": sum(1 for c in calls.values() if c.estimate and c.actual > c.estimate),
        "per_acquire": (sum(state_calls.values()) - settle_calls) / acquires if acquires else math.nan,
        "settles_per_call": settle_calls / made if made and mode != "plain" else math.nan,
        "state_calls": state_calls,
        "acquires": acquires,
        "cumulative": _cumulative(stats),
    }


def _cumulative(stats: TokenStats) -> list[tuple[float, int, int]]:
    """(seconds from the reset, tokens charged so far, 429s so far) at each arrival."""
    points, tokens, refused = [], 0, 0
    for a in sorted(stats.arrivals, key=lambda a: a.t):
        tokens += a.charged
        refused += a.status == 429
        points.append((a.t - stats.started, tokens, refused))
    return points


def _settings(args: argparse.Namespace) -> Settings:
    low, high = _common.numbers(args.costs, int)
    fast, slow = _common.numbers(args.latency_ms)
    return Settings(args.rate, args.capacity, low, high, fast / 1000, slow / 1000, args.seed)


def _signed(value: float, digits: int = 0) -> str:
    if value is None or math.isnan(value):
        return "—"
    text = f"{value:+.{digits}f}"
    return text[1:] if float(text) == 0 else text


# --------------------------------------------------------------------------- main


def main() -> None:
    parser = _common.new_parser(__doc__)
    parser.add_argument("--states", default=",".join(STATES), help="file,redis (default both)")
    parser.add_argument("--modes", default=",".join(MODES), help=",".join(MODES))
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument(
        "--threads", type=int, default=1, help="calls in flight per process, sharing its limiter (1)"
    )
    parser.add_argument(
        "--seconds", type=float, default=20.0, help="length of each mode's run (20; --quick: 5)"
    )
    parser.add_argument("--rate", type=float, default=200.0, help="the budget's tokens per second (200)")
    parser.add_argument("--capacity", type=float, default=400.0, help="the budget's bucket, in tokens (400)")
    parser.add_argument("--costs", default="10,100", help="each call's cost: uniform whole numbers LOW,HIGH")
    parser.add_argument("--low", type=int, default=40, help="low-settle's estimate (40)")
    parser.add_argument("--latency-ms", default="50,250", help="the referee's latency: uniform LOW,HIGH ms")
    parser.add_argument("--seed", type=int, default=1, help="seed of the referee's costs and latencies")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--hog", type=int, default=0, help="busy-loop processes running throughout (0)")
    _common.add_common(
        parser, quick="5 s per mode", plot="write token_budget.png (tokens charged over time) here"
    )
    args = parser.parse_args()
    if args.quick:
        args.seconds = 5.0
    states = _common.chosen(parser, args.states, STATES, "state")
    modes = _common.chosen(parser, args.modes, MODES, "mode")
    settings = _settings(args)
    if not 1 <= args.low <= settings.cost_max or not 1 <= settings.cost_max <= args.capacity:
        parser.error("the estimates (--low and the highest cost) must be from 1 to the capacity")
    import ratequeue

    source = _common.checkout(ratequeue.__file__)
    _common.print_machine()
    print(f"This checkout: {source}\n")
    print(
        f"The referee's budget: {args.rate:g} tokens/s, bucket of {args.capacity:g} tokens (full at first); "
        f"each call costs {settings.cost_min} to {settings.cost_max} tokens (uniform, seed {args.seed}, "
        f"mean {settings.mean_cost:g}), charged on arrival, answered {settings.latency_min * 1000:g} to "
        f"{settings.latency_max * 1000:g} ms later. {args.processes} processes x {args.threads} "
        f"{'call' if args.threads == 1 else 'calls'} in flight, {args.seconds:g} s per mode; limiters at "
        f"interval {1000 / args.rate:g} ms per token, burst {args.capacity:g}; estimates "
        f"{settings.cost_max} (max-*) and {args.low} (low-settle).\n"
    )
    print(f"Load: {args.hog} busy-loop processes (--hog) beside the {args.processes} clients.\n")
    runs = [
        (mode, state)
        for _ in range(args.runs)
        for mode in modes
        for state in (["-"] if mode == "plain" else states)
    ]
    rows = []
    progress = _common.Progress(len(runs), "token_budget")
    with (
        tempfile.TemporaryDirectory(prefix="ratequeue-token-budget-") as directory,
        TokenReferee() as referee,
        _common.busy_loops(args.hog),
    ):
        file_url = (Path(directory) / "state.json").as_uri()
        urls = {}
        with contextlib.ExitStack() as stack:
            for state in states:
                urls[state] = stack.enter_context(_common.state_url(state, args, file_url))
            for mode, state in runs:
                progress.note(f"{mode}/{state}")
                rows.append(run(mode, state, urls.get(state, ""), referee, args))
                progress.step(f"{mode}/{state}: {rows[-1]['refused']} x 429")
    progress.close()
    print(report(rows, args))
    now = _common.checkout(ratequeue.__file__)
    if now != source:  # (the code on disk is read again by every worker process)
        print(f"\nThe checkout changed during the run: now {now}")
    if args.plot:
        plot(rows, args.plot, args)


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    budget = args.capacity + args.rate * args.seconds
    lines = [
        _common.table(
            [
                "mode",
                "state",
                "calls ok",
                "429s",
                f"tokens/s (rate {args.rate:g})",
                f"use of {budget:g} tokens",
                *(f"excess {w:g} s" for w in WINDOWS),
                "G8 on the state's clock (strict)",
                "state calls per acquire",
                "settles per call",
            ],
            [
                [
                    r["mode"],
                    r["state"],
                    r["ok"],
                    r["refused"],
                    f"{r['tokens_per_s']:.1f}",
                    f"{r['use']:.1%}",
                    *(_signed(r["excess"][w]) for w in WINDOWS),
                    f"{_signed(r['g8'], 1)} ({_signed(r['g8_strict'], 1)})",
                    _common.num(r["per_acquire"]),
                    _common.num(r["settles_per_call"]),
                ]
                for r in rows
            ],
        ),
        "",
        f"excess beyond what the fleet did not know when the state started the window's last call "
        f"(windows of {', '.join(f'{w:g}' for w in WINDOWS)} s; at most 0 by G8):",
    ]
    for r in rows:
        if r["mode"] == "plain":
            continue
        beyond = " ".join(_signed(r["beyond_unknown"][w]) for w in WINDOWS)
        lines.append(f"  {r['mode']}/{r['state']}: {beyond} ({r['underestimated']} calls underestimated)")
    worst = max(r["charged_excess"] for r in rows)
    lines += [
        "",
        f"charged tokens beyond capacity + rate * W, any window, any run: {_signed(worst)} "
        "(the referee's own bucket: at most 0)",
        "",
        "state calls per run, by kind, and the state's answers by kind:",
    ]
    for r in rows:
        if r["state_calls"]:
            kinds = ", ".join(f"{k} {v}" for k, v in sorted(r["state_calls"].items(), key=lambda kv: -kv[1]))
            answers = ", ".join(f"{k} {v}" for k, v in sorted(r["answers"].items(), key=lambda kv: -kv[1]))
            lines.append(
                f"  {r['mode']}/{r['state']}: {r['acquires']} acquires, {r['made']} calls; {kinds}; "
                f"answers: {answers}; {r['given_up']} tickets given up unused"
            )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], directory: Path, args: argparse.Namespace) -> None:
    """Tokens charged so far beside the budget (capacity + rate * t), and the 429s as they came."""
    plt = _common.pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True, height_ratios=(3, 1))
    top.plot(
        [0, args.seconds],
        [args.capacity, args.capacity + args.rate * args.seconds],
        color="black",
        linewidth=3,
        label="the budget: capacity + rate x t",
    )
    for row in rows:
        label = f"{row['mode']}/{row['state']}: {row['use']:.0%} used, {row['refused']} x 429"
        times = [0.0] + [t for t, _, _ in row["cumulative"]]
        top.step(times, [0] + [n for _, n, _ in row["cumulative"]], where="post", label=label)
        bottom.step(times, [0] + [n for _, _, n in row["cumulative"]], where="post", label=label)
    top.set_ylabel("tokens charged so far")
    top.legend(fontsize=8, loc="upper left")
    bottom.set_ylabel("429 answers so far")
    bottom.set_xlabel("seconds from the start")
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "token_budget.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    _common.print_written([path])


if __name__ == "__main__":
    main()
