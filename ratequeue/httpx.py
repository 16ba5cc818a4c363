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

Once a request is written (httpcore's ``trace`` extension: its body sent),
the transport calls the turn's :meth:`~ratequeue.Limiter.sent`: a request
written later than ``max_late`` after its turn's start (the process was
descheduled meanwhile) holds the queue, so that the next one comes an
interval after it. A ``trace`` of the request's own is still called. A
wrapped transport that is not httpcore's sends no such event, and nothing
is held.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx

from ._http import Choice, exchange
from .core.flow import arun, run
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
        return run(
            exchange(
                self._choice,
                request,
                self._timeout,
                send=self._transport.handle_request,
                status=_status,
                headers=_headers,
                close=httpx.Response.close,
                replayable=_replayable,
                told=_told,
            )
        )

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
        return await arun(
            exchange(
                self._choice,
                request,
                self._timeout,
                send=self._transport.handle_async_request,
                status=_status,
                headers=_headers,
                close=httpx.Response.aclose,
                replayable=_replayable,
                told=_told_async,
            )
        )

    async def aclose(self) -> None:
        """Close the wrapped transport (the limiter is the caller's to close)."""
        await self._transport.aclose()


def _status(response: httpx.Response) -> int:
    return response.status_code


def _headers(response: httpx.Response) -> httpx.Headers:
    return response.headers


def _replayable(request: httpx.Request) -> bool:
    """Whether ``request`` can be sent again: its body is bytes in memory, not a stream already read."""
    return isinstance(request.stream, httpx.ByteStream)


#: the end of httpcore's trace event once a request's body is written (``http11.``, ``http2.``)
_WRITTEN = ".send_request_body.complete"


class _SentTrace:
    """httpcore's ``trace`` extension: ``sent()`` once the request is written; the request's own trace too."""

    def __init__(self, sent: Callable[[], Any], own: Any) -> None:
        self.sent = sent
        #: the request's own trace (a request sent again keeps its own, not the last try's hook)
        self.own: Any = own.own if isinstance(own, _SentTrace) else own

    def __call__(self, name: str, info: dict[str, Any]) -> None:
        if name.endswith(_WRITTEN):
            self.sent()
        if self.own is not None:
            self.own(name, info)


class _AsyncSentTrace(_SentTrace):
    """:class:`_SentTrace` for the asyncio transport: httpcore awaits it."""

    async def __call__(self, name: str, info: dict[str, Any]) -> None:  # type: ignore[override]
        if name.endswith(_WRITTEN):
            await self.sent()
        if self.own is not None:
            await self.own(name, info)


def _told(request: httpx.Request, sent: Callable[[], Any]) -> httpx.Request:
    """``request``, set to call ``sent()`` once written (see the module's docstring)."""
    request.extensions["trace"] = _SentTrace(sent, request.extensions.get("trace"))
    return request


def _told_async(request: httpx.Request, sent: Callable[[], Any]) -> httpx.Request:
    """As :func:`_told`, for the asyncio transport."""
    request.extensions["trace"] = _AsyncSentTrace(sent, request.extensions.get("trace"))
    return request
