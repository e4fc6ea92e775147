"""The batch-1 product's loop as Triton helpers (``gemv.py``'s module doc gives the layouts,
the norm prologues, the FP8 modes and the programmatic dependent launch): ``products``, which
``gemv``'s and ``gemv_rope_kv``'s kernels run, and ``load_weight``, also ``skinny_gemm``'s."""

from __future__ import annotations

import triton
import triton.language as tl

from tokenspeed_kernels import fp8_jit, pdl


@triton.jit
def _load_h(X, Residual, offs, mask, HAS_RESIDUAL: tl.constexpr):
    """The norm's input at ``offs``: x, or x + residual rounded to x's dtype (as ``rmsnorm``)."""
    h = tl.load(X + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(Residual + offs, mask=mask, other=0.0)
        h = (h.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
    return h


@triton.jit
def load_weight(ptrs, mask, EVEN: tl.constexpr):
    """A weight tile, masked unless EVEN: the tiles divide the weight, and unmasked loads
    keep the tile that ``products`` loads before ``pdl.wait_prior`` to its own registers
    (masked, the kernel with PDL grew from 168 to 254 registers on sm_90). Also
    ``skinny_gemm``'s."""
    if EVEN:
        w = tl.load(ptrs)
    else:
        w = tl.load(ptrs, mask=mask, other=0.0)
    return w


@triton.jit
def _chunk(k0, offs_k, sum_sq, rstd, X, Residual, NormW, ResidualOut, K, h_end,
           NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, TWO_PASS: tl.constexpr,
           STORE_H: tl.constexpr):  # fmt: skip
    """fp32 x at ``k0 + offs_k`` (the normed h with NORM; h stored where STORE_H)."""
    mask_k = (k0 + offs_k) < K
    if NORM:
        h = _load_h(X, Residual, k0 + offs_k, mask_k, HAS_RESIDUAL)
        if HAS_RESIDUAL and STORE_H:
            tl.store(ResidualOut + k0 + offs_k, h, mask=(k0 + offs_k) < h_end)
        hf = h.to(tl.float32)
        g = tl.load(NormW + k0 + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        if TWO_PASS:  # the norm kernel's roundings
            normed = (hf * rstd).to(X.dtype.element_ty).to(tl.float32)
            x = (g * normed).to(X.dtype.element_ty).to(tl.float32)
        else:  # scaled by rstd after the loop
            sum_sq += hf * hf
            x = g * hf
    else:
        x = tl.load(X + k0 + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    return x, sum_sq


@triton.jit
def _accumulate(
    w, w_b, k0, offs_k, acc, acc_b, sum_sq, rstd, X, Residual, NormW, ResidualOut, K, h_end,
    sx, ws, ws_b, num_kb,
    PAIRED: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, TWO_PASS: tl.constexpr,
    FP8: tl.constexpr,
):  # fmt: skip
    """One BLOCK_K step of ``products``: the weight tiles ``w`` (and ``w_b``) at ``k0`` times
    that slice of x (the normed h with NORM); with FP8, x quantized first (``fp8.py``): by
    the row's scale ``sx`` (FP8 == 1), or by each 128-group's own scale, each group's partial
    sums times its weight blocks' scales (FP8 == 2; ``ws``: the rows' block-row pointers)."""
    x, sum_sq = _chunk(k0, offs_k, sum_sq, rstd, X, Residual, NormW, ResidualOut, K, h_end,
                       NORM, HAS_RESIDUAL, TWO_PASS, True)  # fmt: skip
    if FP8 == 2:
        acc = fp8_jit.block_dot(w, x, k0, ws, num_kb, acc)
        if PAIRED:
            acc_b = fp8_jit.block_dot(w_b, x, k0, ws_b, num_kb, acc_b)
    elif FP8 == 1:
        x = fp8_jit.fake_quantize(x, 1.0 / sx)
        acc += fp8_jit.slice_sums(w, x)
        if PAIRED:
            acc_b += fp8_jit.slice_sums(w_b, x)
    else:
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        if PAIRED:
            acc_b += tl.sum(w_b.to(tl.float32) * x[None, :], axis=1)
    return acc, acc_b, sum_sq


@triton.jit
def products(
    X, W, Bias, Residual, NormW, ResidualOut, rows, rows_b, mask_n, K, stride_wn, eps, writes_h,
    W_scale, X_scale, stride_ws,
    BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, PAIRED: tl.constexpr, NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, TWO_PASS: tl.constexpr, PDL: tl.constexpr, EVEN: tl.constexpr,
    FP8: tl.constexpr, STATIC: tl.constexpr, BLOCK_P: tl.constexpr,
):  # fmt: skip
    """fp32 ``x . W[rows] + bias[rows]`` (x: the normed h with NORM, module doc), and the same
    for ``rows_b`` when PAIRED; the program with ``writes_h`` stores h. Only the weight, which
    no kernel writes, is read before ``pdl.wait_prior``: the first tile (module doc). FP8 (module doc): 0 a 16-bit
    weight; 1 e4m3 with a scale per row of ``W_scale``, x quantized by its amax (a prologue
    loop) or by the static ``X_scale``; 2 e4m3 with 128 x 128 block scales ``W_scale``
    (row stride ``stride_ws``), x quantized per 128-group. The prologue loops (the two-pass
    norm's sum of squares, the amax) read x in chunks of ``BLOCK_P`` (``prologue_block``)."""
    offs_k = tl.arange(0, BLOCK_K)
    offs_p = tl.arange(0, BLOCK_P)
    w_ptrs = W + rows.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    b_ptrs = W + rows_b.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    if FP8 == 1:  # partial sums, reduced after the loop (``fp8_jit.slice_sums``)
        acc = tl.zeros((rows.shape[0], BLOCK_K // fp8_jit.SLICE), dtype=tl.float32)
    else:
        acc = tl.zeros(rows.shape, dtype=tl.float32)
    acc_b = acc
    sum_sq = tl.zeros((BLOCK_K,), dtype=tl.float32)  # the one-pass prologue's, lane by lane
    h_end = tl.where(writes_h, K, 0)
    # FP8 == 2: each row's block row of scales (a masked row reads row 0's)
    ws = W_scale + (tl.where(mask_n, rows, 0) // 128) * stride_ws
    ws_b = W_scale + (tl.where(mask_n, rows_b, 0) // 128) * stride_ws
    num_kb = tl.cdiv(K, 128)
    peeled: tl.constexpr = FP8 != 0 or not (NORM and TWO_PASS)
    if peeled:
        w_mask = mask_n[:, None] & (offs_k < K)[None, :]
        w = load_weight(w_ptrs, w_mask, EVEN)
        w_b = w
        if PAIRED:
            w_b = load_weight(b_ptrs, w_mask, EVEN)
    pdl.wait_prior(PDL)
    rstd = 1.0  # the two-pass prologue's, known before its product loop
    start = 0
    if NORM and TWO_PASS:
        squares = tl.zeros((BLOCK_P,), dtype=tl.float32)
        for p0 in range(0, K, BLOCK_P):
            h = _load_h(X, Residual, p0 + offs_p, (p0 + offs_p) < K, HAS_RESIDUAL).to(tl.float32)
            squares += h * h
        rstd = tl.rsqrt(tl.sum(squares, 0) / K + eps)
    sx = 1.0  # FP8 == 1: x's scale, known before the product loop
    if FP8 == 1:
        if STATIC:
            sx = tl.load(X_scale)
        else:
            amax = tl.zeros((BLOCK_P,), dtype=tl.float32)
            for p0 in range(0, K, BLOCK_P):
                # (amax stands in for the sum of squares, which a two-pass or plain x leaves)
                x, _ = _chunk(p0, offs_p, amax, rstd, X, Residual, NormW, ResidualOut, K,
                              h_end, NORM, HAS_RESIDUAL, TWO_PASS, False)  # fmt: skip
                amax = tl.maximum(amax, tl.abs(x))
            sx = fp8_jit.scale_of_amax(tl.max(amax, 0))
    if peeled:
        acc, acc_b, sum_sq = _accumulate(
            w, w_b, 0, offs_k, acc, acc_b, sum_sq, rstd, X, Residual, NormW, ResidualOut, K,
            h_end, sx, ws, ws_b, num_kb, PAIRED, NORM, HAS_RESIDUAL, TWO_PASS, FP8,
        )  # fmt: skip
        start = BLOCK_K
    for k0 in range(start, K, BLOCK_K):
        w_mask = mask_n[:, None] & ((k0 + offs_k) < K)[None, :]
        w = load_weight(w_ptrs + k0, w_mask, EVEN)
        w_b = w
        if PAIRED:
            w_b = load_weight(b_ptrs + k0, w_mask, EVEN)
        acc, acc_b, sum_sq = _accumulate(
            w, w_b, k0, offs_k, acc, acc_b, sum_sq, rstd, X, Residual, NormW, ResidualOut, K,
            h_end, sx, ws, ws_b, num_kb, PAIRED, NORM, HAS_RESIDUAL, TWO_PASS, FP8,
        )  # fmt: skip
    if FP8 == 1:
        acc = tl.sum(acc, 1)
        acc_b = tl.sum(acc_b, 1)
    if NORM and not TWO_PASS:
        rstd = tl.rsqrt(tl.sum(sum_sq, 0) / K + eps)
        acc *= rstd
        acc_b *= rstd
    if FP8 == 1:
        acc *= sx * tl.load(W_scale + rows, mask=mask_n, other=0.0)
        if PAIRED:
            acc_b *= sx * tl.load(W_scale + rows_b, mask=mask_n, other=0.0)
    if HAS_BIAS:
        acc += tl.load(Bias + rows, mask=mask_n, other=0.0).to(tl.float32)
        if PAIRED:
            acc_b += tl.load(Bias + rows_b, mask=mask_n, other=0.0).to(tl.float32)
    return acc, acc_b
