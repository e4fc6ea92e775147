"""The attention layer: hands this layer's q/k/v to the forward's attention backend.

Projections live in the model's attention block; the q/k norms (Qwen3) and RoPE are applied
by the backend (model/attention/) with the cache write, which a kernel backend fuses into one
launch (or, at batch 1 without q/k norms, the qkv product's epilogue, and the layer calls
``attend``); the attention math lives there too. The backend is chosen at startup and passed in
``ctx`` so a layer never looks it up globally.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    import torch

    from tokenspeed_aio.model.attention.base import QKNorm, Rope
    from tokenspeed_aio.model.forward_context import ForwardContext


class Attention(nn.Module):
    def __init__(self, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx  # selects this layer's KV cache pair in ctx

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ctx: ForwardContext,
        rope: Rope | None = None,
        qk_norm: QKNorm | None = None,
    ) -> torch.Tensor:
        """q [n, Hq * D], k/v [n, Hkv * D] (this rank's heads) -> [n, Hq * D]; ``qk_norm``
        norms q and k per head, then ``rope`` rotates them (the backend's contract)."""
        return ctx.backend.forward(q, k, v, self.layer_idx, ctx, rope, qk_norm)

    def attend(self, q: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The attention alone, for a q already rotated whose k/v the caller already wrote
        into this layer's cache (a ``kv_store.StoredKVBackend``'s ``attend``)."""
        return ctx.backend.attend(q, self.layer_idx, ctx)
