from collections.abc import Callable, Sequence

import pytest

from tokenspeed_aio.model.sampling import SamplingState
from tokenspeed_aio.sampling_params import SamplingParams

MakeState = Callable[..., SamplingState]


@pytest.fixture
def make_state() -> MakeState:
    """A SamplingState whose slot i holds params[i] (seed 1000 + i unless given)."""

    def make(
        params: Sequence[SamplingParams],
        vocab_size: int,
        *,
        device: str = "cpu",
        seeds: Sequence[int] | None = None,
        eos_token_ids: Sequence[int] = (0,),
        prompts: Sequence[Sequence[int]] | None = None,
        outputs: Sequence[Sequence[int]] | None = None,
        max_slots: int | None = None,
    ) -> SamplingState:
        state = SamplingState(max_slots or len(params), vocab_size, device)
        for slot, p in enumerate(params):
            state.set_slot(
                slot,
                p,
                seed=1000 + slot if seeds is None else seeds[slot],
                eos_token_ids=eos_token_ids,
                prompt_token_ids=prompts[slot] if prompts else [],
                output_token_ids=outputs[slot] if outputs else [],
            )
        return state

    return make
