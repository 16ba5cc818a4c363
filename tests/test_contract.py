"""The backend contract: every state answers exactly as the reference protocol does.

One table of backends (``backend`` in conftest: memory, file, redis, mongodb,
the last two on real servers started by the tests) runs the same suite.
Hypothesis generates operation sequences and clock movements; each backend,
driven with the same ``now`` through its test-only clock, must give the same
answers as :mod:`ratequeue.protocol` and end with the same record.
"""

from __future__ import annotations

import itertools
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest
from hypothesis import given

from ratequeue import protocol
from ratequeue.errors import ConfigurationError
from ratequeue.protocol import Started

from . import _workers
from .backends import Backend
from .strategies import epochs_us, intervals_us, retime_ticket
from .strategies import operations as ops_strategy

operations = ops_strategy(max_size=25, reads=True)


@given(interval=intervals_us, epoch=epochs_us, ops=operations)
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
        elif kind == "take":
            reference, expected_taken = protocol.take(reference, now)
            assert state.take(name, interval) == expected_taken
        elif kind == "try":
            ticket = 1 + int(op[1]) % (reference.ticket + 1)  # type: ignore[call-overload]
            lead = int(op[2])  # type: ignore[call-overload]
            reference, expected_outcome = protocol.try_start(reference, ticket, lead, now)
            assert state.try_start(name, interval, ticket, lead) == expected_outcome
        elif kind == "retime":
            ticket = retime_ticket(int(op[1]), reference.pos, reference.ticket)  # type: ignore[call-overload]
            lead = int(op[2])  # type: ignore[call-overload]
            reference, expected_outcome = protocol.retime(reference, ticket, lead, now)
            assert state.retime(name, interval, ticket, lead) == expected_outcome
        else:
            lead = int(op[1])  # type: ignore[call-overload]
            reference, expected_outcome = protocol.take_and_try(reference, lead, now)
            assert state.take_and_try(name, interval, lead) == expected_outcome
        if kind != "clock":
            created = True
    assert state.read(name).record == (reference if created else None)


def test_interval_mismatch_changes_nothing(backend: Backend) -> None:
    state = backend.open()
    name = backend.fresh_name()
    state.take_and_try(name, 10_000, 0)
    before = state.read(name).record
    for call in (
        lambda: state.take(name, 20_000),
        lambda: state.take_and_try(name, 20_000, 0),
        lambda: state.try_start(name, 20_000, 1, 0),
        lambda: state.retime(name, 20_000, 1, 0),
    ):
        with pytest.raises(ConfigurationError, match=r"interval 0\.01 s .* not 0\.02 s"):
            call()
    assert state.read(name).record == before


def test_reset_and_read(backend: Backend) -> None:
    state = backend.open()
    name = backend.fresh_name()
    assert state.read(name).record is None
    assert state.reset(name) is False
    state.take(name, 1000)
    record = state.read(name).record
    assert record == protocol.Record(ticket=2, pos=0, at=protocol.NEVER, interval=1000)
    assert state.reset(name) is True
    assert state.read(name).record is None


def test_the_state_clock_moves(backend: Backend) -> None:
    """Without a test clock, ``now`` comes from the state's own clock and moves forward."""
    state = backend.open()
    name = backend.fresh_name()
    first = state.take_and_try(name, 1000, 0)
    second = state.take_and_try(name, 1000, 10_000_000)
    assert isinstance(first, Started)
    assert isinstance(second, Started)
    assert second.start - first.start >= 1000
    assert second.now >= first.now


def spawn_pool(workers: int) -> ProcessPoolExecutor:
    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))


@pytest.mark.processes
def test_tickets_are_unique_across_processes(shared_backend: Backend) -> None:
    """8 processes take 500 tickets each, all at once: 4000 distinct tickets, none skipped."""
    name = shared_backend.fresh_name()
    url = shared_backend.url
    if shared_backend.kind == "mongodb":
        # a collection of its own: the test server (secantusdb) slows down with the many
        # documents the property tests leave in the shared one (31 s alone, > 120 s after them)
        url += f"&collection={name}"
    manager = multiprocessing.get_context("spawn").Manager()
    barrier = manager.Barrier(8)
    with spawn_pool(8) as pool:
        futures = [pool.submit(_workers.take_many, url, name, 1000, 500, barrier) for _ in range(8)]
        tickets = [ticket for future in futures for ticket in future.result(timeout=240)]
    manager.shutdown()
    assert sorted(tickets) == list(range(1, 4001))


@pytest.mark.processes
def test_racers_on_one_ticket_share_its_one_start(shared_backend: Backend) -> None:
    """8 processes try to start the same ticket at once: one start is recorded, all are told it.

    (Asking again for the latest start is the same grant, so that a client
    re-sending a call whose answer it lost keeps its turn.)
    """
    interval = 10_000_000
    name = shared_backend.fresh_name()
    state = shared_backend.open()
    assert isinstance(state.take_and_try(name, interval, 0), Started)
    ticket = state.take(name, interval).ticket
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
    assert isinstance(state.take_and_try(name, 1000, 0), Started)
    tickets = [state.take(name, 1000).ticket for _ in range(8)]
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
