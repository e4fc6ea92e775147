"""Parsers of model replies: tool calls (``--tool-call-parser``) and reasoning
(``--reasoning-parser``), by the names vLLM and SGLang use."""

from __future__ import annotations

from tokenspeed_aio.tokenization.parsers.base import Extraction, ParsedCall, ToolParser
from tokenspeed_aio.tokenization.parsers.formats import (
    HermesParser,
    JsonArrayParser,
    Llama3JsonParser,
    MistralParser,
    PythonicParser,
)
from tokenspeed_aio.tokenization.parsers.reasoning import (
    DeepSeekR1Parser,
    Qwen3Parser,
    ReasoningParser,
    ReasoningStream,
)
from tokenspeed_aio.tokenization.parsers.streaming import ToolCallStream

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "qwen": HermesParser,  # SGLang's name for Qwen 2.5/3's hermes-style calls
    "qwen25": HermesParser,
    "llama3_json": Llama3JsonParser,
    "llama3": Llama3JsonParser,
    "mistral": MistralParser,
    "pythonic": PythonicParser,
}
REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "qwen3": Qwen3Parser,
    "deepseek_r1": DeepSeekR1Parser,
    "deepseek-r1": DeepSeekR1Parser,
}

__all__ = [
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "Extraction",
    "JsonArrayParser",
    "ParsedCall",
    "ReasoningParser",
    "ReasoningStream",
    "ToolCallStream",
    "ToolParser",
]
