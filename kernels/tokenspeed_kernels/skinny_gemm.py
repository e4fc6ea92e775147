"""Linear layer of a small decode batch: ``y = x @ weight.T (+ bias)`` for up to 64 rows of x.

Layout contract::

    x:      [M, K], 1 <= M <= 64, K contiguous (rows may be strided)
    weight: [N, K] contiguous (nn.Linear's layout), x's dtype
    bias:   [N] or None
    y:      [M, N], x's dtype, a new tensor

With M <= 64 the product is, like ``gemv``'s, a read of the weight: its time is how close
that read comes to the memory bandwidth. A program owns ``BLOCK_N`` output features for every
row of x and streams their rows of ``weight`` once, in ``BLOCK_K`` chunks; x's rows pad to
``BLOCK_M`` (``m_bucket(M)``: 16, 32 or 64, rows past M masked) and each chunk is one
``tl.dot`` of ``weight[BLOCK_N, BLOCK_K] @ x.T[BLOCK_K, BLOCK_M]`` -- the weight is the dot's
M side, so tiles of 64+ features can use Hopper's wgmma however few the rows.

Split-K (``SPLIT_K > 1``), for shapes whose features alone make too few programs, gives a
program one K slice of ``ceil(ceil(K / BLOCK_K) / SPLIT_K)`` chunks (the last slices may get
fewer, or none). Partials go to an fp32 workspace ``[SPLIT_K, M, N]`` and a second launch
sums them in slice order, so results are deterministic (no atomics); with ``SPLIT_K = 1`` the
product's own epilogue writes y.

Sums are fp32 (``input_precision="ieee"``: fp32 operands do not drop to TF32) and round once
to x's dtype after the bias; the order differs from cuBLAS's, so results agree with
``F.linear`` to rounding, not bit for bit.

``silu_mul=True`` is a SwiGLU's gate/up projection and its activation in one pass, as in
``gemv``: weight is ``[2d, K]`` (gate rows, then up rows), no bias, y is ``[M, d]``, and a
program owns features ``f`` of both halves (rows ``f`` and ``d + f``; ``BLOCK_N`` counts one
half). Each product rounds to x's dtype and ``silu(gate) * up`` rounds as
``activation.silu_and_mul``: the same values as the plain product with the same config
followed by that kernel. On e4m3 operands (``fp8_gemm.fp8_gemm_silu_mul``) the epilogue may
also write each row's amax over the program's features (``AMAX``), from which
``fp8_quant.quantize_by_chunk_amax`` quantizes the activation per token.

Both launches are programmatic dependent launches where the GPU has one (``pdl.py``), as
``gemv``'s are: a program loads its slice's first weight tile -- no kernel writes a weight --
before ``pdl.wait_prior``, x and everything else after it, so the product's first weight
reads overlap the tail of the kernel before it (a norm, the split-K sum, another product).
Tiles that divide the weight with no empty slice (``EVEN``) load unmasked, which keeps the
tile held across the wait to its own registers (``gemv_jit.load_weight``).

A config is ``(BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages)``. ``configs(device)``
(and ``configs(device, silu_mul=True)``) is the device's table keyed by ``(N, K, m_bucket)``
(the weight's shape, ``[2d, K]`` for ``silu_mul``) of the tiles measured faster than cuBLAS
there (``tuning.py``: JSON per GPU, written by ``kernels/bench_skinny_gemm.py`` and
``kernels/bench_decode_chain.py``); ``DEFAULT`` serves other shapes when called directly.
A bucket's rows pad to its top, so the kernel's time is flat inside it.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping

import torch
import triton
import triton.language as tl

from tokenspeed_kernels import pdl, precise_math, tuning
from tokenspeed_kernels.activation import silu_mul
from tokenspeed_kernels.gemv_jit import load_weight

MAX_M = 64
SUM_BLOCK = 1024  # features per program of the split-K sum
# NOTE: Triton's interpreter (CPU tests) hands bf16 dot operands to numpy as their raw uint16
# bits; there they go to fp32 first, which keeps the products exact, as the MMA's are.
_DOT_IN_FP32 = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def _dot(w, x, acc):
    if _DOT_IN_FP32:
        w = w.to(tl.float32)
        x = x.to(tl.float32)
    if w.dtype == tl.float8e4nv:  # e4m3 operands: Hopper's FP8 MMA, fp32 sums
        return tl.dot(w, x, acc)
    else:
        return tl.dot(w, x, acc, input_precision="ieee")


@triton.jit
def _step(w, w_up, x_ptrs, k0, offs_k, mask_m, K, acc, acc_up, ws, sx_ptrs,
          SILU_MUL: tl.constexpr, FP8: tl.constexpr):  # fmt: skip
    """One BLOCK_K chunk: the weight tiles ``w`` (and ``w_up``) at ``k0`` times x's slice;
    with block scales (FP8 == 2, BLOCK_K == 128) the chunk's product is scaled by the rows'
    weight-block scales (``ws``: each row's block row) and each x row's group scale."""
    x = tl.load(x_ptrs + k0, mask=((k0 + offs_k) < K)[:, None] & mask_m[None, :], other=0.0)
    if FP8 == 2:
        kb = k0 // 128
        s = tl.load(ws + kb) * tl.load(sx_ptrs + kb, mask=mask_m[None, :], other=0.0)
        acc += _dot(w, x, tl.zeros(acc.shape, tl.float32)) * s
    else:
        acc = _dot(w, x, acc)
        if SILU_MUL:
            acc_up = _dot(w_up, x, acc_up)
    return acc, acc_up


@triton.jit
def _finish(acc, acc_up, bias_ptrs, mask, dtype: tl.constexpr, HAS_BIAS, SILU_MUL, PRECISE):
    """fp32 sums to y: add the bias, round to ``dtype``; with SILU_MUL, ``silu(gate) * up``."""
    if HAS_BIAS:
        acc += tl.load(bias_ptrs, mask=mask, other=0.0).to(tl.float32)
    y = acc.to(dtype)
    if SILU_MUL:
        y = silu_mul(y, acc_up.to(dtype), PRECISE)
    return y


# M is not specialized: Triton would compile a row count divisible by 16 apart from the
# others, so a server capturing batches 1-8 met its first 16-token prefill with a compile.
@triton.jit(do_not_specialize=["M"])
def _skinny_gemm_kernel(
    X,
    W,
    Bias,
    Out,  # y; with PARTIAL, the fp32 workspace
    W_scale,  # FP8's (``fp8_gemm.py``): the weight's scales and x's, unread without it
    X_scale,
    stride_ws,
    stride_sxm,  # 0: one static scale for every row
    M,
    N,
    K,
    stride_xm,
    stride_om,
    k_per_split,  # a multiple of BLOCK_K
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PARTIAL: tl.constexpr,  # SPLIT_K > 1: write fp32 sums of this K slice to the workspace
    HAS_BIAS: tl.constexpr,
    SILU_MUL: tl.constexpr,  # rows [0, N) are gates, [N, 2N) their ups (module doc)
    PRECISE: tl.constexpr,
    PDL: tl.constexpr,
    EVEN: tl.constexpr,  # BLOCK_N divides N, BLOCK_K divides K, and no slice is empty
    PEEL: tl.constexpr,  # the first weight tile before the wait (``_peels``)
    FP8: tl.constexpr = 0,  # 1: e4m3 x and weight, scales per row of each; 2: block scales
    Amax=None,  # AMAX: [M, cdiv(N, BLOCK_N)] fp32, each row's max |y| over this tile's features
    stride_am=0,
    AMAX: tl.constexpr = False,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)  # tiles of M (FP8's many rows)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    mask_m = offs_m < M
    w_ptrs = W + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :]
    up_ptrs = W + (offs_n + N).to(tl.int64)[:, None] * K + offs_k[None, :]
    x_ptrs = X + offs_m[None, :] * stride_xm + offs_k[:, None]  # x.T: [BLOCK_K, BLOCK_M]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    ws = W_scale + (tl.where(mask_n, offs_n, 0) // 128)[:, None] * stride_ws  # FP8 == 2
    sx_ptrs = X_scale + offs_m[None, :] * stride_sxm
    if PEEL:  # the slice's first weight tile before the wait (module doc); a program whose
        # slice is empty loads it masked, all zeros, and adds nothing
        mask_nk = mask_n[:, None] & ((k_start + offs_k) < K)[None, :]
        w = load_weight(w_ptrs + k_start, mask_nk, EVEN)
        w_up = load_weight(up_ptrs + k_start, mask_nk, EVEN) if SILU_MUL else w
        pdl.wait_prior(PDL)
        acc, acc_up = _step(w, w_up, x_ptrs, k_start, offs_k, mask_m, K, acc, acc_up, ws, sx_ptrs,
                            SILU_MUL, FP8)  # fmt: skip
        k_start += BLOCK_K
    else:
        pdl.wait_prior(PDL)
    for k0 in range(k_start, k_end, BLOCK_K):
        mask_nk = mask_n[:, None] & ((k0 + offs_k) < K)[None, :]
        w = load_weight(w_ptrs + k0, mask_nk, EVEN)
        w_up = load_weight(up_ptrs + k0, mask_nk, EVEN) if SILU_MUL else w
        acc, acc_up = _step(w, w_up, x_ptrs, k0, offs_k, mask_m, K, acc, acc_up, ws, sx_ptrs,
                            SILU_MUL, FP8)  # fmt: skip
    if FP8 == 1:  # per-row scales of both operands: linear, so before any split-K sum
        sx = tl.load(sx_ptrs, mask=mask_m[None, :], other=0.0)
        acc *= tl.load(W_scale + offs_n, mask=mask_n, other=0.0)[:, None] * sx
        if SILU_MUL:
            acc_up *= tl.load(W_scale + offs_n + N, mask=mask_n, other=0.0)[:, None] * sx
    mask = mask_n[:, None] & mask_m[None, :]
    out_ptrs = Out + offs_m[None, :] * stride_om + offs_n[:, None]  # y.T's tile
    if PARTIAL:
        out_ptrs += pid_k * M * stride_om
        tl.store(out_ptrs, acc, mask=mask)
        if SILU_MUL:
            tl.store(out_ptrs + N, acc_up, mask=mask)
    else:
        dtype = Out.dtype.element_ty
        y = _finish(acc, acc_up, Bias + offs_n[:, None], mask_n[:, None], dtype, HAS_BIAS,
                    SILU_MUL, PRECISE)  # fmt: skip
        tl.store(out_ptrs, y, mask=mask)
        if AMAX:  # masked features hold silu(0) * 0 = 0
            amax = tl.max(tl.abs(y.to(tl.float32)), 0)
            tl.store(Amax + offs_m * stride_am + pid_n, amax, mask=mask_m)


@triton.jit(do_not_specialize=["M"])
def _split_k_sum_kernel(
    Partials,  # [split_k, M, N], or [split_k, M, 2N] with SILU_MUL
    Bias,
    Y,
    M,
    N,
    split_k,
    stride_ym,
    BLOCK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU_MUL: tl.constexpr,
    PRECISE: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.wait_prior(PDL)  # the partials are the product's, right ahead
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    row_len = 2 * N if SILU_MUL else N
    ptrs = Partials + row * row_len + offs
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(split_k):  # in slice order: the same bits every run
        acc += tl.load(ptrs + s * M * row_len, mask=mask, other=0.0)
        if SILU_MUL:
            acc_up += tl.load(ptrs + s * M * row_len + N, mask=mask, other=0.0)
    y = _finish(acc, acc_up, Bias + offs, mask, Y.dtype.element_ty, HAS_BIAS, SILU_MUL, PRECISE)
    tl.store(Y + row * stride_ym + offs, y, mask=mask)


DEFAULT = (32, 128, 1, 4, 3)  # shapes not in a table, when called directly


def configs(
    device: torch.device | None = None, silu_mul: bool = False
) -> Mapping[tuple[int, int, int], tuple[int, int, int, int, int]]:
    """``device``'s (N, K, m_bucket) -> (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages);
    with ``silu_mul`` the fused epilogue's, keyed by the weight's [2d, K], BLOCK_N counting
    the features of one half. Empty where not measured."""
    return tuning.table("skinny_gemm_silu_mul" if silu_mul else "skinny_gemm", device)


def _peels(x, block_m, block_n, block_k, num_stages, silu_mul) -> bool:
    """Whether a program loads its first weight tile before ``pdl.wait_prior``: the tile
    held across the wait is one more pipeline stage of shared memory (on sm_90 with triton
    3.6, ``(num_stages + 1) * stage`` where ``num_stages * stage`` was needed: the H200's
    tables hold tiles that need up to 4 stages of 48 KB of its 227), so only where that still
    fits; elsewhere the program waits first. Without PDL the two orders are the same work."""
    if not x.is_cuda:  # the interpreter: no shared memory to run out of
        return True
    weights = block_n * block_k * (2 if silu_mul else 1)
    stage = (weights + block_k * block_m) * x.element_size()
    return (num_stages + 1) * stage <= _shared_memory(x.device.index)


@functools.cache
def _shared_memory(device_index: int | None) -> int:
    """The most shared memory one program may have on that device, in bytes."""
    return torch.cuda.get_device_properties(device_index).shared_memory_per_block_optin


def sum_partials(
    partials: torch.Tensor,
    dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    silu_mul: bool = False,
) -> torch.Tensor:
    """y [M, N] of ``dtype`` from a split-K workspace [SPLIT_K, M, N] (+ bias; with
    ``silu_mul`` [SPLIT_K, M, 2N], gates then ups): the second launch of a split-K product
    (module doc)."""
    split_k, m, rows = partials.shape
    n = rows // 2 if silu_mul else rows
    y = torch.empty((m, n), dtype=dtype, device=partials.device)
    _split_k_sum_kernel[(m, triton.cdiv(n, SUM_BLOCK))](
        partials, bias if bias is not None else partials, y, m, n, split_k, y.stride(0),
        BLOCK=SUM_BLOCK, HAS_BIAS=bias is not None, SILU_MUL=silu_mul,
        PRECISE=precise_math.PRECISE_MATH, **pdl.launch_args(),
    )  # fmt: skip
    return y


def m_bucket(m: int) -> int:
    """BLOCK_M for M rows, the last field of a ``configs`` key: 16, 32 or 64."""
    return max(16, triton.next_power_of_2(m))


def skinny_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: tuple[int, int, int, int, int] | None = None,
    silu_mul: bool = False,
) -> torch.Tensor:
    """``x @ weight.T + bias`` for at most 64 rows of x; with ``silu_mul``, the SwiGLU
    activation of that product (no bias) (layout, rounding: module doc)."""
    m, k = x.shape
    rows = weight.shape[0]
    assert 1 <= m <= MAX_M, f"skinny_gemm takes 1 to {MAX_M} rows of x, got {m}"
    assert weight.shape[1] == k and weight.dtype == x.dtype
    assert x.stride(1) == 1 and weight.is_contiguous()
    assert not silu_mul or (bias is None and rows % 2 == 0)
    n = rows // 2 if silu_mul else rows
    block_m = m_bucket(m)
    config = config or configs(x.device, silu_mul).get((rows, k, block_m), DEFAULT)
    block_n, block_k, split_k, num_warps, num_stages = config
    k_per_split = triton.cdiv(triton.cdiv(k, block_k), split_k) * block_k
    if split_k > 1:
        out = torch.empty((split_k, m, rows), dtype=torch.float32, device=x.device)
    else:
        out = y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    flags = dict(
        HAS_BIAS=bias is not None, SILU_MUL=silu_mul, PRECISE=precise_math.PRECISE_MATH,
        **pdl.launch_args(),
    )  # fmt: skip
    bias_arg = bias if bias is not None else weight
    even = n % block_n == 0 and k % block_k == 0 and (split_k - 1) * k_per_split < k
    peel = _peels(x, block_m, block_n, block_k, num_stages, silu_mul)
    _skinny_gemm_kernel[(triton.cdiv(n, block_n), split_k, 1)](
        x, weight, bias_arg, out, weight, weight, 0, 0, m, n, k, x.stride(0), out.stride(-2),
        k_per_split,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PARTIAL=split_k > 1, EVEN=even,
        PEEL=peel,
        **flags, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if split_k > 1:
        return sum_partials(out, x.dtype, bias, silu_mul)
    return y
