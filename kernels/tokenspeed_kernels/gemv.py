"""Matrix-vector product for batch-1 decode: ``y = x @ weight.T (+ bias)`` for one row of x,
optionally after an RMSNorm of x (and the residual add before it) done in the prologue.

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

``norm_gemv`` puts the RMSNorm that precedes a projection (``rmsnorm.fused_add_rms_norm``, or
``rms_norm`` without a residual) in the product's prologue::

    residual: [1, K] or None; norm_weight: [K]
    h = round(x + residual)           (x when residual is None)
    y = gemv(rms_norm(h, norm_weight, eps), weight, bias)      (silu_mul composes)
    returns (y, h); h is a new tensor that program 0 alone writes (x itself without residual)

Every program needs the norm of all of h, so each one reads the whole of x (and residual and
norm_weight) -- from L2 after the first -- and reduces ``sum(h**2)`` itself; no program waits
for another. Two prologues, a constexpr of the config:

- one pass (``two_pass=False``): the K loop accumulates ``sum(W * h * norm_weight)`` and
  ``sum(h**2)`` together and scales by ``rsqrt(mean(h**2) + eps)`` at the end. It issues the
  weight loads at once and reads the vectors once, but skips the norm kernel's two roundings
  of the normed input (to dtype, then after the weight): closer to the exact math than the
  unfused pair, equal to it to an output rounding.
- two passes (``two_pass=True``): a first K loop reduces ``sum(h**2)``, the second multiplies
  by the normed input rounded exactly as the norm kernel rounds it, so y equals
  ``gemv(fused_add_rms_norm(...))`` with the same tiles up to the order of the sum of
  squares; the vectors are read twice and the weight stream starts a loop later.

``kernels/bench_gemv.py --norm`` measures both against the norm kernel + ``gemv``.

Every launch is a programmatic dependent launch where the GPU has one (``pdl.py``): a
product's programs may be resident while the kernel before it in the stream finishes. Each
program loads its first weight tile before ``pdl.wait_prior`` -- no kernel writes a weight --
and everything else after it, so one product's first weight reads overlap the tail of the
product before it (a 16-bit weight's two-pass prologue, whose first loop reads h, waits
first; an FP8 product, whose e4m3 tile costs half the registers, holds it across its
norm and amax loops). On the H200 that took ~0.06 ms off a batch-1 Qwen3-8B or Llama-3-8B
decode step (docs/performance.md).
Tiles that divide the weight (``EVEN``) load unmasked: masked, the tile held across the wait
cost registers (Qwen3's gate_up with its norm, 168 -> 254 per thread), and with them a
program per SM, which lost more than the overlap won.

``norm_gemv_rope_kv`` (``gemv_rope_kv.py``) is ``norm_gemv`` of a qkv projection with RoPE and
the KV-cache write as its epilogue, built on the same product loop (``gemv_jit.products``).

``configs(device)`` is the device's table of the tiles ``kernels/bench_gemv.py`` measured
faster than cuBLAS per weight shape (``tuning.py``: JSON per GPU); the engine's products use
the kernel for those shapes only (``model/ops/products.py``), cuBLAS elsewhere; likewise
``configs(device, silu_mul=True)`` and ``norm_configs(device)`` for the fused epilogue and
prologue. Called without a config, the kernels take the table's tiles or ``DEFAULT``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import triton
import triton.language as tl

from tokenspeed_kernels import fp8, pdl, precise_math, tuning
from tokenspeed_kernels.activation import silu_mul
from tokenspeed_kernels.fp8_jit import SLICE
from tokenspeed_kernels.gemv_jit import products


@triton.jit
def _gemv_kernel(
    X,
    W,
    Bias,
    Y,
    Residual,
    NormW,
    ResidualOut,
    W_scale,  # these three: FP8's (``products``), unread without it
    X_scale,
    stride_ws,
    N,
    K,
    stride_wn,
    eps,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU_MUL: tl.constexpr,  # rows [0, N) are gates, [N, 2N) their ups (module doc)
    NORM: tl.constexpr,  # RMSNorm prologue (module doc); the next two only count with it
    HAS_RESIDUAL: tl.constexpr,
    TWO_PASS: tl.constexpr,
    PRECISE: tl.constexpr,
    PDL: tl.constexpr,
    EVEN: tl.constexpr,  # BLOCK_N divides N and BLOCK_K divides K
    FP8: tl.constexpr,
    STATIC: tl.constexpr,
    BLOCK_P: tl.constexpr,  # the prologue loops' chunk (``prologue_block``)
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    acc, acc_up = products(
        X, W, Bias, Residual, NormW, ResidualOut, offs_n, offs_n + N, mask_n, K, stride_wn, eps,
        pid == 0, W_scale, X_scale, stride_ws,
        BLOCK_K, HAS_BIAS, SILU_MUL, NORM, HAS_RESIDUAL, TWO_PASS, PDL, EVEN, FP8, STATIC,
        BLOCK_P,
    )  # fmt: skip
    y = acc.to(Y.dtype.element_ty)
    if SILU_MUL:
        y = silu_mul(y, acc_up.to(Y.dtype.element_ty), PRECISE)
    tl.store(Y + offs_n, y, mask=mask_n)


DEFAULT = (8, 512, 4, 3)  # (BLOCK_N, BLOCK_K, num_warps, num_stages) of shapes not in a table
NORM_DEFAULT = (*DEFAULT, False)  # and two_pass


def configs(
    device: torch.device | None = None, silu_mul: bool = False
) -> Mapping[tuple[int, int], tuple[int, int, int, int]]:
    """``device``'s (N, K) -> (BLOCK_N, BLOCK_K, num_warps, num_stages) of ``gemv``; with
    ``silu_mul`` the fused epilogue's, keyed by the weight's [2d, K], BLOCK_N counting the
    features of one half (a program reads 2 * BLOCK_N rows). Empty where not measured."""
    return tuning.table("gemv_silu_mul" if silu_mul else "gemv", device)


def fp8_configs(
    device: torch.device | None = None,
) -> Mapping[tuple[int, int, bool, bool], tuple[int, int, int, int]]:
    """``device``'s (N, K, block, silu_mul) -> (BLOCK_N, BLOCK_K, num_warps, num_stages) of
    ``gemv`` on an FP8 (e4m3) weight. Empty where not measured."""
    return tuning.table("fp8_gemv", device)


def norm_configs(
    device: torch.device | None = None,
) -> Mapping[tuple[int, int, bool], tuple[int, int, int, int, bool]]:
    """``device``'s (N, K, silu_mul) -> (BLOCK_N, BLOCK_K, num_warps, num_stages, two_pass) of
    ``norm_gemv``: the projections after a decoder layer's norms where the fused prologue beat
    the norm kernel + product."""
    return tuning.table("gemv_norm", device)


def pointer_args(x, weight, bias, y, norm_weight, residual, h) -> tuple[tuple, dict]:
    """The kernels' first ten arguments, the operand itself standing in for an absent one
    (its constexpr keeps it unread), and the FP8 constexprs (``fp8.kernel_args``)."""
    w, fp8_args, fp8_flags = fp8.kernel_args(weight)
    assert x.shape[0] == 1 and w.shape[1] == x.shape[1]
    assert x.stride(1) == 1 and w.is_contiguous()
    args = (
        x, w, bias if bias is not None else w, y,
        residual if residual is not None else x,
        norm_weight if norm_weight is not None else x,
        h if residual is not None else x,
        *fp8_args,
    )  # fmt: skip
    return args, fp8_flags


def prologue_block(k: int, num_warps: int) -> int:
    """The chunk in which ``products``' prologue loops read x: all of it where a thread's share
    stays at 16 values, so that a program's norm and amax take one or two dependent L2 reads
    of x before its product starts, where a chunk of the product's BLOCK_K took K / BLOCK_K
    (the weight tiles after the first wait on them)."""
    return min(triton.next_power_of_2(k), 16 * 32 * num_warps)


def check_tiles(weight, block_k: int, norm: bool, two_pass: bool) -> None:
    """A block-scaled weight's K chunks hold whole 128-groups, a per-row-scaled one's whole
    ``SLICE``-value slices (``fp8_jit.slice_sums``); an FP8 product's norm prologue rounds the
    normed input as the norm kernel does (x is quantized from those values)."""
    if isinstance(weight, fp8.Fp8Weight):
        assert not weight.block or block_k % fp8.BLOCK == 0, "block scales: BLOCK_K % 128"
        slice_ = SLICE.value
        assert block_k % slice_ == 0, f"FP8 products sum {slice_}-value slices: BLOCK_K % {slice_}"
        assert not norm or two_pass, "an FP8 product's norm prologue is the two-pass one"


def _launch(
    x,
    weight,
    bias,
    tiles,
    silu_mul,
    norm_weight=None,
    residual=None,
    h=None,
    eps=0.0,
    two_pass=False,
) -> torch.Tensor:
    """y of ``gemv``; with ``norm_weight``, of ``norm_gemv`` (which allocates ``h``)."""
    rows = weight.shape[0]
    assert not silu_mul or (bias is None and rows % 2 == 0)
    n = rows // 2 if silu_mul else rows
    block_n, block_k, num_warps, num_stages = tiles
    check_tiles(weight, block_k, norm_weight is not None, two_pass)
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    args, fp8_flags = pointer_args(x, weight, bias, y, norm_weight, residual, h)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        *args, n, x.shape[1], x.shape[1], eps,
        BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None, SILU_MUL=silu_mul,
        NORM=norm_weight is not None, HAS_RESIDUAL=residual is not None, TWO_PASS=two_pass,
        PRECISE=precise_math.PRECISE_MATH, EVEN=n % block_n == 0 and x.shape[1] % block_k == 0,
        BLOCK_P=prologue_block(x.shape[1], num_warps), num_warps=num_warps,
        num_stages=num_stages, **fp8_flags, **pdl.launch_args(),
    )  # fmt: skip
    return y


def norm_output(x, residual, norm_weight) -> torch.Tensor:
    """h's buffer (x itself without residual) after checking the prologue's operands."""
    assert norm_weight.shape == (x.shape[1],) and norm_weight.is_contiguous()
    if residual is None:
        return x
    assert residual.shape == x.shape and residual.dtype == x.dtype
    assert residual.stride(1) == 1
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: tuple[int, int, int, int] | None = None,
    silu_mul: bool = False,
) -> torch.Tensor:
    """``x @ weight.T + bias`` for a one-row ``x``; with ``silu_mul``, the SwiGLU activation
    of that product (no bias) (layout: module doc)."""
    config = config or configs(x.device, silu_mul).get(tuple(weight.shape), DEFAULT)
    return _launch(x, weight, bias, config, silu_mul)


def norm_gemv(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: tuple[int, int, int, int, bool] | None = None,
    silu_mul: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gemv(rms_norm(h), weight, bias, silu_mul=silu_mul), h)`` with ``h = x + residual``
    (``x`` when residual is None), in one launch (layout and the two prologues: module doc)."""
    h = norm_output(x, residual, norm_weight)
    key = (*weight.shape, silu_mul)
    *tiles, two_pass = config or norm_configs(x.device).get(key, NORM_DEFAULT)
    y = _launch(x, weight, bias, tiles, silu_mul, norm_weight, residual, h, eps, two_pass)
    return y, h
