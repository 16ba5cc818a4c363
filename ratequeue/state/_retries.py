"""How a server state retries the calls that fail on their connection, and logs them.

A dead connection is routine: a server's idle ``timeout``, a NAT or load
balancer that drops idle flows, PostgreSQL's ``idle_session_timeout`` or
pgbouncer, a ``CLIENT KILL``, a failover. The call's first retry is INFO:
it is answered, and nothing was lost. A retry that fails again (a second
failure in a row), or a call that gives up, is what an operator may act on:
a WARNING -- at most one per :data:`WARNING_EVERY` seconds per state, the
ones held back meanwhile logged at DEBUG and counted in the next warning,
so an outage logs a warning a minute, not one per call per thread.

:meth:`RetryLog.retried` is the retry loop of MongoDB's and PostgreSQL's
calls, a :mod:`ratequeue.core.flow`; Redis' lean calls retry in their own
(they reconnect the same connection first).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from .._redact import scrub
from ..core.flow import Call, Flow, Sleep

__all__ = ["BACKOFF", "BACKOFF_CAP", "RETRIES", "WARNING_EVERY", "RetryLog"]

T = TypeVar("T")

#: the most often (s) one state logs failed retries and calls given up at WARNING
WARNING_EVERY = 60.0

#: how often :meth:`RetryLog.retried` retries a call, the first backoff and the longest (s)
RETRIES = 5
BACKOFF = 0.02
BACKOFF_CAP = 0.5


class RetryLog:
    """The retry lines of one state, to ``log``, naming the server as ``what`` at ``where``.

    :meth:`retried` carries out a call with the retries it logs.
    """

    def __init__(
        self,
        log: logging.Logger,
        what: str,
        where: str,
        *,
        every: float = WARNING_EVERY,
        clock: Callable[[], float] = time.monotonic,
        url: str | None = None,
        transient: tuple[type[BaseException], ...] = (),
        lasting: tuple[type[BaseException], ...] = (),
    ) -> None:
        """
        :param url: the state's URL, whose secrets are taken out of each line's text about
            the failure (a client library's message may hold a password).
        :param transient: the failures :meth:`retried` retries, less those that are ``lasting``.
        """
        self._log, self._what, self.where = log, what, where
        self._transient, self._lasting = transient, lasting
        self._every, self._clock, self._url = every, clock, url
        self._lock = threading.Lock()
        #: when the latest warning was logged (``None``: never), and how many were held back since
        self._warned: float | None = None
        self._held = 0

    def retried(self, attempt: Call | Callable[[], Flow[T]]) -> Flow[T]:
        """``attempt`` (a call, or the flow it makes) carried out; after a transient failure, again.

        At most :data:`RETRIES` times again, with backoff. Any other error, and the last
        transient failure, is raised (the state maps it). A first retry is
        INFO (a connection closed while idle is routine), a retry that fails
        again or a call that gives up a WARNING.
        """
        delay, failures = BACKOFF, 0
        while True:
            try:
                return (yield attempt) if isinstance(attempt, Call) else (yield from attempt())
            except self._transient as exc:
                if isinstance(exc, self._lasting):
                    raise
                failures += 1
                if failures > RETRIES:
                    self.gave_up(exc, failures)
                    raise
                self.retrying(exc, failures, RETRIES)
                yield Sleep(delay)
                delay = min(delay * 2, BACKOFF_CAP)

    def _failure(self, failure: BaseException, where: str | None) -> str:
        return scrub(
            f"{self._what} at {where or self.where} failed ({type(failure).__name__}: {failure})", self._url
        )

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
