"""SwiGLU feed-forward block: down(silu(gate(x)) * up(x)), one all-reduce per call.

The activation is the gate/up projection's epilogue (``act_silu_mul``): at batch 1 on CUDA
one Triton product computes both and writes only the activation. The block takes the norm
before it, so that product can run the norm (and the residual add) as its prologue. With an
FP8 down projection the activation of more rows comes quantized for it, from the SwiGLU's
launch (``fp8_products.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from tokenspeed_aio.model.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from tokenspeed_aio.model.layers.norm import RMSNorm


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size], act_silu_mul=True
        )
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size)

    def forward(
        self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mlp(norm(h)), h)`` with ``h = x + residual`` (``x`` when residual is None)."""
        activation, residual = self.gate_up_proj.after_norm(
            norm, x, residual, feeds=self.down_proj.fp8_weight
        )
        return self.down_proj(activation), residual
