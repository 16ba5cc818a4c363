"""``ratequeue demo --plot FILE``: the demo's begins per process, and its gaps beside the interval.

matplotlib is imported here only (``pip install 'ratequeue[plot]'``), and
without pyplot: a figure drawn by the Agg canvas touches no global backend.
"""

from __future__ import annotations

import itertools
from pathlib import Path

from ..core.protocol import US
from ..errors import ConfigurationError

__all__ = ["check", "draw_demo"]


def check(path: str) -> None:
    """Refuse (:class:`ConfigurationError`) a ``--plot`` file the demo could not draw into, before it runs.

    That is: without matplotlib, in a format it does not know (by the name's
    ending), or in a folder that does not exist.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
    except ImportError as exc:
        raise ConfigurationError(f"--plot needs matplotlib ({exc}): pip install 'ratequeue[plot]'") from exc
    target = Path(path)
    kinds = FigureCanvasAgg.get_supported_filetypes()
    if target.suffix.lstrip(".").lower() not in kinds:
        endings = ", ".join("." + kind for kind in sorted(kinds))
        raise ConfigurationError(f"--plot {path!r}: give a file name ending in one of {endings}")
    if not target.parent.is_dir():
        raise ConfigurationError(f"--plot {path!r}: folder {str(target.parent)!r} does not exist")


def draw_demo(path: str, timeline: list[tuple[int, float]], starts: list[int], interval: float) -> None:
    """Draw into ``path``: begins (x: seconds since the first, y: process) and the gap histograms.

    ``timeline`` holds ``(process, begin)`` pairs, begins in
    ``time.monotonic()`` seconds of this host; ``starts`` the state-clock
    starts (us). The histogram shows the begin gaps and the state-clock gaps
    in milliseconds, in forty bins they share, with the interval marked.
    """
    import numpy
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
    runs.set(xlabel="seconds since the first begin (this host's monotonic clock)", ylabel="process")
    runs.set(yticks=processes, title=f"begins per process, one start every {interval * 1000:g} ms globally")
    runs.grid(axis="x", alpha=0.3)

    begins = sorted(begin for _, begin in timeline)
    begin_gaps = [(later - earlier) * 1000 for earlier, later in itertools.pairwise(begins)]
    state_gaps = [(later - earlier) * 1000 / US for earlier, later in itertools.pairwise(sorted(starts))]
    if begin_gaps:
        bins = numpy.histogram_bin_edges(begin_gaps + state_gaps, bins=40)
        gaps.hist(state_gaps, bins=bins, alpha=0.5, label="state-clock gaps")
        gaps.hist(begin_gaps, bins=bins, alpha=0.5, label="begin gaps")
    gaps.axvline(interval * 1000, color="red", linestyle="--", label=f"interval ({interval * 1000:g} ms)")
    gaps.set(xlabel="gap between consecutive starts (ms)", ylabel="count")
    gaps.legend()
    figure.savefig(path)
