"""Tile helpers shared by the attention kernels: paged K/V loads and the matmul.

Cache layout, one tensor per layer and per K/V::

    cache: [num_blocks, page_size, num_kv_heads, head_dim]   (K token-major; V token- or
                                                              dim-major, ``kv_layout``)

An FP8 (e4m3) cache holds each value divided by its head's scale. With a 16-bit query its
tiles are widened to fp16 (exact: every e4m3 value is an fp16 value) and the products run in
fp16, the query and the probabilities converted once: e4m3 -> fp16 is one conversion
instruction for two values on Hopper, where e4m3 -> bf16 goes through fp32. With an fp32
query they are widened to fp32. The scales are the callers': k's multiplies the scores
(``scale_log2``), v's the output. A 16-bit cache's tiles are in the query's dtype.

A row's token at absolute position ``n`` lives in block ``block_tables[row, n // page_size]``
at offset ``n % page_size``. Tiles are gathered token by token, so any page size (1 included)
and any block order work; a token's ``head_dim`` values are contiguous in a token-major cache,
which keeps each load coalesced. A dim-major V cache (an FP8 pool's) is read a page at a time
where the tiles hold whole pages (``reads_pages``): each page's head is one contiguous run,
loaded as it lies and transposed to the tile in shared memory, so the probabilities x V
product finds consecutive tokens side by side; a page's slots past ``n_hi`` are read too
(finite by ``kv_layout``'s rule) and weighted by zero. Elsewhere a dim-major cache is
gathered token by token through its strides: correct, not coalesced.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from tokenspeed_kernels import kv_layout

# NOTE: Triton's CPU interpreter multiplies bf16 dot operands as their raw uint16 bits. Under
# the interpreter the operands are widened to fp32 first, which is exact (a bf16 product is
# exact in fp32), so results match the GPU path up to summation order.
_WIDEN_DOT = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def load_kv_tile(
    cache,
    block_table_row,  # pointer to this row's block_tables entries
    offs_n,  # [BLOCK_N] absolute token positions
    n_mask,  # [BLOCK_N] which positions exist (masked ones read as 0)
    offs_d,  # [BLOCK_D]
    d_mask,  # [BLOCK_D]
    kv_head,
    stride_block,
    stride_page,
    stride_head,
    stride_dim,  # 1 in a token-major cache (an int argument of 1 compiles as a constant)
    PAGE_SIZE: tl.constexpr,
):
    """Return the [BLOCK_N, BLOCK_D] tile of ``cache`` for positions ``offs_n`` of one row."""
    block = tl.load(block_table_row + offs_n // PAGE_SIZE, mask=n_mask, other=0)
    # int64: block * stride_block overflows int32 for caches beyond 2**31 elements.
    token = block.to(tl.int64) * stride_block + (offs_n % PAGE_SIZE) * stride_page
    ptrs = cache + (token + kv_head * stride_head)[:, None] + (offs_d * stride_dim)[None, :]
    return tl.load(ptrs, mask=n_mask[:, None] & d_mask[None, :], other=0.0)


def reads_pages(v_cache, block_n: int, block_d: int) -> bool:
    """Whether the attention kernels read ``v_cache`` a page at a time (module doc): a
    dim-major cache whose pages fill the tiles and whose heads fill ``block_d``."""
    page_size, head_dim = v_cache.shape[1], v_cache.shape[3]
    return kv_layout.is_dim_major(v_cache) and block_n % page_size == 0 and head_dim == block_d


@triton.jit
def load_page_tile(
    cache, block_table_row, n0, n_hi, kv_head, stride_block, stride_head,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """The [BLOCK_N, BLOCK_D] tile of positions [n0, n0 + BLOCK_N) of a dim-major cache, n0
    on a page: each page that starts before ``n_hi`` whole (module doc), the rest 0."""
    PAGES: tl.constexpr = BLOCK_N // PAGE_SIZE
    pages = n0 // PAGE_SIZE + tl.arange(0, PAGES)
    used = pages * PAGE_SIZE < n_hi
    block = tl.load(block_table_row + pages, mask=used, other=0)
    base = block.to(tl.int64) * stride_block + kv_head * stride_head
    # A page's head as it lies, [head_dim, page_size] in one run, then as [tokens, dims].
    run = tl.arange(0, BLOCK_D * PAGE_SIZE)
    tile = tl.load(cache + base[:, None] + run[None, :], mask=used[:, None], other=0.0)
    tile = tl.permute(tl.reshape(tile, (PAGES, BLOCK_D, PAGE_SIZE)), (0, 2, 1))
    return tl.reshape(tile, (BLOCK_N, BLOCK_D))


@triton.jit
def mma(a, b):
    """``a @ b`` accumulated in fp32; fp32 operands are multiplied in full precision (no TF32)."""
    if _WIDEN_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def attend_keys(
    acc, m_i, l_i, q, q_pos, n_lo, n_hi,
    K_cache, V_cache, bt_row, kv_head, offs_d, d_mask, scale_log2,
    stride_kb, stride_kp, stride_kh, stride_vb, stride_vp, stride_vh, stride_vd,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    V_PAGES: tl.constexpr,
):  # fmt: skip
    """Online-softmax update of (acc, m_i, l_i) with the keys at positions [n_lo, n_hi).

    With CAUSAL, query i sees keys at positions <= q_pos[i]. Callers guarantee every tile
    holds at least one key each query sees, so the running max stays finite. An FP8 cache's
    k scale is in ``scale_log2``; its v scale multiplies the caller's output (module doc).
    With V_PAGES (``reads_pages``) V is read a page at a time: ``n_lo`` must be a multiple
    of BLOCK_N (the decode kernel's splits and the extend kernel's bounds are).
    """
    if K_cache.dtype.element_ty == tl.float8e4nv and q.dtype != tl.float32:
        q = q.to(tl.float16)  # the tiles' dtype (module doc)
    for n0 in range(n_lo, n_hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < n_hi
        k = load_kv_tile(
            K_cache, bt_row, offs_n, n_mask, offs_d, d_mask, kv_head,
            stride_kb, stride_kp, stride_kh, 1, PAGE_SIZE,
        )  # fmt: skip
        s = mma(q, tl.trans(k.to(q.dtype))) * scale_log2
        if CAUSAL:
            s = tl.where((offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :], s, float("-inf"))
        else:
            s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if V_PAGES:
            v = load_page_tile(
                V_cache, bt_row, n0, n_hi, kv_head, stride_vb, stride_vh,
                PAGE_SIZE, BLOCK_N, q.shape[1],
            )  # fmt: skip
        else:
            v = load_kv_tile(
                V_cache, bt_row, offs_n, n_mask, offs_d, d_mask, kv_head,
                stride_vb, stride_vp, stride_vh, stride_vd, PAGE_SIZE,
            )  # fmt: skip
        acc = acc * alpha[:, None] + mma(p.to(q.dtype), v.to(q.dtype))
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def head_scales(K_scale, V_scale, kv_head, K_cache):
    """(k's, v's) scale of ``kv_head`` for an FP8 cache (``K_scale``/``V_scale``: [Hkv] fp32),
    1 for a 16-bit one (whose scale pointers are never read)."""
    if K_cache.dtype.element_ty == tl.float8e4nv:
        return tl.load(K_scale + kv_head), tl.load(V_scale + kv_head)
    else:
        return 1.0, 1.0
