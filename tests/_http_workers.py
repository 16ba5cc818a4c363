"""Processes that call the quota referee through ratequeue's HTTP integrations (tests/test_http.py)."""

from __future__ import annotations

import asyncio
from typing import Any


def call_through(
    client: str, state_url: str, name: str, interval: float, call_url: str, calls: int
) -> list[int]:
    """Make ``calls`` requests to ``call_url`` through ``client``'s integration; the statuses."""
    if client == "httpx":
        import httpx

        import ratequeue
        import ratequeue.httpx

        limiter = ratequeue.Limiter(state_url, name=name, interval=interval)
        with httpx.Client(transport=ratequeue.httpx.Transport(limiter, timeout=60)) as http:
            statuses = [http.get(call_url).status_code for _ in range(calls)]
        limiter.close()
        return statuses
    if client == "requests":
        import requests

        import ratequeue
        import ratequeue.requests

        limiter = ratequeue.Limiter(state_url, name=name, interval=interval)
        with requests.Session() as session:
            session.mount("http://", ratequeue.requests.Adapter(limiter, timeout=60))
            statuses = [session.get(call_url, timeout=30).status_code for _ in range(calls)]
        limiter.close()
        return statuses
    return asyncio.run(_call_async(client, state_url, name, interval, call_url, calls))


async def _call_async(
    client: str, state_url: str, name: str, interval: float, call_url: str, calls: int
) -> list[int]:
    from ratequeue import aio

    limiter = aio.Limiter(state_url, name=name, interval=interval)
    statuses: list[int] = []
    try:
        if client == "httpx-async":
            import httpx

            import ratequeue.httpx

            transport = ratequeue.httpx.AsyncTransport(limiter, timeout=60)
            async with httpx.AsyncClient(transport=transport) as http:
                for _ in range(calls):
                    statuses.append((await http.get(call_url)).status_code)
        else:
            import aiohttp

            import ratequeue.aiohttp

            middleware: Any = ratequeue.aiohttp.middleware(limiter, timeout=60)
            async with aiohttp.ClientSession(middlewares=(middleware,)) as session:
                for _ in range(calls):
                    async with session.get(call_url) as response:
                        statuses.append(response.status)
    finally:
        await limiter.close()
    return statuses


def call_in_process(args: tuple[Any, ...]) -> list[int]:
    """:func:`call_through` for a process pool."""
    return call_through(*args)
