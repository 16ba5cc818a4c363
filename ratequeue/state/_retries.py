"""How a server state logs the calls it retries after a connection failure.

A dead connection is routine: a server's idle ``timeout``, a NAT or load
balancer that drops idle flows, PostgreSQL's ``idle_session_timeout`` or
pgbouncer, a ``CLIENT KILL``, a failover. The call's first retry is INFO:
it is answered, and nothing was lost. A retry that fails again (a second
failure in a row), or a call that gives up, is what an operator may act on:
a WARNING -- at most one per :data:`WARNING_EVERY` seconds per state, the
ones held back meanwhile logged at DEBUG and counted in the next warning,
so an outage logs a warning a minute, not one per call per thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

__all__ = ["WARNING_EVERY", "RetryLog"]

#: the most often (s) one state logs failed retries and calls given up at WARNING
WARNING_EVERY = 60.0


class RetryLog:
    """The retry lines of one state, to ``log``, naming the server as ``what`` at ``where``."""

    def __init__(
        self,
        log: logging.Logger,
        what: str,
        where: str,
        *,
        every: float = WARNING_EVERY,
        clock: Callable[[], float] = time.monotonic,
        scrub: Callable[[str], str] | None = None,
    ) -> None:
        """
        :param scrub: applied to each line's text about the failure (a driver's
            message may hold a password).
        """
        self._log, self._what, self.where = log, what, where
        self._every, self._clock, self._scrub = every, clock, scrub
        self._lock = threading.Lock()
        #: when the latest warning was logged (``None``: never), and how many were held back since
        self._warned: float | None = None
        self._held = 0

    def _failure(self, failure: BaseException, where: str | None) -> str:
        text = f"{self._what} at {where or self.where} failed ({type(failure).__name__}: {failure})"
        return self._scrub(text) if self._scrub is not None else text

    def retrying(
        self,
        failure: BaseException,
        failures: int,
        retries: int,
        *,
        idle: bool = False,
        where: str | None = None,
    ) -> None:
        """Log that a call failed for the ``failures``-th time in a row with ``failure`` and is retried.

        ``idle``: the call's connection had been kept idle since the previous
        call (the server or the network may have closed it meanwhile).
        """
        if failures <= 1:
            if self._log.isEnabledFor(logging.INFO):
                cause = " on a connection kept idle since its last call" if idle else ""
                self._log.info(
                    "%s%s; retrying, %d of %d", self._failure(failure, where), cause, failures, retries
                )
            return
        if failures == 2:
            self._warn("%s again; retrying, %d of %d", self._failure(failure, where), failures, retries)
        elif self._log.isEnabledFor(logging.DEBUG):
            self._log.debug("%s; retrying, %d of %d", self._failure(failure, where), failures, retries)

    def gave_up(self, failure: BaseException, failures: int, *, where: str | None = None) -> None:
        """Log a call that gives up after ``failures`` failures in a row; ``failure`` goes to its caller."""
        self._warn("%s; the call gives up after %d failure(s)", self._failure(failure, where), failures)

    def _warn(self, message: str, *args: object) -> None:
        """Log at WARNING unless one was logged within :data:`WARNING_EVERY` s (then DEBUG, counted)."""
        now = self._clock()
        with self._lock:
            warn = self._warned is None or now - self._warned >= self._every
            if warn:
                held, self._held, self._warned = self._held, 0, now
            else:
                self._held += 1
        if warn:
            if held:
                message += " (%d more retried or failed call(s) since the last warning, logged at DEBUG)"
                args = (*args, held)
            self._log.warning(message, *args)
        elif self._log.isEnabledFor(logging.DEBUG):
            self._log.debug(message, *args)
