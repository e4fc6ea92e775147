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
A program rotates one kv head of one token and the q heads that share it (GQA's group).

``apply_rotary(..., kv_store=(v, k_cache, v_cache, slot_mapping))`` also writes the token's
rotated k and its v into the paged KV cache (``kv_write``'s layout and slot rules), so a
layer's RoPE and cache write are one launch; it needs ``rotary_dim == head_dim``.

``apply_rotary(..., qk_norm=(q_weight, k_weight, eps))`` first RMS-normalizes every q and k
head over head_dim (Qwen3's q_norm/k_norm), so the norms, RoPE and cache write are one launch;
it needs ``rotary_dim == head_dim``. Each normed head rounds as ``rmsnorm.rms_norm`` rounds it
(``round(w * round(x * rsqrt(mean(x**2) + eps)))``, round to q's/k's dtype, the rest fp32) and
then rotates as above, so the result is bitwise that of ``rms_norm`` on each head followed by
``apply_rotary``, provided the sum of squares adds in the same order. Under Triton's
interpreter it does: that sum is taken over the head as one [heads, head_dim] row tile, as
``rms_norm`` takes it over its row (one extra load of lines the program reads anyway; the two
halves' partial sums would add in another order). On a GPU the reduction tree follows each
kernel's register layout, and ``rms_norm`` may contract its squares into FMAs while this kernel
never does, so there the two can differ by an fp32 ulp of the mean square (rarely one ulp of
the stored value).

Kernels that fold this work into another launch (``gemv``'s qkv epilogue, ``decode_attention``'s
new-token prologue) build it from the same parts -- ``load_cos_sin``, ``rotate``,
``rotated_heads``, ``store_kv_slot`` -- so they round as this kernel does. Those launches keep
FMA contraction on for their own sums, so these parts take a ``PRECISE`` constexpr
(``precise_math.mul_rn``); this module's launch turns contraction off and passes False.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenspeed_kernels import fp8_jit, kv_layout, kv_layout_jit
from tokenspeed_kernels.fp8 import cache_scales
from tokenspeed_kernels.precise_math import mul_rn


@triton.jit
def load_cos_sin(Cos_sin, pos, stride_cs, offs, HALF: tl.constexpr):
    """cos and sin (fp32) of position ``pos`` at dims ``offs`` of a half (0 past HALF)."""
    row = Cos_sin + pos.to(tl.int64) * stride_cs
    cos = tl.load(row + offs, mask=offs < HALF, other=0.0)
    sin = tl.load(row + HALF + offs, mask=offs < HALF, other=0.0)
    return cos, sin


@triton.jit
def rotate(x1, x2, cos, sin, PRECISE: tl.constexpr):
    """A head's halves rotated (module doc), in fp32; each product rounds on its own
    (``precise_math.mul_rn``) even in a launch that contracts products into FMAs."""
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    o1 = mul_rn(a, cos, PRECISE) - mul_rn(b, sin, PRECISE)
    o2 = mul_rn(b, cos, PRECISE) + mul_rn(a, sin, PRECISE)
    return o1, o2


@triton.jit
def _rms_norm_heads(
    rows, x1, x2, W, eps, head_dim, head_mask, offs,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, PRECISE: tl.constexpr,
):  # fmt: skip
    """The halves x1, x2 (fp32) of heads starting at ``rows``, RMS-normed over the head as
    ``rmsnorm._rms_norm_kernel`` rounds a row (module doc), back in fp32."""
    dtype = rows.dtype.element_ty
    # The whole head as one row, so the squares add in rms_norm's order (module doc).
    # NOTE: h's elements may sit in other threads than x1's and x2's, which the caller may
    # then overwrite in place; safe, as every store waits on its head's rstd, i.e. on all of
    # h's row.
    cols = tl.arange(0, 2 * BLOCK_HALF)
    mask = head_mask[:, None] & (cols < 2 * HALF)[None, :]
    h = tl.load(rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(mul_rn(h, h, PRECISE), 1) / head_dim + eps)[:, None]
    w1 = tl.load(W + offs, mask=offs < HALF, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(W + HALF + offs, mask=offs < HALF, other=0.0).to(tl.float32)[None, :]
    n1 = (w1 * (x1 * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    n2 = (w2 * (x2 * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    return n1, n2


@triton.jit
def _head_tile(
    X, token, head0, stride_t, stride_h, offs,
    NUM_HEADS: tl.constexpr, BLOCK_HEADS: tl.constexpr, HALF: tl.constexpr,
):  # fmt: skip
    """Pointers to the first dim of heads [head0, head0 + NUM_HEADS) of one token
    ([BLOCK_HEADS, 1]), which of them exist, and the mask of their first halves at ``offs``."""
    head_mask = tl.arange(0, BLOCK_HEADS) < NUM_HEADS
    heads = head0 + tl.arange(0, BLOCK_HEADS)
    rows = X + token.to(tl.int64) * stride_t + heads[:, None] * stride_h
    return rows, head_mask, head_mask[:, None] & (offs < HALF)[None, :]


@triton.jit
def rotated_heads(
    X, token, head0, stride_t, stride_h, cos, sin, offs, W, eps, head_dim,
    NUM_HEADS: tl.constexpr, BLOCK_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr, QK_NORM: tl.constexpr, PRECISE: tl.constexpr,
):  # fmt: skip
    """Heads [head0, head0 + NUM_HEADS) of one token RMS-normed by W when QK_NORM, then
    rotated, rounded to X's dtype: two [BLOCK_HEADS, BLOCK_HALF] halves, 0 where no head or
    dim is. X is only read. ``cos``/``sin``: ``load_cos_sin``'s, as [1, BLOCK_HALF]."""
    rows, head_mask, mask = _head_tile(
        X, token, head0, stride_t, stride_h, offs, NUM_HEADS, BLOCK_HEADS, HALF
    )
    x1 = tl.load(rows + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(rows + HALF + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    if QK_NORM:
        x1, x2 = _rms_norm_heads(
            rows, x1, x2, W, eps, head_dim, head_mask, offs, HALF, BLOCK_HALF, PRECISE
        )
    o1, o2 = rotate(x1, x2, cos, sin, PRECISE)
    return o1.to(X.dtype.element_ty), o2.to(X.dtype.element_ty)


@triton.jit
def _rotate_heads(
    X, token, head0, stride_t, stride_h, cos, sin, offs, W, eps, head_dim,
    NUM_HEADS: tl.constexpr, BLOCK_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
    QK_NORM: tl.constexpr,
):  # fmt: skip
    """``rotated_heads`` written back in place; returns the rotated halves."""
    # PRECISE off: this module's launch never contracts, so plain products already round alone.
    o1, o2 = rotated_heads(
        X, token, head0, stride_t, stride_h, cos, sin, offs, W, eps, head_dim,
        NUM_HEADS, BLOCK_HEADS, HALF, BLOCK_HALF, QK_NORM, False,
    )  # fmt: skip
    rows, _, mask = _head_tile(X, token, head0, stride_t, stride_h, offs, NUM_HEADS,
                               BLOCK_HEADS, HALF)  # fmt: skip
    tl.store(rows + offs[None, :], o1, mask=mask)
    tl.store(rows + HALF + offs[None, :], o2, mask=mask)
    return o1, o2


@triton.jit
def store_kv_slot(
    k1, k2, V, K_cache, V_cache, Slot_mapping, K_scale, V_scale, token, kv_head, stride_vt,
    stride_slot, stride_vb, stride_vp, stride_vh, stride_vd, page_size, offs,
    HALF: tl.constexpr,
):  # fmt: skip
    """Write one token's kv head: its rotated halves k1, k2 ([1, BLOCK_HALF]) and its v (read
    from V) at the token's slot of the caches; slot -1 (padding) writes nothing. The K cache
    is token-major (slot s at ``s * stride_slot``), the V cache either order of
    ``kv_layout`` (``stride_vb`` .. ``stride_vd``: its block, page, head and dim strides).
    An FP8 cache stores them divided by the head's scale (``K_scale``/``V_scale``
    [num_kv_heads] fp32, unread for a 16-bit cache; ``fp8_jit.to_cache``)."""
    slot = tl.load(Slot_mapping + token)
    # Heads of a cache slot are back to back: head h's values start at h * 2 * HALF.
    heads = (kv_head + tl.arange(0, 1))[:, None] * (2 * HALF)
    # A padding token (slot -1) masks its whole row out.
    mask = (offs < tl.where(slot >= 0, HALF, 0))[None, :]
    k_scale, v_scale = 1.0, 1.0
    if K_cache.dtype.element_ty == tl.float8e4nv:
        k_scale = tl.load(K_scale + kv_head)
        v_scale = tl.load(V_scale + kv_head)
    k_ptr = K_cache + slot * stride_slot + heads + offs[None, :]
    tl.store(k_ptr, fp8_jit.to_cache(k1, k_ptr, k_scale), mask=mask)
    tl.store(k_ptr + HALF, fp8_jit.to_cache(k2, k_ptr, k_scale), mask=mask)
    v_ptr = V + token.to(tl.int64) * stride_vt + heads + offs[None, :]
    v_out = (V_cache + kv_layout_jit.slot_offset(slot, page_size, stride_vb, stride_vp)
             + kv_head * stride_vh + offs[None, :] * stride_vd)  # fmt: skip
    tl.store(v_out, fp8_jit.to_cache(tl.load(v_ptr, mask=mask), v_out, v_scale), mask=mask)
    v_hi = tl.load(v_ptr + HALF, mask=mask)
    tl.store(v_out + HALF * stride_vd, fp8_jit.to_cache(v_hi, v_out, v_scale), mask=mask)


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
    K_scale,  # an FP8 cache's [num_kv_heads] fp32 scales (``store_kv_slot``)
    V_scale,
    stride_vt,
    stride_slot,  # of the K cache: one token's [num_kv_heads, head_dim] values
    stride_vb,  # the V cache's (``store_kv_slot``)
    stride_vp,
    stride_vh,
    stride_vd,
    page_size,
    Q_weight,
    K_weight,
    eps,
    head_dim,  # a runtime int, as rms_norm's ``hidden``: the same division
    GROUP: tl.constexpr,  # q heads per kv head
    BLOCK_QH: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    STORE_KV: tl.constexpr,
    QK_NORM: tl.constexpr,
):
    token = tl.program_id(0)
    kv_head = tl.program_id(1)  # with its GROUP q heads
    pos = tl.load(Positions + token)
    offs = tl.arange(0, BLOCK_HALF)
    cos, sin = load_cos_sin(Cos_sin, pos, stride_cs, offs, HALF)
    cos, sin = cos[None, :], sin[None, :]
    _rotate_heads(
        Q, token, kv_head * GROUP, stride_qt, stride_qh, cos, sin, offs, Q_weight, eps, head_dim,
        GROUP, BLOCK_QH, HALF, BLOCK_HALF, QK_NORM,
    )  # fmt: skip
    k1, k2 = _rotate_heads(
        K, token, kv_head, stride_kt, stride_kh, cos, sin, offs, K_weight, eps, head_dim,
        1, 1, HALF, BLOCK_HALF, QK_NORM,
    )  # fmt: skip
    if STORE_KV:
        store_kv_slot(
            k1, k2, V, K_cache, V_cache, Slot_mapping, K_scale, V_scale, token, kv_head,
            stride_vt, stride_slot, stride_vb, stride_vp, stride_vh, stride_vd, page_size,
            offs, HALF,
        )  # fmt: skip


def kv_store_strides(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> tuple[int, ...]:
    """``store_kv_slot``'s ``stride_vt``, ``stride_slot``, the V cache's four strides and
    the page size, after checking the layouts it assumes: k's and v's heads back to back,
    caches packed, K token-major (``kv_layout``)."""
    head_dim = k.shape[2]
    assert k.stride(1) == head_dim and v.stride(1) == head_dim and v.stride(2) == 1
    assert kv_layout.strides(k_cache)[3] == 1, "a token-major K cache"
    return (v.stride(0), k_cache.stride(1), *kv_layout.strides(v_cache), k_cache.shape[1])


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_store: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Rotate q and k in place by their tokens' positions; with ``kv_store`` = (v, k_cache,
    v_cache, slot_mapping), also store k and v in the cache (an FP8 one by ``kv_scales``,
    k's and v's [num_kv_heads] fp32); with ``qk_norm`` = (q_weight, k_weight, eps), weights
    [head_dim], RMS-norm each q and k head first (module doc)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    rotary_dim = cos_sin_cache.shape[1]
    assert rotary_dim % 2 == 0 and rotary_dim <= head_dim and k.shape[2] == head_dim
    assert q.stride(2) == 1 and k.stride(2) == 1 and cos_sin_cache.stride(1) == 1
    if num_tokens == 0:
        return
    half = rotary_dim // 2
    if kv_store is None:
        v, k_cache, v_cache, slot_mapping = k, k, k, positions
        store_strides = (0,) * 7
    else:
        v, k_cache, v_cache, slot_mapping = kv_store
        assert rotary_dim == head_dim, "the fused cache write rotates whole heads"
        store_strides = kv_store_strides(k, v, k_cache, v_cache)
    k_scale, v_scale = cache_scales(k_cache, kv_scales)
    if qk_norm is None:
        q_weight, k_weight, eps = q, k, 0.0
    else:
        q_weight, k_weight, eps = qk_norm
        assert rotary_dim == head_dim, "the fused qk-norm normalizes whole heads"
        for w in (q_weight, k_weight):
            assert w.shape == (head_dim,) and w.is_contiguous()
    assert num_q_heads % num_kv_heads == 0
    group = num_q_heads // num_kv_heads
    _rotary_kernel[(num_tokens, num_kv_heads)](
        q, k, positions, cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        v, k_cache, v_cache, slot_mapping, k_scale, v_scale, *store_strides,
        q_weight, k_weight, eps, head_dim,
        GROUP=group, BLOCK_QH=triton.next_power_of_2(group),
        HALF=half, BLOCK_HALF=triton.next_power_of_2(half), STORE_KV=kv_store is not None,
        QK_NORM=qk_norm is not None,
        # One warp: a program's tile is one token's kv head and its q group, so more warps
        # only idle (H200, 8192 tokens of Qwen3-8B's heads: 1 warp 88 us, 4 warps 114 us).
        num_warps=1,
        enable_fp_fusion=False,  # no FMA: x1*cos - x2*sin rounds as torch's separate ops
    )  # fmt: skip
