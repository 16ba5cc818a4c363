"""``postgresql://`` for asyncio: the flows of :class:`~ratequeue.state.postgresql.PostgresStateBase`."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import psycopg

from .._flow import arun
from .._redact import secrets_kept_out
from ..protocol import Outcome, Taken
from ..state.base import Snapshot, Terms
from ..state.postgresql import (
    PostgresStateBase,
    Query,
    connect_kwargs,
    is_pool,
    split_url,
)
from .state import AsyncState

__all__ = ["AsyncPostgresState"]


class AsyncPostgresState(PostgresStateBase, AsyncState):
    """Records kept in a PostgreSQL table, one server-side function call per operation, from asyncio.

    Made from a ready ``psycopg.AsyncConnection`` (autocommit) or
    ``psycopg_pool.AsyncConnectionPool``, or from a ``conninfo``, with the
    options of :class:`ratequeue.state.postgresql.PostgresStateBase`; every
    operation runs the same flow, awaiting psycopg's asyncio calls.
    """

    _idle: list[psycopg.AsyncConnection[Any]]

    @classmethod
    def from_url(cls, url: str) -> AsyncPostgresState:
        """Open a PostgreSQL URL, as :meth:`ratequeue.state.postgresql.PostgresState.from_url` does."""
        with secrets_kept_out(url):
            conninfo, table, schema = split_url(url)
            return cls(conninfo=conninfo, table=table, schema=schema, url=url)

    async def close(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for connection in idle:
            await connection.close()

    @contextlib.asynccontextmanager
    async def _connection(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        if self._source is not None:
            if is_pool(self._source):
                async with self._source.connection() as pooled:
                    yield pooled
            else:
                yield self._source
            return
        connection = self._idle.pop() if self._idle else None
        if connection is None:
            assert self._conninfo is not None
            connection = await psycopg.AsyncConnection.connect(
                self._conninfo, **connect_kwargs(self._conninfo)
            )
        try:
            yield connection
        except BaseException:
            idle = connection.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
            if connection.broken or connection.closed or not idle:
                # a cancelled call may leave its answer on the way: that connection is not reused
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await connection.close()
            else:
                await self._give_back(connection)
            raise
        await self._give_back(connection)

    async def _give_back(self, connection: psycopg.AsyncConnection[Any]) -> None:
        if self._closed:
            await connection.close()
        else:
            self._idle.append(connection)

    async def _fetch(self, query: Query, params: tuple[Any, ...]) -> tuple[list[Any], int]:
        async with self._connection() as connection:
            if self._warms(connection):
                await self._warm_up(connection)
            cursor = await connection.execute(query, params)
            rows = await cursor.fetchall() if cursor.description is not None else []
            return rows, cursor.rowcount

    async def _warm_up(self, connection: psycopg.AsyncConnection[Any]) -> None:
        """Run ``_warm_up_script`` on ``connection``, once; a failure is ignored (not a broken connection)."""
        self._warmed.add(connection)
        try:
            await connection.execute(self._warm_up_script(), prepare=False)
        except psycopg.OperationalError:
            raise
        except psycopg.Error:
            pass
        finally:
            if (
                not connection.broken
                and connection.info.transaction_status != psycopg.pq.TransactionStatus.IDLE
            ):
                await connection.rollback()

    async def _setup_call(self, statements: list[Query]) -> None:
        async with self._connection() as connection, connection.transaction():
            for statement in statements:
                await connection.execute(statement)

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
