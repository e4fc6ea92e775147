"""Paged decode attention: one query token per row, GQA-aware, split-KV (flash-decoding).

Layout contract::

    q:            [B, num_q_heads, head_dim]           (head_dim contiguous; rows may be strided)
    k/v_cache:    [num_blocks, page_size, num_kv_heads, head_dim]  (K token-major; V token-
                  or dim-major, ``kv_layout``)
    block_tables: [B, max_blocks] int32                (0 = null block)
    seq_lens:     [B] int32                             keys attended: positions [0, seq_lens[b])
    out:          [B, num_q_heads, head_dim], q's dtype (0 for rows with seq_len 0)

Query head ``h`` reads KV head ``h // group`` (group = num_q_heads // num_kv_heads), as in HF's
``repeat_kv``. One program of the first kernel handles every query head of one KV head on one
split of one row, so each K/V tile is loaded once for the whole group.

Splits: each row's keys are cut into ``num_kv_splits`` chunks of equal length, rounded up to
``BLOCK_N`` (so a short row uses only its first splits; the rest exit at once)::

    chunk = round_up(cdiv(seq_len, num_kv_splits), BLOCK_N)
    keys: |<- split 0 ->|<- split 1 ->| ... |<- last used split, may be short ->|  (idle splits)
          0           chunk        2*chunk                                   seq_len

Each split writes its normalized partial output and log-sum-exp, then counts itself done on
its (row, KV head)'s counter; the split that finishes last merges the partials of the splits
the row used, for the group's query heads, and zeroes the counter for the next launch. There
is no second launch::

    counters:     [>= B * num_kv_heads] int32, zero before the launch and zero after it

Ordering: every thread's partials are stored before the count (a CTA barrier, then one
acquire-release atomic at GPU scope); the merging program reads them after its own count, and
through L2 (``.cg``). The merge weighs all splits at once, so its result does not depend on
which split finishes last. With one split (large batches) the split kernel writes the output
itself. ``num_kv_splits`` is a plain (unspecialized) argument and the grid is
``(B, num_kv_heads, num_kv_splits)``, so compiled kernels depend only on head_dim, page_size,
group, dtype and block sizes, and the launch for one batch size is the same every step
(CUDA-graph capturable, no host sync).

New-token prologue: ``decode_attention(q, ..., new_token=NewToken(k, v, positions,
cos_sin_cache, slot_mapping, qk_norm))`` is ``rotary.apply_rotary(q, k, positions,
cos_sin_cache, kv_store=(v, k_cache, v_cache, slot_mapping), qk_norm=qk_norm)`` followed by
``decode_attention(q, ...)``, in one launch fewer::

    q:             [B, num_q_heads, head_dim]    raw: not yet normed nor rotated; only read
    k, v:          [B, num_kv_heads, head_dim]   the rows' new tokens, raw; only read (heads
                                                 back to back, head_dim contiguous; rows may
                                                 be strided, e.g. views of the qkv output)
    positions:     [B]                           each new token's RoPE position
    cos_sin_cache: [max_position, head_dim] fp32 RoPE over whole heads (rotary's layout)
    slot_mapping:  [B] int64                     the new key's slot; -1 stores nothing
    qk_norm:       (q_weight [head_dim], k_weight [head_dim], eps) or None
    k/v_cache:     packed, blocks back to back (``rotary.kv_store_strides``)

head_dim must be a power of two (``folds_new_token``).
Every program norms (with qk_norm) and rotates the q heads of its group from the raw q, with
``rotary``'s own parts, and rounds them to q's dtype: the values apply_rotary would store, kept
in registers. The new key is position ``seq_len - 1``, so the one program whose key range holds
it (split 0 for a row without keys) norms and rotates that kv head's k and stores it and v at
the slot, then waits on a CTA barrier before its loop reads the key back; no other program reads
that slot, so nothing orders programs. This needs ``slot_mapping[b]`` to be the slot of key
``seq_len[b] - 1`` in ``block_tables`` (or -1), as a decode step's is.

Under Triton's interpreter the output and the caches equal the unfused pair's bit for bit. On a
GPU the products round alone here (``precise_math.mul_rn``) as in rotary's launch, which turns
FMA contraction off, so q and the stored k/v match there too, except that qk_norm's sum of
squares may add in another order (``rotary``'s module doc): now and then an ulp of a normed
value, and then of the output.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tokenspeed_kernels import kv_layout, precise_math
from tokenspeed_kernels.attention_tiles import attend_keys, head_scales, reads_pages
from tokenspeed_kernels.fp8 import cache_scales
from tokenspeed_kernels.rotary import kv_store_strides, load_cos_sin, rotated_heads, store_kv_slot

# (keys per tile, warps, pipeline stages, registers per thread or None) by the cache's bytes
# per value. The loop over a split's keys is latency-bound: a tile's gather, widening and two
# small products run back to back, so what the SM holds in flight sets the bandwidth
# (kernels/bench_attention_tiles.py). An e4m3 tile's widened K and V take about 150
# registers a thread uncapped (V dim-major, kv_layout), three programs per SM; capped at 128
# (a few spills), four fit, and that tile stays the fastest.
TILES = {1: (128, 4, 2, 128), 2: (64, 4, 2, None), 4: (64, 4, 2, None)}
# A split launch of one row (``num_kv_splits_for``: up to 32 splits a head) leaves each split
# a tile or less of a 1-2k context, so what its program waits on is one tile's chain, not
# the SM's loads in flight: an e4m3 cache takes half the keys a tile there, and no register
# cap. Unsplit launches (the batch-invariant mode's) keep ``TILES`` at every batch size: a
# row's keys are then summed in the same tiles alone as in a batch.
ONE_ROW_TILES = {1: (64, 4, 2, None)}
MAX_KV_SPLITS = 32
MIN_KEYS_PER_SPLIT = 256  # below this a split costs more (partials, merge) than it saves
_LOG2E = 1.4426950408889634


def tiles_for(batch_size: int, itemsize: int, num_kv_splits: int) -> tuple:
    """The tiles a launch of ``batch_size`` rows and ``num_kv_splits`` splits over a cache of
    ``itemsize``-byte values takes (``TILES``, ``ONE_ROW_TILES``)."""
    one_row = batch_size == 1 and num_kv_splits > 1
    return (one_row and ONE_ROW_TILES.get(itemsize)) or TILES[itemsize]


def num_kv_splits_for(batch_size: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """The split count for a batch size: about two programs per SM, bounded by what the
    longest possible context can use. Depends only on host constants, never on tensor values."""
    useful = triton.cdiv(max(max_seq_len, 1), MIN_KEYS_PER_SPLIT)
    wanted = triton.cdiv(2 * num_sms, max(batch_size * num_kv_heads, 1))
    return max(1, min(MAX_KV_SPLITS, useful, wanted))


@triton.jit(do_not_specialize=["num_kv_splits", "stride_bt"])
def _decode_split_kernel(
    Q,
    K_cache,
    V_cache,
    Block_tables,
    Seq_lens,
    Mid_o,  # [B, num_q_heads, num_kv_splits, HEAD_DIM] fp32, normalized partial outputs
    Mid_lse,  # [B, num_q_heads, num_kv_splits] fp32, log2-sum-exp2 of the scaled scores
    Out,
    Counters,  # [>= B * num_kv_heads] int32, zero before and after the launch (module doc)
    K_scale,  # an FP8 cache's [num_kv_heads] fp32 scales (``attention_tiles``), else unread
    V_scale,
    scale_log2,  # softmax scale * log2(e): scores are exponentiated with exp2
    num_kv_splits,
    stride_ot,
    stride_oh,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kp,
    stride_kh,
    stride_vb,
    stride_vp,
    stride_vh,
    stride_vd,
    stride_bt,
    K_new,  # NEW_TOKEN's operands (module doc), unread without it
    V_new,
    Positions,
    Cos_sin,
    Slot_mapping,
    Q_weight,  # these two and eps: QK_NORM's
    K_weight,
    eps,
    head_dim,  # a runtime int, as rotary's launch passes it: the norm divides alike
    stride_knt,
    stride_knh,
    stride_vnt,
    stride_cs,
    stride_slot,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DIRECT: tl.constexpr,
    BLOCK_G: tl.constexpr,  # GROUP rounded up to a power of two: the merge's head tile
    BLOCK_S: tl.constexpr,  # MAX_KV_SPLITS: the merge's split tile, the same for every count
    NEW_TOKEN: tl.constexpr,  # Q is the raw query; norm, rotate and store first (module doc)
    QK_NORM: tl.constexpr,
    PRECISE: tl.constexpr,  # precise_math.PRECISE_MATH: NEW_TOKEN's products round alone
    V_PAGES: tl.constexpr,  # a dim-major V cache read a page at a time (``attend_keys``)
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_q_heads = tl.num_programs(1) * GROUP

    seq_len = tl.load(Seq_lens + row)
    k_scale, v_scale = head_scales(K_scale, V_scale, kv_head, K_cache)
    chunk = tl.maximum(tl.cdiv(tl.cdiv(seq_len, num_kv_splits), BLOCK_N) * BLOCK_N, BLOCK_N)
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)
    offs_h = tl.arange(0, BLOCK_H)
    h_mask = offs_h < GROUP
    q_heads = kv_head * GROUP + offs_h
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    hd_mask = h_mask[:, None] & d_mask[None, :]
    out_ptrs = Out + row.to(tl.int64) * stride_ot + q_heads[:, None] * stride_oh + offs_d[None, :]
    if NEW_TOKEN:
        HALF: tl.constexpr = HEAD_DIM // 2  # == BLOCK_D // 2: power-of-two heads (module doc)
        offs_half = tl.arange(0, HALF)
        cos, sin = load_cos_sin(Cos_sin, tl.load(Positions + row), stride_cs, offs_half, HALF)
        cos, sin = cos[None, :], sin[None, :]
        # The split whose keys hold the new one, position seq_len - 1 (split 0 for a row
        # without keys), stores it; no other program reads that slot. The condition is the
        # same for the whole program, so every thread reaches the barrier, after which the
        # stores of all of them are visible to the loop's loads.
        if split == tl.maximum(seq_len - 1, 0) // chunk:
            k1, k2 = rotated_heads(
                K_new, row, kv_head, stride_knt, stride_knh, cos, sin, offs_half, K_weight,
                eps, head_dim, 1, 1, HALF, HALF, QK_NORM, PRECISE,
            )  # fmt: skip
            store_kv_slot(
                k1, k2, V_new, K_cache, V_cache, Slot_mapping, K_scale, V_scale, row, kv_head,
                stride_vnt, stride_slot, stride_vb, stride_vp, stride_vh, stride_vd, PAGE_SIZE,
                offs_half, HALF,
            )  # fmt: skip
            tl.debug_barrier()
    if start < end:
        if NEW_TOKEN:  # the values apply_rotary would have written over Q, kept in registers
            q1, q2 = rotated_heads(
                Q, row, kv_head * GROUP, stride_qt, stride_qh, cos, sin, offs_half, Q_weight,
                eps, head_dim, GROUP, BLOCK_H, HALF, HALF, QK_NORM, PRECISE,
            )  # fmt: skip
            # [BLOCK_H, HALF] twice -> [BLOCK_H, 2, HALF] -> the heads' [BLOCK_H, HEAD_DIM].
            q = tl.reshape(tl.permute(tl.join(q1, q2), (0, 2, 1)), (BLOCK_H, BLOCK_D))
        else:
            q = tl.load(
                Q + row.to(tl.int64) * stride_qt + q_heads[:, None] * stride_qh + offs_d[None, :],
                mask=hd_mask,
                other=0.0,
            )
        bt_row = Block_tables + row.to(tl.int64) * stride_bt

        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        acc, m_i, l_i = attend_keys(
            acc, m_i, l_i, q, offs_h, start, end,
            K_cache, V_cache, bt_row, kv_head, offs_d, d_mask, scale_log2 * k_scale,
            stride_kb, stride_kp, stride_kh, stride_vb, stride_vp, stride_vh, stride_vd,
            PAGE_SIZE, BLOCK_N, False, V_PAGES,
        )  # fmt: skip

        o = acc / l_i[:, None] * v_scale
        if DIRECT:
            tl.store(out_ptrs, o.to(Out.dtype.element_ty), mask=hd_mask)
        else:
            mid = (row.to(tl.int64) * num_q_heads + q_heads) * num_kv_splits + split
            tl.store(Mid_o + mid[:, None] * HEAD_DIM + offs_d[None, :], o, mask=hd_mask)
            tl.store(Mid_lse + mid, m_i + tl.log2(l_i), mask=h_mask)
            # Count this split done; the row's last one to finish merges (module doc).
            tl.debug_barrier()  # every thread's partials stored before the count
            counter = Counters + row * tl.num_programs(1) + kv_head
            used = tl.cdiv(seq_len, chunk)  # splits [0, used) hold keys
            if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == used - 1:
                tl.store(counter, 0)  # for the next launch, which the stream orders after this
                _merge_splits(
                    Mid_o, Mid_lse, Out, row, kv_head, used, num_kv_splits,
                    stride_ot, stride_oh, offs_d, d_mask, GROUP, BLOCK_G, HEAD_DIM, BLOCK_S,
                )  # fmt: skip
    elif split == 0:  # a row without keys (a graph's padding row): zeros
        tl.store(out_ptrs, tl.zeros([BLOCK_H, BLOCK_D], Out.dtype.element_ty), mask=hd_mask)


@triton.jit
def _merge_splits(
    Mid_o, Mid_lse, Out, row, kv_head, used, num_kv_splits, stride_ot, stride_oh, offs_d, d_mask,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """The outputs of ``kv_head``'s GROUP query heads on ``row``: the partials of splits
    [0, used), weighted by their log-sum-exp, all in one load. Read through L2 (``.cg``):
    other programs wrote them during this launch."""
    offs_g = tl.arange(0, BLOCK_G)
    offs_s = tl.arange(0, BLOCK_S)
    heads = kv_head * GROUP + offs_g
    num_q_heads = tl.num_programs(1) * GROUP
    mid = ((row.to(tl.int64) * num_q_heads + heads) * num_kv_splits)[:, None] + offs_s[None, :]
    head_ok = offs_g < GROUP  # BLOCK_G pads a group that is not a power of two
    gs_mask = head_ok[:, None] & (offs_s < used)[None, :]
    lse = tl.load(Mid_lse + mid, mask=gs_mask, other=float("-inf"), cache_modifier=".cg")
    lse = tl.where(head_ok[:, None], lse, 0.0)  # padding heads: finite, and stored nowhere
    o = tl.load(
        Mid_o + mid[:, :, None] * HEAD_DIM + offs_d[None, None, :],
        mask=gs_mask[:, :, None] & d_mask[None, None, :],
        other=0.0,
        cache_modifier=".cg",
    )
    w = tl.exp2(lse - tl.max(lse, 1)[:, None])  # [G, S]; 0 for splits past ``used``
    out = tl.sum(w[:, :, None] * o, 1) / tl.sum(w, 1)[:, None]
    out_ptrs = Out + row.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(out_ptrs, out.to(Out.dtype.element_ty), mask=head_ok[:, None] & d_mask[None, :])


def folds_new_token(head_dim: int) -> bool:
    """Whether ``decode_attention`` takes ``new_token`` for heads of ``head_dim`` (a power of
    two: a rotated head's halves then fill the q tile exactly)."""
    return head_dim >= 2 and head_dim & (head_dim - 1) == 0


class NewToken(NamedTuple):
    """Each row's new token, which ``decode_attention`` norms, rotates and stores itself before
    attending (``rotary.apply_rotary`` with ``kv_store``, folded in; layout: module doc)."""

    k: torch.Tensor  # [B, Hkv, D], raw
    v: torch.Tensor  # [B, Hkv, D]
    positions: torch.Tensor  # [B], each token's RoPE position
    cos_sin_cache: torch.Tensor  # [max_position, D] fp32
    slot_mapping: torch.Tensor  # [B] int64; -1 stores nothing
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None  # (q_weight, k_weight, eps)


def _new_token_args(q: torch.Tensor, k_cache, v_cache, new: NewToken | None) -> tuple:
    """The split kernel's operands from K_new to stride_slot (dummies without ``new``)."""
    if new is None:
        return (q,) * 7 + (0.0,) + (0,) * 6
    batch, _, head_dim = q.shape
    k, v, positions, cos_sin, slot_mapping, qk_norm = new
    num_kv_heads = k_cache.shape[2]
    assert folds_new_token(head_dim), "the new-token prologue needs power-of-two heads"
    assert cos_sin.shape[1] == head_dim and cos_sin.stride(1) == 1
    assert cos_sin.dtype == torch.float32
    assert k.shape == v.shape == (batch, num_kv_heads, head_dim) and k.stride(2) == 1
    assert positions.shape == slot_mapping.shape == (batch,)
    stride_vt, stride_slot, *_ = kv_store_strides(k, v, k_cache, v_cache)
    q_weight, k_weight, eps = qk_norm if qk_norm is not None else (q, q, 0.0)
    if qk_norm is not None:
        for w in (q_weight, k_weight):
            assert w.shape == (head_dim,) and w.is_contiguous()
    return (
        k, v, positions, cos_sin, slot_mapping, q_weight, k_weight, eps, head_dim,
        k.stride(0), k.stride(1), stride_vt, cos_sin.stride(0), stride_slot,
    )  # fmt: skip


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_kv_splits: int,
    out: torch.Tensor | None = None,
    new_token: NewToken | None = None,
    counters: torch.Tensor | None = None,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    tiles: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """Attend each row's single query to its ``seq_lens[b]`` cached keys (layout: module doc).

    ``num_kv_splits`` must be a host constant for a given batch size (see
    :func:`num_kv_splits_for`); ``out`` may be given to write in place. With ``new_token``, q
    is the raw query and the rows' new keys are not yet in the cache: the kernel norms and
    rotates q and k and stores k and v first (module doc); q and new_token's tensors are
    only read. ``counters`` (int32, zero, at least B * num_kv_heads entries, left zero) is
    the split merge's; a caller that replays the launch from a CUDA graph keeps one across
    launches, by default each call makes one. An FP8 (e4m3) cache takes ``kv_scales``: k's
    and v's [num_kv_heads] fp32 scales. ``tiles`` overrides ``tiles_for`` (a benchmark's sweep;
    its register cap may be left out).
    """
    batch, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    assert num_q_heads % num_kv_heads == 0, "num_q_heads must be a multiple of num_kv_heads"
    assert q.stride(2) == 1 and k_cache.stride(3) == 1
    v_strides = kv_layout.strides(v_cache)
    assert 1 <= num_kv_splits <= MAX_KV_SPLITS, f"num_kv_splits must be in [1, {MAX_KV_SPLITS}]"
    group = num_q_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    direct = num_kv_splits == 1
    if direct:  # no partials: the split kernel writes out
        mid_o = mid_lse = counters = out
    else:
        if counters is None:
            counters = torch.zeros(batch * num_kv_heads, dtype=torch.int32, device=q.device)
        assert counters.dtype == torch.int32 and counters.numel() >= batch * num_kv_heads
        mid_o = torch.empty(
            (batch, num_q_heads, num_kv_splits, head_dim), dtype=torch.float32, device=q.device
        )
        mid_lse = torch.empty(
            (batch, num_q_heads, num_kv_splits), dtype=torch.float32, device=q.device
        )
    block_d = triton.next_power_of_2(head_dim)
    # tl.dot needs at least 16 rows; the padding heads are masked and cost no memory traffic.
    block_h = max(16, triton.next_power_of_2(group))
    k_scale, v_scale = cache_scales(k_cache, kv_scales)
    block_n, num_warps, num_stages, *cap = tiles or tiles_for(
        batch, k_cache.element_size(), num_kv_splits
    )
    registers = {"maxnreg": cap[0]} if cap and cap[0] is not None else {}
    _decode_split_kernel[(batch, num_kv_heads, num_kv_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, mid_o, mid_lse, out, counters,
        k_scale, v_scale, scale * _LOG2E, num_kv_splits, out.stride(0), out.stride(1),
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        *v_strides, block_tables.stride(0), *_new_token_args(q, k_cache, v_cache, new_token),
        GROUP=group, BLOCK_H=block_h, HEAD_DIM=head_dim, BLOCK_D=block_d,
        PAGE_SIZE=page_size, BLOCK_N=block_n, DIRECT=direct,
        BLOCK_G=triton.next_power_of_2(group), BLOCK_S=MAX_KV_SPLITS,
        NEW_TOKEN=new_token is not None,
        QK_NORM=new_token is not None and new_token.qk_norm is not None,
        PRECISE=precise_math.PRECISE_MATH,
        V_PAGES=reads_pages(v_cache, block_n, block_d), num_warps=num_warps,
        num_stages=num_stages, **registers,
    )  # fmt: skip
    return out
