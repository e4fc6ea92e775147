"""The activation peak of the largest forward, measured before the KV pool is sized.

A dummy prefill of the round's full token budget runs through a temporary KV cache
just large enough for it; the peak allocation above the weights, plus what the
sampler needs for its largest batch, is kept free of KV blocks.
"""

from __future__ import annotations

import numpy as np
import torch

from tokenspeed_aio.guards.host_sync import allow_host_sync
from tokenspeed_aio.model.forward_context import AttentionMetadata, ForwardContext
from tokenspeed_aio.model.kv_cache import allocate_kv_cache

# Sampler temporaries per row and vocabulary entry: fp32 logits, logprobs, probs,
# the sorted values and their int64 indices, the noise.
SAMPLER_BYTES_PER_LOGIT = 28
# The penalty state (output counts int32, prompt mask bool), allocated at the first penalty.
PENALTY_BYTES_PER_LOGIT = 5


def prefill_forward(
    model: torch.nn.Module,
    backend,
    input_ids: torch.Tensor,
    k_caches,
    v_caches,
    *,
    page_size: int,
    kv_scales=None,
) -> torch.Tensor:
    """One prefill of ``input_ids`` [n] (one row, positions 0..n-1) through a temporary cache
    of at least ``ceil(n / page_size) + 1`` blocks: the tokens' k/v land in the slots right
    after the null block (block 0), ``page_size .. page_size + n - 1``. Returns the hidden
    states [n, hidden]."""
    num_tokens = input_ids.shape[0]
    device = input_ids.device
    blocks = -(-num_tokens // page_size)
    positions = torch.arange(num_tokens, dtype=torch.int64, device=device)
    i32 = dict(dtype=torch.int32, device=device)
    meta = AttentionMetadata(
        num_tokens=num_tokens,
        num_rows=1,
        max_query_len=num_tokens,
        max_seq_len=num_tokens,
        is_decode_only=num_tokens == 1,
        query_start_loc=torch.tensor([0, num_tokens], **i32),
        seq_lens=torch.tensor([num_tokens], **i32),
        context_lens=torch.zeros(1, **i32),
        block_tables=torch.arange(1, blocks + 1, **i32).view(1, blocks),
        slot_mapping=positions + page_size,
        query_lens_host=(num_tokens,),
        seq_lens_host=(num_tokens,),
    )
    if backend.plans_on_host:
        table = np.arange(1, blocks + 1, dtype=np.int32)[None, :]
        backend.plan(np.array([num_tokens]), np.array([num_tokens]), table)
    return model(input_ids, positions, ForwardContext(meta, backend, k_caches, v_caches, kv_scales))


@torch.inference_mode()
def activation_peak_bytes(
    model: torch.nn.Module,
    backend,
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,  # the KV cache's
    device: torch.device,
    kv_scales=None,  # an FP8 cache's (ForwardContext.kv_scales)
    page_size: int,
    num_tokens: int,
    num_sampling_rows: int,
    vocab_size: int,
) -> int:
    blocks = -(-num_tokens // page_size)
    with allow_host_sync():
        torch.cuda.synchronize(device)
        k, v = allocate_kv_cache(
            num_layers, blocks + 1, page_size, num_kv_heads, head_dim, dtype, device
        )
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        input_ids = torch.arange(num_tokens, dtype=torch.int64, device=device) % vocab_size
        hidden = prefill_forward(
            model, backend, input_ids, k, v, page_size=page_size, kv_scales=kv_scales
        )
        rows = min(num_sampling_rows, num_tokens)
        model.compute_logits(hidden[:rows])
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
        del k, v, hidden
        torch.cuda.empty_cache()
    return peak + num_sampling_rows * vocab_size * SAMPLER_BYTES_PER_LOGIT
