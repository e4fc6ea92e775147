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
        # Same arithmetic as transformers so float32 results match it exactly.
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
        inv_freq = 1.0 / (base**exponents)
        if scaling is not None:
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
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


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 scaling: slow frequencies divided by ``factor``, a smooth ramp in between."""
    if scaling["rope_type"] != "llama3":
        raise ValueError(f"unsupported rope type {scaling['rope_type']!r}")
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)
