"""Paged prefill/extend attention: rows of several new tokens over a cached prefix, causal.

Layout contract::

    q:               [num_tokens, num_q_heads, head_dim]  (head_dim contiguous)
    k/v_cache:       [num_blocks, page_size, num_kv_heads, head_dim] (K token-major, V token-
                     or dim-major: ``kv_layout``), already holding the new tokens' keys/values
                     (kv_write runs first), so every key is read from it
    block_tables:    [B, max_blocks] int32
    query_start_loc: [B + 1] int32, row b's queries are tokens [query_start_loc[b], [b+1])
    seq_lens:        [B] int32, keys after this forward; context = seq_len - query_len
    out:             [num_tokens, num_q_heads, head_dim]; tokens past query_start_loc[B]
                     (padding) are not written

Query ``j`` of row ``b`` sits at absolute position ``context + j`` and sees keys
``[0, context + j]``. Query head ``h`` reads KV head ``h // group``. A program owns BLOCK_M
queries of one head of one row and walks the keys in two phases::

    keys: 0 ......................... full_hi ........... kv_hi      seq_len
          |  phase 1: visible to every |  phase 2: causal  |  (never  |
          |  query of the block, no    |  mask per (query, |  read)   |
          |  causal mask               |  key)             |          |
    full_hi = (context + first query of the block) rounded down to BLOCK_N
    kv_hi   = min(seq_len, context + last query of the block + 1)

The grid is (num_q_heads, cdiv(max_query_len, BLOCK_M), B - row_start); programs past their
row's queries exit, so compiled kernels depend only on head_dim, page_size, group, dtype and blocks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenspeed_kernels import kv_layout
from tokenspeed_kernels.attention_tiles import attend_keys, head_scales, reads_pages
from tokenspeed_kernels.fp8 import cache_scales

# (queries per program, keys per tile, warps, pipeline stages) by the cache's bytes per value
# (kernels/bench_extend_tiles.py). An e4m3 tile is widened to fp16 before its products, so
# 128 queries share each widening; a 16-bit one is fastest at 64 for a round of 1,024-token
# prompts.
TILES = {1: (128, 64, 4, 2), 2: (64, 64, 4, 2), 4: (64, 64, 4, 2)}
_LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=["stride_bt", "row_start"])
def _extend_kernel(
    Q,
    K_cache,
    V_cache,
    Block_tables,
    Query_start_loc,
    Seq_lens,
    Out,
    K_scale,  # an FP8 cache's [num_kv_heads] fp32 scales (``attention_tiles``), else unread
    V_scale,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_kp,
    stride_kh,
    stride_vb,
    stride_vp,
    stride_vh,
    stride_vd,
    stride_bt,
    row_start,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    V_PAGES: tl.constexpr,  # a dim-major V cache read a page at a time (``attend_keys``)
):
    head = tl.program_id(0)
    # The last query blocks of a row see the most keys: launch them first.
    m_block = tl.num_programs(1) - 1 - tl.program_id(1)
    row = row_start + tl.program_id(2)
    q_start = tl.load(Query_start_loc + row)
    q_len = tl.load(Query_start_loc + row + 1) - q_start
    m_lo = m_block * BLOCK_M
    if m_lo < q_len:
        seq_len = tl.load(Seq_lens + row)
        context = seq_len - q_len
        kv_head = head // GROUP
        k_scale, v_scale = head_scales(K_scale, V_scale, kv_head, K_cache)
        offs_m = m_lo + tl.arange(0, BLOCK_M)
        m_mask = offs_m < q_len
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        tokens = (q_start + offs_m).to(tl.int64)
        io_mask = m_mask[:, None] & d_mask[None, :]
        q = tl.load(
            Q + tokens[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
            mask=io_mask,
            other=0.0,
        )
        q_pos = context + offs_m
        bt_row = Block_tables + row.to(tl.int64) * stride_bt

        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        full_hi = (context + m_lo) // BLOCK_N * BLOCK_N
        kv_hi = tl.minimum(seq_len, context + m_lo + BLOCK_M)
        acc, m_i, l_i = attend_keys(
            acc, m_i, l_i, q, q_pos, 0, full_hi,
            K_cache, V_cache, bt_row, kv_head, offs_d, d_mask, scale_log2 * k_scale,
            stride_kb, stride_kp, stride_kh, stride_vb, stride_vp, stride_vh, stride_vd,
            PAGE_SIZE, BLOCK_N, False, V_PAGES,
        )  # fmt: skip
        acc, m_i, l_i = attend_keys(
            acc, m_i, l_i, q, q_pos, full_hi, kv_hi,
            K_cache, V_cache, bt_row, kv_head, offs_d, d_mask, scale_log2 * k_scale,
            stride_kb, stride_kp, stride_kh, stride_vb, stride_vp, stride_vh, stride_vd,
            PAGE_SIZE, BLOCK_N, True, V_PAGES,
        )  # fmt: skip
        tl.store(
            Out + tokens[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
            (acc / l_i[:, None] * v_scale).to(Out.dtype.element_ty),
            mask=io_mask,
        )


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    row_start: int = 0,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    tiles: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """Causal attention of every row's new tokens over its cached keys (layout: module doc).

    ``max_query_len`` is a host int bounding every row's query count (it sizes the grid).
    With ``row_start``, rows before it are left alone (their outputs unwritten): a caller
    that attends a mixed batch's leading decode rows with ``decode_attention`` passes the
    whole batch's tensors, so no view moves a pointer (Triton specializes on alignment).
    An FP8 (e4m3) cache takes ``kv_scales``: k's and v's [num_kv_heads] fp32 scales.
    ``tiles`` overrides ``TILES`` (a benchmark's sweep).
    """
    _, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    assert num_q_heads % num_kv_heads == 0, "num_q_heads must be a multiple of num_kv_heads"
    assert q.stride(2) == 1 and k_cache.stride(3) == 1
    v_strides = kv_layout.strides(v_cache)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    batch = block_tables.shape[0] - row_start
    if batch <= 0 or max_query_len == 0:
        return out
    block_m, block_n, num_warps, num_stages = tiles or TILES[k_cache.element_size()]
    block_d = triton.next_power_of_2(head_dim)
    grid = (num_q_heads, triton.cdiv(max_query_len, block_m), batch)
    k_scale, v_scale = cache_scales(k_cache, kv_scales)
    _extend_kernel[grid](
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out, k_scale, v_scale,
        scale * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        *v_strides, block_tables.stride(0), row_start,
        GROUP=num_q_heads // num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_D=block_d, PAGE_SIZE=page_size, BLOCK_M=block_m, BLOCK_N=block_n,
        V_PAGES=reads_pages(v_cache, block_n, block_d), num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
    return out
