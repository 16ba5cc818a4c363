"""What the HTTP integrations share: which limiter a request waits for, and whether a refusal is tried again.

:mod:`ratequeue.httpx`, :mod:`ratequeue.requests` and :mod:`ratequeue.aiohttp`
each take a turn before sending, feed every response to the limiter
(:meth:`~ratequeue.Limiter.heed`: a 429, a 503 naming a wait, or a quota
left at 0 holds the whole queue), and may send a refused request again after
the hold. Only the I/O differs: :func:`exchange` is the one flow
(:mod:`ratequeue.core.flow`) each runs with its client's functions, in a
thread (``run``) or on the event loop (``arun``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from .core.flow import Call, Flow
from .errors import ConfigurationError, RateQueueError
from .headers import Feedback, HeadersLike
from .settings import Seconds

__all__ = ["Choice", "check_retries", "exchange", "not_heeded"]

#: an answer the state could not be told of (WARNING: the fleet was not held for it)
_log = logging.getLogger("ratequeue.http")

R = TypeVar("R")
L = TypeVar("L")
A = TypeVar("A")


def not_heeded(limiter: Any, status: int, exc: BaseException) -> None:
    """Log that a response of ``status`` could not be heeded: the state failed; the caller still gets it."""
    _log.warning(
        "queue %r: a %d answer could not be heeded (%s: %s); the response is returned as it came",
        getattr(limiter, "name", "?"),
        status,
        type(exc).__name__,
        exc,
    )


def check_retries(value: object) -> int:
    """``value`` as how many times a refused request is sent again (0 to 100)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 100:
        raise ConfigurationError(f"retries must be a whole number from 0 to 100, got {value!r}")
    return value


class Choice(Generic[R, L]):
    """The limiter a request waits for, its cost, and whether its refusal is sent again.

    ``limiter`` is one limiter for every request, or a group of them (a
    :class:`~ratequeue.LimiterGroup` or anything indexed by a string) with
    ``key``, a function of the request giving its key (its host, say).
    ``cost`` is a number or a function of the request.
    """

    def __init__(
        self,
        limiter: Any,
        *,
        key: Callable[[R], str] | None,
        cost: int | Callable[[R], int],
        retries: int,
    ) -> None:
        if key is not None and not callable(key):
            raise ConfigurationError(f"key must be a function of the request, got {type(key).__name__}")
        if key is None and not hasattr(limiter, "heed"):
            raise ConfigurationError(
                "limiter must be a ratequeue limiter, or a LimiterGroup with key=, "
                f"got {type(limiter).__name__}"
            )
        if key is not None and not hasattr(limiter, "__getitem__"):
            raise ConfigurationError(
                f"with key=, limiter must be a LimiterGroup (indexed by key), got {type(limiter).__name__}"
            )
        if not callable(cost) and (isinstance(cost, bool) or not isinstance(cost, int) or cost < 1):
            raise ConfigurationError(f"cost must be a whole number >= 1 or a function, got {cost!r}")
        self._limiter, self._key, self._cost = limiter, key, cost
        self.retries = check_retries(retries)

    def limiter(self, request: R) -> L:
        """The limiter ``request`` waits for."""
        if self._key is None:
            return self._limiter  # type: ignore[no-any-return]
        return self._limiter[self._key(request)]  # type: ignore[no-any-return]

    def cost(self, request: R) -> int:
        """How many starts of the rate ``request`` uses."""
        return self._cost(request) if callable(self._cost) else self._cost

    def again(self, status: int, feedback: Feedback, tries: int) -> bool:
        """Whether a response of ``status`` to try number ``tries`` (1 first) is sent again, after the hold.

        A 429 is, and a 503 whose headers asked for a wait, while tries are left.
        """
        refused = status == 429 or (status == 503 and feedback.hold is not None)
        return refused and tries <= self.retries


def exchange(
    choice: Choice[R, Any],
    request: R,
    timeout: Seconds | None,
    *,
    send: Callable[[R], Any],
    status: Callable[[A], int],
    headers: Callable[[A], HeadersLike],
    close: Callable[[A], Any],
    replayable: Callable[[R], bool],
    told: Callable[[R, Callable[[], Any]], R] | None = None,
) -> Flow[A]:
    """Send ``request`` at its turn, heed the answer, send a refused one again if ``choice`` allows.

    ``send`` sends the request and returns the answer; ``status``,
    ``headers`` and ``close`` read and close an answer; ``replayable`` says
    whether the request's body can be sent again; ``told``, where the
    client has a moment between writing a request and reading its answer,
    returns the request set to call its argument then (the turn's
    :meth:`~ratequeue.Limiter.sent`). A limiter with
    ``max_running`` has its place given back once the answer's headers are
    in, or the send failed (a failed release must not lose the answer: the
    lease expires). The state failing to heed an answer is logged, and the
    answer still reaches the caller; a cancel while heeding closes the
    answer, so its connection goes back to its pool.
    """
    limiter, cost, tries = choice.limiter(request), choice.cost(request), 0
    while True:
        tries += 1
        turn = yield Call(functools.partial(limiter.acquire, timeout, cost=cost))
        held = ((turn.ticket, turn.token),)
        sending = request if told is None else told(request, functools.partial(limiter.sent, turn))
        try:
            answer: A = yield Call(send, (sending,))
        except BaseException:
            if limiter.holds_places:
                yield Call(limiter._release_quietly, held)
            raise
        code = status(answer)
        try:
            if limiter.holds_places:
                yield Call(limiter._release_quietly, held)
            feedback = yield Call(functools.partial(limiter.heed, headers(answer), status=code))
        except RateQueueError as exc:
            not_heeded(limiter, code, exc)
            return answer
        except BaseException:
            yield Call(close, (answer,))
            raise
        if not (choice.again(code, feedback, tries) and replayable(request)):
            return answer
        yield Call(close, (answer,))
