"""Sleeping until a moment as precisely as the host allows.

A job's begin is felt by the service it calls: a wake-up late by ``d``
shortens the gap to the next begin by ``d`` (G7). Linux lets a thread's
sleeps end up to its *timer slack* late (50 us by default) so that wake-ups
can be batched; for the final sleep before a begin, the thread's slack is
cut to 1 ns and restored afterwards. Elsewhere the sleep is plain.
"""

from __future__ import annotations

import ctypes
import sys
import time
from collections.abc import Callable

__all__ = ["wait_until"]

_PR_SET_TIMERSLACK = 29
_PR_GET_TIMERSLACK = 30


def _load_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # pragma: no cover - a libc without prctl
        return None
    return prctl


_prctl = _load_prctl()


def wait_until(until: float, clock: Callable[[], float] = time.monotonic, *, spin: bool = False) -> None:
    """Return once ``clock()`` has reached ``until``, as soon after it as the host allows.

    ``clock`` must tick at the rate of real time (``time.monotonic`` or a
    shifted copy). The calling thread's timer slack is cut for the sleep and
    restored before returning. With ``spin``, busy-wait instead of sleeping:
    only for the last fraction of a millisecond, where a sleep's wake-up
    lateness would be larger than the wait.
    """
    delay = until - clock()
    if delay <= 0:
        return
    if spin:
        while clock() < until:
            pass
        return
    if _prctl is None:
        time.sleep(delay)
        return
    slack = _prctl(_PR_GET_TIMERSLACK, 0, 0, 0, 0)
    _prctl(_PR_SET_TIMERSLACK, 1, 0, 0, 0)
    try:
        while delay > 0:  # time.sleep may return early on some platforms' clocks: finish the wait
            time.sleep(delay)
            delay = until - clock()
    finally:
        if slack > 0:
            _prctl(_PR_SET_TIMERSLACK, slack, 0, 0, 0)
