"""The FP8 numerics of fp8.py as Triton helpers, for the kernels (fp8.py's docstring gives
the definitions and the interpreter's conversion NOTE)."""

from __future__ import annotations

import os

import triton
import triton.language as tl

_INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")
SLICE = tl.constexpr(16)  # an e4m3 tile's values a thread loads at once: one 16-byte load


@triton.jit
def _round_e4m3(x):
    """fp32 ``x`` (|x| <= 448) rounded to the nearest e4m3 value (ties to even), in fp32.
    Normals keep 3 mantissa bits; below 2**-6 the grid is 2**-9: there ``x * 512`` (exact)
    is rounded to an integer by adding and taking off 2**23, one rounding of the exact
    value. (Shifting the range up by 2**-6 onto the normals' grid instead rounds twice: a
    value an fp32 ulp below a tie became the tie.)"""
    bits = x.to(tl.int32, bitcast=True)
    sign = bits & -2147483648
    a = tl.abs(x)
    b = a.to(tl.int32, bitcast=True)
    normal = ((b + 0x7FFFF + ((b >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    subnormal = ((a * 512.0 + 8388608.0) - 8388608.0) * 0.001953125
    r = tl.where(a < 0.015625, subnormal, normal)
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def to_e4m3(x):
    """``clamp(x, -448, 448)`` of fp32 ``x`` as float8e4nv, rounded to nearest even."""
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    if _INTERPRET:
        x = _round_e4m3(x)
    return x.to(tl.float8e4nv, fp_downcast_rounding="rtne")


@triton.jit
def scale_of_amax(amax):
    """``scale(amax)`` of the module doc (fp32)."""
    return tl.maximum(tl.math.div_rn(amax, 448.0), 1.0 / (448.0 * 512.0))


@triton.jit
def quantize_values(x, scale):
    """``q(x, scale)`` as float8e4nv; ``scale`` broadcasts against x."""
    return to_e4m3(tl.math.div_rn(x.to(tl.float32), scale))


@triton.jit
def fake_quantize(x, inv_scale):
    """``dq(q(x, scale), 1)`` in fp32 (a product's operand whose scale is applied after the
    sum), by the reciprocal ``inv_scale = 1 / scale``: one multiply a value where the
    division took a dozen instructions. x * (1 / scale) is within an fp32 ulp of x / scale,
    so its e4m3 value differs only where x / scale lies within an ulp of the midpoint of two
    e4m3 values (about 2**-20 of values), and then by one e4m3 step."""
    return to_e4m3(x.to(tl.float32) * inv_scale).to(tl.float32)


@triton.jit
def slice_sums(w, xq):
    """[BN, BK / SLICE] fp32: each SLICE-value slice's sum of ``w * xq`` (``w``: a [BN, BK]
    e4m3 tile, ``xq``: [BK] e4m3 values in fp32), the sums a thread takes of its own
    16-byte load, no exchange between threads.

    The products run in packed fp16, two K values an instruction: xq times 2**-8 is exact in
    fp16 (e4m3's 2**-9..448 lands on 2**-17..1.75, inside fp16's subnormal grid of 2**-24);
    the product of two 4-bit significands is exact in fp16 above 2**-14 (below, off by at
    most 2**-25); a slice sums its even and its odd K values as two lanes of 8 products, at
    most 8 * 448 * 1.75 = 6,272 (fp16 tops out at 65,504), each addition rounding to 11
    bits, and the two lanes add in fp32 times 2**8. That rounding is a few 1e-4 of a
    slice's magnitude: below the output's bf16 rounding and the partial-sum precision of
    Hopper's FP8 tensor cores (``fp8.product_tolerance``)."""
    BN: tl.constexpr = w.shape[0]
    BK: tl.constexpr = w.shape[1]
    prod = w.to(tl.float16) * (xq * 0.00390625).to(tl.float16)[None, :]
    lanes = tl.sum(tl.reshape(prod, (BN, BK // SLICE, SLICE // 2, 2)), 2)
    return tl.sum(lanes.to(tl.float32), 2) * 256.0


@triton.jit
def block_dot(w, x, k0, ws, num_kb, acc):
    """``acc`` plus one K chunk of a block-scaled product on CUDA cores: x ([BK] fp32, BK a
    multiple of 128) quantized per 128-group with each group's own scale, times the weight
    tile ``w`` ([BN, BK] e4m3) (``slice_sums``), each group's partial sums scaled by x's
    group scale and the rows' weight-block scale (``ws``: [BN] pointers to each row's block
    row; ``num_kb`` blocks along K)."""
    BN: tl.constexpr = w.shape[0]
    BK: tl.constexpr = w.shape[1]
    G: tl.constexpr = BK // 128
    xg = tl.reshape(x, (G, 128))
    sxg = scale_of_amax(tl.max(tl.abs(xg), 1))
    xq = tl.reshape(fake_quantize(xg, 1.0 / sxg[:, None]), (BK,))
    part = tl.sum(tl.reshape(slice_sums(w, xq), (BN, G, 128 // SLICE)), 2)
    kb = k0 // 128 + tl.arange(0, G)
    s = tl.load(ws[:, None] + kb[None, :], mask=(kb < num_kb)[None, :], other=0.0)
    return acc + tl.sum(part * s * sxg[None, :], 1)


@triton.jit
def to_cache(x, cache, scale):
    """``x`` as the element type of the KV cache ``cache`` points into: e4m3 of x / scale (the
    head's scale) for an FP8 cache, else a plain cast."""
    if cache.dtype.element_ty == tl.float8e4nv:
        return quantize_values(x, scale)
    else:
        return x.to(cache.dtype.element_ty)
