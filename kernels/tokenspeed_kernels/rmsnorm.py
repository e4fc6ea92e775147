"""RMSNorm, plain and fused with the residual add, with HF Llama/Qwen rounding.

Layout contract::

    x, residual: [..., hidden], hidden contiguous (rows may be strided)
    weight:      [hidden]
    returns new tensors of x's shape and dtype

Math (as HF's ``LlamaRMSNorm`` after ``hidden = residual + hidden``)::

    residual' = round(x + residual)                       (fused variant only)
    h         = residual' if fused else x
    out       = round(weight * round(h * rsqrt(mean(h**2) + eps)))

where ``round`` is to x's dtype; the mean and rsqrt are in fp32. One program per row holds the
whole row in registers, so hidden sizes up to a few tens of thousands are fine.

``quant=...`` (``rms_norm_quant``) writes the output quantized to e4m3 instead, with its
scales (``fp8_quant.py``'s layout: per token, per 128-group or a static scale): the input of
an FP8 product, from the rounded values the plain kernel would store.

x may also be a split-K product's partial sums (``fp8.SplitKPartials``, with a residual): the
kernel sums them in slice order and rounds to the product's dtype as it loads x, the values
the product's own sum launch would have stored, so that launch is not needed.

A launch is a programmatic dependent launch where the GPU has one (``pdl.py``): the norm
usually sits between two products of a decode step, so it waits for the one before it with
its programs already resident, and lets the one after it start while it runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenspeed_kernels import fp8, pdl
from tokenspeed_kernels.fp8_quant import group_code, scales_buffer, store_quantized


@triton.jit
def _rms_norm_kernel(
    X,
    Residual,
    W,
    Out,  # with QUANT >= -1: the e4m3 output
    Residual_out,
    S,  # QUANT's scales, and its static scale (unread otherwise)
    Static,
    stride_s,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
    QUANT: tl.constexpr = -2,  # -2: none; else ``fp8_quant.group_code``
    SPLITS: tl.constexpr = 0,  # > 0: X holds that many fp32 partial sums of x (module doc)
    stride_split=0,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    dtype = Residual_out.dtype.element_ty  # x's dtype (the partials' product's)
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)  # a weight: before the wait
    pdl.wait_prior(PDL)
    if SPLITS > 0:
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in range(SPLITS):  # in slice order, as the product's sum launch adds them
            acc += tl.load(X + s * stride_split + row * stride_x + offs, mask=mask, other=0.0)
        h = acc.to(dtype)
    else:
        h = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(Residual + row * stride_r + offs, mask=mask, other=0.0)
        # Round the sum to the input dtype first: HF adds in that dtype, then normalizes.
        h = (h.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(Residual_out + row * stride_ro + offs, h, mask=mask)
    hf = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(hf * hf, 0) / hidden + eps)
    normed = (hf * rstd).to(dtype).to(tl.float32)
    if QUANT == -2:
        tl.store(Out + row * stride_o + offs, (w * normed).to(Out.dtype.element_ty), mask=mask)
    else:
        y = (w * normed).to(dtype).to(tl.float32)
        static = tl.load(Static) if QUANT < 0 else 1.0
        store_quantized(y, Out + row * stride_o, S + row * stride_s, offs, mask, 0,
                        tl.cdiv(hidden, 128), QUANT, static)  # fmt: skip


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, hidden] with hidden contiguous, viewing when possible."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _launch(x, residual, weight, eps, quant=None):
    """(out, residual out, scales); ``quant`` = (group, static_scale): out is e4m3. x may be
    ``fp8.SplitKPartials`` (module doc)."""
    hidden = x.shape[-1]
    assert weight.shape == (hidden,) and weight.is_contiguous()
    splits, stride_split = 0, 0
    if isinstance(x, fp8.SplitKPartials):
        assert residual is not None, "partial sums are added by the residual-add norm"
        partials, dtype = x
        assert partials.stride(-1) == 1
        splits, stride_split, x2 = partials.shape[0], partials.stride(0), partials[0]
        shape = x2.shape
    else:
        dtype, x2, shape = x.dtype, _rows(x), x.shape
    out = torch.empty(x2.shape, dtype=fp8.FP8 if quant is not None else dtype, device=x2.device)
    r2 = _rows(residual) if residual is not None else x2
    r_out = torch.empty(x2.shape, dtype=dtype, device=x2.device) if residual is not None else x2
    code, s, stride_s = -2, x2, 0
    if quant is not None:
        code = group_code(*quant)
        s = scales_buffer(x2.shape[0], hidden, x2.device, *quant)
        stride_s = s.stride(0) if code >= 0 else 0
    block = triton.next_power_of_2(hidden)
    if x2.shape[0] > 0:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, out, r_out, s, s, stride_s,
            x2.stride(0), r2.stride(0), out.stride(0), r_out.stride(0),
            hidden, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, QUANT=code,
            num_warps=min(max(block // 256, 1), 16), SPLITS=splits, stride_split=stride_split,
            **pdl.launch_args(),
        )  # fmt: skip
    return out.view(shape), r_out.view(shape), s


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x (layout and rounding: module doc)."""
    return _launch(x, None, weight, eps)[0]


def rms_norm_quant(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    group: int | None = None,
    static_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(xq, scales, h): ``fp8.quantize_rows(rms_norm(h), group, static_scale)`` with ``h = x
    + residual`` (x itself without residual), in one launch; x [M, hidden]."""
    q, h, s = _launch(x, residual, weight, eps, (group, static_scale))
    return q, s, h


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual = x + residual; return rms_norm(residual), residual`` in one pass (as vLLM's
    fused_add_rms_norm, but out of place: both results are new tensors)."""
    assert residual.shape == x.shape and residual.dtype == x.dtype
    return _launch(x, residual, weight, eps)[:2]
