"""Properties of the protocol's cap on running jobs (``max_running``): leases, full queues, order."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from ratequeue.core import protocol
from ratequeue.core.protocol import FULL_GRACE_US, FULL_RECHECK_US, Passed, Record, Started, Wait

from .strategies import epochs_us, intervals_us, lease_operations, lease_ticket, leases_us, max_runnings

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
    """
    record = protocol.new_record(interval, 1, max_running)
    now = epoch
    running: dict[int, int] = {}  # ticket -> lease expiry, from the answers alone
    for op in ops:
        kind = op[0]
        if kind == "clock":
            now = max(0, now + int(op[1]))  # type: ignore[call-overload]
        elif kind in ("pause", "resume"):
            record, _ = protocol.set_paused(record, kind == "pause", now)
        elif kind == "take":
            record, _ = protocol.take(record, now)
        elif kind in ("try", "take_and_try"):
            before = record
            if kind == "try":
                ticket = 1 + int(op[1]) % (record.ticket + 1)  # type: ignore[call-overload]
                record, outcome = protocol.try_start(record, ticket, int(op[2]), now, 1, lease)  # type: ignore[call-overload]
            else:
                record, outcome = protocol.take_and_try(record, int(op[1]), now, 1, lease)  # type: ignore[call-overload]
            if isinstance(outcome, Started) and not protocol.repeats_start(before, outcome.ticket, now):
                running[outcome.ticket] = outcome.start + lease
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
                running[ticket] += outcome.start - before.at
        elif kind == "release":
            ticket = lease_ticket(int(op[1]), record.leases, record.ticket)  # type: ignore[call-overload]
            record, released = protocol.release(record, ticket, now)
            assert released is (running.get(ticket, now) > now)
            running.pop(ticket, None)
        elif kind == "renew":
            ticket = lease_ticket(int(op[1]), record.leases, record.ticket)  # type: ignore[call-overload]
            record, renewed = protocol.renew(record, ticket, lease, now)
            assert renewed is (running.get(ticket, now) > now)
            if renewed:
                running[ticket] = max(running[ticket], now + lease)
        live = {ticket: expiry for ticket, expiry in running.items() if expiry > now}
        assert len(live) <= max_running
        assert dict(protocol.live_leases(record, now)) == live
        assert protocol.expires(record) >= max(live.values(), default=protocol.NEVER)


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
    assert record.leases == ((waiting.ticket, now + 2000 + LEASE),)


def test_a_full_queue_says_to_ask_again_when_its_first_lease_expires_if_sooner() -> None:
    record = protocol.new_record(INTERVAL, 1, 1)
    record, outcome = protocol.take_and_try(record, 0, 0, 1, 50_000)
    record, waiting = protocol.take_and_try(record, 0, 20_000, 1, 50_000)
    assert isinstance(waiting, Wait)
    assert waiting.slot == 50_000
    record, outcome = protocol.try_start(record, waiting.ticket, 0, 50_000, 1, 50_000)
    assert started(outcome).start == 50_000  # the killed holder's place came back at its lease's expiry
    assert [ticket for ticket, _ in record.leases] == [waiting.ticket]


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
    assert record.leases == ((outcome.ticket, 2200 + LEASE),)


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
