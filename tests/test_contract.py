"""The backend contract: every state answers exactly as the reference protocol does.

One table of backends (``backend`` in conftest: memory, file, redis, mongodb,
the last two on real servers started by the tests) runs the same suite.
Hypothesis generates operation sequences and clock movements; each backend,
driven with the same ``now`` through its test-only clock, must give the same
answers as :mod:`ratequeue.core.protocol` and end with the same record.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import pickle
import shlex
from concurrent.futures import ProcessPoolExecutor

import pytest

from ratequeue._redact import redact
from ratequeue.core import protocol
from ratequeue.core.protocol import Started
from ratequeue.errors import ConfigurationError, TermsMismatch
from ratequeue.state.redis import RedisState

from . import _workers
from .backends import Backend, given_for_backend
from .ops import ado, do, flag_step
from .strategies import (
    FLAGS,
    Tokens,
    burst_operations,
    bursts,
    epochs_us,
    intervals_us,
    lease_operations,
    lease_ticket,
    leases_us,
    max_runnings,
    pick_ticket,
    retime_ticket,
)
from .strategies import operations as ops_strategy

operations = ops_strategy(max_size=25, reads=True, pauses=True)


@given_for_backend(interval=intervals_us, epoch=epochs_us, ops=operations)
def test_backend_answers_as_the_reference(
    backend: Backend, interval: int, epoch: int, ops: list[tuple[object, ...]]
) -> None:
    state, clock = backend.clocked()
    name = backend.fresh_name()
    clock[0] = epoch
    reference = protocol.new_record(interval)
    created = False  # every operation but read creates the record
    for op in ops:
        kind, now = op[0], clock[0]
        if kind == "clock":
            clock[0] = max(0, now + int(op[1]))  # type: ignore[call-overload]
        elif kind == "read":
            snapshot = state.read(name)
            assert snapshot.now == now
            assert snapshot.record == (reference if created else None)
            continue
        elif kind in FLAGS:
            reference, step, args, changed = flag_step(reference, op, now)
            assert do(state, step, name, interval, *args) is changed
        elif kind == "take":
            reference, expected_taken = protocol.take(reference, now)
            assert do(state, "take", name, interval) == expected_taken
        elif kind == "try":
            ticket = 1 + int(op[1]) % (reference.ticket + 1)  # type: ignore[call-overload]
            lead, doubt = int(op[2]), int(op[3])  # type: ignore[call-overload]
            reference, expected_outcome = protocol.try_start(reference, ticket, lead, now, doubt=doubt)
            assert do(state, "try_start", name, interval, ticket, lead, doubt) == expected_outcome
        elif kind == "retime":
            ticket = retime_ticket(int(op[1]), reference.pos, reference.ticket)  # type: ignore[call-overload]
            lead, doubt = int(op[2]), int(op[3])  # type: ignore[call-overload]
            reference, expected_outcome = protocol.retime(reference, ticket, lead, now, doubt)
            assert do(state, "retime", name, interval, ticket, lead, doubt) == expected_outcome
        elif kind == "try_take":
            lead, doubt = int(op[1]), int(op[2])  # type: ignore[call-overload]
            reference, expected_outcome = protocol.try_take(reference, lead, now, doubt=doubt)
            assert do(state, "try_take", name, interval, lead, doubt) == expected_outcome
        else:
            lead, doubt = int(op[1]), int(op[2])  # type: ignore[call-overload]
            reference, expected_outcome = protocol.take_and_try(reference, lead, now, doubt=doubt)
            assert do(state, "take_and_try", name, interval, lead, doubt) == expected_outcome
        if kind != "clock":
            created = True
    assert state.read(name).record == (reference if created else None)
    state.reset(name)  # keep the store small: secantusdb slows down as its documents add up


@given_for_backend(
    interval=intervals_us,
    burst=bursts,
    epoch=epochs_us,
    ops=burst_operations(max_size=25, reads=True, pauses=True),
)
def test_backend_answers_as_the_reference_with_bursts_and_costs(
    backend: Backend, interval: int, burst: int, epoch: int, ops: list[tuple[object, ...]]
) -> None:
    """Bursts, costs and a keep time: every backend answers, and stores, what the reference does."""
    state, clock = backend.clocked()
    name = backend.fresh_name()
    clock[0] = epoch
    keep = 10**12  # a keep time (longer than any test) is sent with every operation: it changes no answer
    reference = protocol.new_record(interval, burst)
    costs: dict[int, int] = {}
    created = False
    for op in ops:
        kind, now = op[0], clock[0]
        if kind == "clock":
            clock[0] = max(0, now + int(op[1]))  # type: ignore[call-overload]
            continue
        if kind == "read":
            snapshot = state.read(name)
            assert snapshot.now == now
            assert snapshot.record == (reference if created else None)
            continue
        if kind in FLAGS:
            reference, step, args, changed = flag_step(reference, op, now)
            assert do(state, step, name, interval, *args, burst=burst, keep_us=keep) is changed
        elif kind == "take":
            cost = 1 + int(op[1]) % burst  # type: ignore[call-overload]
            reference, expected_taken = protocol.take(reference, now, cost)
            assert do(state, "take", name, interval, burst=burst, cost=cost, keep_us=keep) == expected_taken
            costs[expected_taken.ticket] = cost
        elif kind == "try":
            ticket, cost = pick_ticket(int(op[1]), costs, reference.ticket)  # type: ignore[call-overload]
            lead = int(op[2])  # type: ignore[call-overload]
            reference, expected_outcome = protocol.try_start(reference, ticket, lead, now, cost)
            answer = do(
                state, "try_start", name, interval, ticket, lead, burst=burst, cost=cost, keep_us=keep
            )
            assert answer == expected_outcome
        elif kind == "settle":
            ticket, cost = pick_ticket(int(op[1]), costs, reference.ticket)  # type: ignore[call-overload]
            actual = int(op[2]) % (burst + 1)  # type: ignore[call-overload]
            reference, changed = protocol.settle(reference, ticket, cost, actual, now)
            answer = do(state, "settle", name, interval, ticket, cost, actual, burst=burst, keep_us=keep)
            assert answer is changed
        elif kind == "retime":
            ticket = retime_ticket(int(op[1]), reference.pos, reference.ticket)  # type: ignore[call-overload]
            lead = int(op[2])  # type: ignore[call-overload]
            reference, expected_outcome = protocol.retime(reference, ticket, lead, now)
            assert (
                do(state, "retime", name, interval, ticket, lead, burst=burst, keep_us=keep)
                == expected_outcome
            )
        else:
            lead, cost = int(op[1]), 1 + int(op[2]) % burst  # type: ignore[call-overload]
            step = protocol.try_take if kind == "try_take" else protocol.take_and_try
            reference, expected_outcome = step(reference, lead, now, cost)
            if kind == "take_and_try" or isinstance(expected_outcome, Started):
                costs[expected_outcome.ticket] = cost
            assert (
                do(state, kind, name, interval, lead, burst=burst, cost=cost, keep_us=keep)  # type: ignore[arg-type]
                == expected_outcome
            )
        created = True
    assert state.read(name).record == (reference if created else None)
    state.reset(name)  # keep the store small: secantusdb slows down as its documents add up


@given_for_backend(
    interval=intervals_us,
    max_running=max_runnings,
    lease=leases_us,
    epoch=epochs_us,
    ops=lease_operations(max_size=25),
)
def test_backend_answers_as_the_reference_with_leases(
    backend: Backend, interval: int, max_running: int, lease: int, epoch: int, ops: list[tuple[object, ...]]
) -> None:
    """A cap on running jobs: starts take leases, full queues wait; every backend does as the reference."""
    state, clock = backend.clocked()
    name = backend.fresh_name()
    clock[0] = epoch
    terms = {"max_running": max_running, "lease_us": lease, "keep_us": 10**12}
    reference = protocol.new_record(interval, 1, max_running)
    tokens = Tokens()
    created = False
    for op in ops:
        kind, now = op[0], clock[0]
        if kind == "clock":
            clock[0] = max(0, now + int(op[1]))  # type: ignore[call-overload]
            continue
        if kind == "read":
            snapshot = state.read(name)
            assert snapshot.now == now
            assert snapshot.record == (reference if created else None)
            continue
        if kind in FLAGS:
            reference, step, args, changed = flag_step(reference, op, now)
            assert do(state, step, name, interval, *args, **terms) is changed
        elif kind == "take":
            reference, expected_taken = protocol.take(reference, now)
            assert do(state, "take", name, interval, **terms) == expected_taken
        elif kind == "try":
            ticket = 1 + int(op[1]) % (reference.ticket + 1)  # type: ignore[call-overload]
            lead, token = int(op[2]), tokens.of_ticket(ticket)  # type: ignore[call-overload]
            reference, expected_outcome = protocol.try_start(reference, ticket, lead, now, 1, lease, token)
            assert (
                do(state, "try_start", name, interval, ticket, lead, token=token, **terms) == expected_outcome
            )
        elif kind == "retime":
            ticket = retime_ticket(int(op[1]), reference.pos, reference.ticket)  # type: ignore[call-overload]
            lead = int(op[2])  # type: ignore[call-overload]
            reference, expected_outcome = protocol.retime(reference, ticket, lead, now)
            assert do(state, "retime", name, interval, ticket, lead, **terms) == expected_outcome
        elif kind == "release":
            ticket = lease_ticket(int(op[1]), reference.leases, reference.ticket)  # type: ignore[call-overload]
            token = tokens.naming(ticket, reference.leases, op[2])
            reference, released = protocol.release(reference, ticket, now, token)
            assert do(state, "release", name, interval, ticket, token=token, **terms) is released
        elif kind == "renew":
            ticket = lease_ticket(int(op[1]), reference.leases, reference.ticket)  # type: ignore[call-overload]
            token = tokens.naming(ticket, reference.leases, op[2])
            reference, renewed = protocol.renew(reference, ticket, lease, now, token)
            assert do(state, "renew", name, interval, ticket, token=token, **terms) is renewed
        else:
            lead, token = int(op[1]), tokens.take(op[2])  # type: ignore[call-overload]
            step = protocol.try_take if kind == "try_take" else protocol.take_and_try
            reference, expected_outcome = step(reference, lead, now, 1, lease, token)
            assert do(state, kind, name, interval, lead, token=token, **terms) == expected_outcome  # type: ignore[arg-type]
        created = True
    assert state.read(name).record == (reference if created else None)
    state.reset(name)  # keep the store small: secantusdb slows down as its documents add up


def test_max_running_is_fixed_per_queue(backend: Backend) -> None:
    """A queue's cap on running jobs is stored with it: another cap, or none, is refused, changing nothing."""
    state = backend.open()
    name = backend.fresh_name()
    started = do(state, "take_and_try", name, 10_000, 0, max_running=2, lease_us=1_000_000)
    assert isinstance(started, Started)
    before = state.read(name).record
    for other in ({"max_running": 3, "lease_us": 1_000_000}, {}):
        with pytest.raises(ConfigurationError, match="max_running"):
            do(state, "take", name, 10_000, **other)
    assert state.read(name).record == before
    assert before is not None
    assert before.max_running == 2
    assert before.leases[0][0] == started.ticket
    state.reset(name)


def test_pause_and_resume_create_a_missing_record_with_their_terms(backend: Backend) -> None:
    """``set_paused`` creates a missing record with its terms; a mismatch is refused, changing nothing."""
    state, clock = backend.clocked()
    clock[0] = 10**15
    paused, resumed = backend.fresh_name(), backend.fresh_name()
    assert do(state, "set_paused", paused, 20_000, True, burst=3) is True
    assert state.read(paused).record == protocol.Record(
        ticket=1, pos=0, at=protocol.NEVER, interval=20_000, burst=3, due=protocol.NEVER, paused=True,
        paused_at=10**15,
    )  # fmt: skip
    assert do(state, "set_paused", resumed, 20_000, False) is False, (
        "created, not paused: the flag did not change"
    )
    assert state.read(resumed).record == protocol.new_record(20_000)
    before = state.read(paused).record
    for call in (
        lambda: do(state, "set_paused", paused, 10_000, False, burst=3),
        lambda: do(state, "set_paused", paused, 10_000, True, burst=3),
    ):
        with pytest.raises(ConfigurationError, match=r"interval 0\.02 s .* not 0\.01 s"):
            call()
    with pytest.raises(ConfigurationError, match="burst 3"):
        do(state, "set_paused", paused, 20_000, False)
    assert state.read(paused).record == before
    # paused: tickets are handed out, none starts; resumed: the first starts at once
    assert do(state, "take_and_try", paused, 20_000, 0, burst=3) == protocol.Wait(
        1, 10**15 + protocol.US, 10**15
    )
    assert do(state, "set_paused", paused, 20_000, False, burst=3) is True
    assert do(state, "try_start", paused, 20_000, 1, 0, burst=3) == Started(1, 10**15, 10**15)
    state.reset(paused)
    state.reset(resumed)


def test_a_paused_record_with_a_keep_time_is_kept_until_resumed(backend: Backend) -> None:
    """A paused record never expires (forgetting it would forget the pause); resumed, it expires again."""
    state, clock = backend.clocked()
    clock[0] = 10**15
    name = backend.fresh_name()
    keep = 10**9 if backend.kind == "redis" else 5000
    do(state, "take_and_try", name, 1000, 0, keep_us=keep)
    do(state, "set_paused", name, 1000, True, keep_us=keep)
    if isinstance(state, RedisState):
        assert state.client.pttl(state.key(name)) == -1, "paused: no TTL"
        do(state, "set_paused", name, 1000, False, keep_us=keep)
        assert state.client.pttl(state.key(name)) > 0, "resumed: a TTL again"
        state.reset(name)
        return
    clock[0] += 10**9
    state.sweep()
    assert state.names(name) == [name], "paused: kept, however long idle"
    do(state, "set_paused", name, 1000, False, keep_us=keep)
    clock[0] += keep + 1
    state.sweep()
    assert state.names(name) == [], "resumed: gone once idle past the keep time"


def test_burst_mismatch_changes_nothing(backend: Backend) -> None:
    state = backend.open()
    name = backend.fresh_name()
    do(state, "take_and_try", name, 10_000, 0, burst=3)
    before = state.read(name).record
    for call in (
        lambda: do(state, "take", name, 10_000),
        lambda: do(state, "take_and_try", name, 10_000, 0, burst=4),
        lambda: do(state, "try_start", name, 10_000, 1, 0, burst=2),
        lambda: do(state, "retime", name, 10_000, 1, 0),
        lambda: do(state, "set_paused", name, 10_000, True),
    ):
        with pytest.raises(TermsMismatch, match="burst 3") as raised:
            call()
        command = f"ratequeue reset {shlex.quote(redact(state.url))} {name}"
        if backend.kind == "memory":
            command = f"state.reset({name!r})"
        assert command in str(raised.value)
    assert state.read(name).record == before


def test_records_with_a_keep_time_are_listed_and_go_when_idle(backend: Backend) -> None:
    """A record written with ``keep_us`` goes once idle that long past its expiry; the others stay."""
    state, clock = backend.clocked()
    clock[0] = 10**15
    prefix = backend.fresh_name()
    kept, forever = f"{prefix}-kept", f"{prefix}-forever"
    keep = 10**9 if backend.kind == "redis" else 5000  # Redis's TTL runs in real time: 1000 s, not 5 ms
    do(state, "take_and_try", kept, 1000, 0, burst=2, keep_us=keep)
    do(state, "take_and_try", forever, 1000, 0, burst=2)
    assert state.names(prefix) == [forever, kept]
    assert state.names(prefix + "-k") == [kept]
    if isinstance(state, RedisState):
        # PEXPIRE is relative to the script's (fixed) now: expires = now + 2 ms, kept 1000 s after that
        assert 1_000_002 - 1000 < state.client.pttl(state.key(kept)) <= 1_000_002
        assert state.client.pttl(state.key(forever)) == -1
        assert state.sweep() == 0
        return  # expiry in real time: tests/test_redis_client.py
    # expires(record) = slot(ticket) + interval = now + 2 ms; kept until 5 ms after that
    clock[0] += 6999
    state.sweep()
    assert state.names(prefix) == [forever, kept]
    clock[0] += 1
    swept = state.sweep()
    assert backend.kind == "redis" or swept >= 1
    assert state.names(prefix) == [forever]


def test_interval_mismatch_changes_nothing(backend: Backend) -> None:
    state = backend.open()
    name = backend.fresh_name()
    do(state, "take_and_try", name, 10_000, 0)
    before = state.read(name).record
    for call in (
        lambda: do(state, "take", name, 20_000),
        lambda: do(state, "take_and_try", name, 20_000, 0),
        lambda: do(state, "try_start", name, 20_000, 1, 0),
        lambda: do(state, "retime", name, 20_000, 1, 0),
        lambda: do(state, "set_paused", name, 20_000, True),
    ):
        with pytest.raises(TermsMismatch, match=r"interval 0\.01 s .* not 0\.02 s") as raised:
            call()
        assert (raised.value.field, raised.value.stored, raised.value.wanted) == ("interval", 0.01, 0.02)
        # the way out is a command to paste, for this very state (its password masked), said once;
        # a memory state lives in its process, out of a command's reach
        command = f"ratequeue set-interval {shlex.quote(redact(state.url))} {name} 0.02"
        if backend.kind == "memory":
            command = f"state.reset({name!r})"
        assert command in str(raised.value)
        assert str(raised.value).count(command) == 1
        copy = pickle.loads(pickle.dumps(raised.value))
        assert (str(copy), copy.name, copy.way_out) == (str(raised.value), name, raised.value.way_out)
    assert state.read(name).record == before


def test_interval_mismatch_names_the_command_on_asyncio(backend: Backend) -> None:
    """The asyncio states name the same way out as the thread ones."""

    async def main() -> TermsMismatch:
        state = backend.open_async()
        name = backend.fresh_name()
        try:
            await ado(state, "take", name, 10_000)
            with pytest.raises(TermsMismatch) as raised:
                await ado(state, "take", name, 30_000)
            await state.reset(name)
            return raised.value
        finally:
            await state.close()

    error = asyncio.run(main())
    assert error.field == "interval"
    if backend.kind == "memory":
        assert f"state.reset({error.name!r})" in str(error)
    else:
        assert " ratequeue set-interval " in str(error)
        assert str(error).endswith(f" {error.name} 0.03")


def test_reset_and_read(backend: Backend) -> None:
    state = backend.open()
    name = backend.fresh_name()
    assert state.read(name).record is None
    assert state.reset(name) is False
    do(state, "take", name, 1000)
    record = state.read(name).record
    assert record == protocol.Record(ticket=2, pos=0, at=protocol.NEVER, interval=1000, due=protocol.NEVER)
    assert state.reset(name) is True
    assert state.read(name).record is None


def test_the_state_clock_moves(backend: Backend) -> None:
    """Without a test clock, ``now`` comes from the state's own clock and moves forward."""
    state = backend.open()
    name = backend.fresh_name()
    first = do(state, "take_and_try", name, 1000, 0)
    second = do(state, "take_and_try", name, 1000, 10_000_000)
    assert isinstance(first, Started)
    assert isinstance(second, Started)
    assert second.start - first.start >= 1000
    assert second.now >= first.now


def spawn_pool(workers: int) -> ProcessPoolExecutor:
    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))


@pytest.mark.processes
@pytest.mark.timeout(300)  # (its own deadline is 240 s: secantusdb took > 120 s in a CI run on a slow VM)
def test_tickets_are_unique_across_processes(shared_backend: Backend) -> None:
    """8 processes take 500 tickets each (MongoDB: 100), all at once: every ticket distinct, none skipped."""
    name = shared_backend.fresh_name()
    url, each = shared_backend.url, 500
    if shared_backend.kind == "mongodb":
        # a collection of its own: the test server (secantusdb) slows down with the many
        # documents the property tests leave in the shared one; and fewer tickets, as its
        # ~20 ms operations made 4000 of them take 60-120 s of CI's time
        url += f"&collection={name}"
        each = 100
    manager = multiprocessing.get_context("spawn").Manager()
    barrier = manager.Barrier(8)
    with spawn_pool(8) as pool:
        futures = [pool.submit(_workers.take_many, url, name, 1000, each, barrier) for _ in range(8)]
        tickets = [ticket for future in futures for ticket in future.result(timeout=240)]
    manager.shutdown()
    assert sorted(tickets) == list(range(1, 8 * each + 1))


@pytest.mark.processes
def test_racers_on_one_ticket_share_its_one_start(shared_backend: Backend) -> None:
    """8 processes try to start the same ticket at once: one start is recorded, all are told it.

    (Asking again for the latest start is the same grant, so that a client
    re-sending a call whose answer it lost keeps its turn.)
    """
    interval = 10_000_000
    name = shared_backend.fresh_name()
    state = shared_backend.open()
    assert isinstance(do(state, "take_and_try", name, interval, 0), Started)
    ticket = do(state, "take", name, interval).ticket
    answers = race(shared_backend, [(name, interval, ticket, interval)] * 8)
    assert {kind for kind, _ in answers} == {"started"}
    starts = {start for _, start in answers}
    assert len(starts) == 1, "one start, the same for every racer"
    record = state.read(name).record
    assert record is not None
    assert (record.pos, record.at) == (ticket, starts.pop())


@pytest.mark.processes
def test_racers_on_eight_tickets_start_an_interval_apart_in_order(shared_backend: Backend) -> None:
    """8 processes try to start 8 tickets at once: the starts stay spaced and ordered (atomic CAS)."""
    name = shared_backend.fresh_name()
    state = shared_backend.open()
    assert isinstance(do(state, "take_and_try", name, 1000, 0), Started)
    tickets = [do(state, "take", name, 1000).ticket for _ in range(8)]
    answers = race(shared_backend, [(name, 1000, ticket, 10_000_000) for ticket in tickets])
    started = sorted((ticket, start) for ticket, (kind, start) in zip(tickets, answers, strict=True) if start)
    assert started, "the first racer to arrive starts"
    for (_, s1), (_, s2) in itertools.pairwise(started):
        assert s2 - s1 >= 1000, "starts one interval apart, in ticket order"
    assert all(kind in ("started", "passed") for kind, _ in answers)


def race(backend: Backend, calls: list[tuple[str, int, int, int]]) -> list[tuple[str, int | None]]:
    """Run ``try_start(name, interval, ticket, lead)`` for each of ``calls`` in its own process, at once."""
    manager = multiprocessing.get_context("spawn").Manager()
    barrier = manager.Barrier(len(calls))
    with spawn_pool(len(calls)) as pool:
        futures = [pool.submit(_workers.race_try_start, backend.url, *call, barrier) for call in calls]
        answers = [future.result(timeout=120) for future in futures]
    manager.shutdown()
    return answers
