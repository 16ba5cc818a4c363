"""An aiohttp client middleware that waits for the queue's turn before each request and heeds every response.

::

    session = aiohttp.ClientSession(middlewares=(ratequeue.aiohttp.middleware(aio_limiter),))

Client middlewares came with aiohttp 3.12. The same rules as
:mod:`ratequeue.httpx`: a turn of a :class:`ratequeue.aio.Limiter` (or of a
group's key chosen by ``key``) before each send; every response given to
:meth:`~ratequeue.aio.Limiter.heed`, so a 429, a 503 naming a wait or a
quota left at 0 holds every process of the queue; with ``retries=N`` a
refused request is sent again after the hold, at most N times.
docs/feedback.md.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from ._http import Choice, exchange
from .core.flow import arun
from .settings import Seconds

__all__ = ["middleware"]

#: what aiohttp calls a client middleware with: the request and the next handler
Handler = Callable[[aiohttp.ClientRequest], Awaitable[aiohttp.ClientResponse]]


def middleware(
    limiter: Any,
    *,
    key: Callable[[aiohttp.ClientRequest], str] | None = None,
    cost: int | Callable[[aiohttp.ClientRequest], int] = 1,
    retries: int = 0,
    timeout: Seconds | None = None,
) -> Callable[[aiohttp.ClientRequest, Handler], Awaitable[aiohttp.ClientResponse]]:
    """A client middleware sending each request at its turn of ``limiter`` (see :mod:`ratequeue.httpx`).

    :param limiter: a :class:`ratequeue.aio.Limiter`, or an ``aio.LimiterGroup`` with ``key``
        (e.g. ``lambda r: r.url.host``).
    """
    choice: Choice[aiohttp.ClientRequest, Any] = Choice(limiter, key=key, cost=cost, retries=retries)

    async def ratequeue_turns(request: aiohttp.ClientRequest, handler: Handler) -> aiohttp.ClientResponse:
        return await arun(
            exchange(
                choice,
                request,
                timeout,
                send=handler,
                status=_status,
                headers=_headers,
                close=aiohttp.ClientResponse.release,
                replayable=_replayable,
            )
        )

    return ratequeue_turns


def _status(response: aiohttp.ClientResponse) -> int:
    return response.status


def _headers(response: aiohttp.ClientResponse) -> Any:
    return response.headers


def _replayable(request: aiohttp.ClientRequest) -> bool:
    """Whether ``request``'s body can be sent again (a streamed one was read by the first send)."""
    return isinstance(request.body, (bytes, aiohttp.payload.BytesPayload))
