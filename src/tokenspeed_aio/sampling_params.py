"""Per-request sampling settings: a msgspec Struct so it crosses the wire as is."""

from __future__ import annotations

import msgspec

from tokenspeed_aio.errors import InvalidRequestError

MAX_LOGPROBS = 20  # top-N logprobs per token, the OpenAI API's own limit
MAX_N = 16
# Token ids the sampler bans while min_tokens holds (EOS + stop_token_ids): the width
# of its fixed per-slot table.
MAX_BANNED_IDS = 16
INT64_MAX = 2**63 - 1  # integer settings cross the wire and fill int64 device tables
MAX_LOGIT_BIAS = 300  # biased token ids per request (the width of the sampler's table)


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(f"{param}: {message}", param=param)


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How to sample one request. Defaults match the OpenAI API.

    ``temperature == 0`` is greedy. ``top_k <= 0`` and ``top_p == 1`` disable
    those filters. ``seed`` makes a sampled request reproducible whatever the
    batch it runs in (requests without one get a random seed at admission).
    """

    n: int = 1
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N alternatives per token (0: only the sampled one)
    prompt_logprobs: int | None = None  # logprobs of the prompt tokens (top-N alternatives)
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    # Structured output (at most one; compiled by the grammar subsystem).
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    json_object: bool = False
    structural_tag: str | None = None  # xgrammar's structural tag, as JSON text

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field against its range; raise InvalidRequestError naming it."""
        _check(1 <= self.n <= MAX_N, "n", f"must be between 1 and {MAX_N}, got {self.n}")
        if self.max_tokens is not None:
            _check(self.max_tokens >= 1, "max_tokens", f"must be at least 1, got {self.max_tokens}")
        _check(self.min_tokens >= 0, "min_tokens", f"must be >= 0, got {self.min_tokens}")
        for name in ("max_tokens", "min_tokens", "top_k"):
            value = getattr(self, name)
            if value is not None:
                _check(value <= INT64_MAX, name, f"must be at most 2**63 - 1, got {value}")
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}",
            )
        _check(
            0.0 <= self.temperature <= 100.0,
            "temperature",
            f"must be between 0 and 100, got {self.temperature}",
        )
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= -1, "top_k", f"must be -1, 0 (off) or positive, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(
            0.0 < self.repetition_penalty <= 2.0,
            "repetition_penalty",
            f"must be in (0, 2], got {self.repetition_penalty}",
        )
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            _check(-2.0 <= value <= 2.0, name, f"must be between -2 and 2, got {value}")
        if self.seed is not None:
            _check(-(2**63) <= self.seed < 2**64, "seed", "must fit in 64 bits")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check(
                    0 <= value <= MAX_LOGPROBS,
                    name,
                    f"must be between 0 and {MAX_LOGPROBS}, got {value}",
                )
        _check(
            all(isinstance(s, str) and s for s in self.stop),
            "stop",
            "stop strings must be non-empty strings",
        )
        _check(len(self.stop) <= 16, "stop", f"at most 16 stop strings, got {len(self.stop)}")
        _check(
            all(t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "token ids must be non-negative",
        )
        if self.logit_bias:
            _check(
                len(self.logit_bias) <= MAX_LOGIT_BIAS,
                "logit_bias",
                f"at most {MAX_LOGIT_BIAS} token ids, got {len(self.logit_bias)}",
            )
            for token, bias in self.logit_bias.items():
                _check(token >= 0, "logit_bias", f"token id {token} is negative")
                _check(
                    -100.0 <= bias <= 100.0,
                    "logit_bias",
                    f"the bias of token {token} must be between -100 and 100, got {bias}",
                )
        grammars = [
            self.json_schema is not None,
            self.regex is not None,
            self.ebnf is not None,
            self.json_object,
            self.structural_tag is not None,
        ]
        _check(
            sum(grammars) <= 1,
            "response_format",
            "at most one of json_schema, regex, ebnf, json_object, structural_tag may be given",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_grammar(self) -> bool:
        return (
            self.json_schema is not None
            or self.regex is not None
            or self.ebnf is not None
            or self.json_object
            or self.structural_tag is not None
        )
