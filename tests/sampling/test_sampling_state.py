"""SamplingState: per-slot settings, host flags, lazy penalty state, counts across rounds."""

import logging

import pytest
import torch

from tokenspeed_aio.model.sampling import Sampler, SamplingState
from tokenspeed_aio.sampling_params import SamplingParams

VOCAB = 50
GREEDY = SamplingParams(temperature=0.0)


def _assign(state, slot, params, *, seed=0, eos=(0,), prompt=(), outputs=()) -> None:
    state.set_slot(
        slot,
        params,
        seed=seed,
        eos_token_ids=eos,
        prompt_token_ids=prompt,
        output_token_ids=outputs,
    )


def _run_rounds(state: SamplingState, slot: int, logits: torch.Tensor, start: int, rounds: int):
    """Greedy-decode `rounds` tokens for one slot on fixed logits, recording each."""
    sampler, tokens = Sampler(), []
    for step in range(start, start + rounds):
        batch = state.prepare([slot], [step])
        out = sampler(logits, batch)
        state.record(batch, out.tokens)
        tokens.append(int(out.tokens[0]))
    return tokens


def _reference_frequency_decode(logits: torch.Tensor, penalty: float, rounds: int) -> list[int]:
    counts, tokens = torch.zeros(VOCAB), []
    for _ in range(rounds):
        token = int((logits[0] - penalty * counts).argmax())
        counts[token] += 1
        tokens.append(token)
    return tokens


def test_flags_follow_the_host_mirrors(make_state):
    params = [
        GREEDY,
        SamplingParams(temperature=1e-6),  # below the greedy threshold
        SamplingParams(top_k=7, min_p=0.2),
        SamplingParams(top_p=0.8, logprobs=4),
        SamplingParams(temperature=0.0, top_k=3, top_p=0.5, min_tokens=2),  # greedy ignores filters
        SamplingParams(top_k=VOCAB + 5, frequency_penalty=0.1),  # top_k past the vocab: off
    ]
    state = make_state(params, VOCAB)
    greedy = state.prepare([0, 1], [0, 0])
    assert greedy.all_greedy and greedy.any_greedy and greedy.max_num_logprobs == -1
    assert greedy.output_counts is None
    b = state.prepare([2, 3, 4], [0, 0, 0])
    assert not b.all_greedy and b.any_greedy
    assert (b.max_top_k, b.any_top_p, b.any_min_p) == (7, True, True)
    assert b.any_min_tokens_ban and not b.any_penalties and b.max_num_logprobs == 4
    assert torch.equal(b.top_k, torch.tensor([7, VOCAB, 3]))
    b = state.prepare([4, 5], [2, 0])
    assert not (b.any_top_k or b.any_top_p or b.any_min_tokens_ban)
    assert b.any_penalties and b.output_counts is not None


@pytest.mark.parametrize(
    "slots, steps, plain",
    [
        ([0, 1], [0, 5], True),
        ([0, 1, 2], [0, 0, 0], False),  # a row with a temperature
        ([0, 3], [0, 0], False),  # logprobs
        ([0, 4], [3, 0], False),  # repetition penalty
        ([0, 5], [0, 1], False),  # below min_tokens with EOS to ban
        ([0, 5], [0, 2], True),  # min_tokens reached: no ban left
    ],
)
def test_plain_greedy_is_the_samplers_argmax_only_case(make_state, slots, steps, plain):
    params = [
        GREEDY,
        SamplingParams(temperature=0.0, top_k=3, top_p=0.5),  # greedy ignores filters
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=0.0, repetition_penalty=1.2),
        SamplingParams(temperature=0.0, min_tokens=2),
    ]
    state = make_state(params, VOCAB)
    assert state.host_rows(slots, steps).plain_greedy is plain
    # The same decision the sampler takes from prepare's flags for its stage 0.
    b = state.prepare(slots, steps)
    stage0 = b.all_greedy and b.max_num_logprobs < 0
    assert (stage0 and not (b.any_penalties or b.any_min_tokens_ban)) is plain


def test_penalty_state_is_allocated_only_when_a_penalty_is_used(caplog):
    state = SamplingState(4, VOCAB, "cpu")
    for slot in range(3):
        _assign(state, slot, SamplingParams(), seed=slot, prompt=[1, 2], outputs=[3])
    state.prepare(range(3), [1, 1, 1])
    assert state.output_counts is None and state.prompt_mask is None
    with caplog.at_level(logging.INFO, logger="tokenspeed_aio.model.sampling.state"):
        _assign(state, 3, SamplingParams(presence_penalty=0.5), prompt=[1, 2], outputs=[3])
    assert state.output_counts is not None and state.output_counts.shape == (4, VOCAB)
    assert state.prompt_mask is not None and state.prompt_mask.dtype == torch.bool
    assert "penalty state" in caplog.text


def test_recorded_counts_feed_the_frequency_penalty(make_state):
    logits = torch.zeros(1, VOCAB)
    logits[0, :4] = torch.tensor([3.0, 2.6, 2.2, 1.0])
    state = make_state([SamplingParams(temperature=0.0, frequency_penalty=0.5)], VOCAB)
    tokens = _run_rounds(state, 0, logits, 0, 12)
    assert tokens == _reference_frequency_decode(logits, 0.5, 12)
    assert len(set(tokens)) > 1  # the penalty did steer the argmax
    assert state.output_counts is not None
    assert torch.equal(
        state.output_counts[0], torch.bincount(torch.tensor(tokens), minlength=VOCAB).int()
    )


def test_set_slot_after_retraction_restores_counts(make_state):
    logits = torch.zeros(1, VOCAB)
    logits[0, :4] = torch.tensor([3.0, 2.6, 2.2, 1.0])
    params = SamplingParams(temperature=0.0, frequency_penalty=0.5, repetition_penalty=1.3)
    state = make_state([params, GREEDY, GREEDY], VOCAB, prompts=[[7, 8]] * 3)
    uninterrupted = _run_rounds(state, 0, logits, 0, 10)

    previous_owner = SamplingParams(temperature=0.0, presence_penalty=0.3)
    retracted = make_state(
        [params, GREEDY, previous_owner], VOCAB, prompts=[[7, 8], [7, 8], [9, 10]]
    )
    first = _run_rounds(retracted, 0, logits, 0, 6)
    # Back in a different slot, whose previous owner left counts and prompt marks behind.
    _run_rounds(retracted, 2, logits, 0, 3)
    assert retracted.output_counts[2].sum() == 3
    _assign(retracted, 2, params, seed=1000, prompt=[7, 8], outputs=first)
    rest = _run_rounds(retracted, 2, logits, 6, 4)
    assert first + rest == uninterrupted
    assert torch.equal(retracted.output_counts[2], state.output_counts[0])
    assert torch.equal(retracted.prompt_mask[2], state.prompt_mask[0])


def test_reassigned_slot_takes_the_new_owners_settings(make_state):
    state = make_state([SamplingParams(top_k=2, frequency_penalty=1.0)], VOCAB, outputs=[[1, 1]])
    state.prepare([0], [2])
    _assign(state, 0, GREEDY)
    batch = state.prepare([0], [0])
    assert batch.all_greedy and not batch.any_penalties and not batch.any_top_k
    assert float(batch.temperature[0]) == 0.0 and int(batch.top_k[0]) == VOCAB


def test_seed_wraps_to_int64_and_rejects_wider_values():
    state = SamplingState(2, VOCAB, "cpu")
    for slot, seed in enumerate([2**64 - 1, -1]):
        _assign(state, slot, SamplingParams(), seed=seed)
    assert state.prepare([0, 1], [0, 0]).seeds.tolist() == [-1, -1]
    with pytest.raises(ValueError, match="seed"):
        _assign(state, 0, SamplingParams(), seed=2**64)


def test_too_many_banned_ids_is_an_error_naming_the_limit():
    state = SamplingState(1, VOCAB, "cpu", max_stop_ids=4)
    params = SamplingParams(min_tokens=2, stop_token_ids=[5, 6, 7])
    with pytest.raises(ValueError, match="at most 4"):
        _assign(state, 0, params, eos=[1, 2])
    # Without min_tokens nothing is banned, so any number of stop ids is fine.
    _assign(state, 0, SamplingParams(stop_token_ids=list(range(10))), eos=[1, 2])
