"""The Sampler end to end: greedy, seeded batch invariance, distribution, logprobs."""

import torch

from tokenspeed_aio.model.sampling import Sampler, compute_token_logprobs
from tokenspeed_aio.model.sampling import sampler as sampler_module
from tokenspeed_aio.sampling_params import SamplingParams

VOCAB = 1000
GREEDY = SamplingParams(temperature=0.0)


def _logits(rows: int, vocab_size: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab_size, generator=torch.Generator().manual_seed(seed)) * 2


def test_greedy_equals_argmax(make_state):
    state = make_state([GREEDY] * 8, VOCAB)
    batch = state.prepare(range(8), [0] * 8)
    assert batch.all_greedy
    logits = _logits(8)
    out = Sampler()(logits, batch)
    assert out.tokens.dtype == torch.int64
    assert torch.equal(out.tokens, logits.argmax(-1))
    assert out.logprobs is None and out.top_ids is None


def test_seeded_row_gets_the_same_token_in_any_batch(make_state):
    params = [
        SamplingParams(temperature=0.8, top_p=0.9),  # the row under test
        GREEDY,
        SamplingParams(top_k=5),
        SamplingParams(temperature=1.3, min_p=0.05, repetition_penalty=1.2),
        SamplingParams(min_tokens=4, frequency_penalty=0.5),
    ]
    state = make_state(params, VOCAB, prompts=[[1, 2]] * 5)
    steps = range(32)
    logits = _logits(32)
    alone = Sampler()(logits, state.prepare([0] * 32, steps)).tokens

    # The same 32 (slot 0, step) rows, interleaved with other rows in shuffled order.
    rows = [(0, s, logits[s]) for s in steps] + [
        (slot, s, _logits(1, seed=100 + slot * 32 + s)[0]) for slot in range(1, 5) for s in steps
    ]
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(1)).tolist()
    rows = [rows[i] for i in order]
    batch = state.prepare([r[0] for r in rows], [r[1] for r in rows])
    mixed = Sampler()(torch.stack([r[2] for r in rows]), batch).tokens
    got = {r[1]: t for r, t in zip(rows, mixed.tolist()) if r[0] == 0}
    assert [got[s] for s in steps] == alone.tolist()


def test_skipped_stages_do_not_change_a_plain_row(make_state):
    # Slot 0 needs no stage but the draw; in the mixed batch its rows go through
    # penalties, the min_tokens ban, the sort (top-p) and min-p anyway.
    params = [
        SamplingParams(),
        SamplingParams(top_p=0.5, min_p=0.1),
        SamplingParams(presence_penalty=1.0, min_tokens=9),
    ]
    state = make_state(params, VOCAB, outputs=[[], [], [3, 4]])
    logits = _logits(16, seed=2)
    plain = state.prepare([0] * 16, range(16))
    assert not (plain.any_top_p or plain.any_min_p or plain.any_penalties)
    alone = Sampler()(logits, plain).tokens
    mixed = state.prepare([0, 1, 2] * 16, [s for s in range(16) for _ in range(3)])
    assert mixed.any_top_p and mixed.any_min_p and mixed.any_penalties
    together = Sampler()(logits.repeat_interleave(3, dim=0), mixed).tokens
    assert torch.equal(together[0::3], alone)


def test_greedy_row_in_a_mixed_batch_is_its_argmax(make_state):
    state = make_state([GREEDY, SamplingParams(top_k=3)], VOCAB)
    batch = state.prepare([1, 0, 1, 0], [0, 0, 1, 1])
    assert batch.any_greedy and not batch.all_greedy
    logits = _logits(4, seed=3)
    tokens = Sampler()(logits, batch).tokens
    assert tokens[1] == logits[1].argmax() and tokens[3] == logits[3].argmax()


def test_noise_chunking_does_not_change_tokens(make_state, monkeypatch):
    state = make_state([SamplingParams(temperature=0.9, top_k=50), GREEDY], VOCAB)
    batch = state.prepare([0, 1] * 10, [s // 2 for s in range(20)])
    logits = _logits(20, seed=7)
    whole = Sampler()(logits, batch).tokens
    monkeypatch.setattr(sampler_module, "_NOISE_CHUNK_ELEMENTS", 3 * VOCAB)  # 3 rows a chunk
    assert torch.equal(Sampler()(logits, batch).tokens, whole)


def test_different_seeds_give_different_tokens(make_state):
    state = make_state([SamplingParams()] * 64, VOCAB)
    logits = torch.zeros(64, VOCAB)  # uniform: 64 draws from 1000 tokens rarely repeat
    tokens = Sampler()(logits, state.prepare(range(64), [0] * 64)).tokens
    assert tokens.unique().numel() > 55


def _draws(make_state, params: SamplingParams, logits_row: torch.Tensor) -> torch.Tensor:
    """8192 draws: 512 seeds x 16 steps of the same logits row."""
    state = make_state([params] * 512, logits_row.numel())
    slots = [s for s in range(512) for _ in range(16)]
    batch = state.prepare(slots, list(range(16)) * 512)
    return Sampler()(logits_row.expand(len(slots), -1).contiguous(), batch).tokens


def test_sampled_distribution_matches_softmax_over_temperature(make_state):
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.3, 1.5])
    temperature = 0.7
    tokens = _draws(make_state, SamplingParams(temperature=temperature), logits)
    observed = torch.bincount(tokens, minlength=8).double()
    expected = torch.softmax(logits.double() / temperature, -1) * tokens.numel()
    chi2 = (((observed - expected) ** 2) / expected).sum()
    assert chi2 < 24.3  # 7 degrees of freedom, p = 0.001


def test_top_k_and_top_p_only_ever_sample_kept_tokens(make_state):
    logits = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.0, -1.0, 2.8, 0.5])
    probs = torch.softmax(logits, -1)
    tokens = _draws(make_state, SamplingParams(top_k=3), logits)
    assert set(tokens.tolist()) == {0, 6, 1}
    # Sorted probs: 0.30, 0.25, 0.20, 0.12, ... -> top_p=0.7 keeps the first three.
    assert probs.sort(descending=True).values[:3].sum() > 0.7
    tokens = _draws(make_state, SamplingParams(top_p=0.7), logits)
    assert set(tokens.tolist()) == {0, 6, 1}
    tokens = _draws(make_state, SamplingParams(top_k=2, top_p=0.99), logits)
    assert set(tokens.tolist()) == {0, 6}
    # Renormalized over the kept set, the frequencies still follow the probabilities.
    kept = torch.tensor([0, 6, 1])
    observed = torch.bincount(_draws(make_state, SamplingParams(top_k=3), logits))[kept]
    expected = torch.softmax(logits[kept].double(), -1) * 8192
    assert (((observed - expected) ** 2) / expected).sum() < 13.8  # 2 dof, p = 0.001


def test_logprobs_are_the_raw_log_softmax(make_state):
    params = [
        SamplingParams(temperature=0.5, logprobs=3, repetition_penalty=1.5),
        SamplingParams(temperature=0.0, logprobs=0, presence_penalty=2.0),
        SamplingParams(top_k=2),
    ]
    state = make_state(params, VOCAB, prompts=[[1, 2, 3]] * 3, outputs=[[4]] * 3)
    batch = state.prepare(range(3), [1, 1, 1])
    assert batch.max_num_logprobs == 3
    logits = _logits(3, seed=5)
    out = Sampler()(logits, batch)
    reference = torch.log_softmax(logits, -1)
    torch.testing.assert_close(out.logprobs, reference.gather(1, out.tokens[:, None])[:, 0])
    values, ids = reference.topk(3, dim=-1)
    assert torch.equal(out.top_ids, ids)
    torch.testing.assert_close(out.top_logprobs, values)

    only_sampled = state.prepare([1], [1])
    assert only_sampled.max_num_logprobs == 0
    out = Sampler()(logits[1:2], only_sampled)
    assert out.logprobs is not None and out.top_ids is None and out.top_logprobs is None


def test_compute_token_logprobs_accepts_logits_or_logprobs():
    logits = _logits(6, seed=6)
    targets = torch.tensor([0, 5, 999, 17, 3, 3])
    reference = torch.log_softmax(logits, -1)
    target, top_ids, top_logprobs = compute_token_logprobs(logits, targets, 4)
    torch.testing.assert_close(target, reference[torch.arange(6), targets])
    assert torch.equal(top_ids, reference.topk(4, -1).indices)
    torch.testing.assert_close(top_logprobs, reference.topk(4, -1).values)
    again = compute_token_logprobs(reference, targets, 4)
    torch.testing.assert_close(again[0], target)
    empty = compute_token_logprobs(logits, targets, 0)
    assert empty[1].shape == (6, 0) and empty[2].shape == (6, 0)
