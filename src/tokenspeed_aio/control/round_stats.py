"""Per-round control-plane timing: how long the round's own Python ran (excluding
the time it awaited messages or commits), against the number of running requests.

Two clocks: the loop thread's CPU time (what the round itself computed) and its wall
time (that plus any wait for the GIL while the forward thread runs Python). Both leave
out the awaited commits; the CPU clock also the other tasks the loop ran meanwhile."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RoundSample:
    cpu_seconds: float  # the round's own work: admission, planning, dispatch, commit, tail
    running: int
    batch_tokens: int
    wall_seconds: float  # the same span on the wall clock: CPU plus GIL waits


class RoundStats:
    def __init__(self, capacity: int = 100_000) -> None:
        self.samples: deque[RoundSample] = deque(maxlen=capacity)
        self.rounds = 0
        self._start = (0.0, 0.0)  # (wall, thread CPU) clocks at the round's start
        self._waited = [0.0, 0.0]

    @staticmethod
    def clocks() -> tuple[float, float]:
        return time.perf_counter(), time.thread_time()

    def begin(self) -> None:
        self._start = self.clocks()
        self._waited = [0.0, 0.0]

    def waited(self, since: tuple[float, float]) -> None:
        """An await that started at ``since`` (``clocks()``) just ended."""
        wall, cpu = self.clocks()
        self._waited[0] += wall - since[0]
        self._waited[1] += cpu - since[1]

    def end(self, running: int, batch_tokens: int) -> None:
        self.rounds += 1
        if batch_tokens:
            wall, cpu = self.clocks()
            wall -= self._start[0] + self._waited[0]
            cpu -= self._start[1] + self._waited[1]
            self.samples.append(RoundSample(cpu, running, batch_tokens, wall))
