"""A memory state that answers as a server across a slow network would, for tests of clock offsets."""

from __future__ import annotations

import time

from ratequeue.protocol import Outcome
from ratequeue.state.base import Terms
from ratequeue.state.memory import MemoryState


class FarMemory(MemoryState):
    """A memory store whose clock is not read beside the caller's, so that each answer only
    bounds the clock offset (as a server's does), and whose every answer comes back ``delay``
    seconds (20 ms) after the state read its clock. It counts the calls it answered."""

    def __init__(self, store: str = "", *, delay: float = 0.02) -> None:
        super().__init__(store, private=not store)
        self.delay = delay
        self.calls = 0

    def local_now(self) -> float | None:
        return None

    def _answer_late(self, answer: Outcome) -> Outcome:
        self.calls += 1
        time.sleep(self.delay)  # the answer's way back, after the state read its clock
        return answer

    def _take_and_try(self, name: str, terms: Terms, lead_us: int, cost: int) -> Outcome:
        return self._answer_late(super()._take_and_try(name, terms, lead_us, cost))

    def _try_start(self, name: str, terms: Terms, ticket: int, lead_us: int, cost: int) -> Outcome:
        return self._answer_late(super()._try_start(name, terms, ticket, lead_us, cost))

    def _retime(self, name: str, terms: Terms, ticket: int, lead_us: int) -> Outcome:
        return self._answer_late(super()._retime(name, terms, ticket, lead_us))
