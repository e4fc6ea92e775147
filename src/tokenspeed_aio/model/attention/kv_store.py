"""The KV-cache write the kernel backends share: RoPE on q/k, then k/v into the paged cache.

``store_layer_kv`` is the part of ``AttentionBackend.forward``'s contract before the
attention itself (base.py): norm q and k per head (when the layer passes a QKNorm), rotate
them by RoPE at each token's position (when it passes a Rope) and write k/v at
``slot_mapping`` (slot -1 writes nothing). When the rotary embedding covers whole heads,
norms, rotation and store are one Triton launch.

``StoredKVBackend`` is a backend whose forward is that store, then ``attend``; a caller that
has already rotated q and stored k/v itself (the batch-1 qkv product with RoPE and the cache
write as its epilogue, ``model/layers/linear.py``) calls ``attend`` directly. A backend may
fold the store into its attention kernel where that kernel can do it (the Triton backend's
decode forwards), with the same conditions (``rotates_whole_heads``, ``joint_qk_norm``).
"""

from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING

from tokenspeed_kernels.kv_write import kv_write
from tokenspeed_kernels.rotary import apply_rotary

from tokenspeed_aio.model.attention.base import AttentionBackend, KVWrite

if TYPE_CHECKING:
    import torch

    from tokenspeed_aio.model.attention.base import QKNorm, Rope
    from tokenspeed_aio.model.forward_context import ForwardContext


def rotates_whole_heads(rope: Rope | None, head_dim: int) -> bool:
    """Whether ``rope`` covers every dim of a head, which the fused launches need."""
    return rope is not None and rope[0].cos_sin_cache.shape[1] == head_dim


def joint_qk_norm(qk_norm: QKNorm) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """(q weight, k weight, eps) for a kernel that norms q and k in one launch; None when the
    two norms' eps differ (it takes one)."""
    q_norm, k_norm = qk_norm
    if q_norm.eps != k_norm.eps:
        return None
    return q_norm.weight, k_norm.weight, q_norm.eps


def store_layer_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_idx: int,
    ctx: ForwardContext,
    rope: Rope | None,
    qk_norm: QKNorm | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Norm, rotate and store one layer's new k/v (q/k/v as ``AttentionBackend.forward``
    takes them; q and k are normed and rotated in place). Returns q as [T, Hq, D] and the
    layer's k and v caches."""
    k_cache, v_cache = ctx.k_caches[layer_idx], ctx.v_caches[layer_idx]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    n = q.shape[0]
    q3 = q.view(n, -1, head_dim)
    k3 = k.view(n, num_kv_heads, head_dim)
    v3 = v.view(n, num_kv_heads, head_dim)
    slot_mapping = ctx.attn.slot_mapping
    whole_heads = rotates_whole_heads(rope, head_dim)
    fused_norm = None
    if qk_norm is not None:
        fused_norm = joint_qk_norm(qk_norm) if whole_heads else None
        if fused_norm is None:  # no supported model gets here: the norm layers in place
            q_norm, k_norm = qk_norm
            q3.copy_(q_norm(q3))
            k3.copy_(k_norm(k3))
    scales = ctx.layer_kv_scales(layer_idx)
    if rope is None:
        kv_write(k3, v3, k_cache, v_cache, slot_mapping, scales)
        return q3, k_cache, v_cache
    rotary_emb, positions = rope
    cos_sin = rotary_emb.cos_sin_cache
    if whole_heads:  # one launch
        kv_store = (v3, k_cache, v_cache, slot_mapping)
        apply_rotary(q3, k3, positions, cos_sin, kv_store, fused_norm, scales)
    else:
        apply_rotary(q3, k3, positions, cos_sin)
        kv_write(k3, v3, k_cache, v_cache, slot_mapping, scales)
    return q3, k_cache, v_cache


class StoredKVBackend(AttentionBackend):
    """``forward`` = ``store_layer_kv``, then ``attend`` over the cache."""

    def kv_write(
        self, layer_idx: int, ctx: ForwardContext, rope: Rope | None, qk_norm: QKNorm | None
    ) -> KVWrite | None:
        # The product's epilogue rotates whole heads and norms nothing.
        if rope is None or qk_norm is not None:
            return None
        return KVWrite(
            ctx.k_caches[layer_idx],
            ctx.v_caches[layer_idx],
            ctx.attn.slot_mapping,
            rope,
            ctx.layer_kv_scales(layer_idx),
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_idx: int,
        ctx: ForwardContext,
        rope: Rope | None = None,
        qk_norm: QKNorm | None = None,
    ) -> torch.Tensor:
        store_layer_kv(q, k, v, layer_idx, ctx, rope, qk_norm)
        return self.attend(q, layer_idx, ctx)

    @abstractmethod
    def attend(self, q: torch.Tensor, layer_idx: int, ctx: ForwardContext) -> torch.Tensor:
        """``forward`` after the store: q [num_tokens, num_q_heads * head_dim], already
        rotated; this forward's k/v are already in layer ``layer_idx``'s cache. Returns
        ``forward``'s output."""
