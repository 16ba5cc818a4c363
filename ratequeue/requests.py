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

from ._http import Choice, exchange
from .core.flow import run
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

        def sent(prepared: requests.PreparedRequest) -> requests.Response:
            return super(Adapter, self).send(prepared, *args, **kwargs)

        return run(
            exchange(
                self._choice,
                request,
                self._turn_timeout,
                send=sent,
                status=_status,
                headers=_headers,
                close=requests.Response.close,
                replayable=_replayable,
            )
        )


def _status(response: requests.Response) -> int:
    return response.status_code


def _headers(response: requests.Response) -> Any:
    return response.headers


def _replayable(request: requests.PreparedRequest) -> bool:
    """Whether ``request``'s body can be sent again: none, or bytes (an iterator or file was read)."""
    return request.body is None or isinstance(request.body, (bytes, str))
