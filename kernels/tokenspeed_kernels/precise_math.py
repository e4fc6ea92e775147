"""exp, log and products rounded as torch's CUDA kernels round them, for kernels that must
match torch (or another kernel of ours) bit for bit.

``tl.exp``/``tl.log`` compile to the approximate ``ex2``/``lg2`` instructions; libdevice's
``exp``/``log`` are the precise ``expf``/``logf`` that torch's (non fast-math) kernels call.
Triton's interpreter has no libdevice, so there (CPU, CI) the plain ops run on numpy.
Pass ``PRECISE_MATH`` as the ``PRECISE`` constexpr of a launch.

``mul_rn`` is a product that rounds on its own: ptxas contracts ``a * b + c`` into one FMA
unless the launch passes ``enable_fp_fusion=False``, which a kernel that wants FMAs elsewhere
(an attention loop) would rather not pass.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl
from triton.language.extra import libdevice

PRECISE_MATH = os.environ.get("TRITON_INTERPRET") != "1"


@triton.jit
def exp(x, PRECISE: tl.constexpr):
    if PRECISE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def log(x, PRECISE: tl.constexpr):
    if PRECISE:
        return libdevice.log(x)
    else:
        return tl.log(x)


@triton.jit
def mul_rn(a, b, PRECISE: tl.constexpr):
    """fp32 ``a * b`` rounded on its own even where the launch contracts products into FMAs."""
    if PRECISE:  # an explicit rounding mode: ptxas never fuses it
        return tl.inline_asm_elementwise(
            "mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True, pack=1
        )
    else:  # the interpreter's numpy never contracts, nor does a launch without fp fusion
        return a * b
