"""Properties of the reference protocol (ratequeue.core.protocol) under any operation sequence."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from hypothesis import given
from hypothesis import strategies as st

from ratequeue.core import protocol
from ratequeue.core.protocol import NEVER, PAUSED_RECHECK_US, Passed, Record, Started, Wait

from .strategies import epochs_us, intervals_us, leads_us, retime_ticket
from .strategies import operations as ops_strategy

operations = ops_strategy(max_size=60, pauses=True)


@dataclass
class History:
    """What a sequence of operations did, for checking the guarantees."""

    starts: list[tuple[int, int]] = field(default_factory=list)  # (ticket, start)
    records: list[Record] = field(default_factory=list)


def run(interval: int, epoch: int, ops: list[tuple[object, ...]]) -> History:
    record = protocol.new_record(interval)
    now = epoch
    history = History(records=[record])
    for op in ops:
        kind = op[0]
        if kind == "clock":
            now = max(0, now + int(op[1]))  # type: ignore[call-overload]
            continue
        before = record
        if kind in ("pause", "resume"):
            record, changed = protocol.set_paused(record, kind == "pause", now)
            assert changed is (before.paused != (kind == "pause"))
            if changed:  # the flag, and since when the pause is on
                since = now if kind == "pause" else NEVER
                assert record == before._replace(paused=kind == "pause", paused_at=since), "only the flag"
            else:
                assert record is before
        elif kind == "hold":
            lead = int(op[1])  # type: ignore[call-overload]
            record, changed = protocol.hold(record, lead, now)
            assert record.not_before == max(before.not_before, now + lead), "a hold only grows"
            assert changed is (record != before)
            assert record == before._replace(not_before=record.not_before), "only the hold changes"
        elif kind == "slow":
            to = int(op[1])  # type: ignore[call-overload]
            record, changed = protocol.slow(record, to, now)
            before_now = protocol.effective_interval(before, now)
            assert protocol.effective_interval(record, now) >= before_now, "a slow-down never speeds up"
            assert changed is (record != before)
            assert record.pace <= protocol.MAX_SLOW * record.interval
        elif kind == "lift":
            record, changed = protocol.lift(record, now)
            assert changed is (before.not_before > now)
            assert record == before._replace(not_before=NEVER), "only the hold changes"
        elif kind == "take":
            record, taken = protocol.take(record, now)
            assert taken.ticket == before.ticket
            assert taken.now == now
        elif kind == "try":
            ticket = 1 + int(op[1]) % before.ticket  # type: ignore[call-overload]
            lead, doubt = int(op[2]), int(op[3])  # type: ignore[call-overload]
            record, outcome = protocol.try_start(record, ticket, lead, now, doubt=doubt)
            check_outcome(before, record, outcome, ticket, lead, now, history, doubt)
        elif kind == "retime":
            ticket = retime_ticket(int(op[1]), before.pos, before.ticket)  # type: ignore[call-overload]
            lead, doubt = int(op[2]), int(op[3])  # type: ignore[call-overload]
            record, outcome = protocol.retime(record, ticket, lead, now, doubt)
            check_retime(before, record, outcome, ticket, lead, now, history, doubt)
        elif kind == "try_take":
            lead, doubt = int(op[1]), int(op[2])  # type: ignore[call-overload]
            record, outcome = protocol.try_take(record, lead, now, doubt=doubt)
            assert (record, outcome) == protocol.take_and_try(before, lead, now, doubt=doubt) or (
                record is before and not isinstance(outcome, Started)
            ), "a try is take_and_try when it starts, and changes nothing when it does not"
            check_outcome(before, record, outcome, outcome.ticket, lead, now, history, doubt)
        else:
            lead, doubt = int(op[1]), int(op[2])  # type: ignore[call-overload]
            record, outcome = protocol.take_and_try(record, lead, now, doubt=doubt)
            assert outcome.ticket == before.ticket
            check_outcome(before, record, outcome, outcome.ticket, lead, now, history, doubt)
        history.records.append(record)
    return history


def check_outcome(
    before: Record,
    after: Record,
    outcome: object,
    ticket: int,
    lead: int,
    now: int,
    history: History,
    doubt: int = 0,
) -> None:
    if before.paused:
        assert after.paused
        assert not isinstance(outcome, Started) or protocol.repeats_start(before, ticket, now), (
            "while paused, nothing starts but the same grant again"
        )
        if isinstance(outcome, Wait):
            assert outcome.slot >= now + PAUSED_RECHECK_US, "a paused queue is asked again a second on"
    if isinstance(outcome, Started) and protocol.repeats_start(before, ticket, now):
        assert outcome.start == before.at, "asked again, the latest start is the same grant"
        assert after == before, "a repeated grant changes nothing"
        assert history.starts, "only a real start is granted again"
        assert history.starts[-1][0] == ticket, "only the latest start is granted again"
    elif isinstance(outcome, Started):
        assert outcome.ticket == ticket
        assert now <= outcome.start <= now + lead, "a start lies between now and now + lead"
        assert outcome.start >= before.not_before, "no start before a hold's end"
        assert (after.pos, after.at) == (ticket, outcome.start)
        assert after.due >= outcome.start + doubt, "the starter's doubt moves the next start"
        history.starts.append((ticket, outcome.start))
    elif isinstance(outcome, Wait):
        assert outcome.slot > now + lead, "WAIT only when the slot is more than lead away"
        assert after == before or after.ticket == before.ticket + 1
    else:
        assert isinstance(outcome, Passed)
        assert outcome.pos >= ticket or ticket >= after.ticket
        assert not protocol.repeats_start(before, ticket, now)


def check_retime(
    before: Record,
    after: Record,
    outcome: object,
    ticket: int,
    lead: int,
    now: int,
    history: History,
    doubt: int = 0,
) -> None:
    if isinstance(outcome, Started):
        assert before.pos == ticket, "only the latest start moves"
        assert outcome.start == max(before.at, now + lead), "forward only, to now + lead at the earliest"
        assert after == Record(
            before.ticket,
            before.pos,
            outcome.start,
            before.interval,
            # what the start added stays, and the doubt now is added at least
            max(before.due + outcome.start - before.at, outcome.start + doubt),
            paused=before.paused,
            not_before=before.not_before,
            pace=before.pace,
            paced_at=before.paced_at,
            paused_at=before.paused_at,
        )
        if history.starts and history.starts[-1][0] == ticket:
            history.starts[-1] = (ticket, outcome.start)
        else:  # pos was jumped to and never started: a retime starts it, at least 2 intervals on
            history.starts.append((ticket, outcome.start))
    else:
        assert isinstance(outcome, Passed)
        assert before.pos != ticket or ticket >= before.ticket
        assert after == before, "a refused retime changes nothing"


@given(intervals_us, epochs_us, operations)
def test_starts_are_spaced_and_ordered(interval: int, epoch: int, ops: list[tuple[object, ...]]) -> None:
    """G1 and G2: starts at least one interval apart, in increasing ticket order, whatever the clock does."""
    history = run(interval, epoch, ops)
    for (t1, s1), (t2, s2) in zip(history.starts, history.starts[1:], strict=False):
        assert t2 > t1, "tickets start in increasing order"
        assert s2 - s1 >= interval, "two starts are at least one interval apart"


@given(intervals_us, epochs_us, operations)
def test_pos_never_moves_back(interval: int, epoch: int, ops: list[tuple[object, ...]]) -> None:
    """G2: pos and ticket never decrease; at never decreases once set; pos < ticket always."""
    records = run(interval, epoch, ops).records
    for before, after in itertools.pairwise(records):
        assert after.pos >= before.pos
        assert after.ticket >= before.ticket
        assert after.at >= before.at
        assert 0 <= after.pos < after.ticket
        assert after.interval == interval


@given(intervals_us, epochs_us, leads_us, st.integers(1, 20), st.integers(0, 5_000_000))
def test_take_jumps_over_stale_tickets_only(
    interval: int, epoch: int, lead: int, abandoned: int, later: int
) -> None:
    """G4: a new ticket does not wait behind tickets whose slots have all passed by an interval."""
    record, outcome = protocol.take_and_try(protocol.new_record(interval), lead, epoch)
    assert isinstance(outcome, Started)
    for _ in range(abandoned):  # tickets handed out and never tried again (their holders died)
        record, _ = protocol.take(record, epoch)
    now = epoch + later
    record, outcome = protocol.take_and_try(record, lead, now)
    last_abandoned_slot = epoch + abandoned * interval
    if last_abandoned_slot + interval <= now:
        assert outcome == Started(ticket=abandoned + 2, start=now, now=now), "all stale: start at once"
    else:  # wait behind the abandoned tickets: one interval each
        slot = last_abandoned_slot + interval
        expected = (
            Started(abandoned + 2, max(slot, now), now)
            if now + lead >= slot
            else Wait(abandoned + 2, slot, now)
        )
        assert outcome == expected


@given(intervals_us, epochs_us, leads_us)
def test_first_ticket_starts_at_once(interval: int, epoch: int, lead: int) -> None:
    """An unused queue starts its first job immediately."""
    record, outcome = protocol.take_and_try(protocol.new_record(interval), lead, epoch)
    assert outcome == Started(ticket=1, start=epoch, now=epoch)
    assert record == Record(ticket=2, pos=1, at=epoch, interval=interval, due=epoch)


@given(intervals_us, epochs_us, st.integers(1, 10))
def test_ticket_never_handed_out_is_passed(interval: int, epoch: int, ahead: int) -> None:
    """A ticket from before a reset is answered PASSED, so its holder takes a new one."""
    record = protocol.new_record(interval)
    record, outcome = protocol.try_start(record, ahead, 0, epoch)
    assert outcome == Passed(ticket=ahead, pos=0, now=epoch)
    assert record == protocol.new_record(interval)


def test_never_is_far_in_the_past() -> None:
    """NEVER + any realistic slot offset stays below any real clock and exact in a double."""
    assert float(NEVER + 10**15) == NEVER + 10**15
    assert NEVER + 10**15 < 0


@given(intervals_us, epochs_us, leads_us, st.integers(0, 10_000_000))
def test_a_repeated_try_start_gets_the_same_grant(interval: int, epoch: int, lead: int, later: int) -> None:
    """A re-sent try_start (its answer was lost) keeps the turn while its interval runs, then is passed."""
    record, _ = protocol.take_and_try(protocol.new_record(interval), 0, epoch)
    record, taken = protocol.take(record, epoch)
    record, first = protocol.try_start(record, taken.ticket, interval, epoch)
    assert first == Started(ticket=2, start=epoch + interval, now=epoch)
    now = epoch + later
    again, second = protocol.try_start(record, taken.ticket, lead, now)
    assert again == record, "asking again changes nothing"
    if now < first.start + interval:
        assert second == Started(ticket=2, start=first.start, now=now)
    else:
        assert second == Passed(ticket=2, pos=2, now=now)


@given(intervals_us, epochs_us, leads_us, st.integers(1, 10), st.integers(0, 10_000_000))
def test_a_ticket_jumped_to_is_never_granted(
    interval: int, epoch: int, lead: int, abandoned: int, later: int
) -> None:
    """``take`` jumping ``pos`` to a stale ticket does not make that ticket a grant to repeat."""
    record, _ = protocol.take_and_try(protocol.new_record(interval), 0, epoch)
    for _ in range(abandoned):
        record, _ = protocol.take(record, epoch)
    now = epoch + (abandoned + 1) * interval + later  # every abandoned ticket is an interval late
    record, _ = protocol.take(record, now)
    assert record.pos == abandoned + 1, "pos jumped to the last abandoned ticket"
    _, outcome = protocol.try_start(record, abandoned + 1, lead, now)
    assert outcome == Passed(ticket=abandoned + 1, pos=abandoned + 1, now=now)


def ask(record: Record, ticket: int | None, now: int) -> tuple[Record, object]:
    """A shard's head asking, lead 0: its held ticket tried, or (none held) a new one taken and tried."""
    if ticket is None:
        return protocol.take_and_try(record, 0, now)
    return protocol.try_start(record, ticket, 0, now)


@given(intervals_us, epochs_us, st.integers(0, 10_000_000), st.integers(1, 5), st.integers(0, 30_000_000))
def test_shards_waiting_through_a_pause_start_at_the_rate_on_resume(
    interval: int, epoch: int, before_pause: int, shards: int, paused_for: int
) -> None:
    """Paused, every waiting shard is told to wait (a second on, at least); resumed, all start, spaced.

    Tickets are still handed out while paused, and take's jump (G4) may pass
    a ticket held through the pause: its holder takes a new one, as ever.
    """
    record, first = protocol.take_and_try(protocol.new_record(interval), 0, epoch)
    assert isinstance(first, Started)
    now = epoch + before_pause
    record, changed = protocol.set_paused(record, True, now)
    assert changed
    assert record.paused
    held: list[int | None] = [None] * shards
    for moment in (now, now + paused_for):  # each shard asks, then asks again later, still paused
        for shard in range(shards):
            record, outcome = ask(record, held[shard], moment)
            if isinstance(outcome, Passed):  # passed by a take's jump: take a new ticket
                record, outcome = ask(record, None, moment)
            assert isinstance(outcome, Wait), "nothing starts while paused"
            assert outcome.slot >= moment + PAUSED_RECHECK_US
            held[shard] = outcome.ticket
    now += paused_for
    resumed = now
    record, changed = protocol.set_paused(record, False, now)
    assert changed
    assert not record.paused
    starts = [first.start]
    waiting = set(range(shards))
    for _ in range(10 * shards):
        slots = []
        for shard in sorted(waiting):
            record, outcome = ask(record, held[shard], now)
            if isinstance(outcome, Passed):
                record, outcome = ask(record, None, now)
            if isinstance(outcome, Started):
                starts.append(outcome.start)
                waiting.discard(shard)
                held[shard] = None
            else:
                assert isinstance(outcome, Wait)
                held[shard] = outcome.ticket
                slots.append(outcome.slot)
        if not waiting:
            break
        now = max(now, min(slots))
    assert not waiting, "every shard waiting through the pause starts once resumed"
    for earlier, later in itertools.pairwise(starts):
        assert later - earlier >= interval, "G1 after resume"
    assert starts[-1] <= max(resumed, first.start + (shards + 1) * interval) + shards * interval, "no stall"


@given(intervals_us, epochs_us, st.integers(1, 5), st.integers(0, 10_000_000))
def test_a_paused_queue_still_passes_tickets_whose_holders_left(
    interval: int, epoch: int, abandoned: int, paused_for: int
) -> None:
    """G4 holds through a pause: a new ticket taken after resume does not wait behind stale ones."""
    record, _ = protocol.take_and_try(protocol.new_record(interval), 0, epoch)
    record, _ = protocol.set_paused(record, True, epoch)
    for _ in range(abandoned):
        record, _ = protocol.take_and_try(record, 0, epoch)
    now = epoch + (abandoned + 1) * interval + paused_for
    record, _ = protocol.set_paused(record, False, now)
    record, outcome = protocol.take_and_try(record, 0, now)
    assert outcome == Started(ticket=abandoned + 2, start=now, now=now)


@given(intervals_us, epochs_us, leads_us, st.integers(0, 10_000_000))
def test_a_grant_from_before_the_pause_is_granted_again(
    interval: int, epoch: int, lead: int, later: int
) -> None:
    """A start granted before the pause, asked again after a lost reply, is the same grant."""
    record, _first = protocol.take_and_try(protocol.new_record(interval), 0, epoch)
    record, _ = protocol.set_paused(record, True, epoch)
    now = epoch + later
    again, outcome = protocol.try_start(record, 1, lead, now)
    assert again == record
    if now < epoch + interval:
        assert outcome == Started(ticket=1, start=epoch, now=now)
    else:
        assert outcome == Passed(ticket=1, pos=1, now=now)
