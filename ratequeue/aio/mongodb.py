"""``mongodb://`` for asyncio: the pipelines of :mod:`ratequeue.state.mongodb` on pymongo's async client."""

from __future__ import annotations

import asyncio
from typing import Any

from pymongo import AsyncMongoClient, ReturnDocument
from pymongo.errors import ConnectionFailure, DuplicateKeyError, PyMongoError

from ..errors import ConfigurationError, StateUnavailable
from ..protocol import Outcome, Taken
from ..state.base import Clock, Snapshot, check_interval_matches
from ..state.mongodb import (
    BACKOFF,
    BAD_URL_ERRORS,
    DEFAULT_COLLECTION,
    DEFAULT_DATABASE,
    RETRIES,
    WELL_FORMED,
    check_document,
    check_well_formed,
    client_options,
    datetime_us,
    initial_document,
    parse,
    pipeline,
    read_pipeline,
    split_url,
    unavailable,
    where_of,
)
from .state import AsyncState

__all__ = ["AsyncMongoState"]


class AsyncMongoState(AsyncState):
    """Records kept in a MongoDB collection, changed only by server-side update pipelines, from asyncio."""

    #: ``$$NOW`` has whole milliseconds
    clock_resolution = 0.001

    def __init__(
        self,
        client: AsyncMongoClient[Any],
        *,
        database: str = DEFAULT_DATABASE,
        collection: str = DEFAULT_COLLECTION,
        url: str | None = None,
        clock: Clock | None = None,
    ) -> None:
        """Use a ready ``pymongo.AsyncMongoClient`` (see :class:`ratequeue.state.mongodb.MongoState`)."""
        self._client = client
        self._collection = client[database][collection]
        self._clock = clock
        self._where = where_of(client)
        self.url = url or f"mongodb://{self._where}/?database={database}&collection={collection}"

    @classmethod
    def from_url(cls, url: str) -> AsyncMongoState:
        """Open a MongoDB URL, as :meth:`ratequeue.state.mongodb.MongoState.from_url` does."""
        client_url, database, collection = split_url(url)
        try:
            client: AsyncMongoClient[Any] = AsyncMongoClient(client_url, **client_options(client_url))
        except BAD_URL_ERRORS as exc:
            raise ConfigurationError(f"bad MongoDB URL {url!r}: {exc}") from exc
        return cls(client, database=database, collection=collection, url=url)

    async def close(self) -> None:
        await self._client.close()

    async def _update(self, op: str, name: str, interval: int, **args: int) -> Any:
        steps = pipeline(op, interval, None if self._clock is None else self._clock(), **args)
        for _ in range(3):
            document = await self._retrying(
                lambda: self._collection.find_one_and_update(
                    {"_id": name, "interval": interval, **WELL_FORMED},
                    steps,
                    return_document=ReturnDocument.AFTER,
                )
            )
            if document is not None:
                check_document(self._collection.full_name, name, document)
                return parse(op, document)
            await self._create(name, interval)
        raise StateUnavailable(  # pragma: no cover - only if the document vanishes again and again
            f"MongoDB at {self._where}: queue {name!r} disappeared while being created", where=self._where
        )

    async def _create(self, name: str, interval: int) -> None:
        """Create the record of ``name`` if missing (see ``MongoState._create`` for why not an upsert)."""
        try:
            await self._retrying(lambda: self._collection.insert_one(initial_document(name, interval)))
        except DuplicateKeyError:
            stored = await self._retrying(lambda: self._collection.find_one({"_id": name}))
            if stored is not None:
                record = check_document(self._collection.full_name, name, stored)
                check_interval_matches(name, record.interval, interval)
                check_well_formed(self._collection.full_name, name, stored)

    async def _retrying(self, call: Any) -> Any:
        delay = BACKOFF
        for attempt in range(RETRIES + 1):
            try:
                return await call()
            except DuplicateKeyError:
                raise
            except ConnectionFailure as exc:
                if attempt == RETRIES:
                    raise unavailable(self._where, exc) from exc
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.5)
            except PyMongoError as exc:
                raise unavailable(self._where, exc) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    async def _take(self, name: str, interval: int) -> Taken:
        return await self._update("take", name, interval)  # type: ignore[no-any-return]

    async def _try_start(self, name: str, interval: int, ticket: int, lead: int) -> Outcome:
        return await self._update("try_start", name, interval, ticket=ticket, lead=lead)  # type: ignore[no-any-return]

    async def _take_and_try(self, name: str, interval: int, lead: int) -> Outcome:
        return await self._update("take_and_try", name, interval, lead=lead)  # type: ignore[no-any-return]

    async def _retime(self, name: str, interval: int, ticket: int, lead: int) -> Outcome:
        return await self._update("retime", name, interval, ticket=ticket, lead=lead)  # type: ignore[no-any-return]

    async def _read(self, name: str) -> Snapshot:
        fixed = None if self._clock is None else self._clock()

        async def rows() -> list[Any]:
            cursor = await self._collection.aggregate(read_pipeline(name, fixed))
            return [row async for row in cursor]

        found = await self._retrying(rows)
        if found:
            record = check_document(self._collection.full_name, name, found[0])
            return Snapshot(record=record, now=int(found[0]["_now"]))
        if fixed is not None:
            return Snapshot(record=None, now=fixed)
        hello = await self._retrying(lambda: self._client.admin.command("hello"))
        return Snapshot(record=None, now=datetime_us(hello["localTime"]))

    async def _reset(self, name: str) -> bool:
        result = await self._retrying(lambda: self._collection.delete_one({"_id": name}))
        return bool(result.deleted_count)
