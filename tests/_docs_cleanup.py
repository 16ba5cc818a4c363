"""What a docs page leaves behind, taken away after it (for ``tests/test_docs.py``).

The pages use plain queue names ("github", "emails") on the servers the
tests start and in the process-wide ``memory://`` store, with different
intervals from page to page. So that pages cannot meet each other's records
(or those of other tests, which use fresh names), :class:`Leftovers` notes
what exists before a page runs and deletes what the page added: Redis keys
(every database), MongoDB databases, collections and documents, PostgreSQL
tables and functions, and the records of every ``memory://`` store.
:func:`close_all` first closes the objects the page's snippets left open.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import psycopg
import redis
from pymongo import MongoClient

import ratequeue
from ratequeue.state.memory import MemoryState

from .servers import Server

#: what the MongoDB-compatible server keeps for itself
MONGO_SYSTEM = {"admin", "config", "local"}
#: PostgreSQL's own schemas
PG_SYSTEM = "('pg_catalog', 'information_schema', 'pg_toast')"


def close_all(values: list[Any]) -> None:
    """Close what a page's snippets made: queues first, then limiters, states and clients.

    A queue's jobs not started yet are cancelled. Objects of ``ratequeue.aio``
    are the snippets' to close (inside their own event loop): they are left alone.
    """
    for value in values:
        if isinstance(value, ratequeue.Queue):
            value.close(cancel_pending=True)
    for value in values:
        if isinstance(value, (ratequeue.Limiter, ratequeue.LimiterGroup, ratequeue.State)):
            value.close()
    for value in values:
        module = type(value).__module__.split(".")[0]
        if module in ("redis", "pymongo", "psycopg", "psycopg_pool") and callable(
            getattr(value, "close", None)
        ):
            value.close()


def _memory_records() -> dict[str, set[str]]:
    return {store: set(MemoryState(store).names()) for store in list(MemoryState._stores)}


class Leftovers:
    """A note of what exists now, on ``servers`` and in memory; :meth:`remove` deletes what came after."""

    def __init__(self, servers: dict[str, Server]) -> None:
        self.servers = servers
        self.memory = _memory_records()
        self.redis = self._redis_keys() if "redis" in servers else {}
        self.mongodb = self._mongodb_ids() if "mongodb" in servers else {}
        self.postgresql = self._postgresql_objects() if "postgresql" in servers else {}

    def remove(self) -> None:
        for store, names in _memory_records().items():
            state = MemoryState(store)
            for name in names - self.memory.get(store, set()):
                state.reset(name)
        if "redis" in self.servers:
            self._remove_redis()
        if "mongodb" in self.servers:
            self._remove_mongodb()
        if "postgresql" in self.servers:
            self._remove_postgresql()

    # ------------------------------------------------------------------ Redis: keys, every database

    def _redis(self, db: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.servers["redis"].port, db=db)

    def _redis_keys(self) -> dict[int, set[bytes]]:
        with self._redis(0) as client:
            databases = int(client.config_get("databases")["databases"])
        keys: dict[int, set[bytes]] = {}
        for db in range(databases):
            with self._redis(db) as client:
                keys[db] = set(client.scan_iter(count=1000))
        return keys

    def _remove_redis(self) -> None:
        for db, keys in self._redis_keys().items():
            new = keys - self.redis.get(db, set())
            if new:
                with self._redis(db) as client:
                    client.delete(*new)

    # ------------------------------------------------------------------ MongoDB: databases to documents

    def _mongo(self) -> MongoClient[Any]:
        return MongoClient(
            f"mongodb://127.0.0.1:{self.servers['mongodb'].port}", serverSelectionTimeoutMS=5000
        )

    def _mongodb_ids(self) -> dict[tuple[str, str], set[Any]]:
        ids: dict[tuple[str, str], set[Any]] = {}
        with self._mongo() as client:
            for database in set(client.list_database_names()) - MONGO_SYSTEM:
                for collection in client[database].list_collection_names():
                    found = client[database][collection].find({}, {"_id": 1})
                    ids[database, collection] = {doc["_id"] for doc in found}
        return ids

    def _remove_mongodb(self) -> None:
        before_databases = {database for database, _ in self.mongodb}
        with self._mongo() as client:
            for (database, collection), ids in self._mongodb_ids().items():
                if database not in before_databases:
                    client.drop_database(database)
                elif (database, collection) not in self.mongodb:
                    client[database].drop_collection(collection)
                elif new := ids - self.mongodb[database, collection]:
                    client[database][collection].delete_many({"_id": {"$in": list(new)}})

    # ------------------------------------------------------------------ PostgreSQL: tables and functions

    def _pg(self) -> psycopg.Connection[Any]:
        return psycopg.connect(
            f"postgresql://postgres@127.0.0.1:{self.servers['postgresql'].port}/postgres", autocommit=True
        )

    def _postgresql_objects(self) -> dict[str, set[str]]:
        with self._pg() as connection:
            tables = connection.execute(
                "SELECT format('%I.%I', schemaname, tablename) FROM pg_tables"
                f" WHERE schemaname NOT IN {PG_SYSTEM}"
            ).fetchall()
            functions = connection.execute(
                "SELECT p.oid::regprocedure::text FROM pg_proc p"
                " JOIN pg_namespace n ON n.oid = p.pronamespace"
                f" WHERE n.nspname NOT IN {PG_SYSTEM}"
            ).fetchall()
        return {"tables": {row[0] for row in tables}, "functions": {row[0] for row in functions}}

    def _remove_postgresql(self) -> None:
        now = self._postgresql_objects()
        with self._pg() as connection:
            for function in _new(now["functions"], self.postgresql["functions"]):
                connection.execute(f"DROP FUNCTION IF EXISTS {function}")
            for table in _new(now["tables"], self.postgresql["tables"]):
                connection.execute(f"DROP TABLE IF EXISTS {table} CASCADE")


def _new(now: Iterable[str], before: set[str]) -> list[str]:
    return sorted(set(now) - before)
