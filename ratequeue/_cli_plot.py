"""``ratequeue demo --plot FILE``: the demo's begins per process, and its gaps beside the interval.

matplotlib is imported here only (``pip install 'ratequeue[plot]'``), and
without pyplot: a figure drawn by the Agg canvas touches no global backend.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

from .protocol import US

__all__ = ["draw_demo"]


def draw_demo(
    path: Path, timeline: Sequence[tuple[int, float]], starts: Sequence[int], interval: float
) -> None:
    """Draw into ``path``: begins (x: seconds since the first, y: process) and the gap histograms.

    ``timeline`` holds ``(process, begin)`` pairs, begins in
    ``time.monotonic()`` seconds of this host; ``starts`` the state-clock
    starts (us). The histogram shows the begin gaps and the state-clock gaps
    in milliseconds, with the interval marked.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10, 6), layout="constrained")
    FigureCanvasAgg(figure)
    runs, gaps = figure.subplots(2, 1, height_ratios=[3, 2])

    first = min((begin for _, begin in timeline), default=0.0)
    processes = sorted({process for process, _ in timeline})
    for process in processes:
        times = [begin - first for who, begin in timeline if who == process]
        runs.plot(times, [process] * len(times), "|", markersize=14, markeredgewidth=1.5)
    runs.set_yticks(processes)
    runs.set_xlabel("seconds since the first begin (this host's monotonic clock)")
    runs.set_ylabel("process")
    runs.set_title(f"begins per process, one start every {interval * 1000:g} ms globally")
    runs.grid(axis="x", alpha=0.3)

    begins = sorted(begin for _, begin in timeline)
    begin_gaps = [(later - earlier) * 1000 for earlier, later in itertools.pairwise(begins)]
    state_gaps = [(later - earlier) * 1000 / US for earlier, later in itertools.pairwise(sorted(starts))]
    if begin_gaps:
        bins = _bins(begin_gaps + state_gaps)
        gaps.hist(state_gaps, bins=bins, alpha=0.5, label="state-clock gaps")
        gaps.hist(begin_gaps, bins=bins, alpha=0.5, label="begin gaps")
    gaps.axvline(interval * 1000, color="red", linestyle="--", label=f"interval ({interval * 1000:g} ms)")
    gaps.set_xlabel("gap between consecutive starts (ms)")
    gaps.set_ylabel("count")
    gaps.legend()
    figure.savefig(path)


def _bins(values: Sequence[float]) -> list[float]:
    """Forty equal bins over ``values`` (one of width 1 if they are all equal)."""
    low, high = min(values), max(values)
    if high <= low:
        return [low - 0.5, low + 0.5]
    step = (high - low) / 40
    return [low + step * index for index in range(41)]
