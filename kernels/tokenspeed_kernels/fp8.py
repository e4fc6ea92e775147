"""FP8 (e4m3) numerics shared by every FP8 kernel and the engine's CPU path: what a scale is,
how a value quantizes, how a weight is stored.

The definitions (torch here; the same math in Triton in fp8_jit.py, which the kernels use,
so that the engine's CPU path never imports Triton)::

    scale(amax) = max(amax / 448, MIN_SCALE)                 fp32, an IEEE division
    q(x, s)     = e4m3(min(max(x / s, -448), 448))           round to nearest even
    dq(q, s)    = float(q) * s

The clamp's min and max are IEEE maxNum/minNum, as the GPU's (and Triton's) are: a NaN
operand yields the other, so NaN quantizes to -448 and nothing stored is ever non-finite
(a KV cache's page tails are read, weighted by zero, ``kv_layout.py``).

A weight is stored quantized with one fp32 scale per output row (``"channel"``; a checkpoint
scaled per tensor is held so too, each shard's scale repeated over its rows) or one per
128 x 128 block (``"block"``, scales ``[ceil(N/128), ceil(K/128)]``). An activation row is
quantized at run time with its own scale (``group=None``: the token's amax), one per 128-wide
group of the row (``group=128``: with block weights), or a stored static scale. A product is

    y[m, n] = sum_k dq(xq[m, k], sx[m, k // group]) * dq(wq[n, k], sw[n or block])

summed in fp32 (with block scales, each 128-wide K slice's partial sum scaled on its own).

NOTE: Triton's interpreter converts fp32 to float8e4nv wrongly (a rounding that carries into
the exponent halves the value; subnormals flush to zero). Under the interpreter ``to_e4m3``
rounds to the e4m3 grid in fp32 first (``_round_e4m3``), where the conversion is exact; a
GPU's ``cvt.rn.satfinite`` rounds right by itself. Interpreter loads of e4m3 and its dots of
e4m3 operands are exact.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_SCALE = 1.0 / (448.0 * 512.0)  # an all-zero row: q = 0, not a division by zero
BLOCK = 128  # the block and group size of block-wise scales


class Fp8Weight(NamedTuple):
    """A stored e4m3 weight and its scales (module doc), as the FP8 kernels take it."""

    q: torch.Tensor  # [N, K] float8_e4m3fn
    scale: torch.Tensor  # [N] fp32, one per row; or [ceil(N/128), ceil(K/128)] per block
    input_scale: torch.Tensor | None = None  # [1] fp32: static activations; None: dynamic

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def block(self) -> bool:
        return self.scale.dim() == 2

    @property
    def per_token(self) -> bool:
        """Whether a product quantizes its x per token (dynamic scales, per-row weights), so
        that x's producer may quantize it (``QuantizedRows``)."""
        return not self.block and self.input_scale is None


class QuantizedRows(NamedTuple):
    """Activation rows already quantized for an FP8 product (``quantize_rows``' layout) by the
    kernel that produced them, and the dtype the product returns."""

    q: torch.Tensor  # [M, K] float8_e4m3fn
    scale: torch.Tensor  # [M] per token, [M, ceil(K/128)] per group, or the static [1]
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


class SplitKPartials(NamedTuple):
    """A split-K product's fp32 partial sums, not yet summed (``fp8_gemm(..., defer_sum=True)``):
    the residual-add norm after it sums them in slice order as it loads x (``rmsnorm``), the
    values the product's own sum launch would have given. ``shape`` and ``is_cuda`` are the
    product's, so the products' dispatch routes it as it would the tensor."""

    partials: torch.Tensor  # [SPLIT_K, M, N] fp32
    dtype: torch.dtype  # the product's output dtype

    @property
    def shape(self) -> torch.Size:
        return self.partials.shape[1:]

    @property
    def is_cuda(self) -> bool:
        return self.partials.is_cuda


def kernel_args(weight: torch.Tensor | Fp8Weight) -> tuple[torch.Tensor, tuple, dict]:
    """(the weight tensor, ``(W_scale, X_scale, stride_ws)``, ``{FP8, STATIC}``) of a launch
    whose product takes ``gemv_jit.products``' FP8 arguments; a 16-bit weight stands in for the
    absent scales (FP8 = 0 keeps them unread)."""
    if not isinstance(weight, Fp8Weight):
        return weight, (weight, weight, 0), {"FP8": 0, "STATIC": False}
    q, scale, input_scale = weight
    assert q.dtype == FP8 and q.is_contiguous() and scale.dtype == torch.float32
    if weight.block:
        assert input_scale is None, "block-scaled weights take dynamic activations"
        assert scale.shape == (-(-q.shape[0] // BLOCK), -(-q.shape[1] // BLOCK))
    else:
        assert scale.shape == (q.shape[0],)
    static = input_scale is not None
    args = (scale, input_scale if static else scale, scale.stride(0) if weight.block else 0)
    return q, args, {"FP8": 2 if weight.block else 1, "STATIC": static}


# -- torch: the definitions (the engine's CPU path and the kernels' references) ------------


def scale_of(amax: torch.Tensor) -> torch.Tensor:
    amax = amax.float()
    # A tensor divisor: torch's CUDA division by a Python scalar multiplies by its reciprocal,
    # an ulp away from the IEEE quotient the definition (and the kernels) take.
    return torch.clamp(amax / torch.full_like(amax, FP8_MAX), min=MIN_SCALE)


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q(x, scale)``; ``scale`` broadcasts against x (fp32). ``fmax``/``fmin``, not
    ``clamp``: NaN goes to -448 as in the kernels (module doc)."""
    y = x.float() / scale
    bound = torch.tensor(FP8_MAX, device=y.device)
    return torch.fmin(torch.fmax(y, -bound), bound).to(FP8)


def quantize_rows(
    x: torch.Tensor, group: int | None = None, static_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (xq [M, K] e4m3, scales): [M] per token, [M, ceil(K / group)] per group,
    or the static scale [1] as given."""
    if static_scale is not None:
        return quantize(x, static_scale.float().reshape(1, 1)), static_scale.float().reshape(1)
    m, k = x.shape
    if group is None:
        s = scale_of(x.abs().amax(dim=1))
        return quantize(x, s[:, None]), s
    groups = -(-k // group)
    padded = torch.nn.functional.pad(x.float(), (0, groups * group - k))
    s = scale_of(padded.view(m, groups, group).abs().amax(dim=2))
    return quantize(x, s.repeat_interleave(group, dim=1)[:, :k]), s


def dequantize_rows(xq: torch.Tensor, scale: torch.Tensor, group: int | None = None):
    """fp32 values of ``quantize_rows``' output."""
    k = xq.shape[1]
    if scale.numel() == 1:
        return xq.float() * scale.reshape(1, 1)
    if group is None:
        return xq.float() * scale[:, None]
    return xq.float() * scale.repeat_interleave(group, dim=1)[:, :k]


def quantize_weight(w: torch.Tensor, weight: str) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (wq e4m3, scale): ``"tensor"`` [1], ``"channel"`` [N], ``"block"``
    [ceil(N/128), ceil(K/128)]."""
    wf = w.float()
    if weight == "tensor":
        s = scale_of(wf.abs().amax()).reshape(1)
        return quantize(wf, s), s
    if weight == "channel":
        s = scale_of(wf.abs().amax(dim=1))
        return quantize(wf, s[:, None]), s
    n, k = wf.shape
    bn, bk = -(-n // BLOCK), -(-k // BLOCK)
    padded = torch.nn.functional.pad(wf, (0, bk * BLOCK - k, 0, bn * BLOCK - n))
    s = scale_of(padded.view(bn, BLOCK, bk, BLOCK).abs().amax(dim=(1, 3)))
    return quantize(wf, expand_blocks(s, n, k)), s


def expand_blocks(scale: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Block scales [ceil(N/128), ceil(K/128)] as one per element [N, K]."""
    return scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:n, :k]


def dequantize_weight(wq: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 [N, K] of a stored weight: per-row scales [N] (or one [1]), or block scales."""
    n, k = wq.shape
    if scale.dim() == 2:
        return wq.float() * expand_blocks(scale.float(), n, k)
    return wq.float() * scale.float().reshape(-1, 1)


def linear(
    x: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    input_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The product of the module doc in torch, y in x's dtype: the engine's CPU path and the
    GPU kernels' reference. Block weights (2-D ``w_scale``) quantize x per 128-group."""
    group = BLOCK if w_scale.dim() == 2 else None
    xq, sx = quantize_rows(x.reshape(-1, x.shape[-1]), group, input_scale)
    x_dq = dequantize_rows(xq, sx, group)
    y = x_dq @ dequantize_weight(wq, w_scale).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], wq.shape[0])


def product_tolerance(want: torch.Tensor) -> dict[str, float]:
    """``torch.allclose`` tolerances of an FP8 GPU product against ``linear``'s fp32 sum of
    the same quantized operands: Hopper's FP8 tensor cores add partial products at reduced
    precision, so over thousands of K an output can sit up to about a percent of the
    product's largest magnitude from the exact sum (a wrong scale or tile misses by far more)."""
    return dict(rtol=2e-2, atol=1e-2 * want.float().abs().max().item())


def cache_scales(
    k_cache: torch.Tensor, kv_scales: tuple[torch.Tensor, torch.Tensor] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (k, v) per-head scale vectors a kernel writing or reading ``k_cache`` takes: an
    FP8 cache's own (fp32, one per cache head: a per-tensor scale repeated), the cache itself
    standing in for both in a 16-bit one (``to_cache`` never reads them there)."""
    if k_cache.dtype != FP8:
        return k_cache, k_cache
    assert kv_scales is not None, "an FP8 KV cache needs its k/v scales"
    num_kv_heads = k_cache.shape[2]
    for s in kv_scales:
        assert s.dtype == torch.float32 and s.shape == (num_kv_heads,) and s.is_contiguous()
    return kv_scales
