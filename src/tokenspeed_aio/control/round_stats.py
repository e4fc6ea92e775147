"""Per-round control-plane timing: how long the round's own Python ran (excluding
the time it awaited messages or commits), against the number of running requests."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RoundSample:
    cpu_seconds: float  # the round's own work: admission, planning, dispatch, commit, tail
    running: int
    batch_tokens: int


class RoundStats:
    def __init__(self, capacity: int = 100_000) -> None:
        self.samples: deque[RoundSample] = deque(maxlen=capacity)
        self.rounds = 0
        self._start = 0.0
        self._waited = 0.0

    def begin(self) -> None:
        self._start = time.perf_counter()
        self._waited = 0.0

    def waited(self, seconds: float) -> None:
        self._waited += seconds

    def end(self, running: int, batch_tokens: int) -> None:
        self.rounds += 1
        if batch_tokens:
            cpu = time.perf_counter() - self._start - self._waited
            self.samples.append(RoundSample(cpu, running, batch_tokens))
