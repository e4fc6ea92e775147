"""SwiGLU feed-forward block: down(silu(gate(x)) * up(x)), one all-reduce per call.

The activation is the gate/up projection's epilogue (``act_silu_mul``): at batch 1 on CUDA
one Triton product computes both and writes only the activation.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenspeed_aio.model.layers.linear import MergedColumnParallelLinear, RowParallelLinear


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size]
        )
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x, act_silu_mul=True))
