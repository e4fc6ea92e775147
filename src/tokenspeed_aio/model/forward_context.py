"""What one forward reads besides its token ids: attention metadata and the KV cache.

Built by the model runner on the forward thread for each forward, frozen once the
forward is launched (the capture contract), and passed explicitly down the model:
``model(input_ids, positions, ctx)``. Layers never look it up globally.

Paged KV layout (one pair per layer, owned by the KV pool)::

    k_cache[layer], v_cache[layer]: [num_blocks, page_size, num_kv_heads, head_dim]

An FP8 (``float8_e4m3fn``) cache holds each value divided by its layer's and head's scale,
``kv_scales[layer] = (k_scale, v_scale)``, each [num_kv_heads] fp32 (a per-tensor scale
repeated); 16-bit caches have none.

Block 0 is the reserved null block: padding rows and dummy slots point at it and
nothing real is ever stored there. A token at absolute position ``p`` of a row
lives in block ``block_tables[row, p // page_size]`` at offset ``p % page_size``;
``slot_mapping`` holds ``block * page_size + offset`` for each new token.

Rows of a batch are laid out back to back (decodes first, then prefill chunks)::

    query_start_loc = [0, q0, q0+q1, ...]          # [B + 1]
    seq_lens[i]     = context_lens[i] + query_lens[i]  # KV length after this forward
    new tokens of row i attend causally to positions [0, seq_lens[i]).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Device tensors plus the host-side sizes the runner already knows (no sync needed)."""

    num_tokens: int  # sum of query_lens (may include CUDA-graph padding rows at the end)
    num_rows: int  # B
    max_query_len: int  # host int, for kernels that size their grid by it
    max_seq_len: int  # host int
    is_decode_only: bool  # every row has query_len == 1 (CUDA-graph eligible)
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32, KV length after this forward
    context_lens: torch.Tensor  # [B] int32, KV length before this forward (cached prefix)
    block_tables: torch.Tensor  # [B, max_blocks_per_row] int32, unused entries = 0 (null block)
    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 for padding tokens (nothing written)
    # Host copies for backends that loop or pad on the host (the torch backend).
    query_lens_host: tuple[int, ...]
    seq_lens_host: tuple[int, ...]
    # Leading rows of one query each whose token is a decode's (the runner's decode rows):
    # in a mixed forward a backend may attend them with its decode kernel and the rest with
    # its prefill kernel. 0: no row is known to be one (every row goes the prefill way).
    num_decodes: int = 0


@dataclass(frozen=True, slots=True)
class ForwardContext:
    """Everything a layer reads for one forward, besides its own weights."""

    attn: AttentionMetadata
    backend: Any  # an AttentionBackend instance (model/attention/base.py)
    k_caches: tuple[torch.Tensor, ...]  # one per layer
    v_caches: tuple[torch.Tensor, ...]
    # FP8 caches: per layer, (k_scale, v_scale) [num_kv_heads] fp32; None for 16-bit caches.
    kv_scales: tuple[tuple[torch.Tensor, torch.Tensor], ...] | None = None
    # The plan's L2 load-backs still landing (cache/fences.py's LayerFences: ``wait(layer)``
    # makes this forward's stream wait until that layer of every loaded block is in the
    # pool); None when nothing is loading.
    layer_fences: Any = None

    def layer_kv_scales(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None if self.kv_scales is None else self.kv_scales[layer_idx]
