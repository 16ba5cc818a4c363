"""The fleet hears the service: 8 processes against a quota they do not know, which changes mid-run.

A :mod:`quota_referee` allows 30 calls per second, then 10, then 20 (6 s
each; counted in fixed 2 s windows), answers 429 with ``Retry-After`` over
the quota and publishes ``X-RateLimit-Limit / -Remaining / -Reset-After`` on
every answer. 8 processes (``--processes``) call it for the whole schedule,
configured at 40/s (``--rate``), too fast for every phase. Compared in one run:

* ``plain``: httpx, each process pacing itself at rate / 8 and sleeping a
  429's ``Retry-After`` on its own (the usual per-worker retry);
* ``no-feedback``: a ratequeue ``Limiter`` in front of each call, and the same
  per-worker sleep on a 429;
* ``feedback``: ``httpx.Client(transport=ratequeue.httpx.Transport(limiter))``:
  every answer heeded (a quota left at 0, a 429's ``Retry-After``) by holding
  the whole queue on the state;
* ``adaptive``: the same with ``Limiter(..., adaptive=True)``: each refusal
  also halves the queue's rate, which recovers by itself.

``--no-headers`` makes the referee publish no quota (only 429 with
``Retry-After``), the case the adaptive rate is for.

Reported, as the referee saw it: the calls refused (429), the calls accepted
against what the quota allowed over the run, and the calls that came while a
``Retry-After`` the referee had answered was still running (all of them, and
those more than 10 ms after the 429, which no client could have heard yet
before that).

    python bench/feedback.py                      # file and Redis (a redis-server of its own)
    python bench/feedback.py --states file --quick
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from pathlib import Path
from typing import Any

import _common
from quota_referee import DEFAULT_PHASES, QuotaReferee, QuotaStats

MODES = ("plain", "no-feedback", "feedback", "adaptive")
STATES = ("file", "redis")


def worker(index: int, arg: dict[str, Any], gate: _common.Gate) -> dict[str, Any]:
    """One process: call the referee until the schedule ends, as ``arg["mode"]`` says."""
    import httpx

    import ratequeue
    import ratequeue.httpx

    mode, seconds, rate, processes = arg["mode"], arg["seconds"], arg["rate"], arg["processes"]
    call = f"{arg['referee']}/call?who={mode}-{index}"
    limiter = None
    if mode != "plain":
        adaptive = mode == "adaptive"
        limiter = ratequeue.Limiter(arg["url"], name=arg["name"], rate=f"{rate}/second", adaptive=adaptive)
    if mode in ("feedback", "adaptive"):
        client = httpx.Client(transport=ratequeue.httpx.Transport(limiter, timeout=60))
    else:
        client = httpx.Client()
    client.get(f"{arg['referee']}/stats")  # the connection is open before the start
    t0 = gate.wait()
    end, step = t0 + seconds, processes / rate
    slot = t0 + index * step / processes
    calls = 0
    while True:
        if mode == "plain":
            slot = max(slot + step, time.monotonic()) if calls else slot
            if slot >= end:
                break
            time.sleep(max(0.0, slot - time.monotonic()))
        elif mode == "no-feedback":
            turn = limiter.acquire(timeout=60)  # type: ignore[union-attr]
            if time.monotonic() >= end:
                break
            del turn
        elif time.monotonic() >= end:
            break
        response = client.get(call)
        calls += 1
        if mode in ("plain", "no-feedback") and response.status_code == 429:
            time.sleep(float(response.headers.get("Retry-After", "1")))
        if time.monotonic() >= end:
            break
    client.close()
    if limiter is not None:
        limiter.close()
    return {"calls": calls}


def run(mode: str, state: str, url: str, referee: QuotaReferee, args: argparse.Namespace) -> dict[str, Any]:
    seconds = sum(s for _, s in DEFAULT_PHASES)
    name = _common.unique_name(f"feedback-{mode}")
    arg = {
        "mode": mode,
        "url": url,
        "name": name,
        "referee": referee.url,
        "seconds": seconds,
        "rate": args.rate,
        "processes": args.processes,
    }
    _common.run_processes(
        worker, [arg] * args.processes, before_start=lambda _: referee.reset(headers=not args.no_headers)
    )
    stats = referee.stats()
    until = stats.started + seconds  # whole windows: the calls after the schedule's end are not counted
    return figures(mode, state, stats, until)


def figures(mode: str, state: str, stats: QuotaStats, until: float) -> dict[str, Any]:
    allowed = stats.allowed(until)
    early = stats.early_calls()
    return {
        "mode": mode,
        "state": state,
        "refused": stats.refused,
        "accepted": stats.accepted(until),
        "allowed": allowed,
        "use": stats.accepted(until) / allowed if allowed else 0.0,
        "early": len(early),
        "early_late": sum(1 for after, _ in early if after > 0.010),
        "windows": [
            sum(
                1
                for t, status, *_ in stats.arrivals
                if status == 200 and k * stats.window <= t - stats.started < (k + 1) * stats.window
            )
            for k in range(round((until - stats.started) / stats.window))
        ],
        # (seconds from the start, refused so far) at each 429
        "refusals": [
            (t - stats.started, n + 1)
            for n, t in enumerate(t for t, status, *_ in stats.arrivals if status == 429)
        ],
        "sent": [
            sum(
                1
                for t, *_ in stats.arrivals
                if k * stats.window <= t - stats.started < (k + 1) * stats.window
            )
            for k in range(round((until - stats.started) / stats.window))
        ],
    }


def main() -> None:
    parser = _common.new_parser(__doc__)
    parser.add_argument("--states", default=",".join(STATES), help="file,redis (default both)")
    parser.add_argument("--modes", default=",".join(MODES), help="plain,no-feedback,feedback,adaptive")
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--rate", type=float, default=40.0, help="the clients' configured rate (per second)")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--hog", type=int, default=0, help="busy-loop processes running throughout (0)")
    parser.add_argument(
        "--no-headers", action="store_true", help="the referee publishes no quota: only 429 with Retry-After"
    )
    _common.add_common(parser, quick="one run of each", plot="write feedback.png (effective rate) here")
    args = parser.parse_args()
    states = _common.chosen(parser, args.states, STATES, "state")
    modes = _common.chosen(parser, args.modes, MODES, "mode")
    _common.print_machine()
    print(
        f"{args.processes} processes configured at {args.rate:g}/s; the referee's quota (unknown to them): "
        + ", ".join(f"{r:g}/s for {s:g} s" for r, s in DEFAULT_PHASES)
        + " in 2 s windows\n"
    )
    rows = []
    print(f"Load: {args.hog} busy-loop processes (--hog) beside the {args.processes} clients.")
    said = (
        "no quota headers: only 429 with Retry-After" if args.no_headers else "X-RateLimit-* on every answer"
    )
    print(f"The referee publishes {said}.\n")
    with (
        tempfile.TemporaryDirectory(prefix="ratequeue-feedback-") as directory,
        QuotaReferee() as referee,
        _common.busy_loops(args.hog),
    ):
        file_url = (Path(directory) / "state.json").as_uri()
        urls = {}
        with contextlib.ExitStack() as stack:
            for state in states:
                urls[state] = stack.enter_context(_common.state_url(state, args, file_url))
            for _ in range(args.runs):
                for mode in modes:
                    for state in ["-"] if mode == "plain" else states:
                        rows.append(run(mode, state, urls.get(state, ""), referee, args))
                        print(f"  {mode}/{state}: {rows[-1]['refused']} refused", flush=True)
    print()
    print(
        _common.table(
            [
                "mode",
                "state",
                "429s",
                "accepted / allowed",
                "quota used",
                "calls during a Retry-After (> 10 ms after)",
            ],
            [
                [
                    r["mode"],
                    r["state"],
                    r["refused"],
                    f"{r['accepted']} / {r['allowed']}",
                    f"{r['use']:.1%}",
                    f"{r['early']} ({r['early_late']})",
                ]
                for r in rows
            ],
        )
    )
    print(
        "\naccepted per 2 s window (the quota: "
        + " ".join(str(round(r * 2)) for r, s in DEFAULT_PHASES for _ in range(round(s / 2)))
        + ")"
    )
    for r in rows:
        print(f"  {r['mode']}/{r['state']}: " + " ".join(map(str, r["windows"])))
    if args.plot:
        plot(rows, args.plot)


def plot(rows: list[dict[str, Any]], directory: Path) -> None:
    """Calls sent per second (window by window) beside the quota, and the 429s as they came."""
    plt = _common.pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    window = 2.0
    quota_t, quota_r, t = [], [], 0.0
    for rate, length in DEFAULT_PHASES:
        quota_t += [t, t + length]
        quota_r += [rate, rate]
        t += length
    top.plot(quota_t, quota_r, color="black", linewidth=3, label="the quota (unknown to the clients)")
    for row in rows:
        label = f"{row['mode']}/{row['state']}: {row['refused']} x 429, {row['use']:.0%} of the quota used"
        rates = [count / window for count in row["sent"]]
        top.stairs(rates, [k * window for k in range(len(rates) + 1)], label=label, linewidth=1.5)
        times = [0.0] + [when for when, _ in row["refusals"]] + [t]
        counts = [0] + [n for _, n in row["refusals"]] + [row["refused"]]
        bottom.step(times, counts, where="post", label=label)
    top.set_ylabel("calls sent per second\n(per 2 s window)")
    top.set_ylim(0, 45)
    top.legend(fontsize=8, loc="upper right")
    bottom.set_ylabel("429 answers so far")
    bottom.set_xlabel("seconds from the start")
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "feedback.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    _common.print_written([path])


if __name__ == "__main__":
    main()
