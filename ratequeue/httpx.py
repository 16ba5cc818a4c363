"""httpx transports that wait for the queue's turn before each request and heed every response.

::

    client = httpx.Client(transport=ratequeue.httpx.Transport(limiter))
    async_client = httpx.AsyncClient(transport=ratequeue.httpx.AsyncTransport(aio_limiter))

Each request first takes a turn of its limiter (one for all, or one per key
of a :class:`~ratequeue.LimiterGroup` chosen by ``key``, e.g. the host);
then its response is given to :meth:`~ratequeue.Limiter.heed`: a 429, a 503
naming a wait, or a quota left at 0 holds **every process** of the queue
until the service said. With ``retries=N`` a refused request (429, or 503
naming a wait) is sent again after the hold, at most N times, if its body
can be sent again (bytes in memory, not a stream); the last response is
returned either way. A limiter with ``max_running`` has its
place given back once the response's headers are in (a streamed body is
read after that). docs/feedback.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx

from ._http import Choice, not_heeded
from .errors import RateQueueError
from .settings import Seconds

__all__ = ["AsyncTransport", "Transport"]


class Transport(httpx.BaseTransport):
    """An httpx transport that sends each request through ``transport`` at its turn, and heeds the answer."""

    def __init__(
        self,
        limiter: Any,
        transport: httpx.BaseTransport | None = None,
        *,
        key: Callable[[httpx.Request], str] | None = None,
        cost: int | Callable[[httpx.Request], int] = 1,
        retries: int = 0,
        timeout: Seconds | None = None,
    ) -> None:
        """
        :param limiter: a :class:`~ratequeue.Limiter`, or a :class:`~ratequeue.LimiterGroup` with ``key``.
        :param transport: the transport that sends (default: ``httpx.HTTPTransport()``).
        :param key: the group's key of a request (e.g. ``lambda r: r.url.host``).
        :param cost: how many starts of the rate a request uses, or a function of the request.
        :param retries: how many times a refused request is sent again after the hold (default 0).
        :param timeout: seconds to wait for a turn at most (``AcquireTimeout``); ``None``: for ever.
        """
        self._choice: Choice[httpx.Request, Any] = Choice(limiter, key=key, cost=cost, retries=retries)
        self._transport = transport if transport is not None else httpx.HTTPTransport()
        self._timeout = timeout

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        """Send ``request`` at its turn; heed the response; send a refused one again if ``retries`` allow."""
        choice = self._choice
        limiter, cost, tries = choice.limiter(request), choice.cost(request), 0
        while True:
            tries += 1
            turn = limiter.acquire(self._timeout, cost=cost)
            try:
                response = self._transport.handle_request(request)
            finally:
                if limiter.max_running:  # a failed release must not lose the answer: the lease expires
                    limiter._release_quietly((turn.ticket, turn.token))
            try:
                feedback = limiter.heed(response.headers, status=response.status_code)
            except RateQueueError as exc:  # the state failed: the answer still reaches the caller
                not_heeded(limiter, response.status_code, exc)
                return response
            if not (choice.again(response.status_code, feedback, tries) and _replayable(request)):
                return response
            response.close()

    def close(self) -> None:
        """Close the wrapped transport (the limiter is the caller's to close)."""
        self._transport.close()


class AsyncTransport(httpx.AsyncBaseTransport):
    """:class:`Transport` for ``httpx.AsyncClient``, with a :class:`ratequeue.aio.Limiter` (or group)."""

    def __init__(
        self,
        limiter: Any,
        transport: httpx.AsyncBaseTransport | None = None,
        *,
        key: Callable[[httpx.Request], str] | None = None,
        cost: int | Callable[[httpx.Request], int] = 1,
        retries: int = 0,
        timeout: Seconds | None = None,
    ) -> None:
        """The parameters of :class:`Transport`; ``transport`` defaults to ``httpx.AsyncHTTPTransport()``."""
        self._choice: Choice[httpx.Request, Any] = Choice(limiter, key=key, cost=cost, retries=retries)
        self._transport = transport if transport is not None else httpx.AsyncHTTPTransport()
        self._timeout = timeout

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """Send ``request`` at its turn; heed the response; send a refused one again if ``retries`` allow."""
        choice = self._choice
        limiter, cost, tries = choice.limiter(request), choice.cost(request), 0
        while True:
            tries += 1
            turn = await limiter.acquire(self._timeout, cost=cost)
            try:
                response = await self._transport.handle_async_request(request)
            except BaseException:
                if limiter.max_running:
                    await limiter._release_quietly((turn.ticket, turn.token))
                raise
            try:
                if limiter.max_running:  # a failed release must not lose the answer: the lease expires
                    await limiter._release_quietly((turn.ticket, turn.token))
                feedback = await limiter.heed(response.headers, status=response.status_code)
            except RateQueueError as exc:  # the state failed: the answer still reaches the caller
                not_heeded(limiter, response.status_code, exc)
                return response
            except BaseException:  # cancelled: the connection goes back to its pool
                await response.aclose()
                raise
            if not (choice.again(response.status_code, feedback, tries) and _replayable(request)):
                return response
            await response.aclose()

    async def aclose(self) -> None:
        """Close the wrapped transport (the limiter is the caller's to close)."""
        await self._transport.aclose()


def _replayable(request: httpx.Request) -> bool:
    """Whether ``request`` can be sent again: its body is bytes in memory, not a stream already read."""
    return isinstance(request.stream, httpx.ByteStream)
