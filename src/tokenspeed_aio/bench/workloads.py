"""The benchmark workloads (docs/performance.md, "Method"), as plain data built from a seed.

Every request is a turn of a conversation: a turn appends ``new_ids`` to the
conversation so far (its earlier prompts and the replies the engine produced) and
asks for exactly ``output_len`` tokens (``ignore_eos``). Single-request workloads
are conversations of one turn. A run is one level of a workload (a concurrency, an
arrival rate): its conversations start at their ``arrival`` time, at most
``concurrency`` of them at once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True)
class TokenSpace:
    """The token ids a random prompt may use: the model's vocabulary minus special tokens
    (an end-of-text id inside a prompt would change what the model does)."""

    vocab_size: int
    special_ids: frozenset[int] = frozenset()

    @classmethod
    def from_model_dir(cls, path: str | Path, tokenizer: str | Path | None = None) -> TokenSpace:
        from tokenspeed_aio.model.config import ModelConfig
        from tokenspeed_aio.tokenization.tokenizer import Tokenizer

        config = ModelConfig.from_pretrained(path)
        tok = Tokenizer(tokenizer or path)
        # Ids past the tokenizer's vocabulary would not detokenize; ids past the model's
        # would not embed.
        vocab = min(config.vocab_size, tok.vocab_size)
        return cls(vocab, frozenset(tok.special_ids) | frozenset(config.eos_token_ids))

    def allowed(self) -> np.ndarray:
        ids = np.arange(self.vocab_size, dtype=np.int64)
        return np.setdiff1d(ids, np.fromiter(self.special_ids, dtype=np.int64))

    def sampler(self, seed: int) -> Callable[[int], list[int]]:
        """``sample(n)``: n random allowed ids, reproducible for the seed."""
        allowed = self.allowed()
        rng = np.random.default_rng(seed)
        return lambda n: allowed[rng.integers(0, len(allowed), n)].tolist()


@dataclass(frozen=True)
class Turn:
    new_ids: list[int]  # tokens this turn appends to the conversation
    output_len: int  # tokens the reply must have (ignore_eos makes it exact)


@dataclass(frozen=True)
class Conversation:
    turns: list[Turn]
    arrival: float = 0.0  # seconds after the run starts when the first turn may be sent


@dataclass(frozen=True)
class Run:
    name: str  # the level, as the report labels it: "c=16", "rate=4", ...
    conversations: list[Conversation]
    concurrency: int | None  # most conversations in flight at once; None: arrivals decide
    params: dict[str, Any] = field(default_factory=dict)  # the level's knobs, for the report

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.conversations)

    def uniform_lengths(self) -> tuple[int, int] | None:
        """(input, output) length when every request is a first turn of the same shape
        and all arrive at once: the runs a roofline and generate_batch can describe."""
        shapes = {(len(s.turns[0].new_ids), s.turns[0].output_len) for s in self.conversations}
        single = all(len(s.turns) == 1 and s.arrival == 0.0 for s in self.conversations)
        return next(iter(shapes)) if single and len(shapes) == 1 else None


@dataclass(frozen=True)
class Workload:
    name: str
    runs: list[Run]
    settings: dict[str, Any]  # every knob that built it (seed included), for the JSON


def parse_list(text: str, kind: Callable[[str], Any] = int) -> list[Any]:
    """``"1,4,16"`` -> [1, 4, 16]; ``kind=float`` also reads ``inf``."""
    return [kind(part) for part in text.split(",") if part.strip()]


def fixed_requests(concurrency: int) -> int:
    """At least 4× the concurrency, and at least 256 at concurrency 64 and above."""
    return max(4 * concurrency, 256 if concurrency >= 64 else 0)


def fixed(
    tokens: TokenSpace,
    *,
    name: str = "fixed-1k",
    input_len: int = 1024,
    output_len: int = 1024,
    concurrency: Sequence[int] = (1, 4, 16, 64, 256),
    num_requests: int | Sequence[int] | None = None,
    seed: int = 0,
) -> Workload:
    """Closed loop: ``c`` requests in flight, each replaced as soon as it finishes;
    ``num_requests`` per level (one count for all, or one per concurrency level)."""
    sample = tokens.sampler(seed)
    counts = (
        num_requests if isinstance(num_requests, Sequence) else [num_requests] * len(concurrency)
    )
    if len(counts) != len(concurrency):
        raise ValueError(
            f"num_requests: {len(counts)} counts for {len(concurrency)} concurrency levels"
        )
    runs = []
    for c, count in zip(concurrency, counts):
        n = count or fixed_requests(c)
        conversations = [Conversation([Turn(sample(input_len), output_len)]) for _ in range(n)]
        runs.append(Run(f"c={c}", conversations, c, {"concurrency": c, "num_requests": n}))
    settings = dict(
        input_len=input_len,
        output_len=output_len,
        concurrency=list(concurrency),
        num_requests=list(counts) if isinstance(num_requests, Sequence) else num_requests,
        seed=seed,
    )
    return Workload(name, runs, settings)


def latency(
    tokens: TokenSpace,
    *,
    input_len: int = 32,
    output_len: int = 128,
    batch: int = 8,
    num_requests: int = 32,
    seed: int = 0,
) -> Workload:
    """vLLM's nightly latency test: batches of 8 short requests, one batch after another
    (a closed loop of 8 identical requests finishes them in the same round)."""
    w = fixed(
        tokens,
        name="latency",
        input_len=input_len,
        output_len=output_len,
        concurrency=[batch],
        num_requests=num_requests,
        seed=seed,
    )
    return Workload("latency", w.runs, w.settings | {"batch": batch})


def overhead(
    tokens: TokenSpace,
    *,
    input_len: int = 32,
    output_len: int = 128,
    concurrency: Sequence[int] = (256,),
    seed: int = 0,
) -> Workload:
    """256 decodes at once on a tiny model: the round's CPU cost is most of the step.
    Each level is one wave of ``c`` requests (more levels: the cost against ``c``)."""
    sample = tokens.sampler(seed)
    runs = []
    for c in concurrency:
        conversations = [Conversation([Turn(sample(input_len), output_len)]) for _ in range(c)]
        runs.append(Run(f"c={c}", conversations, c, {"concurrency": c, "num_requests": c}))
    settings = dict(
        input_len=input_len, output_len=output_len, concurrency=list(concurrency), seed=seed
    )
    return Workload("overhead", runs, settings)


def lognormal_lengths(
    rng: np.random.Generator, n: int, median: float, sigma: float, lo: int, hi: int
) -> list[int]:
    return np.clip(np.rint(rng.lognormal(math.log(median), sigma, n)), lo, hi).astype(int).tolist()


def chat_mix(
    tokens: TokenSpace,
    *,
    num_requests: int = 500,
    rates: Sequence[float] = (1.0, 4.0, 16.0, math.inf),
    input_median: float = 200,
    output_median: float = 180,
    sigma: float = 1.0,
    max_input: int = 4096,
    max_output: int = 2048,
    seed: int = 0,
) -> Workload:
    """ShareGPT-like lengths (lognormal, clipped) arriving as a Poisson process; the same
    requests at every rate (``inf``: all at once). The medians are the workload's
    definition (docs/performance.md); the
    spread ``sigma`` is ours (1.0: the 10th-90th percentiles span about 13×)."""
    rng = np.random.default_rng(seed)
    inputs = lognormal_lengths(rng, num_requests, input_median, sigma, 4, max_input)
    outputs = lognormal_lengths(rng, num_requests, output_median, sigma, 4, max_output)
    sample = tokens.sampler(seed + 1)
    turns = [Turn(sample(i), o) for i, o in zip(inputs, outputs)]
    runs = []
    for rate in rates:
        if math.isinf(rate):
            arrivals = [0.0] * num_requests
        else:
            gaps = np.random.default_rng(seed + 2).exponential(1.0 / rate, num_requests)
            arrivals = (np.cumsum(gaps) - gaps[0]).tolist()
        conversations = [Conversation([t], a) for t, a in zip(turns, arrivals)]
        runs.append(Run(f"rate={rate:g}", conversations, None, {"rate": rate}))
    settings = dict(
        num_requests=num_requests,
        rates=list(rates),
        input_median=input_median,
        output_median=output_median,
        sigma=sigma,
        max_input=max_input,
        max_output=max_output,
        seed=seed,
    )
    return Workload("chat-mix", runs, settings)


def agentic_prefix(
    tokens: TokenSpace,
    *,
    conversations: int = 64,
    turns: int = 8,
    turn_tokens: int = 200,
    reply_tokens: int = 150,
    seed: int = 0,
) -> Workload:
    """Each conversation resends everything so far plus ``turn_tokens`` new tokens and
    gets ``reply_tokens`` back, turn after turn; all conversations run at once."""
    sample = tokens.sampler(seed)
    built = [
        Conversation([Turn(sample(turn_tokens), reply_tokens) for _ in range(turns)])
        for _ in range(conversations)
    ]
    params = {"conversations": conversations, "turns": turns}
    runs = [Run(f"conversations={conversations}", built, None, params)]
    settings = dict(
        conversations=conversations,
        turns=turns,
        turn_tokens=turn_tokens,
        reply_tokens=reply_tokens,
        seed=seed,
    )
    return Workload("agentic-prefix", runs, settings)


WORKLOADS: dict[str, Callable[..., Workload]] = {
    "fixed-1k": fixed,
    "chat-mix": chat_mix,
    "latency": latency,
    "agentic-prefix": agentic_prefix,
    "overhead": overhead,
}
