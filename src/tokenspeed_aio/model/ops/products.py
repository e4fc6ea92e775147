"""Which kernel runs a product: the shape-table dispatch of every linear layer.

Batch-1 products on CUDA whose weight shape has a measured Triton config
(``tokenspeed_kernels.gemv``'s tables for the tensor's GPU: the shapes where it read the
weight faster than cuBLAS, with a SwiGLU's activation as the product's epilogue for gate/up)
run that kernel, and 16-bit products of 2 to 64 rows likewise
``tokenspeed_kernels.skinny_gemm`` (its tables keyed by shape and row bucket); everything
else is ``F.linear``, as is every product on a GPU without tables
(``tokenspeed_kernels.tuning``). A column-parallel layer fed by an RMSNorm takes the norm,
and the residual add before it, as the product's prologue where the norm table has its shape
(``norm_linear``): one launch fewer per norm; a batch-1 qkv projection also takes RoPE and
the KV-cache write as its epilogue where ``gemv_rope_kv``'s table has its shape
(``norm_linear_rope_kv``): one launch fewer per layer. An FP8 weight (``Fp8Weight``) takes
``fp8_products.py``'s kernels instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from tokenspeed_kernels.fp8 import Fp8Weight, QuantizedRows, SplitKPartials

from tokenspeed_aio.model.layers.activation import silu_and_mul
from tokenspeed_aio.model.ops import fp8_products
from tokenspeed_aio.model.ops.determinism import batch_invariant, invariant_linear

if TYPE_CHECKING:
    from tokenspeed_aio.model.attention.base import KVWrite
    from tokenspeed_aio.model.layers.norm import RMSNorm


def linear(
    x: torch.Tensor | QuantizedRows,
    weight: torch.Tensor | Fp8Weight,
    bias: torch.Tensor | None = None,
    act_silu_mul: bool = False,
    defer_sum: bool = False,
) -> torch.Tensor | SplitKPartials:
    """``F.linear`` -- followed by ``silu_and_mul`` when ``act_silu_mul`` -- or the Triton
    product for a batch of at most 64 rows (2 to 64 in a 16-bit dtype) where it was measured
    faster. In batch-invariant mode (ops/determinism.py) every 16-bit product is the
    invariant one. ``QuantizedRows`` (a fused producer's output, ``norm_linear``'s
    ``feeds``) go to an FP8 weight. ``defer_sum``: the output goes to a residual-add norm,
    so an FP8 split-K product may return its partial sums (``fp8_products.py``)."""
    if isinstance(weight, Fp8Weight):
        return fp8_products.linear(x, weight, bias, act_silu_mul, defer_sum)
    if batch_invariant():
        y = invariant_linear(x, weight, bias)
        return silu_and_mul(y) if act_silu_mul else y
    rows = x.shape[0]
    # skinny_gemm's tiles were measured in 16-bit dtypes; fp32's need twice the shared memory.
    if x.is_cuda and (rows == 1 or (rows <= 64 and x.element_size() == 2)):
        if rows == 1:
            from tokenspeed_kernels import gemv as kernel

            product, key = kernel.gemv, tuple(weight.shape)
        else:
            from tokenspeed_kernels import skinny_gemm as kernel

            product, key = kernel.skinny_gemm, (*weight.shape, kernel.m_bucket(rows))
        if act_silu_mul and bias is None:
            config = kernel.configs(x.device, silu_mul=True).get(key)
            if config is not None:
                return product(x, weight, None, config, silu_mul=True)
        config = kernel.configs(x.device).get(key)
        y = product(x, weight, bias, config) if config else F.linear(x, weight, bias)
    else:
        y = F.linear(x, weight, bias)
    return silu_and_mul(y) if act_silu_mul else y


def norm_linear(
    norm: RMSNorm,
    x: torch.Tensor | SplitKPartials,
    residual: torch.Tensor | None,
    weight: torch.Tensor | Fp8Weight,
    bias: torch.Tensor | None = None,
    act_silu_mul: bool = False,
    feeds: Fp8Weight | None = None,
) -> tuple[torch.Tensor | QuantizedRows, torch.Tensor]:
    """``(linear(norm(h), weight, bias, act_silu_mul), h)`` with ``h = x + residual`` (``x``
    when residual is None): the norm as the batch-1 Triton product's prologue where it has a
    config, else the norm layer then ``linear``. Norms are replicated, so this holds on every
    tensor-parallel rank. ``feeds``: the FP8 weight the SwiGLU activation goes to, which an
    FP8 product of more rows quantizes it for (``fp8_products.py``)."""
    if isinstance(weight, Fp8Weight):
        return fp8_products.norm_linear(norm, x, residual, weight, bias, act_silu_mul, feeds)
    if x.is_cuda and x.shape[0] == 1 and not batch_invariant():
        from tokenspeed_kernels.gemv import norm_configs, norm_gemv

        config = norm_configs(x.device).get((*weight.shape, act_silu_mul))
        if config is not None:
            return norm_gemv(
                x, residual, norm.weight, norm.eps, weight, bias, config, silu_mul=act_silu_mul
            )
    if residual is None:
        h, normed = x, norm(x)
    else:
        normed, h = norm(x, residual)
    return linear(normed, weight, bias, act_silu_mul), h


def norm_linear_rope_kv(
    norm: RMSNorm,
    x: torch.Tensor | SplitKPartials,
    residual: torch.Tensor | None,
    weight: torch.Tensor | Fp8Weight,
    bias: torch.Tensor | None,
    kv: KVWrite,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A batch-1 qkv projection with the norm as its prologue and, as its epilogue, RoPE on
    q and k and k/v written into the paged cache at ``kv.slot_mapping``
    (``gemv_rope_kv.norm_gemv_rope_kv``): ``(rotated q, h)``, where its table has the
    weight's shape and RoPE covers whole heads; None elsewhere (the caller runs the
    product, then the attention backend's store)."""
    if isinstance(weight, Fp8Weight):
        return fp8_products.norm_linear_rope_kv(norm, x, residual, weight, bias, kv)
    if not (x.is_cuda and x.shape[0] == 1) or batch_invariant():
        return None
    from tokenspeed_kernels.gemv_rope_kv import norm_gemv_rope_kv, rope_kv_configs

    rotary_emb, positions = kv.rope
    cos_sin = rotary_emb.cos_sin_cache
    config = rope_kv_configs(x.device).get(tuple(weight.shape))
    if config is None or cos_sin.shape[1] != kv.k_cache.shape[-1]:
        return None
    return norm_gemv_rope_kv(
        x, residual, norm.weight, norm.eps, weight, bias, positions, cos_sin,
        kv.k_cache, kv.v_cache, kv.slot_mapping, config, kv.kv_scales,
    )  # fmt: skip
