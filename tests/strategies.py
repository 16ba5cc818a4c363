"""Hypothesis strategies shared by the property tests."""

from __future__ import annotations

from hypothesis import strategies as st

from ratequeue.core.protocol import MAX_DOUBT_US, MAX_HOLD_US

#: the operations on a queue's pause and hold that ``pauses`` adds (see :func:`tests.ops.flag_step`)
FLAGS = ("pause", "resume", "hold", "lift", "slow")

#: intervals in microseconds: from 1 us to 10 s, biased to small and round values
intervals_us = st.one_of(st.sampled_from([1, 1000, 20_000, 100_000, 1_000_000]), st.integers(1, 10_000_000))

#: leads in microseconds
leads_us = st.one_of(st.just(0), st.integers(0, 50_000))
#: a starter's doubt of the state's clock (us): mostly none, as on a fast state
doubts_us = st.one_of(st.just(0), st.integers(0, 5_000), st.just(MAX_DOUBT_US))

#: state-clock starting points in microseconds (around "now" since the epoch, and small ones)
epochs_us = st.one_of(st.integers(0, 10**9), st.integers(1_700_000_000_000_000, 1_900_000_000_000_000))

#: how far the state clock moves in one step, in microseconds (negative: steps back)
clock_steps_us = st.one_of(st.integers(0, 200_000), st.integers(-2_000_000, 0))


#: ``("pause",)`` and ``("resume",)``: the queue paused, or resumed, for every shard (``set_paused``);
#: ``("hold", lead)`` and ``("lift",)``: no start before ``now + lead``, or no hold (``hold``, ``lift``);
#: ``("slow", to)``: slots at ``to`` us at least, or twice as slow for 0 (``slow``)
_pauses = [
    st.tuples(st.just("pause")),
    st.tuples(st.just("resume")),
    st.tuples(st.just("hold"), st.one_of(st.integers(0, 300_000), st.just(MAX_HOLD_US))),
    st.tuples(st.just("lift")),
    st.tuples(st.just("slow"), st.one_of(st.just(0), st.integers(1, 3_000_000))),
]


def operations(
    *, max_size: int, reads: bool = False, pauses: bool = False
) -> st.SearchStrategy[list[tuple[object, ...]]]:
    """Sequences of protocol operations and clock moves.

    Each is ``("take",)``, ``("try", n, lead, doubt)`` (``n`` picks a ticket among those
    handed out, or one more), ``("take_and_try", lead, doubt)``, ``("try_take", lead, doubt)``,
    ``("clock", step)``,
    with ``reads`` ``("read",)``, and with ``pauses`` ``("pause",)``, ``("resume",)``,
    ``("hold", lead)`` and ``("lift",)`` (:data:`FLAGS`).
    """
    kinds = [
        st.tuples(st.just("take")),
        st.tuples(st.just("try"), st.integers(0, 40), leads_us, doubts_us),
        st.tuples(st.just("take_and_try"), leads_us, doubts_us),
        st.tuples(st.just("try_take"), leads_us, doubts_us),
        st.tuples(st.just("retime"), st.integers(0, 40), leads_us, doubts_us),
        st.tuples(st.just("clock"), clock_steps_us),
    ]
    if reads:
        kinds.append(st.tuples(st.just("read")))
    if pauses:
        kinds.extend(_pauses)
    return st.lists(st.one_of(kinds), min_size=1, max_size=max_size)


def retime_ticket(n: int, pos: int, ticket: int) -> int:
    """The ticket a ``("retime", n, lead)`` operation names: mostly the latest started one."""
    return max(1, pos) if n % 3 else 1 + n % ticket


#: bursts: mostly small, sometimes large
bursts = st.one_of(st.integers(1, 4), st.sampled_from([10, 100]))


def burst_operations(
    *, max_size: int, reads: bool = False, pauses: bool = False
) -> st.SearchStrategy[list[tuple[object, ...]]]:
    """Like :func:`operations`, with a cost seed on the operations that take a ticket.

    ``("take", c)``, ``("take_and_try", lead, c)`` and ``("try_take", lead, c)``: ``c`` picks the cost
    (``1 + c % burst``); ``("try", n, lead)`` picks a ticket handed out (with
    the cost it was taken for), or one never handed out. ``("settle", n, a)``:
    the ticket ``n`` picks (as for ``try``) settled at cost ``a % (burst + 1)``.
    ``pauses`` as in :func:`operations`.
    """
    kinds = [
        st.tuples(st.just("take"), st.integers(0, 200)),
        st.tuples(st.just("try"), st.integers(0, 40), leads_us),
        st.tuples(st.just("take_and_try"), leads_us, st.integers(0, 200)),
        st.tuples(st.just("try_take"), leads_us, st.integers(0, 200)),
        st.tuples(st.just("settle"), st.integers(0, 40), st.integers(0, 200)),
        st.tuples(st.just("retime"), st.integers(0, 40), leads_us, doubts_us),
        st.tuples(st.just("clock"), clock_steps_us),
    ]
    if reads:
        kinds.append(st.tuples(st.just("read")))
    if pauses:
        kinds.extend(_pauses)
    return st.lists(st.one_of(kinds), min_size=1, max_size=max_size)


def pick_ticket(n: int, costs: dict[int, int], next_ticket: int) -> tuple[int, int]:
    """The ticket (and its cost) a ``("try", n, lead)`` names among those handed out, or the next one."""
    handed = sorted(costs)
    if not handed or n % 7 == 0:
        return next_ticket, 1
    ticket = handed[-1 - n % min(len(handed), 4)] if n % 2 else handed[n % len(handed)]
    return ticket, costs[ticket]


#: caps on running jobs: mostly 1 or 2, so that queues fill up
max_runnings = st.one_of(st.integers(1, 3), st.just(10))

#: lease lengths (us): around the clock steps, so that leases expire now and then
leases_us = st.one_of(st.sampled_from([1, 50_000, 150_000, 10**9]), st.integers(1, 400_000))


def lease_operations(*, max_size: int) -> st.SearchStrategy[list[tuple[object, ...]]]:
    """Like :func:`operations` with reads and pauses, plus leases given back and renewed.

    ``("take_and_try", lead, again)`` and ``("try_take", lead, again)``: with
    ``again``, the call names the previous take's token, as a shard's retry
    after a lost reply does.
    ``("release", n, own)`` and ``("renew", n, own)``: ``n`` picks a ticket
    (mostly one that holds a lease, see :func:`lease_ticket`), named by its
    lease's own token, or (not ``own``) by another one, as a turn of
    another queue would be (see :class:`Tokens`).
    """
    kinds = [
        st.tuples(st.just("take")),
        st.tuples(st.just("try"), st.integers(0, 40), leads_us),
        st.tuples(st.just("take_and_try"), leads_us, st.booleans()),
        st.tuples(st.just("try_take"), leads_us, st.booleans()),
        st.tuples(st.just("retime"), st.integers(0, 40), leads_us),
        st.tuples(st.just("clock"), clock_steps_us),
        st.tuples(st.just("release"), st.integers(0, 40), st.booleans()),
        st.tuples(st.just("renew"), st.integers(0, 40), st.booleans()),
        st.tuples(st.just("read")),
        *_pauses,
    ]
    return st.lists(st.one_of(kinds), min_size=1, max_size=max_size)


def lease_ticket(n: int, leases: tuple[tuple[int, int, int], ...], next_ticket: int) -> int:
    """The ticket a ``("release", n)`` or ``("renew", n)`` names: mostly one holding a lease."""
    if leases and n % 4:
        return leases[n % len(leases)][0]
    return 1 + n % next_ticket


class Tokens:
    """The tokens :func:`lease_operations` name, as shards would.

    A ticket tried on its own is named by one token for good (the shard
    holding it names it so); each ``take_and_try`` gets a new token, unless
    it is sent ``again``; a release or renewal names the ticket's lease's
    token, or another one.
    """

    def __init__(self) -> None:
        self._next = 1
        self.last_take = 0

    def of_ticket(self, ticket: int) -> int:
        return 10**9 + ticket

    def take(self, again: object) -> int:
        if not (again and self.last_take):
            self.last_take, self._next = self._next, self._next + 1
        return self.last_take

    def naming(self, ticket: int, leases: tuple[tuple[int, int, int], ...], own: object) -> int:
        token = next((named for held, _, named in leases if held == ticket), self.of_ticket(ticket))
        return token if own else token + 1
