"""Rotary position embedding (neox style, as HF Llama/Qwen), in place on q and k.

Layout contract::

    q:             [num_tokens, num_q_heads, head_dim]   (head_dim contiguous; tokens and heads
    k:             [num_tokens, num_kv_heads, head_dim]   may be strided, e.g. views of qkv)
    positions:     [num_tokens] int32/int64
    cos_sin_cache: [max_position, rotary_dim] fp32, cos in [:, :rotary_dim/2], sin after it

The first ``rotary_dim`` dims of each head rotate by halves (the rest pass through)::

    x = [x1 | x2 | rest],  x1, x2 of rotary_dim/2
    out = [x1*cos - x2*sin | x2*cos + x1*sin | rest]

Each product and the sum round separately in fp32 (no FMA contraction), as torch computes
them, so fp32 results equal HF's bit for bit. Scaled variants (llama3, linear, ...) only change
the cache, which the model builds (``tokenspeed_aio.model.layers.rotary.build_cos_sin_cache``).
One program per token rotates all its q and k heads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    X, token, stride_t, stride_h, cos, sin, offs,
    NUM_HEADS: tl.constexpr, BLOCK_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    heads = tl.arange(0, BLOCK_HEADS)
    mask = (heads < NUM_HEADS)[:, None] & (offs < HALF)[None, :]
    ptr1 = X + token.to(tl.int64) * stride_t + heads[:, None] * stride_h + offs[None, :]
    x1 = tl.load(ptr1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr1 + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptr1, (x1 * cos - x2 * sin).to(X.dtype.element_ty), mask=mask)
    tl.store(ptr1 + HALF, (x2 * cos + x1 * sin).to(X.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    Q,
    K,
    Positions,
    Cos_sin,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cs,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0)
    pos = tl.load(Positions + token).to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)
    cs_mask = offs < HALF
    cos = tl.load(Cos_sin + pos * stride_cs + offs, mask=cs_mask, other=0.0)[None, :]
    sin = tl.load(Cos_sin + pos * stride_cs + HALF + offs, mask=cs_mask, other=0.0)[None, :]
    _rotate_heads(
        Q, token, stride_qt, stride_qh, cos, sin, offs, NUM_Q_HEADS, BLOCK_QH, HALF, BLOCK_HALF
    )
    _rotate_heads(
        K, token, stride_kt, stride_kh, cos, sin, offs, NUM_KV_HEADS, BLOCK_KH, HALF, BLOCK_HALF
    )


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    """Rotate q and k in place by their tokens' positions (layout: module doc)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    rotary_dim = cos_sin_cache.shape[1]
    assert rotary_dim % 2 == 0 and rotary_dim <= head_dim and k.shape[2] == head_dim
    assert q.stride(2) == 1 and k.stride(2) == 1 and cos_sin_cache.stride(1) == 1
    if num_tokens == 0:
        return
    half = rotary_dim // 2
    _rotary_kernel[(num_tokens,)](
        q, k, positions, cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads,
        BLOCK_QH=triton.next_power_of_2(num_q_heads),
        BLOCK_KH=triton.next_power_of_2(num_kv_heads),
        HALF=half, BLOCK_HALF=triton.next_power_of_2(half), num_warps=4,
        enable_fp_fusion=False,  # no FMA: x1*cos - x2*sin rounds as torch's separate ops
    )  # fmt: skip
