"""When forwards ran on the device: CUDA events at each forward's start and end, so the
GPU's idle time between forwards (the overlap's target: near zero) can be measured.

Recording two events per forward costs a few microseconds of CPU; they are read only
when asked (a low-rate, deliberate host wait). On CPU there is no device timeline.
"""

from __future__ import annotations

import itertools
from collections import deque

import torch

from tokenspeed_aio.guards.host_sync import allow_host_sync


class ForwardTimeline:
    def __init__(self, device: torch.device, capacity: int = 4096) -> None:
        self.enabled = device.type == "cuda"
        self._spans: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque(maxlen=capacity)
        self._start: torch.cuda.Event | None = None

    def forward_started(self) -> None:
        if self.enabled:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()

    def forward_ended(self) -> torch.cuda.Event | None:
        """Record the end (after the result copies); the commit waits on this event."""
        if not self.enabled:
            return None
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._spans.append((self._start, end))
        return end

    def summary(self) -> dict[str, float] | None:
        """Busy and idle milliseconds over the recorded forwards, then forget them."""
        if not self.enabled or len(self._spans) < 2:
            return None
        spans = list(self._spans)
        self._spans.clear()
        with allow_host_sync():
            spans[-1][1].synchronize()
            busy = sum(s.elapsed_time(e) for s, e in spans)
            idle = sum(max(0.0, e.elapsed_time(s)) for (_, e), (s, _) in itertools.pairwise(spans))
        return {"forwards": len(spans), "busy_ms": busy, "idle_ms": idle}
