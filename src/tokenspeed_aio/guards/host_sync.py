"""No host synchronization on the data plane's per-round path.

After startup the data plane arms torch's sync-debug mode
(``TOKENSPEED_DATA_PLANE_SYNC_DEBUG=warn|error``, default warn): every hidden
device->host wait on the per-round path is reported (or raised). A deliberate wait
off that path goes inside ``allow_host_sync()``. Host->device metadata goes through
``host_to_device``: a non-blocking copy from pinned memory.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import numpy as np
import torch

SYNC_DEBUG_ENV = "TOKENSPEED_DATA_PLANE_SYNC_DEBUG"
_MODES = {"warn": 1, "error": 2}


def sync_debug_mode() -> int:
    value = os.environ.get(SYNC_DEBUG_ENV, "warn").lower()
    if value not in _MODES:
        raise ValueError(f"{SYNC_DEBUG_ENV} must be 'warn' or 'error', got {value!r}")
    return _MODES[value]


def arm_sync_debug(device: torch.device) -> None:
    """Called once the rank finished startup; there is no switch to leave it off."""
    if device.type == "cuda":
        torch.cuda.set_sync_debug_mode(sync_debug_mode())


@contextlib.contextmanager
def allow_host_sync() -> Iterator[None]:
    """A deliberate, low-rate host wait (startup, a control operation)."""
    if not torch.cuda.is_available():
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def host_to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """Copy host metadata to the device without a host wait.

    On CUDA the array goes through pinned memory from torch's caching host allocator,
    which does not hand that buffer out again before the copy has run, so the caller
    may reuse its own array at once.
    """
    tensor = torch.from_numpy(array)
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
