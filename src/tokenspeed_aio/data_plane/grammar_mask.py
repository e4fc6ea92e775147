"""Token bitmasks of a batch's constrained rows, filled from their grammar matchers on
the forward thread and applied to the logits before sampling (xgrammar's kernels,
on CPU and CUDA alike).

Matchers ride the plan's rows; the commit advances them, and a dispatch with one
commits the queue first, so the fill here always reads the state after the last
committed token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tokenspeed_aio.guards.host_sync import host_to_device
from tokenspeed_aio.scheduler.plan import ScheduledRow


@dataclass(frozen=True, slots=True)
class TokenBitmask:
    bitmask: torch.Tensor  # [num_sample_rows, ceil(vocab / 32)] int32 on the logits' device
    rows: torch.Tensor  # [n] int32 on that device: the constrained rows among the sampling rows
    vocab_size: int

    def apply(self, logits: torch.Tensor) -> None:
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(
            logits, self.bitmask, vocab_size=self.vocab_size, indices=self.rows
        )


def fill_token_bitmask(
    sample_rows: Sequence[ScheduledRow], vocab_size: int, device: torch.device
) -> TokenBitmask | None:
    """None when no sampling row is constrained (the common case costs one scan)."""
    rows = [
        i
        for i, row in enumerate(sample_rows)
        if row.grammar is not None and not row.grammar.is_terminated()
    ]
    if not rows:
        return None
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(sample_rows), vocab_size)
    for i in rows:
        sample_rows[i].grammar.fill_next_token_bitmask(bitmask, i)
    return TokenBitmask(
        host_to_device(bitmask.numpy(), device),
        host_to_device(np.asarray(rows, np.int32), device),
        vocab_size,
    )


def warm_up_bitmask_kernel(vocab_size: int, device: torch.device) -> None:
    """Compile xgrammar's CUDA apply kernel at startup, not under the first constrained batch.

    Triton specializes its row count on divisibility by 16 (and, in older releases, on
    being 1), so one, two and sixteen constrained rows cover every variant serving meets.
    """
    import xgrammar as xgr

    for n in (1, 2, 16):
        bitmask = xgr.allocate_token_bitmask(n, vocab_size)
        TokenBitmask(
            host_to_device(bitmask.numpy(), device),
            host_to_device(np.arange(n, dtype=np.int32), device),
            vocab_size,
        ).apply(torch.zeros(n, vocab_size, dtype=torch.float32, device=device))
