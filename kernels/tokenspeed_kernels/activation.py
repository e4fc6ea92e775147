"""SwiGLU's gate in one pass: ``silu(gate) * up`` over a fused ``[.., 2 * d]`` projection.

Layout contract::

    x:   [..., 2 * d], the last dim contiguous (rows may be strided); gate = x[..., :d],
         up = x[..., d:]
    out: [..., d], x's dtype, a new tensor

Rounding as HF's ``act_fn(gate_proj(x)) * up_proj(x)`` in torch: silu in fp32 with the
precise ``exp`` and an IEEE division (as torch's CUDA kernel), rounded to x's dtype, then the
product in fp32 rounded once more, so fp32 results equal torch's bit for bit.

A launch is a programmatic dependent launch where the GPU has one (``pdl.py``), like the
norm's: it follows a decode step's gate/up product and precedes its down product.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenspeed_kernels import pdl, precise_math

BLOCK = 1024


@triton.jit
def silu_mul(gate, up, PRECISE: tl.constexpr):
    """``silu(gate) * up`` of values in the activation dtype, rounded as the module doc says
    (also the epilogue of ``gemv(..., silu_mul=True)``)."""
    g = gate.to(tl.float32)
    silu = tl.math.div_rn(g, 1.0 + precise_math.exp(-g, PRECISE)).to(gate.dtype)
    return (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)


@triton.jit
def _silu_and_mul_kernel(
    X, Out, stride_x, stride_o, d, BLOCK: tl.constexpr, PRECISE: tl.constexpr, PDL: tl.constexpr
):
    pdl.wait_prior(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < d
    gate = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(X + row * stride_x + d + offs, mask=mask, other=0.0)
    tl.store(Out + row * stride_o + offs, silu_mul(gate, up, PRECISE), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` (layout and rounding: module doc)."""
    assert x.shape[-1] % 2 == 0 and x.stride(-1) == 1
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    out = torch.empty((x2.shape[0], d), dtype=x.dtype, device=x.device)
    if x2.shape[0] > 0:
        grid = (x2.shape[0], triton.cdiv(d, BLOCK))
        _silu_and_mul_kernel[grid](
            x2, out, x2.stride(0), out.stride(0), d, BLOCK=BLOCK,
            PRECISE=precise_math.PRECISE_MATH, **pdl.launch_args(),
        )  # fmt: skip
    return out.view(*x.shape[:-1], d)
