"""Every Python block in README.md and docs/*.md runs, so the docs cannot drift from the code.

**The tool: sybil** (https://sybil.readthedocs.io). It finds the ```python
blocks of a Markdown page, runs them in order in one namespace per page
(as a reader runs a tutorial), reports a failure at the page's own line,
checks the output of a block written as a doctest (``>>>``), and reads
directives from HTML comments, which a rendered page does not show
(``<!-- skip: next "reason" -->``). ``pytest --doctest-glob`` runs only
``>>>`` sessions, not plain code blocks; pytest-examples runs each block as
a module of its own, so a page's later blocks cannot use what its earlier
ones defined. Here sybil parses the pages and this module runs them, one
test per page, so that the test can choose the servers a page needs and
rewrite their addresses.

The rules a page's Python blocks follow:

- **Pages**: README.md and every docs/*.md (a glob: a new page is tested as
  soon as it exists). Blocks in other languages (```console, ```text) are
  not run.
- **Servers**: a snippet writes the address a user would have on their own
  machine, ``localhost`` (or ``127.0.0.1``) at the server's default port:
  Redis ``localhost:6379`` (or ``port=6379``), MongoDB ``localhost:27017``,
  PostgreSQL ``postgres@localhost:5432/postgres``. The test starts the
  servers a page names (the session fixtures ``redis_server``,
  ``mongodb_server``, ``postgresql_server``) and writes their address in
  place of those, in the whole page (so a doctest's expected output that
  shows a URL changes with it). A page that would still reach a default
  port, another host, or a client built without an address fails before
  anything runs: the tests never touch the machine's own servers.
- **Files**: ``/tmp/`` (in ``file:///tmp/x.json`` too, and in a doctest's
  expected output) becomes the test's temporary directory; the default
  state file is private to the test (the autouse ``_private_default_state``
  fixture of conftest.py).
- **Placeholders** (``call_the_api``, ``send_email``) are defined in the
  snippet itself, visibly; long-running loops are shown with small numbers.
- **Between pages**: what a page left open is closed, and what it added on
  the servers and in the ``memory://`` store is deleted
  (``tests/_docs_cleanup.py``), so each page runs as on a clean machine;
  and :func:`test_pages_run_one_after_another_against_one_state` runs them
  all in sequence without that cleanup, as a reader pasting page after page
  would, so that one queue name has one set of terms across the docs.
- **Skips** are counted: a block is skipped only by a visible-in-source
  ``<!-- skip: next "reason" -->`` and :data:`SKIPPED` holds each page's
  count; a page run by another test is in :data:`ELSEWHERE`, with the name
  of that test, which must exist.
"""

from __future__ import annotations

import doctest
import re
import unittest
from pathlib import Path
from typing import Any

import pytest
from sybil import Document
from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser

from ratequeue.errors import TermsMismatch

from ._docs_cleanup import Leftovers, close_all
from .servers import Server

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])

#: the default port of each server a snippet may name, as a user would
DEFAULT_PORTS = {"redis": 6379, "mongodb": 27017, "postgresql": 5432}

#: pages whose Python blocks another test runs: the page, that test (file::function)
ELSEWHERE = {
    "docs/spark.md": (
        "tests/test_spark.py::test_docs_snippets_run_as_written",
        "it runs them in the Spark module's own SparkSession (one JVM at a time) and checks every"
        " printed line against its comment",
    ),
}

#: blocks skipped with ``<!-- skip: next "reason" -->``, per page (every other block runs)
SKIPPED: dict[str, int] = {}

#: ```python blocks, in the page as it is on disk
PYTHON_BLOCK = re.compile(r"^[ \t]*```python[ \t]*\n(.*?)^[ \t]*```", re.MULTILINE | re.DOTALL)
#: a server URL in a snippet, and its host[:port]
SERVER_URL = re.compile(
    r"\b(?:redis|rediss|unix|mongodb(?:\+srv)?|postgres(?:ql)?)://(?:[^@/\s\"']*@)?([^/?\s\"']*)"
)
#: a client built without an address connects to localhost at the default port
ADDRESSLESS = re.compile(r"\bRedis\(\s*(?:\)|db=)|\bMongoClient\(\s*\)|psycopg\.connect\(\s*\)")


def page_id(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def python_blocks(text: str) -> list[str]:
    return PYTHON_BLOCK.findall(text)


def servers_named(text: str) -> list[str]:
    """The servers a page's Python blocks name, by their default port."""
    code = "\n".join(python_blocks(text))
    return [kind for kind, port in DEFAULT_PORTS.items() if re.search(rf"(?::|port=){port}\b", code)]


def point_at(text: str, servers: dict[str, Server], tmp_path: Path) -> str:
    """``text`` with the default address of each of ``servers`` made the server's, /tmp made ``tmp_path``."""
    for kind, server in servers.items():
        default = DEFAULT_PORTS[kind]
        text = re.sub(rf"\b(?:localhost|127\.0\.0\.1):{default}\b", f"127.0.0.1:{server.port}", text)
        text = re.sub(rf"\bport={default}\b", f"port={server.port}", text)
    return re.sub(r"(?<![\w.])/tmp/", f"{tmp_path}/", text)  # /tmp/x and file:///tmp/x, not /var/tmp/x


def check_addresses(text: str, servers: dict[str, Server]) -> None:
    """Fail if a Python block of ``text`` (already pointed at ``servers``) could reach another server."""
    allowed = {f"127.0.0.1:{server.port}" for server in servers.values()}
    for block in python_blocks(text):
        for port in DEFAULT_PORTS.values():
            assert not re.search(rf"(?::|port=){port}\b", block), (
                f"a default port ({port}) is left in:\n{block}"
            )
        for host in SERVER_URL.findall(block):
            if not re.search(r"\w", host):
                continue  # "redis://..." in a comment, or a unix:// socket path
            assert host in allowed, (
                f"{host!r} is not a server the test starts: write localhost and the default port in\n{block}"
            )
        assert not ADDRESSLESS.search(block), (
            f"a client without an address (write host and port) in:\n{block}"
        )


def parse(path: Path, text: str) -> Document:
    """The page's Python blocks (doctests where they begin with ``>>>``) and skip directives."""
    document = Document(text, str(path))
    for parser in (PythonCodeBlockParser(doctest_optionflags=doctest.ELLIPSIS), SkipParser()):
        for region in parser(document):
            document.add(region)
    document.namespace["__name__"] = "__main__"  # as when a reader pastes the blocks into a script
    return document


def block_spans(text: str) -> list[tuple[int, int]]:
    """Where each ```python block of ``text`` begins and ends."""
    return [(m.start(), m.end()) for m in PYTHON_BLOCK.finditer(text)]


def run(document: Document, kept: list[Any]) -> tuple[int, int]:
    """Evaluate every example of ``document`` in order; how many Python blocks ran and were skipped.

    A doctest block is several examples (one per ``>>>``): it ran if all of them did. What each
    example leaves in the namespace is added to ``kept``, so that a name bound again later (a
    page's sections each make their own ``client``) does not drop an object before it is closed.
    """
    skipped_in: set[int] = set()
    spans = block_spans(document.text)
    for example in document.examples():
        try:
            example.evaluate()
        except unittest.SkipTest:
            skipped_in.update(i for i, (start, end) in enumerate(spans) if start <= example.start < end)
        finally:
            known = {id(value) for value in kept}
            kept.extend(value for value in document.namespace.values() if id(value) not in known)
    return len(spans) - len(skipped_in), len(skipped_in)


@pytest.mark.parametrize("name", sorted(ELSEWHERE))
def test_pages_run_elsewhere_have_their_test(name: str) -> None:
    """A page left out of :func:`test_page_runs` is run by the test :data:`ELSEWHERE` names."""
    where, _why = ELSEWHERE[name]
    file, function = where.split("::")
    assert f"def {function}(" in (ROOT / file).read_text(), f"{where} is gone: run {name} here again"


@pytest.mark.parametrize("path", [path for path in PAGES if page_id(path) not in ELSEWHERE], ids=page_id)
def test_page_runs(path: Path, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """The page's Python blocks run in order, in one namespace, against the servers the tests started."""
    name = page_id(path)
    text = path.read_text()
    # the session servers the page names: skipped locally (failed in CI) where one cannot start
    servers = {kind: request.getfixturevalue(f"{kind}_server") for kind in servers_named(text)}
    text = point_at(text, servers, tmp_path)
    check_addresses(text, servers)
    document = parse(path, text)
    leftovers = Leftovers(servers)
    kept: list[Any] = []
    try:
        ran, skipped = run(document, kept)
    finally:
        try:
            close_all(kept)
        finally:
            leftovers.remove()
    assert skipped == SKIPPED.get(name, 0), f"{name}: {skipped} block(s) skipped; SKIPPED says otherwise"
    request.node.user_properties.append(("python blocks run", ran))


def test_pages_run_one_after_another_against_one_state(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Every page, one after another, against the same servers and files, nothing deleted between them.

    As a reader pastes page after page into one session against one Redis: a
    name one page uses with other terms than an earlier page would raise
    ``TermsMismatch`` here (issue 31, item 4). Pages therefore give each
    queue name one set of terms across the docs (``github`` is 10/s
    everywhere; an hourly quota is ``github-hourly``).
    """
    pages = [path for path in PAGES if page_id(path) not in ELSEWHERE]
    texts = {path: path.read_text() for path in pages}
    kinds = sorted({kind for text in texts.values() for kind in servers_named(text)})
    servers = {kind: request.getfixturevalue(f"{kind}_server") for kind in kinds}
    leftovers = Leftovers(servers)
    kept: list[Any] = []
    clashes: list[str] = []
    try:
        for path in pages:
            document = parse(path, point_at(texts[path], servers, tmp_path))
            try:
                run(document, kept)
            except TermsMismatch as exc:
                clashes.append(f"{page_id(path)}: {exc}")
    finally:
        try:
            close_all(kept)
        finally:
            leftovers.remove()
    assert not clashes, "\n".join(clashes)


def test_every_page_is_collected() -> None:
    """README.md and the docs pages, cli.md and operating.md included once they exist."""
    names = {page_id(path) for path in PAGES}
    assert {"README.md", "docs/quickstart.md", "docs/backends.md"} <= names
    assert set(ELSEWHERE) <= names
    assert set(SKIPPED) <= names


def test_python_blocks_are_found_as_sybil_finds_them() -> None:
    """Every ```python block this module counts is one sybil parses (no block escapes the test)."""
    for path in PAGES:
        text = path.read_text()
        starts = [region.start for _, region in parse(path, text).regions]
        for start, end in block_spans(text):
            line = text.count("\n", 0, start) + 1
            assert any(start <= s < end for s in starts), (
                f"{page_id(path)}:{line}: a block sybil does not see"
            )
