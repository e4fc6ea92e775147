"""Which kernel runs an FP8 product (e4m3 weights, ``tokenspeed_kernels.fp8``'s numerics):
``products.py``'s three entry points for a layer whose operand is an ``Fp8Weight``.

On CUDA a one-row product is ``gemv`` on the e4m3 weight, x quantized in its prologue (after
the norm where one precedes it, then RoPE and the KV write as the qkv product's epilogue, as
for 16-bit weights); its tiles come from the device's ``fp8_gemv`` table (else
``gemv.DEFAULT``). More rows are quantized by the kernel before the product -- the norm's
(``rms_norm_quant``) where one precedes it, else ``fp8_quant.quantize_rows`` -- and
multiplied by ``fp8_gemm`` (Triton or ``torch._scaled_mm``, per its table). Where a SwiGLU's
activation ``feeds`` another FP8 product (the MLP's down projection) it comes quantized for
that product as ``QuantizedRows``, which the next product takes as its input with no
quantizing launch of its own (bitwise what ``quantize_rows`` of the activation gives): for a
down product taking per-token scales, from the gate/up product's SwiGLU epilogue and a
quantizing launch (``fp8_gemm_silu_mul``) where the device's ``fp8_gemm_silu_mul`` table
has the shape and row bucket (measured faster there), else from a SwiGLU launch that also
quantizes (``silu_and_mul_quant``). A SwiGLU feeding
nothing quantized is its own launch. A split-K product of more rows whose output goes to a residual-add norm (o_proj, down:
``defer_sum``) returns its partial sums (``SplitKPartials``), which that norm adds as it loads
them, one launch fewer. On the CPU every product is ``fp8.linear``, the torch definition the
kernels are tested against.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from tokenspeed_kernels import fp8
from tokenspeed_kernels.fp8 import Fp8Weight, QuantizedRows, SplitKPartials

from tokenspeed_aio.model.layers.activation import silu_and_mul

if TYPE_CHECKING:
    from tokenspeed_aio.model.attention.base import KVWrite
    from tokenspeed_aio.model.layers.norm import RMSNorm


def _gemv_tiles(w: Fp8Weight, silu_mul: bool, device) -> tuple[int, int, int, int]:
    from tokenspeed_kernels import gemv

    config = gemv.fp8_configs(device).get((*w.shape, w.block, silu_mul))
    if config is not None:
        return config
    block_n, block_k, num_warps, num_stages = gemv.DEFAULT
    return (block_n, max(block_k, fp8.BLOCK), num_warps, num_stages)


def _group(w: Fp8Weight) -> int | None:
    return fp8.BLOCK if w.block else None


def _product(
    xq,
    sx,
    w: Fp8Weight,
    bias,
    dtype,
    act_silu_mul: bool,
    feeds: Fp8Weight | None = None,
    defer_sum: bool = False,
) -> torch.Tensor | QuantizedRows | SplitKPartials:
    from tokenspeed_kernels.fp8_gemm import fp8_gemm

    if not act_silu_mul:
        return fp8_gemm(xq, sx, w, bias, dtype, defer_sum=defer_sum)
    if feeds is not None and feeds.per_token and bias is None:
        from tokenspeed_kernels.fp8_gemm import fp8_gemm_silu_mul, silu_mul_config

        config = silu_mul_config(xq.shape[0], w, xq.device)
        if config is not None:  # the SwiGLU as the product's epilogue (module doc)
            from tokenspeed_kernels.fp8_quant import quantize_by_chunk_amax

            act, amax = fp8_gemm_silu_mul(xq, sx, w, dtype, config)
            return QuantizedRows(*quantize_by_chunk_amax(act, amax), dtype)
    y = fp8_gemm(xq, sx, w, bias, dtype)
    if feeds is None:
        return silu_and_mul(y)
    from tokenspeed_kernels.activation import silu_and_mul_quant

    return QuantizedRows(*silu_and_mul_quant(y, _group(feeds), feeds.input_scale), dtype)


def linear(
    x: torch.Tensor | QuantizedRows,
    w: Fp8Weight,
    bias: torch.Tensor | None,
    act_silu_mul: bool,
    defer_sum: bool = False,
) -> torch.Tensor | SplitKPartials:
    """``products.linear`` on an FP8 weight; ``defer_sum``: a split-K product of more rows may
    return its partial sums for the residual-add norm after it (module doc)."""
    if isinstance(x, QuantizedRows):  # quantized by the kernel that wrote it (module doc)
        return _product(x.q, x.scale, w, bias, x.dtype, act_silu_mul, defer_sum=defer_sum)
    if not x.is_cuda:
        y = fp8.linear(x, w.q, w.scale, bias, w.input_scale)
        return silu_and_mul(y) if act_silu_mul else y
    if x.shape[0] == 1:
        from tokenspeed_kernels.gemv import gemv

        fused = act_silu_mul and bias is None
        y = gemv(x, w, bias, _gemv_tiles(w, fused, x.device), silu_mul=fused)
        return silu_and_mul(y) if act_silu_mul and not fused else y
    from tokenspeed_kernels.fp8_quant import quantize_rows

    xq, sx = quantize_rows(x, _group(w), w.input_scale)
    return _product(xq, sx, w, bias, x.dtype, act_silu_mul, defer_sum=defer_sum)


def norm_linear(
    norm: RMSNorm,
    x: torch.Tensor | SplitKPartials,
    residual: torch.Tensor | None,
    w: Fp8Weight,
    bias: torch.Tensor | None,
    act_silu_mul: bool,
    feeds: Fp8Weight | None = None,
) -> tuple[torch.Tensor | QuantizedRows, torch.Tensor]:
    """``products.norm_linear`` on an FP8 weight; with ``act_silu_mul`` and ``feeds`` (the FP8
    weight the activation goes to), a product of more rows on CUDA returns the activation as
    ``QuantizedRows`` for that weight (module doc). x may be the partial sums of the product
    before (more rows, on CUDA), which the norm adds."""
    if not x.is_cuda:
        normed, h = (norm(x), x) if residual is None else norm(x, residual)
        return linear(normed, w, bias, act_silu_mul), h
    if x.shape[0] == 1 and (bias is None or not act_silu_mul):
        from tokenspeed_kernels.gemv import norm_gemv

        tiles = (*_gemv_tiles(w, act_silu_mul, x.device), True)  # the two-pass prologue
        return norm_gemv(x, residual, norm.weight, norm.eps, w, bias, tiles, act_silu_mul)
    return _norm_quant_product(norm, x, residual, w, bias, act_silu_mul, feeds)


def _norm_quant_product(norm, x, residual, w: Fp8Weight, bias, act_silu_mul, feeds):
    from tokenspeed_kernels.rmsnorm import rms_norm_quant

    xq, sx, h = rms_norm_quant(x, residual, norm.weight, norm.eps, _group(w), w.input_scale)
    return _product(xq, sx, w, bias, h.dtype, act_silu_mul, feeds), h


def norm_linear_rope_kv(
    norm: RMSNorm,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    w: Fp8Weight,
    bias: torch.Tensor | None,
    kv: KVWrite,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``products.norm_linear_rope_kv`` on an FP8 weight: the one-row qkv product with RoPE
    and the KV write as its epilogue, tiles of ``fp8_gemv``'s (N, K) entry (two rows per
    BLOCK_HALF); None where it does not apply."""
    if not (x.is_cuda and x.shape[0] == 1):
        return None
    from tokenspeed_kernels.gemv_rope_kv import norm_gemv_rope_kv

    rotary_emb, positions = kv.rope
    cos_sin = rotary_emb.cos_sin_cache
    if cos_sin.shape[1] != kv.k_cache.shape[-1]:
        return None
    block_n, block_k, num_warps, num_stages = _gemv_tiles(w, False, x.device)
    config = (max(block_n // 2, 1), block_k, num_warps, num_stages, True)
    return norm_gemv_rope_kv(
        x, residual, norm.weight, norm.eps, w, bias, positions, cos_sin,
        kv.k_cache, kv.v_cache, kv.slot_mapping, config, kv.kv_scales,
    )  # fmt: skip
