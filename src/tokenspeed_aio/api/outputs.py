"""RequestOutput: what ``AsyncEngine.generate`` yields."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenspeed_aio.wire.messages import TokenLogprobs


@dataclass(slots=True)
class RequestOutput:
    """One output of a request. Of a ``cumulative`` stream (``generate``'s default)
    ``token_ids``, ``text`` and ``logprobs`` hold everything generated so far; of a
    ``delta`` stream only what is new in this output (then ``token_ids`` is
    ``delta_token_ids`` and ``text`` is ``delta_text``). ``num_tokens`` counts every
    token generated so far, in both."""

    rid: str
    token_ids: list[int]  # without the prompt
    text: str  # stop strings applied
    delta_text: str  # text new in this output
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[TokenLogprobs] | None = None  # aligned with token_ids, when asked
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    queue_seconds: float = 0.0  # from submission to the scheduler to its first forward
    delta_token_ids: list[int] = field(default_factory=list)
    weight_version: str = ""  # the weights' version when this output arrived
    num_tokens: int = 0  # tokens generated so far
