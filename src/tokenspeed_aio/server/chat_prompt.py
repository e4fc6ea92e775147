"""A chat request's prompt: its messages (text parts joined, ``tool_calls`` arguments as
objects, as Hugging Face templates expect), its tools, rendered with the chat template
and tokenized."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import msgspec

from tokenspeed_aio.api.frontend import ASYNC_TOKENIZE_CHARS
from tokenspeed_aio.protocol.openai import ChatCompletionRequest, ChatMessage
from tokenspeed_aio.server.context import ServerContext
from tokenspeed_aio.server.errors import ApiError
from tokenspeed_aio.server.generation import tokenize

# Template variables the server sets itself (the request's own fields, special tokens).
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "bos_token", "eos_token"})


def _tool_calls(calls: list[dict[str, Any]], index: int) -> list[dict[str, Any]]:
    """OpenAI sends a call's arguments as JSON text; templates index into them (Llama's
    ``tool_call.arguments | tojson``, Qwen's), so they get the object, as vLLM does."""
    result = []
    for j, call in enumerate(calls):
        field = f"messages[{index}].tool_calls[{j}].function"
        call = dict(call)
        function = call.get("function")
        if function is None:
            function = {}
        elif not isinstance(function, dict):
            raise _refused(index, field, f"must be an object, got {type(function).__name__}")
        function = dict(function)
        args = function.get("arguments")
        if isinstance(args, str):
            try:
                function["arguments"] = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                raise _refused(index, f"{field}.arguments", "not valid JSON") from None
            except RecursionError:
                raise _refused(index, f"{field}.arguments", "JSON nested too deeply") from None
        elif args is not None and not isinstance(args, dict):
            kind = type(args).__name__
            raise _refused(index, f"{field}.arguments", f"must be a JSON string, got {kind}")
        call["function"] = function
        result.append(call)
    return result


def _refused(index: int, field: str, problem: str) -> ApiError:
    return ApiError(400, f"{field}: {problem}", param=f"messages[{index}].tool_calls")


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template expects them: text parts joined into a string."""
    result = []
    for i, msg in enumerate(messages):
        content = msg.content
        if isinstance(content, list):
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    problem = (
                        f"only text parts are supported (got type {part.type!r})"
                        if part.type != "text"
                        else "a text part needs its 'text'"
                    )
                    raise ApiError(
                        400,
                        f"messages[{i}].content[{j}]: {problem}",
                        param=f"messages[{i}].content",
                    )
            content = "\n".join(part.text or "" for part in content)
        entry: dict[str, Any] = {"role": msg.role, "content": content}
        if content is None and not msg.tool_calls:
            entry["content"] = ""
        for key in ("name", "tool_call_id", "reasoning_content"):
            value = getattr(msg, key)
            if value is not None:
                entry[key] = value
        if msg.tool_calls:
            entry["tool_calls"] = _tool_calls(msg.tool_calls, i)
        result.append(entry)
    return result


def _final_message(req: ChatCompletionRequest) -> str:
    """The content continue_final_message continues: the last message's, an assistant's."""
    last = req.messages[-1]
    if last.role != "assistant" or not isinstance(last.content, str) or not last.content:
        raise ApiError(
            400,
            "continue_final_message: the last message must be an assistant message with text",
            param="continue_final_message",
        )
    return last.content


async def chat_prompt(
    ctx: ServerContext, req: ChatCompletionRequest, add_special_tokens: bool = False
) -> tuple[list[int], str]:
    """The rendered conversation's (token ids, text). The template writes the special
    tokens itself, so none are added, as Hugging Face does for templated text."""
    if not req.messages:
        raise ApiError(400, "messages: the conversation is empty", param="messages")
    messages = template_messages(req.messages)
    tokenizer = ctx.frontend.tokenizer
    kwargs = dict(req.chat_template_kwargs or {})
    reserved = sorted(kwargs.keys() & RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise ApiError(
            400,
            f"chat_template_kwargs: {', '.join(reserved)} cannot be set here (the server "
            "passes them to the template itself)",
            param="chat_template_kwargs",
        )
    final = _final_message(req) if req.continue_final_message else None
    kwargs["add_generation_prompt"] = req.add_generation_prompt and final is None
    if req.tools:
        kwargs["tools"] = [msgspec.to_builtins(tool) for tool in req.tools]
    size = sum(len(str(m.get("content") or "")) for m in messages)
    if size > ASYNC_TOKENIZE_CHARS:  # jinja over a long conversation: off the loop
        text = await asyncio.to_thread(tokenizer.render_chat, messages, **kwargs)
    else:
        text = tokenizer.render_chat(messages, **kwargs)
    if final is not None:  # end the text where the final message's content ends
        end = text.rfind(final)
        if end < 0:
            raise ApiError(
                400,
                "continue_final_message: the chat template does not render the final "
                "message's content verbatim, so it cannot be continued",
                param="continue_final_message",
            )
        text = text[: end + len(final)]
    return (await tokenize(tokenizer, [text], add_special_tokens=add_special_tokens))[0], text
