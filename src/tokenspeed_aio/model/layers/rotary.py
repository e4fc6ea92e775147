"""Rotary position embedding (neox style, as HF Llama/Qwen), with llama3 frequency scaling.

cos/sin for every position are precomputed once in float32 and indexed by ``positions``,
so a forward does no trigonometry and no host work. On CUDA one Triton kernel rotates q and k
in place (``tokenspeed_kernels.rotary``, the same float32 rounding as the torch ops).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        scaling: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        cache = build_cos_sin_cache(head_dim, max_position, base, scaling)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [n, Hq * D], k [n, Hkv * D] (head dims contiguous) -> rotated, same shapes.

        On CUDA q and k are rotated in place and returned; elsewhere new tensors.
        """
        if q.is_cuda:
            from tokenspeed_kernels.rotary import apply_rotary

            n = q.shape[0]
            hd = self.head_dim
            apply_rotary(q.view(n, -1, hd), k.view(n, -1, hd), positions, self.cos_sin_cache)
            return q, k
        cos, sin = self.cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.unflatten(-1, (-1, self.head_dim)).chunk(2, dim=-1)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


def build_cos_sin_cache(
    rotary_dim: int, max_position: int, base: float, rope_scaling: dict | None = None
) -> torch.Tensor:
    """The [max_position, rotary_dim] fp32 cos/sin cache, as HF computes its inv_freq.

    ``rope_scaling`` may be None/"default", ``{"rope_type": "linear", "factor"}`` or
    ``{"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings"}``.
    """
    # fp32 throughout, as HF: matching its rounding keeps long positions token-identical.
    inv_freq = 1.0 / base ** (
        torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    )
    kind = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
    if kind == "linear":
        inv_freq = inv_freq / rope_scaling["factor"]
    elif kind == "llama3":
        factor = rope_scaling["factor"]
        low, high = rope_scaling["low_freq_factor"], rope_scaling["high_freq_factor"]
        old_len = rope_scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = torch.where(medium, blended, scaled)
    elif kind != "default":
        raise ValueError(f"rope_scaling.rope_type {kind!r} is not supported")
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)
