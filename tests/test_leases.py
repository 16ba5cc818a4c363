"""Properties of the protocol's cap on running jobs (``max_running``): leases, full queues, order."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ratequeue.core import protocol
from ratequeue.core.protocol import FULL_GRACE_US, FULL_RECHECK_US, Passed, Record, Started, Wait

from .ops import flag_step
from .strategies import (
    FLAGS,
    Tokens,
    epochs_us,
    intervals_us,
    lease_operations,
    lease_ticket,
    leases_us,
    max_runnings,
)

INTERVAL = 10_000  # 10 ms
LEASE = 5_000_000


def started(outcome: protocol.Outcome) -> Started:
    assert isinstance(outcome, Started), outcome
    return outcome


@given(
    interval=intervals_us,
    max_running=max_runnings,
    lease=leases_us,
    epoch=epochs_us,
    ops=lease_operations(max_size=80),
)
def test_never_more_running_than_the_cap(
    interval: int, max_running: int, lease: int, epoch: int, ops: list[tuple[object, ...]]
) -> None:
    """Whatever the operations, at most ``max_running`` jobs hold a live lease at any state-clock time.

    A model kept beside the record counts the running jobs from the answers
    alone: a start (not a repeated grant) adds one until its lease expires,
    a release that says it was live ends it, a renewal that says so extends
    it. The model and the record agree, and the model never exceeds the cap
    (a holder that was killed is counted until its lease expires).

    Ownership: a release or renewal naming another token than the lease's
    (another queue's turn with the same ticket number) changes nothing; a
    take sent again with the token of a live lease (its first reply lost)
    is answered with that lease's start and takes no new place.
    """
    record = protocol.new_record(interval, 1, max_running)
    now = epoch
    tokens = Tokens()
    running: dict[int, tuple[int, int]] = {}  # ticket -> (lease expiry, token), from the answers alone
    for op in ops:
        kind = op[0]
        if kind == "clock":
            now = max(0, now + int(op[1]))  # type: ignore[call-overload]
        elif kind in FLAGS:
            record = flag_step(record, op, now)[0]
        elif kind == "take":
            record, _ = protocol.take(record, now)
        elif kind in ("try", "take_and_try", "try_take"):
            before = record
            if kind == "try":
                ticket = 1 + int(op[1]) % (record.ticket + 1)  # type: ignore[call-overload]
                token = tokens.of_ticket(ticket)
                record, outcome = protocol.try_start(record, ticket, int(op[2]), now, 1, lease, token)  # type: ignore[call-overload]
            else:
                token = tokens.take(op[2])
                step = protocol.try_take if kind == "try_take" else protocol.take_and_try
                record, outcome = step(record, int(op[1]), now, 1, lease, token)  # type: ignore[call-overload]
                if kind == "try_take" and not isinstance(outcome, Started):
                    assert record is before, "a try without a turn takes no place and notes nothing"
            held = [(t, expiry) for t, (expiry, named) in running.items() if named == token and expiry > now]
            if held and (kind != "try" or held[0][0] == outcome.ticket):
                # asked again with a live lease's token: that start again, and no new place
                assert outcome == Started(held[0][0], held[0][1] - lease, now)
                assert record == before
            elif isinstance(outcome, Started) and not protocol.repeats_start(before, outcome.ticket, now):
                running[outcome.ticket] = (outcome.start + lease, token)
            full = len(protocol.live_leases(before, now)) >= max_running
            if isinstance(outcome, Wait) and full and not before.paused:
                assert outcome.slot > now  # a full queue says when to ask again, never "now"
                assert outcome.slot <= max(before.earliest(outcome.ticket, 1), now + FULL_RECHECK_US) or (
                    outcome.ticket > before.pos + 1
                )
        elif kind == "retime":
            ticket = protocol_retime_ticket(int(op[1]), record)  # type: ignore[call-overload]
            before = record
            record, outcome = protocol.retime(record, ticket, int(op[2]), now)  # type: ignore[call-overload]
            if isinstance(outcome, Started) and ticket in running:
                expiry, token = running[ticket]
                running[ticket] = (expiry + outcome.start - before.at, token)
        elif kind in ("release", "renew"):
            ticket = lease_ticket(int(op[1]), record.leases, record.ticket)  # type: ignore[call-overload]
            token = tokens.naming(ticket, record.leases, op[2])
            expiry, named = running.get(ticket, (now, 0))
            live = expiry > now and named == token
            # both drop every expired lease from the record: a later retime moves none of them
            running = {held: lease for held, lease in running.items() if lease[0] > now}
            if kind == "release":
                record, released = protocol.release(record, ticket, now, token)
                assert released is live
                if live:
                    del running[ticket]
            else:
                record, renewed = protocol.renew(record, ticket, lease, now, token)
                assert renewed is live
                if renewed:
                    running[ticket] = (max(expiry, now + lease), token)
        live_leases = {t: held for t, held in running.items() if held[0] > now}
        assert len(live_leases) <= max_running
        assert {t: (expiry, named) for t, expiry, named in protocol.live_leases(record, now)} == live_leases
        assert protocol.expires(record) >= max(
            (held[0] for held in live_leases.values()), default=protocol.NEVER
        )
        _assert_the_validity_rule(record, now)


def _assert_the_validity_rule(record: Record, now: int) -> None:
    """What the protocol writes it accepts; a held or lease further ahead than it can write, it refuses."""
    assert protocol.check(record, now) is record
    far = now + protocol.MAX_LEAD_US + 1
    with pytest.raises(protocol.Unwritten, match="held"):
        protocol.check(record._replace(held=far), now)
    for i, (ticket, _, token) in enumerate(record.leases):
        stalled = (*record.leases[:i], (ticket, far + protocol.MAX_LEASE_US, token), *record.leases[i + 1 :])
        with pytest.raises(protocol.Unwritten, match="leases"):
            protocol.check(record._replace(leases=stalled), now)


def protocol_retime_ticket(n: int, record: Record) -> int:
    return max(1, record.pos) if n % 3 else 1 + n % record.ticket


def full_queue(max_running: int = 1) -> tuple[Record, int]:
    """A queue of ``max_running`` whose places are all taken at time 0, with tickets 2.. free."""
    record = protocol.new_record(INTERVAL, 1, max_running)
    now = 0
    for _ in range(max_running):
        record, outcome = protocol.take_and_try(record, 0, now, 1, LEASE)
        started(outcome)
        now += INTERVAL
    return record, now


def test_a_full_queue_waits_until_a_place_is_released_and_then_starts_at_once() -> None:
    record, now = full_queue(1)
    record, waiting = protocol.take_and_try(record, 0, now, 1, LEASE)
    assert isinstance(waiting, Wait)
    assert waiting.slot == now + FULL_RECHECK_US  # asked again ten times a second, not at the lease's expiry
    assert record.held == now
    record, released = protocol.release(record, 1, now + 1000)
    assert released
    record, outcome = protocol.try_start(record, waiting.ticket, 0, now + 2000, 1, LEASE)
    assert started(outcome).start == now + 2000
    assert record.leases == ((waiting.ticket, now + 2000 + LEASE, 0),)


def test_a_full_queue_says_to_ask_again_when_its_first_lease_expires_if_sooner() -> None:
    record = protocol.new_record(INTERVAL, 1, 1)
    record, outcome = protocol.take_and_try(record, 0, 0, 1, 50_000)
    record, waiting = protocol.take_and_try(record, 0, 20_000, 1, 50_000)
    assert isinstance(waiting, Wait)
    assert waiting.slot == 50_000
    record, outcome = protocol.try_start(record, waiting.ticket, 0, 50_000, 1, 50_000)
    assert started(outcome).start == 50_000  # the killed holder's place came back at its lease's expiry
    assert [lease[0] for lease in record.leases] == [waiting.ticket]


def test_places_go_in_ticket_order() -> None:
    """Freed places go to the earliest waiting ticket, even when a later one asks first."""
    record, now = full_queue(1)
    record, second = protocol.take_and_try(record, 0, now, 1, LEASE)
    record, third = protocol.take_and_try(record, 0, now + 10, 1, LEASE)
    assert isinstance(second, Wait)
    assert isinstance(third, Wait)
    record, _ = protocol.release(record, 1, now + 20)
    later = now + 5 * INTERVAL  # both slots long past
    record, outcome = protocol.try_start(record, third.ticket, 0, later, 1, LEASE)
    assert isinstance(outcome, Wait)  # may not pass ticket 2, which waits for a place
    assert outcome.slot == record.held + FULL_GRACE_US
    record, outcome = protocol.try_start(record, second.ticket, 0, later + 1, 1, LEASE)
    assert started(outcome).ticket == second.ticket
    # a ticket taken now does not jump over the waiting third either
    record, taken = protocol.take(record, later + 2)
    assert record.pos == second.ticket
    assert taken.ticket == third.ticket + 1


def test_a_waiting_holder_that_left_is_passed_after_the_grace() -> None:
    """G4 with a cap: a ticket whose holder stopped asking costs the queue at most FULL_GRACE_US."""
    record, now = full_queue(1)
    record, second = protocol.take_and_try(record, 0, now, 1, LEASE)  # its holder then dies
    record, third = protocol.take_and_try(record, 0, now + 10, 1, LEASE)
    record, _ = protocol.release(record, 1, now + 20)
    record, outcome = protocol.try_start(record, third.ticket, 0, now + 30, 1, LEASE)
    assert isinstance(outcome, Wait)
    record, outcome = protocol.try_start(record, third.ticket, 0, outcome.slot, 1, LEASE)
    assert started(outcome).start == now + FULL_GRACE_US  # held: when the second found it full
    record, answer = protocol.try_start(record, second.ticket, 0, outcome.start + 1, 1, LEASE)
    assert isinstance(answer, Passed)


@given(max_running=st.integers(1, 5), interval=intervals_us, epoch=epochs_us)
def test_starts_keep_their_spacing_under_a_cap(max_running: int, interval: int, epoch: int) -> None:
    """Leases add a condition to a start, never remove one: starts stay an interval apart."""
    record = protocol.new_record(interval, 1, max_running)
    now, starts, ticket = epoch, [], None
    for _ in range(6 * max_running):
        if ticket is None:
            record, outcome = protocol.take_and_try(record, 0, now, 1, LEASE)
        else:
            record, outcome = protocol.try_start(record, ticket, 0, now, 1, LEASE)
        if isinstance(outcome, Started):
            starts.append(outcome.start)
            now, ticket = outcome.start, None
        else:
            assert isinstance(outcome, Wait)
            ticket = outcome.ticket
            if len(protocol.live_leases(record, now)) >= max_running:
                record, _ = protocol.release(record, record.leases[0][0], now)
                now += 1
            else:
                now = outcome.slot
    assert all(b - a >= interval for a, b in itertools.pairwise(starts))
    assert len(starts) >= max_running


def test_retime_moves_the_lease_with_the_start() -> None:
    record = protocol.new_record(INTERVAL, 1, 2)
    record, outcome = protocol.take_and_try(record, 0, 1000, 1, LEASE)
    record, moved = protocol.retime(record, started(outcome).ticket, 700, 1500)
    assert started(moved).start == 2200
    assert record.leases == ((outcome.ticket, 2200 + LEASE, 0),)


def test_an_expired_lease_is_neither_renewed_nor_released() -> None:
    record = protocol.new_record(INTERVAL, 1, 1)
    record, outcome = protocol.take_and_try(record, 0, 0, 1, 1000)
    record, renewed = protocol.renew(record, started(outcome).ticket, 1000, 1000)
    assert not renewed
    assert record.leases == ()
    record, released = protocol.release(record, outcome.ticket, 1001)
    assert not released


def test_a_record_with_a_live_lease_does_not_expire_before_it() -> None:
    record = protocol.new_record(INTERVAL, 1, 1)
    record, outcome = protocol.take_and_try(record, 0, 0, 1, 60_000_000)
    assert protocol.expires(record) == 60_000_000
    record, _ = protocol.release(record, started(outcome).ticket, 1)
    assert protocol.expires(record) == 2 * INTERVAL


def test_only_the_token_of_a_lease_releases_or_renews_it() -> None:
    """Another queue's turn with the same ticket number names another token: it frees no place here."""
    record = protocol.new_record(INTERVAL, 1, 1)
    record, outcome = protocol.take_and_try(record, 0, 0, 1, LEASE, 41)
    ticket = started(outcome).ticket
    for wrong in (0, 42):
        record, renewed = protocol.renew(record, ticket, LEASE, 10, wrong)
        assert not renewed
        record, released = protocol.release(record, ticket, 20, wrong)
        assert not released
        assert record.leases == ((ticket, LEASE, 41),)
    record, waiting = protocol.take_and_try(record, 0, 30, 1, LEASE, 43)
    assert isinstance(waiting, Wait), "the place is still taken"
    record, released = protocol.release(record, ticket, 40, 41)
    assert released
    assert record.leases == ()


def test_a_take_sent_again_is_answered_with_the_start_it_made() -> None:
    """A take_and_try whose reply was lost, sent again with its token, gets its start back, not a new place.

    Before tokens, the retry of a lost ``take_and_try`` on a full-at-one queue
    started nothing and waited for the orphan's lease (5 s in the issue's run).
    """
    record = protocol.new_record(INTERVAL, 1, 1)
    record, first = protocol.take_and_try(record, 0, 1000, 1, LEASE, 7)  # carried out; its reply lost
    again, repeated = protocol.take_and_try(record, 0, 300_000, 1, LEASE, 7)
    assert repeated == Started(started(first).ticket, first.start, 300_000)
    assert again == record, "nothing taken, nothing started"
    _, waiting = protocol.take_and_try(record, 0, 300_000, 1, LEASE, 8)
    assert isinstance(waiting, Wait), "a new token is a new caller: the queue is full"
    # the held ticket tried again with its token, after its interval and a later start: the same start
    record, _ = protocol.release(record, first.ticket, 400_000, 7)
    record, second = protocol.take_and_try(record, 0, 500_000, 1, LEASE, 9)
    record, _ = protocol.take(record, 600_000)
    assert protocol.try_start(record, started(second).ticket, 0, 10**6, 1, LEASE, 9)[1] == Started(
        second.ticket, second.start, 10**6
    )
    assert isinstance(protocol.try_start(record, second.ticket, 0, 10**6, 1, LEASE, 10)[1], Passed)
    # once the lease has expired, the token names nothing: a take starts a new ticket
    later = second.start + LEASE
    _, fresh = protocol.take_and_try(record, 0, later, 1, LEASE, 9)
    assert started(fresh).ticket > second.ticket
