"""Tool calling's messages: the tools a chat request offers, its tool_choice, and the
calls a response (or a streamed delta) carries, as OpenAI shapes them."""

from __future__ import annotations

from typing import Any, Literal

import msgspec


class FunctionDefinition(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: takes no arguments
    strict: bool | None = None


class Tool(msgspec.Struct, kw_only=True):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(msgspec.Struct, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    """``{"type": "function", "function": {"name": "get_weather"}}``: call exactly this."""

    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(msgspec.Struct):
    id: str
    function: FunctionCall
    type: str = "function"


class DeltaFunctionCall(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(msgspec.Struct, omit_defaults=True):
    """One tool call in a streamed chunk; ``index`` groups the pieces of one call."""

    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunctionCall | None = None
