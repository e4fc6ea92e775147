"""The torch profiler on the forward thread, the thread that issues the device work
(``/start_profile``, ``/stop_profile``). Started there, it records that thread's ops and
kernel launches (and the device's kernels on CUDA); a trace per rank is written as a
Chrome trace (``chrome://tracing``, Perfetto) into the requested directory."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from tokenspeed_aio.errors import InvalidRequestError, RequestConflictError
from tokenspeed_aio.guards.host_sync import allow_host_sync
from tokenspeed_aio.wire.control import StartProfile

logger = logging.getLogger(__name__)

ACTIVITIES = {
    "CPU": torch.profiler.ProfilerActivity.CPU,
    "GPU": torch.profiler.ProfilerActivity.CUDA,
}


class ForwardProfiler:
    def __init__(self, device: torch.device, rank: int) -> None:
        self.device = device
        self.rank = rank
        self._profile: torch.profiler.profile | None = None
        self._dir: Path | None = None
        self._steps_left: int | None = None
        self.last_trace: str | None = None

    def start(self, op: StartProfile) -> None:
        if self._profile is not None:
            raise RequestConflictError("the profiler is already running; stop it first")
        unknown = [a for a in op.activities if a not in ACTIVITIES]
        if unknown:
            raise InvalidRequestError(f"activities: unknown {unknown}; choose from CPU, GPU")
        activities = [ACTIVITIES[a] for a in op.activities]
        if self.device.type != "cuda":
            activities = [a for a in activities if a is ACTIVITIES["CPU"]] or [ACTIVITIES["CPU"]]
        out = Path(op.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        self._dir = out
        self._steps_left = op.num_steps
        self._profile = torch.profiler.profile(
            activities=activities, record_shapes=op.record_shapes, with_stack=False
        )
        self._profile.start()
        logger.info("profiling the forward thread into %s", out)

    def step(self) -> None:
        """After each forward: a profile of num_steps forwards stops by itself."""
        if self._steps_left is None or self._profile is None:
            return
        self._steps_left -= 1
        if self._steps_left <= 0:
            self.last_trace = self._finish()

    def stop(self) -> str:
        if self._profile is None:
            if self.last_trace is not None:  # stopped by itself after num_steps
                trace, self.last_trace = self.last_trace, None
                return f"the profile had stopped after its steps; trace: {trace}"
            raise RequestConflictError("the profiler is not running")
        return f"trace: {self._finish()}"

    def _finish(self) -> str:
        with allow_host_sync():
            self._profile.stop()
            path = self._dir / f"trace-rank{self.rank}-{time.strftime('%Y%m%d-%H%M%S')}.json"
            self._profile.export_chrome_trace(str(path))
        self._profile = None
        self._steps_left = None
        logger.info("profile written to %s", path)
        return str(path)
