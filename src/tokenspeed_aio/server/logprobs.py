"""Logprobs in OpenAI's two formats: completions' parallel lists (tokens,
token_logprobs, top_logprobs, text_offset) and chat's per-token entries (token,
logprob, bytes, top_logprobs). Token strings are each token decoded alone, with
special tokens shown, as OpenAI and vLLM report them."""

from __future__ import annotations

from collections.abc import Sequence

from tokenspeed_aio.api.outputs import RequestOutput
from tokenspeed_aio.protocol.openai import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    TopLogprob,
)
from tokenspeed_aio.tokenization.tokenizer import Tokenizer
from tokenspeed_aio.wire.messages import TokenLogprobs


class TokenTexts:
    """Token id -> its string, decoded once: a response with top-20 alternatives per
    token would otherwise decode 21 strings per token on the event loop."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self.tokenizer.decode([token_id], False)
        return text


def completion_logprobs(
    texts: TokenTexts,
    token_ids: Sequence[int],
    logprobs: Sequence[TokenLogprobs | None],
    offset: int,
    into: CompletionLogprobs | None = None,
) -> CompletionLogprobs:
    """Append entries for ``token_ids`` (aligned with ``logprobs``; a None entry is the
    first prompt token, which has no logprob) to ``into``; ``offset`` is the first
    token's position in the choice's text."""
    result = into or CompletionLogprobs()
    for tid, lp in zip(token_ids, logprobs):
        token = texts(tid)
        result.tokens.append(token)
        result.text_offset.append(offset)
        offset += len(token)
        if lp is None:
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            continue
        result.token_logprobs.append(lp.logprob)
        top: dict[str, float] = {}
        for alt, value in lp.top:
            top.setdefault(texts(alt), value)  # two ids may decode alike: keep the likelier
        result.top_logprobs.append(top)
    return result


def chat_logprobs(
    texts: TokenTexts, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs]
) -> ChatLogprobs:
    content = []
    for tid, lp in zip(token_ids, logprobs):
        token = texts(tid)
        top = [TopLogprob(texts(alt), value, list(texts(alt).encode())) for alt, value in lp.top]
        content.append(ChatTokenLogprob(token, lp.logprob, list(token.encode()), top))
    return ChatLogprobs(content)


def prompt_logprobs(
    texts: TokenTexts, prompt_ids: Sequence[int], out: RequestOutput
) -> PromptLogprobs:
    """vLLM's ``prompt_logprobs``: per prompt token ``{token id: {logprob, decoded_token}}``
    holding the token and its top-N alternatives; None for the first token."""
    result: PromptLogprobs = []
    entries = out.prompt_logprobs or [None] * len(prompt_ids)
    for tid, lp in zip(prompt_ids, entries):
        if lp is None:
            result.append(None)
            continue
        entry = {str(tid): PromptLogprob(lp.logprob, texts(tid))}
        for rank, (alt, value) in enumerate(lp.top, start=1):
            if alt == tid:
                entry[str(tid)].rank = rank
            entry.setdefault(str(alt), PromptLogprob(value, texts(alt), rank))
        result.append(entry)
    return result
