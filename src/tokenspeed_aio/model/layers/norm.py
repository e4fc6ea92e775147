"""RMSNorm, optionally fused with the residual add that precedes it (as vLLM does).

On CUDA both run as one Triton kernel (``tokenspeed_kernels.rmsnorm``, same rounding);
elsewhere as the torch ops below. A decoder layer's norms go through the projection after them
(``linear.norm_linear``), which at batch 1 runs them inside the product instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from tokenspeed_kernels.fp8 import SplitKPartials


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size))

    def forward(
        self, x: torch.Tensor | SplitKPartials, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``norm(x)``; with ``residual``: ``(norm(x + residual), x + residual)``.

        The add happens in the activation dtype and the statistics in float32, as HF does,
        so results match the reference bit for bit in float32 and closely in bf16.
        """
        if x.is_cuda:  # x may be an FP8 product's partial sums, which the kernel adds
            from tokenspeed_kernels import rmsnorm

            if residual is None:
                return rmsnorm.rms_norm(x, self.weight, self.eps)
            return rmsnorm.fused_add_rms_norm(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
            residual = x
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * x32.to(x.dtype)
        return out if residual is None else (out, residual)
