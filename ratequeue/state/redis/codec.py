"""The Redis state's codec: the script, the requests that run it, and the parsing of its replies.

Pure functions and data, no I/O. The script is ``script.lua`` beside this
module; its header states KEYS, ARGV and the reply of every operation.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from importlib import resources
from typing import NoReturn, TypeVar, Union

from ...core.operation import Operation, Terms
from ...core.protocol import Answer, Outcome, Passed, Record, Started, Taken, Unwritten, Wait, Waiter
from ...errors import StateCorrupted
from ..base import Snapshot
from ..records import mismatch, unwritten

__all__ = [
    "PARSERS",
    "READ_ARGUMENTS",
    "READ_TERMS",
    "SCRIPT",
    "SHA",
    "Commands",
    "Reply",
    "arguments",
    "glob_escape",
    "parse_snapshot",
    "script_args",
]

#: the Lua script serving every operation
SCRIPT: str = resources.files(__name__.rpartition(".")[0]).joinpath("script.lua").read_text(encoding="utf-8")

#: the SHA1 Redis knows the script by (``EVALSHA``)
SHA: str = hashlib.sha1(SCRIPT.encode()).hexdigest()

#: a reply of the script: one bulk string, as text if the client decodes replies
Reply = Union[bytes, str]

R = TypeVar("R")

#: what every parser takes: the reply, and the call's queue name, key and terms
Parser = Callable[[Reply, str, str, Terms], R]

#: the terms and arguments a read sends (the script reads and checks none of them)
READ_TERMS = Terms(1)
READ_ARGUMENTS = (0, 0, 1, 0, 0, 0)


def arguments(op: Operation) -> tuple[int | bytes, ...]:
    """The script's ARGV[8..13]: the operation's own arguments, each at its place.

    On a fair queue, ARGV[14..16] follow: 1 (the caller expects a fair
    record), the weight, and the tenant in UTF-8 (whatever the client's
    encoding: the script stores it as it comes, and :func:`parse_snapshot`
    reads it back as UTF-8). A queue that is not fair sends none of them.
    """
    if op.terms.fair:
        return (
            *(op.ticket, op.lead_us, op.cost, int(op.paused), op.token, op.doubt_us),
            *(1, op.weight, op.tenant.encode()),
        )
    return op.ticket, op.lead_us, op.cost, int(op.paused), op.token, op.doubt_us


def script_args(
    kind: str, terms: Terms, now_us: int | None, args: tuple[int | bytes, ...]
) -> list[str | int | bytes]:
    """The script's ARGV (``now_us``: ``None`` to read the server's clock); see its header."""
    return [kind, *_numbers(terms), "" if now_us is None else now_us, *args]


def _numbers(terms: Terms) -> tuple[int, int, int, int, int]:
    """The script's ARGV[2..6]: ``terms`` as the script takes them (no cap: 0)."""
    return terms.interval_us, terms.burst, terms.keep_us, terms.max_running or 0, terms.lease_us


def glob_escape(text: str) -> str:
    """``text`` as a Redis glob pattern (``SCAN MATCH``) matching itself only: ``* ? [ ] \\`` escaped."""
    return "".join("\\" + char if char in _GLOB else char for char in text)


_GLOB = frozenset("*?[]\\")


class Commands:
    """``EVALSHA SHA 1 key op interval burst keep max_running lease now ...`` in RESP, packed by hand.

    redis-py's packer handles every argument type and encoding option; the
    script's arguments are only a key, an operation and whole numbers, and
    the head of each command (operation, key and the terms) is
    the same call after call, so it is packed once and kept (for up to
    :attr:`MAX_HEADS` of them).
    """

    #: heads kept before the cache starts over (names are few; this bounds a process that makes many)
    MAX_HEADS = 1024

    def __init__(self, encoding: str = "utf-8", errors: str = "strict") -> None:
        """Encode keys as the client does (its ``encoding`` and ``encoding_errors``)."""
        self._encoding = encoding
        self._errors = errors
        self._heads: dict[tuple[str, str, Terms], bytes] = {}

    def packed(
        self, kind: str, key: str, terms: Terms, now_us: int | None, args: tuple[int | bytes, ...]
    ) -> list[bytes]:
        """The command running ``kind`` on ``key``, for ``send_packed_command`` (``args``: ARGV[8..])."""
        head = self._heads.get((kind, key, terms))
        if head is None:
            head = self._head(kind, key, terms)
        head += _SERVER_CLOCK if now_us is None else _bulk(b"%d" % now_us)
        if terms.fair:  # (ARGV[16], the tenant, is text: :func:`arguments`)
            return [head + b"".join(_bulk(v if isinstance(v, bytes) else b"%d" % v) for v in args)]
        for value in args:  # (whole numbers only, on a queue that is not fair)
            head += _bulk(b"%d" % value)  # type: ignore[str-format]
        return [head]

    def _head(self, kind: str, key: str, terms: Terms) -> bytes:
        parts = (b"EVALSHA", SHA.encode(), b"1", key.encode(self._encoding, self._errors), kind.encode())
        head = b"*%d\r\n%b%b" % (
            20 if terms.fair else 17,  # (a fair queue's 3 more arguments: :func:`arguments`)
            b"".join(map(_bulk, parts)),
            b"".join(_bulk(b"%d" % number) for number in _numbers(terms)),
        )
        if len(self._heads) >= self.MAX_HEADS:
            self._heads.clear()
        self._heads[(kind, key, terms)] = head
        return head


#: ARGV[7] when the script reads the server's clock: an empty bulk string
_SERVER_CLOCK = b"$0\r\n\r\n"


def _bulk(data: bytes) -> bytes:
    """``data`` as a RESP bulk string."""
    return b"$%d\r\n%b\r\n" % (len(data), data)


def _parser(**builders: Callable[..., R]) -> Parser[R]:
    """A parser of replies ``KIND NUMBER...`` whose kind is one of ``builders``: ``builders[kind](*numbers)``.

    The kind is read as bytes or as text (a client made with
    ``decode_responses=True``). The answer expected is read in one try, the
    common case kept cheap (a call's CPU matters); anything else -- another
    kind, a wrong count, a word that is not a whole number, a reply that is
    not one string -- falls through to :func:`_refuse`, which always raises:
    ``mismatch`` (of the interval, the burst or max_running)
    :class:`~ratequeue.errors.ConfigurationError`, anything else
    :class:`~ratequeue.errors.StateCorrupted`.
    """
    by_kind = {kind: build for word, build in builders.items() for kind in (word, word.encode())}

    def parse(reply: Reply, name: str, key: str, terms: Terms) -> R:
        try:
            kind, *numbers = reply.split()
            return by_kind[kind](*map(int, numbers))
        except (AttributeError, TypeError, ValueError, KeyError):
            pass
        _refuse(reply, name, key, terms)

    return parse


def _flag(flag: int, now: int) -> bool:
    """A flag of a reply, 0 or 1: whether it is 1."""
    if flag not in (0, 1):
        raise ValueError(flag)
    return flag == 1


def _snapshot(now: int, *fields: int) -> Snapshot:
    """The :class:`Snapshot` of a ``record`` reply: its fields, then ``TICKET EXPIRY TOKEN`` per lease."""
    (
        ticket,
        pos,
        at,
        interval,
        burst,
        due,
        paused,
        max_running,
        held,
        not_before,
        pace,
        paced_at,
        settled,
        paused_at,
        *numbers,
    ) = fields
    leases = tuple(zip(numbers[::3], numbers[1::3], numbers[2::3], strict=True))
    record = Record(
        ticket,
        pos,
        at,
        interval,
        due,
        burst,
        _flag(paused, now),
        max_running or None,
        leases,
        held,
        not_before,
        pace,
        paced_at,
        settled,
        paused_at=paused_at,
    )
    return Snapshot(record=record, now=now)


#: the answer of ``take``: ``taken TICKET POS AT NOW``
parse_taken: Parser[Taken] = _parser(taken=Taken)

#: the answer of ``try_start``, ``take_and_try``, ``try_take`` or ``retime``: ``KIND TICKET VALUE NOW``
parse_outcome: Parser[Outcome] = _parser(started=Started, wait=Wait, passed=Passed)

#: the answer of ``set_paused``, ``hold``, ``lift``, ``slow`` and ``settle``: ``set CHANGED NOW``; whether
#: the flag changed, the hold moved, a hold was on, the queue was slowed, or the schedule moved
parse_changed: Parser[bool] = _parser(set=_flag)

#: the answer of ``release`` and ``renew``: ``live LIVE NOW``; whether the ticket's lease was live
parse_live: Parser[bool] = _parser(live=_flag)

#: the answer of ``read`` on a record that is not fair: ``record NOW TICKET POS AT INTERVAL BURST DUE
#: PAUSED MAX_RUNNING HELD NOT_BEFORE PACE PACED_AT SETTLED PAUSED_AT`` followed by ``TICKET EXPIRY
#: TOKEN`` for each lease, or ``none NOW`` (a read checks no terms)
_parse_plain_snapshot: Parser[Snapshot] = _parser(
    record=_snapshot, none=lambda now: Snapshot(record=None, now=now)
)


def parse_snapshot(reply: Reply, name: str, key: str, terms: Terms) -> Snapshot:
    """The answer of ``read``: as :data:`_parse_plain_snapshot`, and for a fair record a newline and
    ``NUMBER BEGUN WAITERS``, the waiters a JSON array of ``[number, tenant, weight, cost, ticket]``."""
    parts: tuple[Reply, Reply, Reply]
    if isinstance(reply, bytes):
        parts = reply.partition(b"\n")
    elif isinstance(reply, str):
        parts = reply.partition("\n")
    else:
        parts = (reply, "", "")
    head, newline, tail = parts
    if not newline:
        return _parse_plain_snapshot(reply, name, key, terms)
    snapshot = _parse_plain_snapshot(head, name, key, terms)
    try:
        number, begun, text = tail.split(None, 2)
        listed = json.loads(text)
        if not isinstance(listed, list):
            raise ValueError(text)
        waiters = tuple(_waiter(*waiter) for waiter in listed)
        record = snapshot.record._replace(  # type: ignore[union-attr]
            fair=True, number=int(number), begun=int(begun), waiters=waiters
        )
    except (AttributeError, TypeError, ValueError):
        _refuse(reply, name, key, terms)
    return Snapshot(record=record, now=snapshot.now)


def _waiter(number: int, tenant: str, weight: int, cost: int, ticket: int) -> Waiter:
    """A waiter as the script stores it (whole numbers, a tenant), or :class:`ValueError`."""
    if not (isinstance(tenant, str) and all(type(value) is int for value in (number, weight, cost, ticket))):
        raise ValueError(tenant)
    return number, tenant, weight, cost, ticket


def _refuse(reply: object, name: str, key: str, terms: Terms) -> NoReturn:
    """Raise the error a reply other than the answer expected stands for."""
    text = reply.decode("utf-8", "replace") if isinstance(reply, bytes) else reply
    words = text.split(" ") if isinstance(text, str) else [""]
    if words[0] == "mismatch" and len(words) == 3 and words[1] in _TERMS and words[2].isdigit():
        field, stored = words[1], int(words[2])
        stored_term: int | None = stored  # (no cap: 0 in the hash; fair: 1 or 0)
        if field == "max_running":
            stored_term = stored or None
        elif field == "fair":
            stored_term = bool(stored)
        wanted = getattr(terms, _TERMS[field])
        if stored_term != wanted:  # (else: nonsense, below)
            raise mismatch(name, field, stored_term, wanted)
    # (``unwritten FIELD VALUE NOW``, the numbers in decimal as the script writes them)
    if words[0] == "unwritten" and len(words) == 4 and all(w.removeprefix("-").isdigit() for w in words[2:]):
        exc = Unwritten(words[1], int(words[2]), int(words[3]))
        raise unwritten(exc, f"Redis hash {key}", key)
    if words[0] == "corrupt" and len(words) >= 3:
        field, value = words[1], " ".join(words[2:])
        raise StateCorrupted(
            f"Redis hash {key} has {field}={value!r}, not a record ratequeue wrote", where=key
        )
    raise StateCorrupted(f"the ratequeue script on Redis hash {key} answered {reply!r}", where=key)


#: the field of :class:`Terms` holding each term a mismatch names, as the caller asked for it
_TERMS = {"interval": "interval_us", "burst": "burst", "max_running": "max_running", "fair": "fair"}


#: how each operation's reply is read
PARSERS: dict[str, Parser[Answer]] = {
    "take": parse_taken,
    "try_start": parse_outcome,
    "take_and_try": parse_outcome,
    "try_take": parse_outcome,
    "retime": parse_outcome,
    "set_paused": parse_changed,
    "release": parse_live,
    "renew": parse_live,
    "hold": parse_changed,
    "lift": parse_changed,
    "slow": parse_changed,
    "settle": parse_changed,
}
