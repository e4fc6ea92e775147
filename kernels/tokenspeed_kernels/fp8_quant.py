"""Activation quantization: rows of x to e4m3 with their scales (``fp8.py``'s numerics), the
input of an FP8 product of two or more rows.

Layout contract::

    x:      [M, K], K contiguous (rows may be strided), 16-bit or fp32
    xq:     [M, K] float8_e4m3fn, a new tensor
    scales: [M] fp32 (per token), [M, ceil(K / 128)] (group=128), or the static scale [1]

A program owns one row (per token: the whole row is one tile, so its amax is one reduction;
group=128: ``GROUPS`` 128-groups of a row, each its own scale). ``quantize_by_chunk_amax``
takes rows whose producer also wrote each chunk's amax (the SwiGLU launch, or the gate/up
product's fused SwiGLU epilogue, ``fp8_gemm.py``). The norm and
SwiGLU kernels that precede most products quantize their own output the same way
(``rmsnorm.py``'s and ``activation.py``'s ``quant``), so this launch serves the rest (the
attention output before o_proj). Results equal ``fp8.quantize_rows`` bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenspeed_kernels import fp8, fp8_jit, pdl

GROUP_TILE = 8  # 128-groups per program with group scales


@triton.jit
def store_quantized(x, Q, S, offs, mask, group_id, num_groups, GROUP: tl.constexpr, STATIC_S):
    """Quantize the fp32 values ``x`` (one row's tile at ``offs``) into Q: by ``STATIC_S``
    (a loaded scalar) when GROUP < 0, else by their amax (GROUP == 0: the tile is the whole
    row, its scale goes to ``S``) or each 128-group's (GROUP == 128: the tile's groups are
    ``group_id ...`` of the row's ``num_groups``, their scales go to ``S + group_id``)."""
    if GROUP < 0:
        s = STATIC_S
        tl.store(Q + offs, fp8_jit.quantize_values(x, s), mask=mask)
    elif GROUP == 0:
        s = fp8_jit.scale_of_amax(tl.max(tl.abs(x), 0))
        tl.store(Q + offs, fp8_jit.quantize_values(x, s), mask=mask)
        tl.store(S, s)
    else:
        n: tl.constexpr = x.shape[0] // GROUP
        xg = tl.reshape(x, (n, GROUP))
        s = fp8_jit.scale_of_amax(tl.max(tl.abs(xg), 1))
        q = tl.reshape(fp8_jit.quantize_values(xg, s[:, None]), (n * GROUP,))
        tl.store(Q + offs, q, mask=mask)
        groups = group_id + tl.arange(0, n)
        tl.store(S + groups, s, mask=groups < num_groups)


@triton.jit
def _quantize_kernel(
    X, Q, S, Static, stride_x, stride_q, stride_s, K,
    BLOCK: tl.constexpr, GROUP: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.wait_prior(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < K
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    static = tl.load(Static) if GROUP < 0 else 1.0
    group_id = chunk * (BLOCK // 128) if GROUP > 0 else 0
    store_quantized(x, Q + row * stride_q, S + row * stride_s, offs, mask, group_id,
                    tl.cdiv(K, 128), GROUP, static)  # fmt: skip


@triton.jit
def _quantize_by_amax_kernel(
    X, Q, S, Amax, stride_x, stride_q, stride_a, K, num_chunks,
    BLOCK: tl.constexpr, CHUNKS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.wait_prior(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    chunks = tl.arange(0, CHUNKS)
    amax = tl.load(Amax + row * stride_a + chunks, mask=chunks < num_chunks, other=0.0)
    s = fp8_jit.scale_of_amax(tl.max(amax, 0))
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < K
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Q + row * stride_q + offs, fp8_jit.quantize_values(x, s), mask=mask)
    if chunk == 0:
        tl.store(S + row, s)


def quantize_by_chunk_amax(
    x: torch.Tensor, amax: torch.Tensor, block: int = 1024
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``quantize_rows(x)`` of rows whose producer also wrote the amax of each chunk
    of them (``amax`` [M, C]: the chunks cover the row, in any number): a row's scale is the
    max of its chunks', so no program needs the whole row; a program quantizes ``block``
    values."""
    m, k = x.shape
    assert x.stride(1) == 1 and amax.shape[0] == m and amax.stride(1) == 1
    q = torch.empty((m, k), dtype=fp8.FP8, device=x.device)
    s = torch.empty((m,), dtype=torch.float32, device=x.device)
    if m > 0:
        _quantize_by_amax_kernel[(m, triton.cdiv(k, block))](
            x, q, s, amax, x.stride(0), q.stride(0), amax.stride(0), k, amax.shape[1],
            BLOCK=block, CHUNKS=triton.next_power_of_2(amax.shape[1]),
            num_warps=min(max(block // 256, 1), 8), **pdl.launch_args(),
        )  # fmt: skip
    return q, s


def group_code(group: int | None, static_scale: torch.Tensor | None) -> int:
    """The kernels' GROUP constexpr: -1 static, 0 per token, 128 per 128-group."""
    if static_scale is not None:
        return -1
    assert group in (None, fp8.BLOCK), f"group scales are 128-wide, got {group}"
    return 0 if group is None else group


def scales_buffer(m: int, k: int, device, group: int | None, static_scale) -> torch.Tensor:
    """The scales output of ``quantize_rows`` for [m, k] (the static scale itself)."""
    if static_scale is not None:
        return static_scale.reshape(1)
    shape = (m,) if group is None else (m, -(-k // fp8.BLOCK))
    return torch.empty(shape, dtype=torch.float32, device=device)


def quantize_rows(
    x: torch.Tensor, group: int | None = None, static_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``fp8.quantize_rows`` on the device, one launch (layout: module doc)."""
    m, k = x.shape
    assert x.stride(1) == 1
    code = group_code(group, static_scale)
    q = torch.empty((m, k), dtype=fp8.FP8, device=x.device)
    s = scales_buffer(m, k, x.device, group, static_scale)
    if m == 0:
        return q, s
    block = GROUP_TILE * fp8.BLOCK if code > 0 else triton.next_power_of_2(k)
    stride_s = s.stride(0) if code >= 0 else 0
    _quantize_kernel[(m, triton.cdiv(k, block))](
        x, q, s, s, x.stride(0), q.stride(0), stride_s, k,
        BLOCK=block, GROUP=code, num_warps=min(max(block // 512, 1), 16), **pdl.launch_args(),
    )  # fmt: skip
    return q, s
