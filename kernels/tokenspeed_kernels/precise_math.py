"""exp and log rounded as torch's CUDA kernels round them, for kernels that must match torch
bit for bit.

``tl.exp``/``tl.log`` compile to the approximate ``ex2``/``lg2`` instructions; libdevice's
``exp``/``log`` are the precise ``expf``/``logf`` that torch's (non fast-math) kernels call.
Triton's interpreter has no libdevice, so there (CPU, CI) the plain ops run on numpy.
Pass ``PRECISE_MATH`` as the ``PRECISE`` constexpr of a launch.
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
