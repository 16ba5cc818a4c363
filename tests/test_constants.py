"""The protocol's constants and operations, the same in Python, Lua, SQL and the MongoDB pipeline.

Each state runs :mod:`ratequeue.core.protocol` in its own language: the Redis
script and the PostgreSQL function write the constants out, and each
dispatches on the operation's kind. A constant changed in one place, or an
operation added to :data:`~ratequeue.core.operation.KINDS` without a branch in
a script, fails here (the contract suite then holds each branch to the reference).
"""

from __future__ import annotations

import re

import pytest

from ratequeue.core import protocol
from ratequeue.core.operation import ARGUMENTS, KINDS
from ratequeue.state.mongodb import codec as mongodb_codec
from ratequeue.state.postgresql import SETUP_SQL
from ratequeue.state.redis.codec import PARSERS as REDIS_PARSERS
from ratequeue.state.redis.codec import SCRIPT

#: each constant under its Python, Lua and SQL names
CONSTANTS = [
    ("NEVER", "NEVER", "c_never"),
    ("MAX_US", "LIMIT", "c_limit"),
    ("MAX_LEAD_US", "MAX_LEAD", "c_max_lead"),
    ("MAX_BURST", "MAX_BURST", "c_max_burst"),
    ("PAUSED_RECHECK_US", "PAUSED_RECHECK", "c_paused_recheck"),
    ("FULL_RECHECK_US", "FULL_RECHECK", "c_full_recheck"),
    ("FULL_GRACE_US", "FULL_GRACE", "c_full_grace"),
    ("MAX_RUNNING", "MAX_RUNNING", "c_max_running"),
    ("MAX_LEASE_US", "MAX_LEASE", "c_max_lease"),
    ("MAX_HOLD_US", "MAX_HOLD", "c_max_hold"),
    ("MAX_SLOW", "MAX_SLOW", "c_max_slow"),
    ("RECOVER_US", "RECOVER", "c_recover"),
    ("MAX_DOUBT_US", "MAX_DOUBT", "c_max_doubt"),
]


def lua_constant(name: str) -> int:
    match = re.search(rf"^local {name} = (-?\d+)\b", SCRIPT, re.MULTILINE)
    assert match is not None, f"the Redis script defines no {name}"
    return int(match.group(1))


def sql_constant(name: str) -> int:
    match = re.search(rf"^\s*{name} CONSTANT \w+ := (-?\d+);", SETUP_SQL, re.MULTILINE)
    assert match is not None, f"the PostgreSQL function defines no {name}"
    return int(match.group(1))


@pytest.mark.parametrize(("python", "lua", "sql"), CONSTANTS, ids=[row[0] for row in CONSTANTS])
def test_a_constant_is_the_same_in_every_language(python: str, lua: str, sql: str) -> None:
    value = getattr(protocol, python)
    assert lua_constant(lua) == value, f"Lua's {lua}"
    assert sql_constant(sql) == value, f"SQL's {sql}"


def test_the_mongodb_pipeline_uses_the_protocols_own_constants() -> None:
    """The pipeline is built in Python: it imports the constants rather than writing them out."""
    for python, _, _ in CONSTANTS:
        if hasattr(mongodb_codec, python):
            assert getattr(mongodb_codec, python) is getattr(protocol, python)


def test_the_postgresql_table_defaults_held_to_never() -> None:
    match = re.search(r"held_us bigint NOT NULL DEFAULT (-?\d+)", SETUP_SQL)
    assert match is not None
    assert int(match.group(1)) == protocol.NEVER


@pytest.mark.parametrize("kind", KINDS)
def test_every_operation_has_a_branch_in_every_state(kind: str) -> None:
    assert kind in ARGUMENTS
    assert re.search(rf'op == "{kind}"', SCRIPT), f"the Redis script has no branch for {kind}"
    assert kind in REDIS_PARSERS, f"the Redis codec reads no answer of {kind}"
    assert re.search(rf"p_op = '{kind}'", SETUP_SQL), f"the PostgreSQL function has no branch for {kind}"
    assert kind in mongodb_codec.PARSERS, f"the MongoDB codec reads no answer of {kind}"
