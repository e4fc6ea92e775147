"""logit_bias: per slot, up to MAX_LOGIT_BIAS (token id, bias) pairs added to the logits
before any choice (after the raw logprobs, which report the model's own distribution,
as vLLM does).

The tables are allocated the first time a slot with a bias is set ([max_slots, W] ids and
values, a few MB at 256 slots), written on the host and copied to the device per dirty
slot at the round's gather, like the other sampling tables.
"""

from __future__ import annotations

import numpy as np
import torch

from tokenspeed_aio.sampling_params import MAX_LOGIT_BIAS


class LogitBiasTable:
    def __init__(self, max_slots: int, device: torch.device) -> None:
        self.max_slots = max_slots
        self.device = device
        self._count = np.zeros(max_slots, np.int32)  # biased ids per slot (host)
        self._ids: np.ndarray | None = None
        self._values: np.ndarray | None = None
        self._dev_ids: torch.Tensor | None = None
        self._dev_values: torch.Tensor | None = None
        self._dirty: set[int] = set()

    def set_slot(self, slot: int, bias: dict[int, float] | None) -> None:
        if not bias and not self._count[slot]:
            return
        self._allocate()
        assert self._ids is not None and self._values is not None
        self._ids[slot] = -1
        self._values[slot] = 0.0
        items = list((bias or {}).items())
        self._count[slot] = len(items)
        if items:
            self._ids[slot, : len(items)] = [t for t, _ in items]
            self._values[slot, : len(items)] = [b for _, b in items]
        self._dirty.add(slot)

    def biased(self, rows: np.ndarray) -> np.ndarray:
        return self._count[rows] > 0

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' (ids, values), [B, W] each, on the device."""
        self._flush()
        assert self._dev_ids is not None and self._dev_values is not None
        return self._dev_ids.index_select(0, slots), self._dev_values.index_select(0, slots)

    def _allocate(self) -> None:
        if self._ids is None:
            self._ids = np.full((self.max_slots, MAX_LOGIT_BIAS), -1, np.int64)
            self._values = np.zeros((self.max_slots, MAX_LOGIT_BIAS), np.float32)
            self._dev_ids = torch.from_numpy(self._ids.copy()).to(self.device)
            self._dev_values = torch.from_numpy(self._values.copy()).to(self.device)

    def _flush(self) -> None:
        if not self._dirty:
            return
        assert self._ids is not None and self._values is not None
        assert self._dev_ids is not None and self._dev_values is not None
        dirty = np.fromiter(sorted(self._dirty), np.int64, len(self._dirty))
        self._dirty.clear()
        index, ids, values = (
            _to_device(a, self.device) for a in (dirty, self._ids[dirty], self._values[dirty])
        )
        self._dev_ids.index_copy_(0, index, ids)
        self._dev_values.index_copy_(0, index, values)


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    host = torch.from_numpy(np.ascontiguousarray(array))
    if device.type == "cuda":  # a fresh pinned block: the host rows may change at once
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device, copy=True)


def apply_logit_bias(logits: torch.Tensor, batch) -> torch.Tensor:
    """``logits[row, id] += bias`` for every row's pairs (padding adds 0 to token 0)."""
    ids, values = batch.logit_bias_ids, batch.logit_bias_values
    return logits.scatter_add(1, ids.clamp(min=0), values)
