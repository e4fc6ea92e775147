"""Write a forward's new keys and values into the paged KV cache.

Layout contract::

    k, v:          [num_tokens, num_kv_heads, head_dim]  (each token's heads contiguous;
                                                          tokens may be strided, e.g. qkv views)
    k_cache:       [num_blocks, page_size, num_kv_heads, head_dim], token-major
    v_cache:       the same shape, token- or dim-major (``kv_layout``)
    slot_mapping:  [num_tokens] int64, block * page_size + offset; -1 = padding, not written

One program per token copies its ``num_kv_heads * head_dim`` values of k and of v, cast to
the cache's dtype; an FP8 (e4m3) cache stores each value divided by its head's scale
(``kv_scales``: k's and v's [num_kv_heads] fp32, ``fp8.py``'s rounding). The grid depends only on num_tokens, so one launch per batch size is the
same every step (CUDA-graph capturable).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenspeed_kernels import fp8_jit, kv_layout, kv_layout_jit
from tokenspeed_kernels.fp8 import cache_scales


@triton.jit
def _kv_write_kernel(
    K,
    V,
    K_cache,
    V_cache,
    Slot_mapping,
    K_scale,  # [num_kv_heads] fp32: an FP8 cache's, unread otherwise
    V_scale,
    stride_kt,
    stride_vt,
    stride_k_slot,
    stride_vb,  # v_cache's (block, page, head, dim) strides (``kv_layout``)
    stride_vp,
    stride_vh,
    stride_vd,
    PAGE_SIZE: tl.constexpr,
    ROW: tl.constexpr,  # num_kv_heads * head_dim
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(Slot_mapping + token)
    offs = tl.arange(0, BLOCK)
    # A padding token (slot -1) masks its whole row out.
    mask = offs < tl.where(slot >= 0, ROW, 0)
    k = tl.load(K + token.to(tl.int64) * stride_kt + offs, mask=mask)
    v = tl.load(V + token.to(tl.int64) * stride_vt + offs, mask=mask)
    k_cache = K_cache + slot * stride_k_slot + offs
    head = offs // HEAD_DIM
    v_cache = (V_cache + kv_layout_jit.slot_offset(slot, PAGE_SIZE, stride_vb, stride_vp)
               + head * stride_vh + (offs % HEAD_DIM) * stride_vd)  # fmt: skip
    if K_cache.dtype.element_ty == tl.float8e4nv:
        k_scale = tl.load(K_scale + head, mask=mask, other=1.0)
        v_scale = tl.load(V_scale + head, mask=mask, other=1.0)
    else:
        k_scale, v_scale = 1.0, 1.0
    tl.store(k_cache, fp8_jit.to_cache(k, k_cache, k_scale), mask=mask)
    tl.store(v_cache, fp8_jit.to_cache(v, v_cache, v_scale), mask=mask)


def kv_write(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Store k/v [num_tokens, Hkv, D] at ``slot_mapping`` in the caches (layout: module doc);
    an FP8 cache takes ``kv_scales``."""
    num_tokens, num_kv_heads, head_dim = k.shape
    row = num_kv_heads * head_dim
    for x in (k, v):
        assert x.stride(2) == 1 and x.stride(1) == head_dim, "each token's heads must be contiguous"
    page_size = k_cache.shape[1]
    # slot * stride(1) addresses k's (block, offset): blocks packed back to back, token-major.
    assert kv_layout.strides(k_cache)[3] == 1 and k_cache.stride(1) == row
    v_strides = kv_layout.strides(v_cache)
    if num_tokens == 0:
        return
    k_scale, v_scale = cache_scales(k_cache, kv_scales)
    _kv_write_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        k.stride(0), v.stride(0), k_cache.stride(1), *v_strides, PAGE_SIZE=page_size,
        ROW=row, HEAD_DIM=head_dim, BLOCK=triton.next_power_of_2(row), num_warps=4,
    )  # fmt: skip
