"""A requests adapter that waits for the queue's turn before each request and heeds every response.

::

    session = requests.Session()
    session.mount("https://", ratequeue.requests.Adapter(limiter))

The same rules as :mod:`ratequeue.httpx`: a turn (of one limiter, or of a
group's key chosen by ``key``) before each send; every response given to
:meth:`~ratequeue.Limiter.heed`, so a 429, a 503 naming a wait or a quota
left at 0 holds every process of the queue; with ``retries=N`` a refused
request is sent again after the hold, at most N times. docs/feedback.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import requests
from requests.adapters import HTTPAdapter

from ._http import Choice, not_heeded
from .errors import RateQueueError
from .settings import Seconds

__all__ = ["Adapter"]


class Adapter(HTTPAdapter):
    """An ``HTTPAdapter`` whose every send waits for its turn of ``limiter`` and heeds the answer."""

    def __init__(
        self,
        limiter: Any,
        *,
        key: Callable[[requests.PreparedRequest], str] | None = None,
        cost: int | Callable[[requests.PreparedRequest], int] = 1,
        retries: int = 0,
        timeout: Seconds | None = None,
        **adapter: Any,
    ) -> None:
        """
        :param limiter: a :class:`~ratequeue.Limiter`, or a :class:`~ratequeue.LimiterGroup` with ``key``.
        :param key: the group's key of a request (e.g. ``lambda r: urllib.parse.urlsplit(r.url).hostname``).
        :param cost: how many starts of the rate a request uses, or a function of the request.
        :param retries: how many times a refused request is sent again after the hold (default 0);
            not the adapter's own ``max_retries``, which is about connections.
        :param timeout: seconds to wait for a turn at most (``AcquireTimeout``); ``None``: for ever.
        :param adapter: passed on to ``HTTPAdapter`` (``pool_connections``, ``max_retries``, ...).
        """
        self._choice: Choice[requests.PreparedRequest, Any] = Choice(
            limiter, key=key, cost=cost, retries=retries
        )
        self._turn_timeout = timeout
        super().__init__(**adapter)

    def send(self, request: requests.PreparedRequest, *args: Any, **kwargs: Any) -> requests.Response:
        """Send ``request`` at its turn; heed the response; send a refused one again if ``retries`` allow."""
        choice = self._choice
        limiter, cost, tries = choice.limiter(request), choice.cost(request), 0
        while True:
            tries += 1
            turn = limiter.acquire(self._turn_timeout, cost=cost)
            try:
                response = super().send(request, *args, **kwargs)
            finally:
                if limiter.max_running:  # a failed release must not lose the answer: the lease expires
                    limiter._release_quietly((turn.ticket, turn.token))
            try:
                feedback = limiter.heed(response.headers, status=response.status_code)
            except RateQueueError as exc:  # the state failed: the answer still reaches the caller
                not_heeded(limiter, response.status_code, exc)
                return response
            # (a body that is an iterator or a file was read by the first send: it is not sent again)
            replayable = request.body is None or isinstance(request.body, (bytes, str))
            if not (choice.again(response.status_code, feedback, tries) and replayable):
                return response
            response.close()
