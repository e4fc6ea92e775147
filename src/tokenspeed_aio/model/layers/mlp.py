"""SwiGLU feed-forward block: down(silu(gate(x)) * up(x)), one all-reduce per call."""

from __future__ import annotations

import torch
from torch import nn

from tokenspeed_aio.model.layers.activation import SiluAndMul
from tokenspeed_aio.model.layers.linear import MergedColumnParallelLinear, RowParallelLinear


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size]
        )
        self.act_fn = SiluAndMul()
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))
