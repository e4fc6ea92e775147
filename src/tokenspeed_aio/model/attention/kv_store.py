"""The KV-cache write the kernel backends share: RoPE on q/k, then k/v into the paged cache.

``rotate_and_store`` is the part of ``AttentionBackend.forward``'s contract before the
attention itself (base.py): rotate q and k of every token by RoPE at its position (when the
layer passes a Rope) and write k/v at ``slot_mapping`` (slot -1 writes nothing). When the
rotary embedding covers whole heads, rotation and store are one Triton launch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenspeed_kernels.kv_write import kv_write
from tokenspeed_kernels.rotary import apply_rotary

if TYPE_CHECKING:
    import torch

    from tokenspeed_aio.model.attention.base import Rope


def rotate_and_store(
    q3: torch.Tensor,
    k3: torch.Tensor,
    v3: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    rope: Rope | None,
) -> None:
    """q3: [T, Hq, D], k3/v3: [T, Hkv, D] (token-strided views are fine); q3 and k3 are
    rotated in place."""
    if rope is None:
        kv_write(k3, v3, k_cache, v_cache, slot_mapping)
        return
    rotary_emb, positions = rope
    cos_sin = rotary_emb.cos_sin_cache
    if cos_sin.shape[1] == k3.shape[-1]:  # whole heads rotate: one launch
        apply_rotary(q3, k3, positions, cos_sin, (v3, k_cache, v_cache, slot_mapping))
    else:
        apply_rotary(q3, k3, positions, cos_sin)
        kv_write(k3, v3, k_cache, v_cache, slot_mapping)
