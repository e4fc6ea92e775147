"""Each logit edit against a straightforward per-row reference implementation."""

import math

import numpy as np
import pytest
import torch

from tokenspeed_aio.model.sampling.filters import apply_min_p, apply_top_k_top_p
from tokenspeed_aio.model.sampling.penalties import apply_min_tokens_ban, apply_penalties
from tokenspeed_aio.sampling_params import SamplingParams

VOCAB = 64


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _kept(filtered: torch.Tensor) -> list[set[int]]:
    return [set(np.flatnonzero(np.isfinite(row))) for row in filtered.numpy()]


def _softmax(row: np.ndarray) -> np.ndarray:
    e = np.exp(row.astype(np.float64) - row.max())
    return e / e.sum()


def _ref_top_k(row: np.ndarray, k: int) -> set[int]:
    if k <= 0 or k >= len(row):
        return set(range(len(row)))
    return set(np.argsort(-row)[:k])


def _ref_top_p(row: np.ndarray, candidates: set[int], p: float) -> set[int]:
    if p >= 1.0:
        return candidates
    ids = sorted(candidates, key=lambda i: -row[i])
    probs = _softmax(row[ids])
    kept, total = set(), 0.0
    for token, prob in zip(ids, probs):
        kept.add(token)
        total += prob
        if total >= p:
            break
    return kept


TOP_K = [0, 1, 5, 20, VOCAB, 3, 0, 40]
TOP_P = [1.0, 0.5, 1.0, 0.9, 0.3, 0.95, 0.05, 1.0]


@pytest.mark.parametrize("use_top_p", [False, True])
def test_top_k_top_p_match_reference(use_top_p):
    logits = _logits(len(TOP_K))
    top_k = torch.tensor([k if 0 < k < VOCAB else VOCAB for k in TOP_K])
    top_p = torch.tensor(TOP_P if use_top_p else [1.0] * len(TOP_P))
    max_top_k = max(k for k in top_k.tolist() if k < VOCAB)
    out = apply_top_k_top_p(logits, top_k, top_p, max_top_k=max_top_k, use_top_p=use_top_p)
    for row, kept, k, p in zip(logits.numpy(), _kept(out), TOP_K, top_p.tolist()):
        assert kept == _ref_top_p(row, _ref_top_k(row, k), p)
    # Kept logits are untouched.
    finite = torch.isfinite(out)
    assert torch.equal(out[finite], logits[finite])


def test_top_p_alone_takes_the_sort_path_without_top_k():
    logits = _logits(len(TOP_P), seed=1)
    top_k = torch.full((len(TOP_P),), VOCAB)
    out = apply_top_k_top_p(logits, top_k, torch.tensor(TOP_P), max_top_k=0, use_top_p=True)
    for row, kept, p in zip(logits.numpy(), _kept(out), TOP_P):
        assert kept == _ref_top_p(row, set(range(VOCAB)), p)


@pytest.mark.parametrize("min_p", [0.0, 0.01, 0.1, 0.5, 1.0])
def test_min_p_matches_reference(min_p):
    logits = _logits(4, seed=2)
    out = apply_min_p(logits, torch.full((4,), min_p))
    for row, kept in zip(logits.numpy(), _kept(out)):
        probs = _softmax(row)
        assert kept == set(np.flatnonzero(probs >= min_p * probs.max()))


def _penalty_batch(make_state, params, prompts, outputs):
    state = make_state(params, VOCAB, prompts=prompts, outputs=outputs)
    return state.prepare(range(len(params)), [len(o) for o in outputs])


def test_penalties_match_reference(make_state):
    params = [
        SamplingParams(repetition_penalty=1.5),
        SamplingParams(repetition_penalty=0.7, frequency_penalty=0.5),
        SamplingParams(frequency_penalty=-0.8, presence_penalty=1.2),
        SamplingParams(),  # unpenalized rows pass through untouched
        SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=-0.6),
    ]
    prompts = [[1, 2, 3, 60], [5, 5, 6], [7, 8], [1, 2, 9], [10, 11, 12]]
    outputs = [[4, 4], [5, 40, 40, 40], [7, 30, 30], [1, 9, 9], [12, 12, 13]]
    batch = _penalty_batch(make_state, params, prompts, outputs)
    logits = _logits(len(params), seed=3)
    out = apply_penalties(logits, batch)

    expected = logits.clone().double()
    for i, p in enumerate(params):
        counts = {t: outputs[i].count(t) for t in set(outputs[i])}
        for token in set(prompts[i]) | set(outputs[i]):
            x = expected[i, token]
            penalty = p.repetition_penalty
            expected[i, token] = x / penalty if x > 0 else x * penalty
        for token, count in counts.items():
            expected[i, token] -= p.frequency_penalty * count + p.presence_penalty
    torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(out[3], logits[3])


def test_min_tokens_ban_matches_reference(make_state):
    params = [
        SamplingParams(min_tokens=3, stop_token_ids=[5, 9]),
        SamplingParams(min_tokens=3, stop_token_ids=[5]),
        SamplingParams(min_tokens=2, ignore_eos=True, stop_token_ids=[7]),
        SamplingParams(),
        SamplingParams(min_tokens=1, stop_token_ids=[VOCAB + 3]),  # past the vocab: dropped
    ]
    state = make_state(params, VOCAB, eos_token_ids=[0, 1])
    output_indices = [0, 3, 1, 0, 0]  # row 1 has reached its min_tokens
    batch = state.prepare(range(len(params)), output_indices)
    assert batch.any_min_tokens_ban
    logits = _logits(len(params), seed=4)
    out = apply_min_tokens_ban(logits, batch)

    banned = [{0, 1, 5, 9}, set(), {7}, set(), {0, 1}]
    for i, ids in enumerate(banned):
        for token in range(VOCAB):
            if token in ids:
                assert out[i, token] == -math.inf
            else:
                assert out[i, token] == logits[i, token]
