"""Truncation filters on temperature-scaled logits: top-k, top-p and min-p.

Removed tokens get -inf. Each filter is vectorized over the batch, and a row
whose filter is off comes out unchanged, so a batch may run a filter whenever
any of its rows needs it.

Top-k and top-p cut at a threshold *value*: a token survives when its logit is
at least the row's cutoff logit. Tokens tied with the cutoff all survive, so the
result depends neither on how a sort orders ties nor on whether the batch took
the full sort or the cheaper ``topk``.
"""

from __future__ import annotations

import torch

_NEG_INF = float("-inf")


def apply_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    *,
    max_top_k: int,
    use_top_p: bool,
) -> torch.Tensor:
    """Keep each row's ``top_k`` highest tokens, then the smallest prefix reaching ``top_p``.

    ``top_k`` is vocab_size where off and ``max_top_k`` the largest k below that
    (0: no row uses top-k); ``top_p`` is 1 where off. Top-p is renormalized over
    what top-k kept and always keeps the top token. Without top-p, a ``topk`` of
    ``max_top_k`` replaces the full sort.
    """
    vocab_size = logits.shape[-1]
    if use_top_p:
        ordered = logits.sort(dim=-1, descending=True).values
    else:
        ordered = logits.topk(max_top_k, dim=-1).values
    threshold = None
    if max_top_k > 0:
        kth = ordered.gather(1, (top_k - 1).clamp(max=ordered.shape[-1] - 1).unsqueeze(1))
        threshold = torch.where((top_k < vocab_size).unsqueeze(1), kth, _NEG_INF)
    if use_top_p:
        if threshold is not None:
            ordered.masked_fill_(ordered < threshold, _NEG_INF)
        cumulative = ordered.softmax(dim=-1).cumsum_(dim=-1)
        # Float sums of non-negatives are monotone, so a binary search finds how many
        # tokens stay below top_p; keep those plus the token that reaches it.
        below = torch.searchsorted(cumulative, top_p.unsqueeze(1).contiguous())
        cutoff = ordered.gather(1, below.clamp_(max=vocab_size - 1))
        # A float cumsum can stop short of 1: rows with top_p == 1 must not cut at all.
        cutoff = torch.where((top_p < 1.0).unsqueeze(1), cutoff, _NEG_INF)
        threshold = cutoff if threshold is None else torch.maximum(threshold, cutoff)
    assert threshold is not None, "called with neither top-k nor top-p in use"
    return logits.masked_fill(logits < threshold, _NEG_INF)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` times the row's top probability.

    ``p / p_max == exp(logit - logit_max)``, so no softmax is needed; min_p == 0 drops nothing.
    """
    top = logits.max(dim=-1, keepdim=True).values
    relative = (logits - top).exp_()
    return logits.masked_fill(relative < min_p.unsqueeze(1), _NEG_INF)
