"""Logit edits that apply to greedy and sampled rows alike: penalties and the min_tokens ban.

Each function is vectorized over the batch and returns a new tensor. A row whose
settings are off (penalty 1 / 0 / 0, no active ban) comes out bit-identical, so
running these for a whole batch never changes an unpenalized row.
"""

from __future__ import annotations

import torch

from tokenspeed_aio.model.sampling.batch import SamplingBatch


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Repetition penalty on prompt + output tokens, then OpenAI frequency/presence penalties.

    Repetition (CTRL / HF semantics): a seen token's logit is divided by the
    penalty when positive and multiplied by it when negative. Frequency subtracts
    ``penalty * count`` and presence ``penalty * (count > 0)``, counting outputs only.
    """
    assert batch.output_counts is not None and batch.prompt_mask is not None
    counts = batch.output_counts.index_select(0, batch.slots)
    in_output = counts > 0
    seen = batch.prompt_mask.index_select(0, batch.slots) | in_output
    repetition = batch.repetition_penalty.unsqueeze(1)
    repeated = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, repeated, logits)
    logits -= batch.frequency_penalty.unsqueeze(1) * counts.to(logits.dtype)
    logits -= batch.presence_penalty.unsqueeze(1) * in_output.to(logits.dtype)
    return logits


def apply_min_tokens_ban(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Set the banned ids (EOS, stop ids) to -inf in rows still below their min_tokens."""
    num_rows, vocab_size = logits.shape
    active = (batch.output_indices < batch.min_tokens).unsqueeze(1)
    # Inactive and padding (-1) entries go to a spare column past the vocabulary, so
    # the mask is built with one scatter and no data-dependent shapes (no host sync).
    columns = torch.where(active & (batch.banned_ids >= 0), batch.banned_ids, vocab_size)
    mask = torch.zeros(num_rows, vocab_size + 1, dtype=torch.bool, device=logits.device)
    mask.scatter_(1, columns, True)
    return logits.masked_fill(mask[:, :vocab_size], float("-inf"))
