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

``apply_rotary(..., kv_store=(v, k_cache, v_cache, slot_mapping))`` also writes the token's
rotated k and its v into the paged KV cache (``kv_write``'s layout and slot rules), so a
layer's RoPE and cache write are one launch; it needs ``rotary_dim == head_dim``.
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
    """Rotate the heads of one token in place; return the rotated halves."""
    heads = tl.arange(0, BLOCK_HEADS)
    mask = (heads < NUM_HEADS)[:, None] & (offs < HALF)[None, :]
    ptr1 = X + token.to(tl.int64) * stride_t + heads[:, None] * stride_h + offs[None, :]
    x1 = tl.load(ptr1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr1 + HALF, mask=mask, other=0.0).to(tl.float32)
    o1 = (x1 * cos - x2 * sin).to(X.dtype.element_ty)
    o2 = (x2 * cos + x1 * sin).to(X.dtype.element_ty)
    tl.store(ptr1, o1, mask=mask)
    tl.store(ptr1 + HALF, o2, mask=mask)
    return o1, o2


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
    V,
    K_cache,
    V_cache,
    Slot_mapping,
    stride_vt,
    stride_slot,  # of both caches: one token's [num_kv_heads, head_dim] values
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    STORE_KV: tl.constexpr,
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
    k1, k2 = _rotate_heads(
        K, token, stride_kt, stride_kh, cos, sin, offs, NUM_KV_HEADS, BLOCK_KH, HALF, BLOCK_HALF
    )
    if STORE_KV:
        slot = tl.load(Slot_mapping + token)
        # Heads of a cache slot are back to back: head h's values start at h * 2 * HALF.
        kv_heads = tl.arange(0, BLOCK_KH)
        heads = kv_heads[:, None] * (2 * HALF)
        # A padding token (slot -1) masks its whole row out.
        mask = (kv_heads < NUM_KV_HEADS)[:, None] & (offs < tl.where(slot >= 0, HALF, 0))[None, :]
        k_ptr = K_cache + slot * stride_slot + heads + offs[None, :]
        tl.store(k_ptr, k1.to(K_cache.dtype.element_ty), mask=mask)
        tl.store(k_ptr + HALF, k2.to(K_cache.dtype.element_ty), mask=mask)
        v_ptr = V + token.to(tl.int64) * stride_vt + heads + offs[None, :]
        v_out = V_cache + slot * stride_slot + heads + offs[None, :]
        tl.store(v_out, tl.load(v_ptr, mask=mask).to(V_cache.dtype.element_ty), mask=mask)
        v_hi = tl.load(v_ptr + HALF, mask=mask)
        tl.store(v_out + HALF, v_hi.to(V_cache.dtype.element_ty), mask=mask)


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_store: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Rotate q and k in place by their tokens' positions; with ``kv_store`` = (v, k_cache,
    v_cache, slot_mapping), also store k and v in the cache (layout: module doc)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    rotary_dim = cos_sin_cache.shape[1]
    assert rotary_dim % 2 == 0 and rotary_dim <= head_dim and k.shape[2] == head_dim
    assert q.stride(2) == 1 and k.stride(2) == 1 and cos_sin_cache.stride(1) == 1
    if num_tokens == 0:
        return
    half = rotary_dim // 2
    if kv_store is None:
        v, k_cache, v_cache, slot_mapping, stride_vt, stride_slot = k, k, k, positions, 0, 0
    else:
        v, k_cache, v_cache, slot_mapping = kv_store
        assert rotary_dim == head_dim, "the fused cache write rotates whole heads"
        assert k.stride(1) == head_dim and v.stride(1) == head_dim and v.stride(2) == 1
        row = num_kv_heads * head_dim
        for cache in (k_cache, v_cache):
            assert cache.stride(1) == row and cache.stride(2) == head_dim and cache.stride(3) == 1
            assert cache.stride(0) == cache.shape[1] * row, "blocks packed back to back"
        stride_vt, stride_slot = v.stride(0), row
    _rotary_kernel[(num_tokens,)](
        q, k, positions, cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        v, k_cache, v_cache, slot_mapping, stride_vt, stride_slot,
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads,
        BLOCK_QH=triton.next_power_of_2(num_q_heads),
        BLOCK_KH=triton.next_power_of_2(num_kv_heads),
        HALF=half, BLOCK_HALF=triton.next_power_of_2(half), STORE_KV=kv_store is not None,
        num_warps=4,
        enable_fp_fusion=False,  # no FMA: x1*cos - x2*sin rounds as torch's separate ops
    )  # fmt: skip
