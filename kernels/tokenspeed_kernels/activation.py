"""SwiGLU's gate in one pass: ``silu(gate) * up`` over a fused ``[.., 2 * d]`` projection.

Layout contract::

    x:   [..., 2 * d], the last dim contiguous (rows may be strided); gate = x[..., :d],
         up = x[..., d:]
    out: [..., d], x's dtype, a new tensor

Rounding as HF's ``act_fn(gate_proj(x)) * up_proj(x)`` in torch: silu in fp32 with the
precise ``exp`` and an IEEE division (as torch's CUDA kernel), rounded to x's dtype, then the
product in fp32 rounded once more, so fp32 results equal torch's bit for bit.

``silu_and_mul_quant`` writes the activation quantized to e4m3 with its scales instead
(``fp8_quant.py``'s layout), from the rounded values ``silu_and_mul`` returns: the input of an
FP8 down projection. Group and static scales are one launch. A per-token scale needs the
row's amax before any value quantizes, and a row of an 8B model's MLP (14,336 values) in one
program is 16 warps of 128 registers, one program per SM, whose loads, reduction and stores
nothing overlaps (it read at about a third of the copy rate). Below ``PERSISTENT_ROWS`` rows
it is two launches: this kernel writes the activation and each chunk's amax, and
``fp8_quant.quantize_by_chunk_amax`` quantizes it by the row's. From there on it is one
persistent launch of up to ``PROGRAMS_PER_SM`` programs a SM, each taking rows in turn: a row's
activation goes chunk by chunk to the program's own scratch row (which stays in L2: each
program rewrites one row of it) while its amax accumulates, then comes back from there
quantized. The activation never reaches memory, so the launch moves the gate/up rows in and
the e4m3 rows out, where the two launches also wrote the activation and read it back.

A launch is a programmatic dependent launch where the GPU has one (``pdl.py``), like the
norm's: it follows a decode step's gate/up product and precedes its down product.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenspeed_kernels import fp8, fp8_jit, pdl, precise_math
from tokenspeed_kernels.fp8_quant import (
    group_code,
    quantize_by_chunk_amax,
    scales_buffer,
    store_quantized,
)

BLOCK = 1024
PERSISTENT_ROWS = 128  # rows from which the per-token quantized SwiGLU is one launch (doc)
PROGRAMS_PER_SM = 4  # that launch's programs: their scratch rows stay within the L2
PERSISTENT_BLOCK = 2048  # and the values a program takes at a time


@triton.jit
def silu_mul(gate, up, PRECISE: tl.constexpr):
    """``silu(gate) * up`` of values in the activation dtype, rounded as the module doc says
    (also the epilogue of ``gemv(..., silu_mul=True)``)."""
    g = gate.to(tl.float32)
    silu = tl.math.div_rn(g, 1.0 + precise_math.exp(-g, PRECISE)).to(gate.dtype)
    return (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)


@triton.jit
def _silu_and_mul_kernel(
    X, Out, S, Static, stride_x, stride_o, stride_s, d,
    BLOCK: tl.constexpr, PRECISE: tl.constexpr, PDL: tl.constexpr, QUANT: tl.constexpr = -2,
):  # fmt: skip
    """QUANT: -2 a plain output; -3 a plain output and each chunk's amax to S (``stride_s``
    a row's); else ``fp8_quant.group_code`` (Out e4m3, scales to S)."""
    pdl.wait_prior(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < d
    gate = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(X + row * stride_x + d + offs, mask=mask, other=0.0)
    y = silu_mul(gate, up, PRECISE)
    if QUANT <= -2:
        tl.store(Out + row * stride_o + offs, y, mask=mask)
        if QUANT == -3:
            tl.store(S + row * stride_s + chunk, tl.max(tl.abs(y.to(tl.float32)), 0))
    else:
        static = tl.load(Static) if QUANT < 0 else 1.0
        group_id = chunk * (BLOCK // 128) if QUANT > 0 else 0
        store_quantized(y.to(tl.float32), Out + row * stride_o, S + row * stride_s, offs, mask,
                        group_id, tl.cdiv(d, 128), QUANT, static)  # fmt: skip


@triton.jit(do_not_specialize=["m"])  # a prefill's row count compiles nothing new
def _silu_and_mul_quant_rows_kernel(
    X, Q, S, Scratch, stride_x, stride_q, m, d,
    BLOCK: tl.constexpr, PRECISE: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Per-token quantized SwiGLU, persistent (module doc): rows pid, pid + programs, ..."""
    pdl.wait_prior(PDL)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    scratch = Scratch + pid.to(tl.int64) * d
    offs = tl.arange(0, BLOCK)
    for turn in range(0, tl.cdiv(m - pid, programs)):
        row = pid.to(tl.int64) + turn * programs
        x = X + row * stride_x
        amax = tl.zeros([BLOCK], tl.float32)
        for c0 in range(0, d, BLOCK):
            mask = c0 + offs < d
            gate = tl.load(x + c0 + offs, mask=mask, other=0.0, eviction_policy="evict_first")
            up = tl.load(x + d + c0 + offs, mask=mask, other=0.0, eviction_policy="evict_first")
            y = silu_mul(gate, up, PRECISE)
            tl.store(scratch + c0 + offs, y, mask=mask, eviction_policy="evict_last")
            amax = tl.maximum(amax, tl.abs(y.to(tl.float32)))
        s = fp8_jit.scale_of_amax(tl.max(amax, 0))
        tl.debug_barrier()  # the row's scratch stored before any thread reads it back
        q = Q + row * stride_q
        for c0 in range(0, d, BLOCK):
            mask = c0 + offs < d
            y = tl.load(scratch + c0 + offs, mask=mask, other=0.0, eviction_policy="evict_last")
            tl.store(q + c0 + offs, fp8_jit.quantize_values(y, s), mask=mask)
        tl.store(S + row, s)
        tl.debug_barrier()  # read back before the next row overwrites it


def persistent_programs(m: int, device: torch.device, per_sm: int = PROGRAMS_PER_SM) -> int:
    """The persistent launch's program count for ``m`` rows on ``device`` (module doc)."""
    if device.type != "cuda":  # Triton's interpreter: two, so that rows take turns
        return min(m, 2)
    return min(m, per_sm * torch.cuda.get_device_properties(device).multi_processor_count)


def silu_and_mul_quant_chunks(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``silu_and_mul_quant`` of x2 [M, 2d] in two launches (module doc): the
    activation and its chunks' amaxes, then the quantization by each row's."""
    m, d = x2.shape[0], x2.shape[1] // 2
    y = torch.empty((m, d), dtype=x2.dtype, device=x2.device)
    amax = torch.empty((m, triton.cdiv(d, BLOCK)), dtype=torch.float32, device=x2.device)
    _run(x2, y, amax, amax.stride(0), d, -3)
    return quantize_by_chunk_amax(y, amax, BLOCK)


def silu_and_mul_quant_rows(
    x2: torch.Tensor, config: tuple[int, int, int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``silu_and_mul_quant`` of x2 [M, 2d] in the persistent launch (module doc),
    at any row count. ``config``: (programs a SM, block, warps) instead of the module's (a
    benchmark's sweep)."""
    m, d = x2.shape[0], x2.shape[1] // 2
    per_sm, block, warps = config or (PROGRAMS_PER_SM, PERSISTENT_BLOCK, 8)
    programs = persistent_programs(m, x2.device, per_sm)
    q = torch.empty((m, d), dtype=fp8.FP8, device=x2.device)
    s = torch.empty((m,), dtype=torch.float32, device=x2.device)
    if m == 0:
        return q, s
    scratch = torch.empty((programs, d), dtype=x2.dtype, device=x2.device)
    _silu_and_mul_quant_rows_kernel[(programs,)](
        x2, q, s, scratch, x2.stride(0), q.stride(0), m, d, BLOCK=block,
        PRECISE=precise_math.PRECISE_MATH, num_warps=warps, **pdl.launch_args(),
    )  # fmt: skip
    return q, s


def _launch(x: torch.Tensor, quant=None) -> tuple[torch.Tensor, torch.Tensor]:
    assert x.shape[-1] % 2 == 0 and x.stride(-1) == 1
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    m = x2.shape[0]
    code = -2 if quant is None else group_code(*quant)
    if code == 0:  # per token: one launch or two (module doc)
        return (silu_and_mul_quant_rows if m >= PERSISTENT_ROWS else silu_and_mul_quant_chunks)(x2)
    out = torch.empty((m, d), dtype=x.dtype if code == -2 else fp8.FP8, device=x.device)
    s, stride_s = out, 0
    if code != -2:
        s = scales_buffer(m, d, x.device, *quant)
        stride_s = s.stride(0) if code >= 0 else 0
    _run(x2, out, s, stride_s, d, code)
    return out.view(*x.shape[:-1], d), s


def _run(x2, out, s, stride_s, d, code) -> None:
    if x2.shape[0] > 0:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, BLOCK))](
            x2, out, s, s, x2.stride(0), out.stride(0), stride_s, d, BLOCK=BLOCK,
            PRECISE=precise_math.PRECISE_MATH, QUANT=code, num_warps=4, **pdl.launch_args(),
        )  # fmt: skip


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` (layout and rounding: module doc)."""
    return _launch(x)[0]


def silu_and_mul_quant(
    x: torch.Tensor, group: int | None = None, static_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(xq, scales): ``fp8.quantize_rows(silu_and_mul(x), group, static_scale)`` in one
    launch, two with per-token scales (module doc); x [M, 2d]."""
    return _launch(x, (group, static_scale))
