"""The retraction snapshot pool's slot-state half: per entry, what a request-pool slot
holds for its owner besides KV -- the future token (the slot's last sampled token, which
its next decode reads on the device), its sampling settings and, when it has penalties,
its penalty rows (output token counts, prompt presence). The tail pages are host pages
(host_pool.py).

Token history is not in it: the control plane keeps every request's tokens. Nor is a
constrained request's grammar matcher: it lives on the request in the control plane
(control/grammar.py), advanced by the commit, and survives a retraction as it is.

Exports ride the write stream, imports the load stream; an entry is reused only after the
restore that read it was acknowledged.
"""

from __future__ import annotations

import torch

from tokenspeed_aio.model.sampling.state import SamplingState, SavedSlot


class SlotStates:
    def __init__(self, num_entries: int, vocab_size: int, pinned: bool) -> None:
        self.pinned = pinned
        self.vocab_size = vocab_size
        self.last = torch.zeros(max(num_entries, 1), dtype=torch.int64, pin_memory=pinned)
        self._saved: list[SavedSlot | None] = [None] * num_entries
        # entry -> (output counts, prompt mask) host rows; allocated on first use
        self._penalty: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def export(
        self, entry: int, slot: int, sampling: SamplingState, last_sampled: torch.Tensor
    ) -> None:
        """Copy ``slot``'s state into ``entry`` (enqueued on the current stream)."""
        self.last[entry].copy_(last_sampled[slot], non_blocking=True)
        saved = self._saved[entry] = sampling.save_slot(slot)
        if saved.device_penalty:
            counts, mask = self._penalty_rows(entry)
            counts.copy_(sampling.output_counts[slot], non_blocking=True)
            mask.copy_(sampling.prompt_mask[slot], non_blocking=True)

    def restore(
        self, entry: int, slot: int, sampling: SamplingState, last_sampled: torch.Tensor
    ) -> None:
        """Copy ``entry`` into ``slot`` (enqueued on the current stream)."""
        saved = self._saved[entry]
        self._saved[entry] = None
        last_sampled[slot].copy_(self.last[entry], non_blocking=True)
        sampling.load_slot(slot, saved)
        if saved.device_penalty:
            counts, mask = self._penalty[entry]
            sampling.output_counts[slot].copy_(counts, non_blocking=True)
            sampling.prompt_mask[slot].copy_(mask, non_blocking=True)

    def _penalty_rows(self, entry: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self._penalty.get(entry)
        if rows is None:
            v = self.vocab_size
            rows = self._penalty[entry] = (
                torch.empty(v, dtype=torch.int32, pin_memory=self.pinned),
                torch.empty(v, dtype=torch.bool, pin_memory=self.pinned),
            )
        return rows
