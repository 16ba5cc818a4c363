"""The Redis backend's codec: the script, the requests that run it, and the parsing of its replies.

Pure functions and data, no I/O: the synchronous and the asyncio Redis
states (:mod:`ratequeue.state.redis`, :mod:`ratequeue.aio.redis`) both
build their calls and read their answers here. The script itself is
``redis.lua`` beside this module; its header states KEYS, ARGV and the
reply of every operation.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from importlib import resources
from typing import Literal, NoReturn, TypeVar, Union

from ..errors import StateCorrupted
from ..protocol import NEVER, Outcome, Passed, Record, Started, Taken, Unwritten, Wait
from .base import Snapshot, Terms, check_max_running_matches, check_terms_match, unwritten

__all__ = [
    "READ_TERMS",
    "SCRIPT",
    "SHA",
    "Commands",
    "Operation",
    "Parser",
    "Reply",
    "glob_escape",
    "parse_changed",
    "parse_live",
    "parse_outcome",
    "parse_snapshot",
    "parse_taken",
    "script_args",
]

#: what the script can be asked to do (its ARGV[1])
Operation = Literal["take", "try_start", "take_and_try", "retime", "set_paused", "release", "renew", "read"]

#: the Lua script serving every operation
SCRIPT: str = resources.files(__name__.rpartition(".")[0]).joinpath("redis.lua").read_text(encoding="utf-8")

#: the SHA1 Redis knows the script by (``EVALSHA``)
SHA: str = hashlib.sha1(SCRIPT.encode()).hexdigest()

#: a reply of the script: one bulk string, as text if the client decodes replies
Reply = Union[bytes, str]

R = TypeVar("R")

#: what every parser takes: the reply, and the call's queue name, key and terms
Parser = Callable[[Reply, str, str, Terms], R]

#: the terms a read sends (the script ignores them: a read checks none)
READ_TERMS = Terms(0, 1, 0, 0, 0)


def script_args(op: Operation, terms: Terms, now_us: int | None, args: tuple[int, ...]) -> list[str | int]:
    """The script's ARGV for ``op`` (``now_us``: ``None`` to read the server's clock).

    ``op``, the interval, burst, keep time, max_running and lease of
    ``terms``, ``now_us``, then the operation's own ``args`` (see the
    script's header).
    """
    head: list[str | int] = [op, *_numbers(terms)]
    return [*head, "" if now_us is None else now_us, *args]


def _numbers(terms: Terms) -> tuple[int, int, int, int, int]:
    """The script's ARGV[2..6]: ``terms`` as the script takes them."""
    return terms.interval_us, terms.burst, terms.keep_us, terms.max_running, terms.lease_us


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
        self._heads: dict[tuple[Operation, str, int, int, int, int, int], bytes] = {}

    def packed(
        self, op: Operation, key: str, terms: Terms, now_us: int | None, args: tuple[int, ...]
    ) -> list[bytes]:
        """The command running ``op`` on ``key``, as ``send_packed_command`` takes it.

        ``args`` must be as many as ``op`` always takes (the kept head counts them).
        """
        head = self._heads.get((op, key, *_numbers(terms)))
        if head is None:
            head = self._head(op, key, terms, len(args))
        head += _SERVER_CLOCK if now_us is None else _bulk(b"%d" % now_us)
        for value in args:
            head += _bulk(b"%d" % value)
        return [head]

    def _head(self, op: Operation, key: str, terms: Terms, more: int) -> bytes:
        parts = (b"EVALSHA", SHA.encode(), b"1", key.encode(self._encoding, self._errors), op.encode())
        numbers = _numbers(terms)
        head = b"*%d\r\n%b%b" % (
            11 + more,
            b"".join(map(_bulk, parts)),
            b"".join(_bulk(b"%d" % number) for number in numbers),
        )
        if len(self._heads) >= self.MAX_HEADS:
            self._heads.clear()
        self._heads[(op, key, *numbers)] = head
        return head


#: ARGV[7] when the script reads the server's clock: an empty bulk string
_SERVER_CLOCK = b"$0\r\n\r\n"


def _bulk(data: bytes) -> bytes:
    """``data`` as a RESP bulk string."""
    return b"$%d\r\n%b\r\n" % (len(data), data)


#: the outcomes of try_start, take_and_try and retime by their reply's first word, as bytes or as
#: text (a client made with ``decode_responses=True``)
_OUTCOMES: dict[bytes | str, Callable[[int, int, int], Outcome]] = {
    kind: cls
    for word, cls in (("started", Started), ("wait", Wait), ("passed", Passed))
    for kind in (word, word.encode())
}
_TAKEN = ("taken", b"taken")
_SET = ("set", b"set")
_LIVE = ("live", b"live")
#: a flag in a reply, 0 or 1, and 1 alone
_FLAGS = ("0", "1", b"0", b"1")
_TRUE = ("1", b"1")
_RECORD = ("record", b"record")
_NONE = ("none", b"none")

# Each parser reads the answer it expects in one try, the common case kept cheap (a call's CPU
# matters); anything else -- another kind, a wrong count, a word that is not a whole number, a
# reply that is not one string -- falls through to _refuse, which always raises.


def parse_taken(reply: Reply, name: str, key: str, terms: Terms) -> Taken:
    """The answer of ``take``: ``taken TICKET POS AT NOW``."""
    try:
        kind, ticket, pos, at, now = reply.split()
        if kind in _TAKEN:
            return Taken(ticket=int(ticket), pos=int(pos), at=int(at), now=int(now))
    except (AttributeError, TypeError, ValueError):
        pass
    _refuse(reply, name, key, terms)


def parse_outcome(reply: Reply, name: str, key: str, terms: Terms) -> Outcome:
    """The answer of ``try_start``, ``take_and_try`` or ``retime``: ``KIND TICKET VALUE NOW``.

    A kind other than ``started``, ``wait`` or ``passed`` raises: ``mismatch``
    (of the interval, the burst or max_running) :class:`~ratequeue.errors.ConfigurationError`, anything else
    :class:`~ratequeue.errors.StateCorrupted`.
    """
    try:
        kind, ticket, value, now = reply.split()
        return _OUTCOMES[kind](int(ticket), int(value), int(now))
    except (AttributeError, TypeError, ValueError, KeyError):
        pass
    _refuse(reply, name, key, terms)


def parse_changed(reply: Reply, name: str, key: str, terms: Terms) -> bool:
    """The answer of ``set_paused``: ``set CHANGED NOW``; whether the flag changed."""
    return _parse_flag(_SET, reply, name, key, terms)


def parse_live(reply: Reply, name: str, key: str, terms: Terms) -> bool:
    """The answer of ``release`` and ``renew``: ``live LIVE NOW``; whether the ticket's lease was live."""
    return _parse_flag(_LIVE, reply, name, key, terms)


def _parse_flag(kinds: tuple[str, bytes], reply: Reply, name: str, key: str, terms: Terms) -> bool:
    """The flag of a ``KIND FLAG NOW`` answer whose kind is one of ``kinds``."""
    try:
        kind, flag, now = reply.split()
        int(now)  # a whole number, or ValueError
        if kind in kinds and flag in _FLAGS:
            return flag in _TRUE
    except (AttributeError, TypeError, ValueError):
        pass
    _refuse(reply, name, key, terms)


def parse_snapshot(reply: Reply, name: str, key: str, terms: Terms) -> Snapshot:
    """The answer of ``read``: ``record NOW TICKET POS AT INTERVAL BURST DUE PAUSED MAX_RUNNING HELD``
    followed by ``TICKET EXPIRY`` for each lease, or ``none NOW``.

    (``terms`` is not needed: a read checks none.)
    """
    try:
        kind, *numbers = reply.split()
        if kind in _NONE and len(numbers) == 1:
            return Snapshot(record=None, now=int(numbers[0]))
        if kind in _RECORD and len(numbers) >= 10 and len(numbers) % 2 == 0 and numbers[7] in _FLAGS:
            now, ticket, pos, at, interval, burst, due, paused, max_running, held, *rest = (
                int(number) for number in numbers
            )
            record = Record(
                ticket=ticket,
                pos=pos,
                at=at,
                interval=interval,
                burst=burst,
                due=due,
                paused=paused == 1,
                max_running=max_running,
                leases=tuple(zip(rest[::2], rest[1::2], strict=True)),
                held=held,
            )
            return Snapshot(record=record, now=now)
    except (AttributeError, TypeError, ValueError):
        pass
    _refuse(reply, name, key, terms)


def _refuse(reply: object, name: str, key: str, terms: Terms) -> NoReturn:
    """Raise the error a reply other than the answer expected stands for."""
    text = reply.decode("utf-8", "replace") if isinstance(reply, bytes) else reply
    words = text.split(" ") if isinstance(text, str) else [""]
    if (
        words[0] == "mismatch"
        and len(words) == 3
        and words[1] in ("interval", "burst")
        and words[2].isdigit()
    ):
        # the stored interval or burst (the other one as expected), with the message base gives
        stored = {"interval": terms.interval_us, "burst": terms.burst, words[1]: int(words[2])}
        record = Record(
            ticket=1,
            pos=0,
            at=NEVER,
            interval=stored["interval"],
            burst=stored["burst"],
            max_running=terms.max_running,
        )
        check_terms_match(name, record, terms)
    if words[0] == "mismatch" and len(words) == 3 and words[1] == "max_running" and words[2].isdigit():
        check_max_running_matches(name, int(words[2]), terms.max_running)
    if words[0] == "unwritten" and len(words) == 4 and all(_is_decimal(word) for word in words[2:]):
        exc = Unwritten(words[1], int(words[2]), int(words[3]))
        raise unwritten(exc, f"Redis hash {key}", key)
    if words[0] == "corrupt" and len(words) >= 3:
        field, value = words[1], " ".join(words[2:])
        raise StateCorrupted(
            f"Redis hash {key} has {field}={value!r}, not a record ratequeue wrote", where=key
        )
    raise StateCorrupted(f"the ratequeue script on Redis hash {key} answered {reply!r}", where=key)


def _is_decimal(word: str) -> bool:
    """Whether ``word`` is a whole number in decimal, as the script writes them."""
    return word.removeprefix("-").isdigit()
