"""FP8 (e4m3) products of two or more rows: ``y = dq(xq) @ dq(wq).T (+ bias)`` on quantized
activations (``fp8.py``'s numerics; ``fp8_quant.py`` or a fused producer quantizes x).

Layout contract::

    xq:     [M, K] float8_e4m3fn, K contiguous; sx: its scales ([M], [M, ceil(K/128)] with
            block weights, or a static [1])
    weight: ``fp8.Fp8Weight`` ([N, K] e4m3, per-row or 128 x 128 block scales)
    bias:   [N] or None
    y:      [M, N] of ``out_dtype``, a new tensor

Two implementations, picked per (N, K, block, row bucket) by the device's ``fp8_gemm``
table (``tuning.py``, written by ``kernels/bench_fp8_gemm.py``):

- Triton: ``skinny_gemm``'s kernel with e4m3 operands (Hopper's FP8 MMA, fp32 sums): the
  weight is the MMA's M side, x's rows pad to BLOCK_M, and rows beyond one tile make a
  third grid axis. Per-row scales multiply the sums once (before any split-K sum); block
  scales need BLOCK_K = 128 and scale each chunk's product by its weight block's and x's
  group's scales.
- ``torch._scaled_mm`` (cuBLASLt/CUTLASS) with row-wise scales: per-row weight scales only.

A shape missing from the table takes ``default_config``: the Triton kernel up to 64 rows,
``torch._scaled_mm`` above where it applies (every GPU without a table gets that).

``fp8_gemm_silu_mul`` is a SwiGLU's gate/up product (weight ``[2d, K]``, per-row scales) with
the activation as the Triton kernel's epilogue (``skinny_gemm``'s ``silu_mul``: y is ``[M, d]``,
the values of the plain product followed by ``activation.silu_and_mul``), which also writes
each row's amax over every program's features, so ``fp8_quant.quantize_by_chunk_amax``
quantizes the activation for the down product with no SwiGLU launch between. Its tiles come
from the device's ``fp8_gemm_silu_mul`` table (``silu_mul_config``, keyed by the weight's
[2d, K] and the row bucket, BLOCK_N counting one half's features), written by
``kernels/bench_fp8_swiglu.py`` where that chain measured faster than the product, the
SwiGLU launch and the quantizing launch; elsewhere the engine takes those three.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import triton

from tokenspeed_kernels import fp8, pdl, precise_math, tuning
from tokenspeed_kernels.skinny_gemm import _peels, _skinny_gemm_kernel, sum_partials

MAX_BUCKET = 8192  # row buckets: 16, 32, 64, 128, ..., 8192 (more rows share the last)


def m_bucket(m: int) -> int:
    """The row bucket of a ``fp8_gemm`` key: the next power of two from 16, at most 8192."""
    return min(max(16, triton.next_power_of_2(m)), MAX_BUCKET)


def configs(
    device: torch.device | None = None,
) -> Mapping[tuple[int, int, bool, int], tuple[int | bool, ...]]:
    """``device``'s (N, K, block, m_bucket) -> (scaled_mm, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K,
    num_warps, num_stages). Empty where not measured."""
    return tuning.table("fp8_gemm", device)


def default_config(m: int, block: bool) -> tuple[int | bool, ...]:
    if m <= 64:
        return (False, max(16, triton.next_power_of_2(m)), 64, 128, 1, 4, 3)
    return (not block, 64, 128, 128, 1, 4, 3)


def config_for(m: int, weight: fp8.Fp8Weight, device) -> tuple[int | bool, ...]:
    key = (*weight.shape, weight.block, m_bucket(m))
    return configs(device).get(key) or default_config(m, weight.block)


def fp8_gemm(
    xq: torch.Tensor,
    sx: torch.Tensor,
    weight: fp8.Fp8Weight,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    config: tuple[int | bool, ...] | None = None,
    defer_sum: bool = False,
) -> torch.Tensor | fp8.SplitKPartials:
    """The product of the module doc; ``config`` overrides the table's. ``defer_sum``: a
    split-K product without bias returns its partial sums (``fp8.SplitKPartials``) for the
    next kernel to add, instead of launching their sum."""
    m, k = xq.shape
    n = weight.shape[0]
    assert xq.dtype == fp8.FP8 and xq.stride(1) == 1 and weight.shape[1] == k
    scaled_mm, *tiles = config or config_for(m, weight, xq.device)
    if scaled_mm:
        assert not weight.block, "torch._scaled_mm takes per-row weight scales"
        scale_a = sx.reshape(-1, 1).float().expand(m, 1).contiguous()
        return torch._scaled_mm(
            xq, weight.q.t(), scale_a=scale_a, scale_b=weight.scale.view(1, n), bias=bias,
            out_dtype=out_dtype,
        )  # fmt: skip
    return _triton(xq, sx, weight, bias, out_dtype, tiles, defer_sum and bias is None)


def silu_mul_configs(device: torch.device | None = None) -> Mapping[tuple[int, int, int], tuple]:
    """``device``'s (N, K, m_bucket) -> (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of
    ``fp8_gemm_silu_mul`` (module doc). Empty where not measured."""
    return tuning.table("fp8_gemm_silu_mul", device)


def silu_mul_config(m: int, weight: fp8.Fp8Weight, device) -> tuple[int | bool, ...] | None:
    """``fp8_gemm_silu_mul``'s config for ``m`` rows of gate/up ``weight`` from the device's
    table, or None where the fused chain was not measured faster (module doc)."""
    if weight.block:
        return None
    tiles = silu_mul_configs(device).get((*weight.shape, m_bucket(m)))
    if tiles is None:
        return None
    block_m, block_n, block_k, num_warps, num_stages = tiles
    return (False, block_m, block_n, block_k, 1, num_warps, num_stages)


def fp8_gemm_silu_mul(
    xq: torch.Tensor,
    sx: torch.Tensor,
    weight: fp8.Fp8Weight,
    out_dtype: torch.dtype,
    config: tuple[int | bool, ...],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``silu_and_mul(fp8_gemm(xq, sx, weight))`` [M, d], each row's amax over each
    program's ``config`` BLOCK_N features [M, cdiv(d, BLOCK_N)]): one launch (module doc)."""
    m, k = xq.shape
    rows = weight.shape[0]
    assert xq.dtype == fp8.FP8 and xq.stride(1) == 1 and weight.shape[1] == k and rows % 2 == 0
    assert not weight.block, "the fused SwiGLU takes per-row weight scales"
    _, block_m, block_n, block_k, split_k, num_warps, num_stages = config
    assert split_k == 1, "the fused SwiGLU's epilogue needs whole sums"
    n = rows // 2
    y = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    amax = torch.empty((m, triton.cdiv(n, block_n)), dtype=torch.float32, device=xq.device)
    stride_sx = 0 if sx.dim() == 1 and sx.shape[0] == 1 else sx.stride(0)
    even = n % block_n == 0 and k % block_k == 0
    grid = (amax.shape[1], 1, triton.cdiv(m, block_m))
    _skinny_gemm_kernel[grid](
        xq, weight.q, weight.q, y, weight.scale, sx, 0, stride_sx, m, n, k, xq.stride(0),
        y.stride(0), triton.cdiv(k, block_k) * block_k,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PARTIAL=False, EVEN=even,
        PEEL=_peels(xq, block_m, block_n, block_k, num_stages, True), FP8=1, HAS_BIAS=False,
        SILU_MUL=True, PRECISE=precise_math.PRECISE_MATH, Amax=amax, stride_am=amax.stride(0),
        AMAX=True, num_warps=num_warps, num_stages=num_stages, **pdl.launch_args(),
    )  # fmt: skip
    return y, amax


def _triton(xq, sx, weight: fp8.Fp8Weight, bias, out_dtype, tiles, defer_sum: bool):
    m, k = xq.shape
    n = weight.shape[0]
    block_m, block_n, block_k, split_k, num_warps, num_stages = tiles
    assert not weight.block or block_k == fp8.BLOCK, "block scales take BLOCK_K = 128"
    k_per_split = triton.cdiv(triton.cdiv(k, block_k), split_k) * block_k
    if split_k > 1:
        out = torch.empty((split_k, m, n), dtype=torch.float32, device=xq.device)
    else:
        out = y = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    flags = dict(HAS_BIAS=bias is not None, SILU_MUL=False, PRECISE=precise_math.PRECISE_MATH,
                 **pdl.launch_args())  # fmt: skip
    bias_arg = bias if bias is not None else weight.q
    stride_sx = 0 if sx.dim() == 1 and sx.shape[0] == 1 else sx.stride(0)  # static: every row
    even = n % block_n == 0 and k % block_k == 0 and (split_k - 1) * k_per_split < k
    peel = _peels(xq, block_m, block_n, block_k, num_stages, False)
    stride_ws = weight.scale.stride(0) if weight.block else 0
    grid = (triton.cdiv(n, block_n), split_k, triton.cdiv(m, block_m))
    _skinny_gemm_kernel[grid](
        xq, weight.q, bias_arg, out, weight.scale, sx, stride_ws, stride_sx, m, n, k,
        xq.stride(0), out.stride(-2), k_per_split,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PARTIAL=split_k > 1, EVEN=even,
        PEEL=peel, FP8=2 if weight.block else 1,
        **flags, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if split_k == 1:
        return y
    if defer_sum:
        return fp8.SplitKPartials(out, out_dtype)
    return sum_partials(out, out_dtype, bias)
