"""``mongodb://`` for asyncio: the flows of :class:`~ratequeue.state.mongodb.MongoStateBase`, awaited."""

from __future__ import annotations

from typing import Any

from pymongo import AsyncMongoClient
from pymongo.asynchronous.collection import AsyncCollection

from .._flow import arun
from ..protocol import Outcome, Taken
from ..state._mongodb_codec import Document, Pipeline
from ..state.base import Snapshot, Terms
from ..state.mongodb import MongoStateBase, open_client
from .state import AsyncState

__all__ = ["AsyncMongoState"]


class AsyncMongoState(MongoStateBase[AsyncMongoClient[Any]], AsyncState):
    """Records kept in a MongoDB collection, changed only by server-side update pipelines, from asyncio.

    Made from a ready ``pymongo.AsyncMongoClient`` with the options of
    :class:`ratequeue.state.mongodb.MongoState`; every operation runs the
    same flow, awaiting the asyncio client's calls.
    """

    _collection: AsyncCollection[Any]

    @classmethod
    def from_url(cls, url: str) -> AsyncMongoState:
        """Open a MongoDB URL, as :meth:`ratequeue.state.mongodb.MongoState.from_url` does."""
        client, database, collection = open_client(url, AsyncMongoClient)
        return cls(client, database=database, collection=collection, url=url)

    async def close(self) -> None:
        await self._client.close()

    async def _aggregate_list(self, steps: Pipeline) -> list[Document]:
        return [row async for row in await self._collection.aggregate(steps)]

    async def _take(self, name: str, terms: Terms, cost: int) -> Taken:
        return await arun(self._take_flow(name, terms, cost))

    async def _try_start(self, name: str, terms: Terms, ticket: int, lead_us: int, cost: int) -> Outcome:
        return await arun(self._outcome_flow("try_start", name, terms, ticket, lead_us, cost))

    async def _take_and_try(self, name: str, terms: Terms, lead_us: int, cost: int) -> Outcome:
        return await arun(self._outcome_flow("take_and_try", name, terms, lead_us=lead_us, cost=cost))

    async def _retime(self, name: str, terms: Terms, ticket: int, lead_us: int) -> Outcome:
        return await arun(self._outcome_flow("retime", name, terms, ticket, lead_us))

    async def _set_paused(self, name: str, terms: Terms, paused: bool) -> bool:
        return await arun(self._changed_flow("set_paused", name, terms, paused=paused))

    async def _release(self, name: str, terms: Terms, ticket: int) -> bool:
        return await arun(self._changed_flow("release", name, terms, ticket))

    async def _renew(self, name: str, terms: Terms, ticket: int) -> bool:
        return await arun(self._changed_flow("renew", name, terms, ticket))

    async def _read(self, name: str) -> Snapshot:
        return await arun(self._read_flow(name))

    async def _reset(self, name: str) -> bool:
        return await arun(self._reset_flow(name))

    async def _names(self, prefix: str) -> list[str]:
        return await arun(self._names_flow(prefix))

    async def _sweep(self) -> int:
        return await arun(self._sweep_flow())
