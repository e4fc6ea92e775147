"""The attention backend interface every implementation (torch, triton, flashinfer) serves.

A backend owns two things for one layer of one forward: writing the forward's new k/v
into the paged cache, and attending each row's new queries over its cached positions.

    for each row i (tokens query_start_loc[i] : query_start_loc[i+1]):
        RMS-norm each q and k head of token t over head_dim (when the layer passes a QKNorm)
        rotate q and k of token t by RoPE at its position  (when the layer passes a Rope)
        write k/v of token t at slot_mapping[t]            (skip slot -1: padding)
        query j of row i sits at position context_lens[i] + j and attends causally to
        keys at positions [0, context_lens[i] + j], all read from the cache through
        block_tables[i] (so a cached prefix and this forward's tokens look the same)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar, NamedTuple

if TYPE_CHECKING:
    import numpy as np
    import torch

    from tokenspeed_aio.model.forward_context import ForwardContext
    from tokenspeed_aio.model.layers.norm import RMSNorm
    from tokenspeed_aio.model.layers.rotary import RotaryEmbedding

    # The layer's rotary embedding and the forward's token positions.
    Rope = tuple[RotaryEmbedding, torch.Tensor]
    # The layer's per-head norms of q and of k, each an RMSNorm over head_dim (Qwen3).
    QKNorm = tuple[RMSNorm, RMSNorm]


class KVWrite(NamedTuple):
    """Where a product that rotates q/k and writes k/v as its epilogue puts them: one
    layer's caches, the forward's slots, the rotary embedding and positions."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor
    rope: Rope
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None  # an FP8 cache's


class AttentionBackend(ABC):
    name: ClassVar[str]
    # True when a decode-only forward launches the same kernels for the same batch size
    # whatever the device values (no host reads, grid from host ints), so the runner may
    # capture it in a CUDA graph and replay it.
    supports_cuda_graphs: ClassVar[bool] = False
    # True when every forward must first be planned on the host (``plan``): FlashInfer's
    # kernels are scheduled that way. The runner then calls ``plan`` before each forward,
    # outside any CUDA-graph capture, and before each graph replay.
    plans_on_host: ClassVar[bool] = False

    def plan(
        self,
        query_lens: np.ndarray,
        seq_lens: np.ndarray,
        block_tables: np.ndarray,
        graph_size: int | None = None,
    ) -> None:
        """Plan the next forward from host arrays: each row's new tokens, its KV length
        after the forward and its block table row ([B, >= its pages]). ``graph_size``: the
        forward is the replay (or capture) of the decode graph of that batch size, and the
        arrays are padded to it."""
        raise NotImplementedError(f"the {self.name} backend does not plan on the host")

    def kv_write(
        self, layer_idx: int, ctx: ForwardContext, rope: Rope | None, qk_norm: QKNorm | None
    ) -> KVWrite | None:
        """Where the layer's qkv product may rotate q/k and store k/v itself, so that the
        layer then calls ``attend`` (``kv_store.StoredKVBackend``); None: the layer calls
        ``forward`` with q/k/v (the default)."""
        return None

    def attend(self, q: torch.Tensor, layer_idx: int, ctx: ForwardContext) -> torch.Tensor:
        """``forward`` for a q already rotated whose k/v are already in the cache; only
        backends whose ``kv_write`` returns a target get here."""
        raise NotImplementedError(f"the {self.name} backend stores k/v inside forward")

    @abstractmethod
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
        """Rotate q and k by ``rope`` if given, store k/v in layer ``layer_idx``'s cache,
        then attend. When ``qk_norm`` (two RMSNorm layers, q's and k's, over head_dim) is
        given, q and k are normed per head first, then rotated (and k stored normed).

        q: [num_tokens, num_q_heads * head_dim]; k, v: [num_tokens, num_kv_heads * head_dim]
        (this rank's heads; GQA when num_q_heads > num_kv_heads). Each token's values are
        contiguous, but tokens may be strided: v is typically a view of the fused qkv
        projection's output. Returns
        [num_tokens, num_q_heads * head_dim] in q's dtype; softmax scale head_dim ** -0.5.
        Must not sync with the host: sizes come from ``ctx.attn``'s host fields.
        """
