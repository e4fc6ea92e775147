"""A chat request's tool choice: which tools it may call, whether the reply is parsed for
calls, and the constraint that makes ``required`` and named choices well formed.

As vLLM: ``auto`` (the default with tools) needs ``--enable-auto-tool-choice`` and a
``--tool-call-parser``; ``none`` renders the tools but parses nothing. ``required`` and a
named function are constrained with xgrammar so every call parses against its function's
schema: in the parser's own format when the server has one (the reply reads as the model
would write it, and the parser reads it back), else as vLLM does (``required``: a JSON
array of ``{"name", "parameters"}``; named: the arguments object alone).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tokenspeed_aio.protocol.openai import ChatCompletionRequest
from tokenspeed_aio.protocol.tools import NamedToolChoice
from tokenspeed_aio.server.context import ServerContext
from tokenspeed_aio.server.errors import ApiError
from tokenspeed_aio.server.structured import structured_output
from tokenspeed_aio.tokenization.parsers import JsonArrayParser, ToolParser


@dataclass(frozen=True)
class ToolPlan:
    parser: ToolParser | None  # reads calls out of the reply; None: no tool parsing
    grammar: dict[str, Any] | None  # SamplingParams' grammar fields for the constraint
    named: str | None = None  # named choice without a parser: the reply is its arguments


NO_TOOLS = ToolPlan(None, None)


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


def plan_tools(ctx: ServerContext, req: ChatCompletionRequest) -> ToolPlan:
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise _bad("tool_choice", "needs tools")
        return NO_TOOLS
    tools = [{"name": t.function.name, "parameters": t.function.parameters} for t in req.tools]
    names = [t["name"] for t in tools]
    if len(set(names)) != len(names):
        raise _bad("tools", "function names must be unique")
    choice = choice or "auto"
    if choice == "none":
        return NO_TOOLS
    if choice == "auto":
        if ctx.tool_parser is None or not ctx.options.enable_auto_tool_choice:
            raise _bad(
                "tool_choice",
                '"auto" needs the server started with --enable-auto-tool-choice and '
                '--tool-call-parser (or send tool_choice "none", "required" or a named function)',
            )
        return ToolPlan(ctx.tool_parser, None)
    if structured_output(req):
        raise _bad("tool_choice", f"{choice!r} cannot be combined with a structured output field")
    if isinstance(choice, NamedToolChoice):
        tool = next((t for t in tools if t["name"] == choice.function.name), None)
        if tool is None:
            raise _bad("tool_choice", f"names {choice.function.name!r}, which is not in tools")
        if ctx.tool_parser is None:
            schema = tool["parameters"] or {"type": "object", "properties": {}}
            return ToolPlan(JsonArrayParser(), {"json_schema": json.dumps(schema)}, tool["name"])
        tag = ctx.tool_parser.constraint([tool], parallel=False)
        return ToolPlan(ctx.tool_parser, {"structural_tag": tag})
    parser = ctx.tool_parser or JsonArrayParser()
    return ToolPlan(parser, {"structural_tag": parser.constraint(tools, req.parallel_tool_calls)})
