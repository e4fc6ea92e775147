"""Matrix-vector product for batch-1 decode: ``y = x @ weight.T (+ bias)`` for one row of x.

Layout contract::

    x:      [1, K], K contiguous
    weight: [N, K] contiguous (nn.Linear's layout)
    bias:   [N] or None
    y:      [1, N], x's dtype, a new tensor

With one row a linear layer is a pure read of its weight; what decides its time is how close
the read comes to the memory bandwidth. Each program owns ``BLOCK_N`` output features and
streams their rows of ``weight`` once, in ``BLOCK_K`` chunks; products accumulate in fp32 and
round once to x's dtype. The summation order differs from cuBLAS's, so results agree with
``F.linear`` to rounding, not bit for bit.

``silu_mul=True`` is a SwiGLU's gate/up projection and its activation in one pass: weight is
``[2d, K]`` (gate rows, then up rows), y is ``[1, d]``, and a program owns output features
``f`` of both halves (rows ``f`` and ``d + f``), rounds each product to x's dtype and writes
``silu(gate) * up`` rounded as ``activation.silu_and_mul`` does: the same values as the
product followed by that kernel, one launch fewer.

``CONFIGS`` holds the tile shapes ``kernels/bench_gemv.py`` measured best on the H200 for the
Llama-3-8B and Qwen3-8B projections; the model's layers use the kernel for those shapes only
(``model/layers/linear.py``), cuBLAS elsewhere.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenspeed_kernels import precise_math
from tokenspeed_kernels.activation import silu_mul


@triton.jit
def _gemv_kernel(
    X,
    W,
    Bias,
    Y,
    N,
    K,
    stride_wn,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU_MUL: tl.constexpr,  # rows [0, N) are gates, [N, 2N) their ups (module doc)
    PRECISE: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    w_ptrs = W + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    up_ptrs = W + (offs_n + N).to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = (k0 + offs_k) < K
        w = tl.load(w_ptrs + k0, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        if SILU_MUL:
            w_up = tl.load(up_ptrs + k0, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        x = tl.load(X + k0 + offs_k, mask=mask_k, other=0.0)
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
        if SILU_MUL:
            acc_up += tl.sum(w_up.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    y = acc.to(Y.dtype.element_ty)
    if SILU_MUL:
        y = silu_mul(y, acc_up.to(Y.dtype.element_ty), PRECISE)
    tl.store(Y + offs_n, y, mask=mask_n)


# (N, K) -> (BLOCK_N, BLOCK_K, num_warps, num_stages): the best of bench_gemv.py's grid on one
# H200 (bench/results/gemv-h200.json), every one faster than cuBLAS for that shape there.
CONFIGS: dict[tuple[int, int], tuple[int, int, int, int]] = {
    (6144, 4096): (4, 512, 4, 3),  # Llama-3-8B / Qwen3-8B qkv: 14.4 us vs cuBLAS 15.4
    (4096, 4096): (8, 1024, 8, 3),  # o_proj: 10.4 vs 13.5
    (28672, 4096): (16, 512, 4, 1),  # Llama gate_up: 55.7 vs 60.7
    (4096, 14336): (8, 1024, 8, 1),  # Llama down: 29.5 vs 32.3
    (128256, 4096): (8, 512, 4, 3),  # Llama lm_head: 238 vs 248
    (24576, 4096): (16, 512, 8, 3),  # Qwen3 gate_up: 48.2 vs 49.5
    (4096, 12288): (8, 1024, 8, 1),  # Qwen3 down: 25.6 vs 30.2
    (151936, 4096): (8, 512, 4, 3),  # Qwen3 lm_head: 282 vs 297
}
# The same for ``silu_mul=True``, keyed by the weight's [2d, K]; BLOCK_N counts the
# features of one half (a program reads 2 * BLOCK_N rows). ``bench_gemv.py --silu-mul``
# (bench/results/gemv-silu-mul-h200.json) against the product + activation kernel:
SILU_MUL_CONFIGS: dict[tuple[int, int], tuple[int, int, int, int]] = {
    (28672, 4096): (4, 1024, 8, 3),  # Llama gate_up: 56.6 us vs 57.3
    (24576, 4096): (4, 1024, 8, 1),  # Qwen3 gate_up: 49.3 vs 50.4
}
DEFAULT = (8, 512, 4, 3)  # shapes not measured, when called directly


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: tuple[int, int, int, int] | None = None,
    silu_mul: bool = False,
) -> torch.Tensor:
    """``x @ weight.T + bias`` for a one-row ``x``; with ``silu_mul``, the SwiGLU activation
    of that product (no bias) (layout: module doc)."""
    k = x.shape[1]
    rows = weight.shape[0]
    assert x.shape[0] == 1 and weight.shape[1] == k
    assert x.stride(1) == 1 and weight.is_contiguous()
    assert not silu_mul or (bias is None and rows % 2 == 0)
    n = rows // 2 if silu_mul else rows
    configs = SILU_MUL_CONFIGS if silu_mul else CONFIGS
    block_n, block_k, num_warps, num_stages = config or configs.get((rows, k), DEFAULT)
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, y, n, k, weight.stride(0),
        BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None, SILU_MUL=silu_mul,
        PRECISE=precise_math.PRECISE_MATH, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return y
