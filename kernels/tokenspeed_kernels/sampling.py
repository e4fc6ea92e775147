"""Greedy and temperature sampling of a batch of logits in one pass over the vocabulary.

Layout contract::

    logits:         [B, vocab] fp32/bf16/fp16 (vocab contiguous; rows may be strided)
    temperatures:   [B] fp32; a row with temperature <= 0 samples greedily
    seeds:          [B] int64 (a 64-bit seed, two's complement)
    output_indices: [B] int64, tokens the row's request generated before this one
    returns         (greedy_ids, sampled_ids), both [B] int64

``greedy(logits)`` is the argmax alone, in the logits' own dtype (widening bf16 to fp32 is
exact, so the argmax is the same), over ``cdiv(vocab, ARGMAX_CHUNK)`` programs per row and a
second kernel that merges their maxima: one program streaming a 128k-entry row takes ~50 µs.

Sampling is the Gumbel-max draw of the engine's sampler, ``argmax_v(logits_v / T + g_v)``,
which picks ``v`` with probability ``softmax(logits / T)[v]``. ``g`` is the counter-based noise
of ``tokenspeed_kernels/noise.py`` (the spec), reproduced here bit for bit:
int64 lanes holding 31-bit values, ``mix(x, c) = ((x * c) ^ ((x * c) >> 31)) & (2**31 - 1)``::

    words  = [seed & M31, (seed >> 31) & M31, (seed >> 62) & 3, output_index & M31]
    key_a  = absorb(words, IV_A, ROW_A);  key_b = absorb(reversed(words), IV_B, ROW_B)
             (absorb: state = iv; for word, c: state = mix(state ^ word, c))
    h      = mix(mix(mix(token ^ key_a, TOKEN[0]) ^ key_b, TOKEN[1]), TOKEN[2])
    u      = ((h >> 8) + 0.5) * 2**-23;  g = -log(-log(u))

Ties go to the lowest token id, as ``torch.argmax``. One program per row streams its logits
once: no [B, vocab] noise or scaled-logits temporaries.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenspeed_kernels import precise_math

# Must equal the constants of tokenspeed_kernels/noise.py (a test checks the draws).
_M31 = tl.constexpr(0x7FFFFFFF)
_IV_A = tl.constexpr(0x165667B1)
_IV_B = tl.constexpr(0x27D4EB2F)
BLOCK_V = 2048
ARGMAX_CHUNK = 4096


@triton.jit
def _mix(x, c: tl.constexpr):
    """One round on 31-bit values in int64 lanes: multiply (< 2**62) and fold the high half."""
    x = x * c
    return (x ^ (x >> 31)) & _M31


@triton.jit
def _sample_kernel(
    Logits,
    Temperatures,
    Seeds,
    Output_indices,
    Greedy,
    Sampled,
    stride_l,
    vocab,
    BLOCK_V: tl.constexpr,
    PRECISE: tl.constexpr,
):
    row = tl.program_id(0)
    temperature = tl.load(Temperatures + row)
    seed = tl.load(Seeds + row)
    output_index = tl.load(Output_indices + row)
    w0 = seed & _M31
    w1 = (seed >> 31) & _M31
    w2 = (seed >> 62) & 3
    w3 = output_index & _M31
    key_a = _mix(w0 ^ _IV_A, 0x2C1B3C6D)
    key_a = _mix(key_a ^ w1, 0x297A2D39)
    key_a = _mix(key_a ^ w2, 0x6B43A9B5)
    key_a = _mix(key_a ^ w3, 0x5851F42D)
    key_b = _mix(w3 ^ _IV_B, 0x4F1BBCDD)
    key_b = _mix(key_b ^ w2, 0x1B873593)
    key_b = _mix(key_b ^ w1, 0x68E31DA5)
    key_b = _mix(key_b ^ w0, 0x3C6EF373)
    safe_t = tl.where(temperature > 0, temperature, 1.0)

    best_g = float("-inf")
    arg_g = 0
    best_s = float("-inf")
    arg_s = 0
    row_ptr = Logits + row.to(tl.int64) * stride_l
    for v0 in range(0, vocab, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        mask = offs < vocab
        x = tl.load(row_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32)
        h = _mix(offs.to(tl.int64) ^ key_a, 0x7FEB352D)
        h = _mix(_mix(h ^ key_b, 0x46B2D2A5), 0x2545F491)
        u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
        # div_rn and the precise log round like torch's ops: the same scores, the same draws.
        gumbel = -precise_math.log(-precise_math.log(u, PRECISE), PRECISE)
        score = tl.where(mask, tl.math.div_rn(x, safe_t) + gumbel, float("-inf"))
        # Strictly greater: an earlier tile keeps ties (lowest id wins, as torch.argmax).
        tile_g = tl.max(x, 0)
        idx_g = tl.argmax(x, 0, tie_break_left=True)
        take = tile_g > best_g
        arg_g = tl.where(take, v0 + idx_g, arg_g)
        best_g = tl.where(take, tile_g, best_g)
        tile_s = tl.max(score, 0)
        idx_s = tl.argmax(score, 0, tie_break_left=True)
        take = tile_s > best_s
        arg_s = tl.where(take, v0 + idx_s, arg_s)
        best_s = tl.where(take, tile_s, best_s)
    tl.store(Greedy + row, arg_g.to(tl.int64))
    tl.store(Sampled + row, tl.where(temperature > 0, arg_s, arg_g).to(tl.int64))


def sample(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    seeds: torch.Tensor,
    output_indices: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(greedy_ids, sampled_ids) for each row of ``logits`` (layout and noise: module doc)."""
    batch, vocab = logits.shape
    assert logits.stride(1) == 1, "vocab must be contiguous"
    greedy = torch.empty(batch, dtype=torch.int64, device=logits.device)
    sampled = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if batch > 0:
        _sample_kernel[(batch,)](
            logits, temperatures, seeds, output_indices, greedy, sampled,
            logits.stride(0), vocab, BLOCK_V=BLOCK_V, PRECISE=precise_math.PRECISE_MATH, num_warps=8,
        )  # fmt: skip
    return greedy, sampled


@triton.jit
def _argmax_chunk_kernel(Logits, Chunk_max, Chunk_arg, stride_l, vocab, CHUNK: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(Logits + row.to(tl.int64) * stride_l + offs, mask=offs < vocab, other=float("-inf"))
    x = x.to(tl.float32)
    out = row * tl.num_programs(1) + chunk
    tl.store(Chunk_max + out, tl.max(x, 0))
    tl.store(Chunk_arg + out, chunk * CHUNK + tl.argmax(x, 0, tie_break_left=True))


@triton.jit
def _argmax_merge_kernel(Chunk_max, Chunk_arg, Out, num_chunks, BLOCK_C: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_C)
    mask = offs < num_chunks
    best = tl.load(Chunk_max + row * num_chunks + offs, mask=mask, other=float("-inf"))
    # The lowest chunk holding the maximum holds its lowest id: ties go to the lowest id.
    pick = tl.argmax(best, 0, tie_break_left=True)
    tl.store(Out + row, tl.load(Chunk_arg + row * num_chunks + pick).to(tl.int64))


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """The argmax of each row of ``logits`` [B, vocab] (ties: the lowest id), [B] int64."""
    batch, vocab = logits.shape
    assert logits.stride(1) == 1, "vocab must be contiguous"
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if batch == 0:
        return out
    num_chunks = triton.cdiv(vocab, ARGMAX_CHUNK)
    chunk_max = torch.empty((batch, num_chunks), dtype=torch.float32, device=logits.device)
    chunk_arg = torch.empty((batch, num_chunks), dtype=torch.int32, device=logits.device)
    _argmax_chunk_kernel[(batch, num_chunks)](
        logits, chunk_max, chunk_arg, logits.stride(0), vocab, CHUNK=ARGMAX_CHUNK, num_warps=8
    )
    _argmax_merge_kernel[(batch,)](
        chunk_max, chunk_arg, out, num_chunks, BLOCK_C=triton.next_power_of_2(num_chunks)
    )
    return out
