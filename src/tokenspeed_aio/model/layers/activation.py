"""SwiGLU's gate: silu(gate) * up on a fused [.., 2 * d] projection; one Triton kernel on
CUDA (``tokenspeed_kernels.activation``, torch's rounding)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if x.is_cuda:
        from tokenspeed_kernels.activation import silu_and_mul as kernel

        return kernel(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
