"""Batch-invariant mode (``--enable-deterministic-inference``): every product, attention and
sampling step computes a row's result by the same sequence of operations whatever else
is in the batch, so a request's greedy tokens and logprobs are bit-identical alone, in a
batch of 64, after a prefix hit or across prefill chunks.

Why plain kernels are not: a BLAS (MKL on CPU, cuBLAS) picks its algorithm by the
problem's shape, and for a small row count (GEMV paths, split-K) that changes how a row's
sum is ordered -- measured on this project's CPU build, a row of ``x[:M] @ W.T`` differs
in its last bits between M = 1, 2 and 64 (docs/design/determinism.md).

How this mode avoids it: a product runs in fixed-shape row tiles (``ROW_TILE`` rows, the
last tile zero-padded) -- every call the library sees has the same shape, and a row's
result does not depend on its position in a tile. On CUDA the tile is one Triton
``skinny_gemm`` launch of 64 rows with one fixed config and no split-K. Attention and
sampling have their own invariant paths (model/attention/invariant.py; the sampler's
reductions are per row).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_enabled = False

CPU_ROW_TILE = 16  # the smallest tile whose rows matched a 64-row product bit for bit
CUDA_ROW_TILE = 64  # skinny_gemm's largest row block
# skinny_gemm's config in this mode, whatever the shape: (BLOCK_N, BLOCK_K, SPLIT_K=1, warps,
# stages). One config for every row count is what makes a row's sum order fixed.
CUDA_CONFIG = (64, 128, 1, 4, 3)


def set_batch_invariant(enabled: bool) -> None:
    """Set once per process at startup (build_device_side), before the model runs."""
    global _enabled
    _enabled = enabled


def batch_invariant() -> bool:
    return _enabled


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """``F.linear(x, weight, bias)`` with each row's result independent of the others."""
    tile = CUDA_ROW_TILE if x.is_cuda else CPU_ROW_TILE
    rows = x.shape[0]
    if rows == 0:
        return F.linear(x, weight, bias)
    pad = (-rows) % tile
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    if x.is_cuda and x.element_size() == 2:
        from tokenspeed_kernels.skinny_gemm import skinny_gemm

        parts = [
            skinny_gemm(x[i : i + tile], weight, bias, CUDA_CONFIG)
            for i in range(0, x.shape[0], tile)
        ]
    else:
        parts = [F.linear(x[i : i + tile], weight, bias) for i in range(0, x.shape[0], tile)]
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out[:rows] if pad else out
