"""The attention layer: hands this layer's q/k/v to the forward's attention backend.

Projections live in the model's attention block; the q/k norms (Qwen3) and RoPE are applied
by the backend (model/attention/) with the cache write, which a kernel backend fuses into one
launch. Where the backend allows it (``kv_write``) the qkv product itself rotates q/k and
writes k/v as its epilogue, and the layer then only attends. The backend is chosen at startup
and passed in ``ctx`` so a layer never looks it up globally.

The layer holds its FP8 KV cache's scales, ``k_scale`` and ``v_scale`` ([num_kv_heads] fp32
of this rank's heads, 1 unless the checkpoint stores them, per tensor or per head); the
runner hands them to the backends in ``ctx.kv_scales`` when the cache is FP8.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import nn

from tokenspeed_aio.model.layers.weights import check_shape

if TYPE_CHECKING:
    from tokenspeed_aio.model.attention.base import KVWrite, QKNorm, Rope
    from tokenspeed_aio.model.forward_context import ForwardContext


class QKV(NamedTuple):
    """A layer's projected q/k/v (this rank's heads). ``k`` and ``v`` are None where the
    product already rotated q and k and wrote k/v into the cache (``Attention.kv_write``)."""

    q: torch.Tensor
    k: torch.Tensor | None
    v: torch.Tensor | None


class Attention(nn.Module):
    def __init__(self, layer_idx: int, num_kv_heads: int = 1, kv_head_start: int = 0) -> None:
        super().__init__()
        self.layer_idx = layer_idx  # selects this layer's KV cache pair in ctx
        self.kv_head_start = kv_head_start  # this rank's first KV head (tensor parallelism)
        self.register_buffer("k_scale", torch.ones(num_kv_heads, dtype=torch.float32))
        self.register_buffer("v_scale", torch.ones(num_kv_heads, dtype=torch.float32))

    def weight_loader(
        self, param: torch.Tensor, loaded: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        """A checkpoint's k or v cache scale: one per tensor, or one per KV head."""
        if loaded.numel() == 1:
            param.fill_(float(loaded.reshape(())))
            return
        n = param.shape[0]
        flat = loaded.reshape(-1)
        if flat.shape[0] < self.kv_head_start + n:
            check_shape(loaded, (self.kv_head_start + n,))
        param.copy_(flat.narrow(0, self.kv_head_start, n).float())

    def kv_write(
        self, ctx: ForwardContext, rope: Rope | None, qk_norm: QKNorm | None
    ) -> KVWrite | None:
        """Where this layer's qkv product may rotate q/k and write k/v itself (None: it
        returns plain q/k/v)."""
        return ctx.backend.kv_write(self.layer_idx, ctx, rope, qk_norm)

    def forward(
        self,
        qkv: QKV,
        ctx: ForwardContext,
        rope: Rope | None = None,
        qk_norm: QKNorm | None = None,
    ) -> torch.Tensor:
        """q [n, Hq * D], k/v [n, Hkv * D] -> [n, Hq * D]; ``qk_norm`` norms q and k per
        head, then ``rope`` rotates them (the backend's contract). With load-backs landing,
        the layer first waits for its own layer of them (new k/v go to other blocks)."""
        if ctx.layer_fences is not None:
            ctx.layer_fences.wait(self.layer_idx)
        if qkv.k is None:
            return ctx.backend.attend(qkv.q, self.layer_idx, ctx)
        return ctx.backend.forward(qkv.q, qkv.k, qkv.v, self.layer_idx, ctx, rope, qk_norm)
