"""What the sampler reads for one round: per-row device tensors plus host flags.

Built by ``SamplingState.prepare`` on the forward thread. The device tensors are
gathered from the per-slot tables; the flags are computed from the host mirrors,
so choosing a fast path never reads the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, slots=True)
class SamplingBatch:
    """Sampling settings of the rows that sample this round, in row order."""

    num_rows: int
    # Per-row device tensors, [B] unless noted.
    slots: torch.Tensor  # int64: the slot of each row, to gather penalty rows and record outputs
    output_indices: torch.Tensor  # int64: outputs the request had before this token
    temperature: torch.Tensor  # float32, 0 for greedy rows
    top_k: torch.Tensor  # int64, vocab_size when off (so "rank >= top_k" drops nothing)
    top_p: torch.Tensor  # float32, 1 when off
    min_p: torch.Tensor  # float32, 0 when off
    seeds: torch.Tensor  # int64, keys the counter-based noise
    repetition_penalty: torch.Tensor  # float32, 1 when off
    frequency_penalty: torch.Tensor  # float32, 0 when off
    presence_penalty: torch.Tensor  # float32, 0 when off
    min_tokens: torch.Tensor  # int64: banned_ids stay banned while output_index < min_tokens
    banned_ids: torch.Tensor  # [B, max_stop_ids] int64, padded with -1
    # Penalty state of every slot ([max_slots, V]); None when no row is penalized.
    output_counts: torch.Tensor | None = field(repr=False)  # int32 counts of each slot's outputs
    prompt_mask: torch.Tensor | None = field(repr=False)  # bool: the token is in the slot's prompt
    # Host flags from the host mirrors: which stages this round needs.
    all_greedy: bool
    any_greedy: bool
    max_top_k: int  # largest top_k < vocab_size of a sampled row; 0: no row uses top-k
    any_top_p: bool  # some sampled row has top_p < 1
    any_min_p: bool  # some sampled row has min_p > 0
    any_penalties: bool  # some row has a repetition, frequency or presence penalty
    any_min_tokens_ban: bool  # some row is below min_tokens and has ids to ban
    max_num_logprobs: int  # largest top-N requested in the batch; -1: no row wants logprobs
    # logit_bias of every row ([B, MAX_LOGIT_BIAS], ids -1 and values 0 where unused); None
    # when no row has one.
    logit_bias_ids: torch.Tensor | None = field(default=None, repr=False)
    logit_bias_values: torch.Tensor | None = field(default=None, repr=False)

    @property
    def any_logit_bias(self) -> bool:
        return self.logit_bias_ids is not None

    @property
    def any_top_k(self) -> bool:
        return self.max_top_k > 0
