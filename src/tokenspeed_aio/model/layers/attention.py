"""The attention layer: hands this layer's q/k/v to the forward's attention backend.

Projections, q/k norms and RoPE live in the model's attention block; cache writes and
the attention math live in the backend (model/attention/), chosen at startup and passed
in ``ctx`` so a layer never looks it up globally.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    import torch

    from tokenspeed_aio.model.forward_context import ForwardContext


class Attention(nn.Module):
    def __init__(self, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx  # selects this layer's KV cache pair in ctx

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """q [n, Hq * D], k/v [n, Hkv * D] (this rank's heads) -> [n, Hq * D]."""
        return ctx.backend.forward(q, k, v, self.layer_idx, ctx)
