"""A memory state that answers as a server across a slow network would, for tests of clock offsets."""

from __future__ import annotations

import time

from ratequeue.core.operation import Operation
from ratequeue.core.protocol import Answer
from ratequeue.state.memory import MemoryState


class FarMemory(MemoryState):
    """A memory store whose clock is not read beside the caller's, so that each answer only
    bounds the clock offset (as a server's does), and whose every answer comes back ``delay``
    seconds (20 ms) after the state read its clock. It counts the calls it answered."""

    def __init__(self, store: str = "", *, delay: float = 0.02) -> None:
        super().__init__(store, private=not store)
        self.delay = delay
        self.calls = 0
        self.reads_monotonic = False  # as a server's clock: read only in its answers

    def local_now(self) -> float | None:
        return None

    def _answer_late(self, answer: Answer) -> Answer:
        self.calls += 1
        time.sleep(self.delay)  # the answer's way back, after the state read its clock
        return answer

    def _execute(self, op: Operation) -> Answer:
        answer = super()._execute(op)
        return self._answer_late(answer) if op.kind in ("take_and_try", "try_start", "retime") else answer
