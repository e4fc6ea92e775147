"""Counter-based noise: a uniform draw for each (seed, output_index, token_id).

A seeded request must sample the same tokens whatever batch it runs in and
whatever its row, so its noise cannot come from a shared generator stream.
Instead every draw is a pure hash of its coordinates. The hash uses only torch
int64 ops whose values stay below 2**62 (31-bit lanes multiplied by 31-bit
constants), so it never overflows and is bit-identical on CPU and CUDA.

The mixing step is a 31-bit "multiply and fold": ``h = x * c`` (62 bits), then
the high half is folded onto the low half. Each row is first reduced to two
31-bit keys (its words absorbed in opposite orders, one round per word); each
token then takes three rounds that mix in both keys. End to end, flipping any
input bit flips each output bit with probability 1/2 (tests/sampling checks).

NOTE: kernels/tokenspeed_kernels/sampling.py reproduces this hash bit for bit;
change both together.
"""

from __future__ import annotations

import torch

_MASK31 = (1 << 31) - 1
# Odd 31-bit multipliers (any odd constants with well-spread bits do), one per round.
_ROW_A = (0x2C1B3C6D, 0x297A2D39, 0x6B43A9B5, 0x5851F42D)
_ROW_B = (0x4F1BBCDD, 0x1B873593, 0x68E31DA5, 0x3C6EF373)
_TOKEN = (0x7FEB352D, 0x46B2D2A5, 0x2545F491)
_IV_A = 0x165667B1
_IV_B = 0x27D4EB2F
# Keep 23 bits so that (k + 0.5) * 2**-23 is exact in float32 and lies in (0, 1).
_FLOAT_BITS = 23


def _mix(x: torch.Tensor, c: int, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """One in-place round on 31-bit values: multiply (< 2**62), fold the high half down.

    ``scratch`` (shaped like ``x``) saves allocating a temporary for the shift.
    """
    x.mul_(c)
    high = x >> 31 if scratch is None else torch.bitwise_right_shift(x, 31, out=scratch)
    return x.bitwise_xor_(high).bitwise_and_(_MASK31)


def _absorb(words: list[torch.Tensor], iv: int, constants: tuple[int, ...]) -> torch.Tensor:
    state = torch.full_like(words[0], iv)
    for word, c in zip(words, constants):
        _mix(state.bitwise_xor_(word), c)
    return state


def row_keys(
    seeds: torch.Tensor, output_indices: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two independent 31-bit keys per row from a 64-bit seed and a step counter."""
    seeds = seeds.to(torch.int64)
    # Arithmetic shifts of a negative seed sign-extend; the masks keep the words positive.
    words = [
        seeds & _MASK31,
        (seeds >> 31) & _MASK31,
        (seeds >> 62) & 3,
        output_indices.to(torch.int64) & _MASK31,
    ]
    return _absorb(words, _IV_A, _ROW_A), _absorb(words[::-1], _IV_B, _ROW_B)


def hash_tokens(
    seeds: torch.Tensor, output_indices: torch.Tensor, token_ids: torch.Tensor
) -> torch.Tensor:
    """[B] seeds, [B] output indices, [V] token ids -> [B, V] int64 hashes in [0, 2**31)."""
    key_a, key_b = row_keys(seeds, output_indices)
    x = torch.bitwise_xor(token_ids.to(torch.int64).unsqueeze(0), key_a.unsqueeze(1))
    scratch = torch.empty_like(x)
    _mix(x, _TOKEN[0], scratch)
    x.bitwise_xor_(key_b.unsqueeze(1))
    _mix(x, _TOKEN[1], scratch)
    return _mix(x, _TOKEN[2], scratch)


def uniform_noise(
    seeds: torch.Tensor, output_indices: torch.Tensor, token_ids: torch.Tensor
) -> torch.Tensor:
    """[B, V] float32 uniforms strictly inside (0, 1), a pure function of the coordinates."""
    x = hash_tokens(seeds, output_indices, token_ids).bitwise_right_shift_(31 - _FLOAT_BITS)
    return x.to(torch.float32).add_(0.5).mul_(2.0**-_FLOAT_BITS)


def gumbel_noise(
    seeds: torch.Tensor, output_indices: torch.Tensor, token_ids: torch.Tensor
) -> torch.Tensor:
    """[B, V] standard Gumbel noise ``-log(-log(u))``; finite because u is never 0 or 1."""
    return uniform_noise(seeds, output_indices, token_ids).log_().neg_().log_().neg_()
