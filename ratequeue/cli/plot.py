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


def draw_demo(
    path: str, timeline: list[tuple[int, float]], starts: list[int], interval: float, bound: float
) -> None:
    """Draw into ``path``: begins (x: seconds since the first, y: process) and the gap histograms.

    ``timeline`` holds ``(process, begin)`` pairs, begins in
    ``time.monotonic()`` seconds of this host; ``starts`` the state-clock
    starts (us); ``bound`` the smallest begin gap G7 keeps (s,
    ``interval - max_late``). The histogram shows the begin gaps and the
    state-clock gaps in milliseconds, side by side in the bins they share,
    with the interval and the bound marked. Its range is the gaps near the
    interval: the few far longer ones (a pause, a slow host) are counted in
    the legend rather than drawn, so that they do not squash the rest.
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
    runs.set(xlabel="seconds since the first begin (this host's monotonic clock)", ylabel="process")
    runs.set(yticks=processes, title=f"begins per process, one start every {interval * 1000:g} ms globally")
    runs.grid(axis="x", alpha=0.3)

    begins = sorted(begin for _, begin in timeline)
    begin_gaps = [(later - earlier) * 1000 for earlier, later in itertools.pairwise(begins)]
    state_gaps = [(later - earlier) * 1000 / US for earlier, later in itertools.pairwise(sorted(starts))]
    interval_ms, bound_ms = interval * 1000, bound * 1000
    # the range drawn: from a little below the bound (or the shortest gap) to 4 % over the interval
    low = max(0.0, min([bound_ms - 0.01 * interval_ms, *begin_gaps, *state_gaps]))
    high = min(max([*begin_gaps, *state_gaps], default=interval_ms), interval_ms * 1.04)
    high = max(high, interval_ms + 0.01 * interval_ms)
    shown = [[gap for gap in state_gaps if gap <= high], [gap for gap in begin_gaps if gap <= high]]
    longer = len(state_gaps) + len(begin_gaps) - len(shown[0]) - len(shown[1])
    if begin_gaps:
        gaps.hist(
            shown,
            bins=40,
            range=(low, high),
            label=["state-clock gaps", "begin gaps (acquire() returning)"],
            color=["tab:blue", "tab:orange"],
        )
    gaps.axvline(interval_ms, color="red", linestyle="--", label=f"interval ({interval_ms:g} ms)")
    if bound_ms < interval_ms:
        gaps.axvline(
            bound_ms,
            color="black",
            linestyle=":",
            label=f"interval - max_late ({bound_ms:g} ms): none below (G7)",
        )
    if longer:
        gaps.plot([], [], " ", label=f"{longer} gap(s) over {high:g} ms not drawn")
    gaps.set(xlabel="gap between consecutive starts (ms)", ylabel="count", xlim=(low, high))
    gaps.legend(fontsize="small")
    figure.savefig(path)
