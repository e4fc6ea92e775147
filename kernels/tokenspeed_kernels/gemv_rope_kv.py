"""The batch-1 qkv projection with RoPE and the KV-cache write as its epilogue:
``norm_gemv_rope_kv`` is ``gemv.norm_gemv`` of a decoder layer's qkv projection for one token
with ``rotary.apply_rotary(..., kv_store=...)`` after it, in one launch (whole heads rotate)::

    weight: [(Hq + 2 Hkv) * D, K]: q heads, then k heads, then v heads, D rows each
    positions, slot_mapping: [1] device tensors the kernel reads (CUDA-graph safe)
    cos_sin_cache: [max_position, D] fp32; k/v_cache: [num_blocks, page_size, Hkv, D] (K
                   token-major, V token- or dim-major: ``kv_layout``)
    returns (q [1, Hq * D] rotated, h); the rotated k and the v go to the slot (-1: nowhere)

A program owns ``BLOCK_HALF`` features of one head in both its halves, so RoPE's pairs are in
its registers as silu_mul's gates and ups are::

    head's rows:  [0 ........ D/2)[D/2 ........ D)
    a program:      [j, j + BH)        [D/2 + j, D/2 + j + BH)

Each product rounds to x's dtype (as ``gemv``'s y) and rotates in fp32 rounded as
``rotary.py`` rounds it (no FMA): with the same tiles -- ``norm_gemv``'s BLOCK_N =
BLOCK_HALF reads the same [BLOCK_HALF, BLOCK_K] tiles -- q and the caches equal
``norm_gemv`` then ``apply_rotary`` bit for bit. ``bench_gemv.py --rope-kv`` times the two.

The product loop, its PDL wait and its prologues are ``gemv_jit.products``; the launch is a
programmatic dependent launch as every batch-1 product's is (``gemv``'s module doc).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import triton
import triton.language as tl

from tokenspeed_kernels import fp8_jit, kv_layout, kv_layout_jit, pdl, precise_math, tuning
from tokenspeed_kernels.fp8 import cache_scales
from tokenspeed_kernels.gemv import (
    NORM_DEFAULT,
    check_tiles,
    norm_configs,
    norm_output,
    pointer_args,
    prologue_block,
)
from tokenspeed_kernels.gemv_jit import products
from tokenspeed_kernels.rotary import load_cos_sin, rotate


@triton.jit
def _store_halves(ptr, x1, x2, offs, HALF: tl.constexpr, stores, scale, stride):
    """x1 at ``ptr + offs * stride`` and x2 HALF on, as ptr's dtype (an FP8 cache's: by
    ``scale``, ``fp8_jit.to_cache``), if the scalar ``stores``."""
    mask = offs < tl.where(stores, HALF, 0)  # (the interpreter can't AND a scalar into a mask)
    tl.store(ptr + offs * stride, fp8_jit.to_cache(x1, ptr, scale), mask=mask)
    tl.store(ptr + (offs + HALF) * stride, fp8_jit.to_cache(x2, ptr, scale), mask=mask)


@triton.jit
def _gemv_rope_kv_kernel(
    X, W, Bias, Q, Residual, NormW, ResidualOut, W_scale, X_scale, stride_ws,
    Positions, Cos_sin, K_cache, V_cache, Slot_mapping, K_scale, V_scale,
    K, stride_wn, stride_cs, stride_slot, eps,
    stride_vb, stride_vp, stride_vh, stride_vd, page_size,  # the V cache's (``kv_layout``)
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, TWO_PASS: tl.constexpr, PRECISE: tl.constexpr, PDL: tl.constexpr,
    EVEN: tl.constexpr,  # BLOCK_HALF divides HALF and BLOCK_K divides K
    FP8: tl.constexpr, STATIC: tl.constexpr,  # the weight's (``gemv_jit.products``)
    BLOCK_P: tl.constexpr,  # the prologue loops' chunk (``gemv.prologue_block``)
):  # fmt: skip
    pid = tl.program_id(0)
    per_head = (HALF + BLOCK_HALF - 1) // BLOCK_HALF  # programs
    head = pid // per_head
    offs = (pid % per_head) * BLOCK_HALF + tl.arange(0, BLOCK_HALF)
    mask = offs < HALF
    rows = head * (2 * HALF) + offs
    acc1, acc2 = products(
        X, W, Bias, Residual, NormW, ResidualOut, rows, rows + HALF, mask, K, stride_wn, eps,
        pid == 0, W_scale, X_scale, stride_ws,
        BLOCK_K, HAS_BIAS, True, True, HAS_RESIDUAL, TWO_PASS, PDL, EVEN, FP8, STATIC, BLOCK_P,
    )  # fmt: skip
    x1 = acc1.to(Q.dtype.element_ty)  # the product's rounding, as gemv's output
    x2 = acc2.to(Q.dtype.element_ty)
    cos, sin = load_cos_sin(Cos_sin, tl.load(Positions), stride_cs, offs, HALF)
    o1, o2 = rotate(x1, x2, cos, sin, PRECISE)
    o1 = o1.to(Q.dtype.element_ty)
    o2 = o2.to(Q.dtype.element_ty)
    # Where the head goes: q heads rotated to Q; k heads rotated, v heads as they are, to the
    # caches' slot (a padding token's slot -1: nowhere).
    kv_head = head - NUM_Q_HEADS  # k heads [0, Hkv), then v heads [Hkv, 2 Hkv)
    slot = tl.load(Slot_mapping)
    in_slot = slot * stride_slot + (kv_head % NUM_KV_HEADS) * (2 * HALF)
    is_k = (kv_head >= 0) & (kv_head < NUM_KV_HEADS)
    cache_head = tl.where(kv_head >= 0, kv_head % NUM_KV_HEADS, 0)
    k_scale = tl.load(K_scale + cache_head)  # an FP8 cache's per-head scales
    v_scale = tl.load(V_scale + cache_head)
    v_slot = (
        kv_layout_jit.slot_offset(slot, page_size, stride_vb, stride_vp) + cache_head * stride_vh
    )
    _store_halves(Q + head * (2 * HALF), o1, o2, offs, HALF, kv_head < 0, 1.0, 1)
    _store_halves(K_cache + in_slot, o1, o2, offs, HALF, (slot >= 0) & is_k, k_scale, 1)
    _store_halves(V_cache + v_slot, x1, x2, offs, HALF, (slot >= 0) & (kv_head >= NUM_KV_HEADS),
                  v_scale, stride_vd)  # fmt: skip


def rope_kv_configs(
    device: torch.device | None = None,
) -> Mapping[tuple[int, int], tuple[int, int, int, int, bool]]:
    """``device``'s (N, K) -> (BLOCK_HALF, BLOCK_K, num_warps, num_stages, two_pass) of
    ``norm_gemv_rope_kv``, BLOCK_HALF the features of one half of one head (a program reads
    2 * BLOCK_HALF rows): the qkv shapes where it beat ``norm_gemv`` + ``apply_rotary`` with
    its ``kv_store`` (``tuning.py``). Empty where not measured."""
    return tuning.table("gemv_rope_kv", device)


def rope_kv_config(
    n: int, k: int, device: torch.device | None = None
) -> tuple[int, int, int, int, bool]:
    """``norm_gemv_rope_kv``'s config for an [n, k] qkv weight on ``device``: its
    ``rope_kv_configs`` entry, else the plain product's ``norm_configs`` entry (or
    NORM_DEFAULT) with the same rows per program (BLOCK_HALF = BLOCK_N / 2) and its BLOCK_K,
    warps, stages and prologue."""
    config = rope_kv_configs(device).get((n, k))
    if config is not None:
        return config
    block_n, *rest = norm_configs(device).get((n, k, False), NORM_DEFAULT)
    return (block_n // 2, *rest)


def norm_gemv_rope_kv(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    config: tuple[int, int, int, int, bool] | None = None,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``norm_gemv`` of a qkv projection followed by ``rotary.apply_rotary`` with its
    ``kv_store``, in one launch: returns (q [1, Hq * D] rotated, h) and writes the token's
    rotated k and its v at ``slot_mapping[0]`` of the caches (layout: module doc). ``weight``
    may be an ``fp8.Fp8Weight``; FP8 caches take ``kv_scales`` (k's and v's [Hkv] fp32)."""
    h = norm_output(x, residual, norm_weight)
    _, _, num_kv_heads, head_dim = k_cache.shape
    rows, k = weight.shape
    num_q_heads = rows // head_dim - 2 * num_kv_heads
    assert num_q_heads > 0 and rows == (num_q_heads + 2 * num_kv_heads) * head_dim
    assert cos_sin_cache.shape[1] == head_dim and head_dim % 2 == 0, "RoPE on whole heads"
    assert cos_sin_cache.dtype == torch.float32 and cos_sin_cache.stride(1) == 1
    assert positions.numel() == 1 and slot_mapping.numel() == 1
    assert v_cache.shape == k_cache.shape and k_cache.is_contiguous()
    v_strides = kv_layout.strides(v_cache)
    config = config or rope_kv_config(rows, k, x.device)
    block_half, block_k, num_warps, num_stages, two_pass = config
    check_tiles(weight, block_k, True, two_pass)
    k_scale, v_scale = cache_scales(k_cache, kv_scales)
    half = head_dim // 2
    q = torch.empty((1, num_q_heads * head_dim), dtype=x.dtype, device=x.device)
    grid = ((num_q_heads + 2 * num_kv_heads) * triton.cdiv(half, block_half),)
    args, fp8_flags = pointer_args(x, weight, bias, q, norm_weight, residual, h)
    _gemv_rope_kv_kernel[grid](
        *args, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        k, k, cos_sin_cache.stride(0), num_kv_heads * head_dim, eps, *v_strides,
        k_cache.shape[1],
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HALF=half, BLOCK_HALF=block_half,
        BLOCK_K=block_k, HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
        TWO_PASS=two_pass, PRECISE=precise_math.PRECISE_MATH,
        EVEN=half % block_half == 0 and k % block_k == 0, BLOCK_P=prologue_block(k, num_warps),
        num_warps=num_warps, num_stages=num_stages, **fp8_flags, **pdl.launch_args(),
    )  # fmt: skip
    return q, h
