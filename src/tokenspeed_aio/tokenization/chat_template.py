"""Chat templates: the tokenizer's jinja template (or one given with --chat-template),
rendered in a sandbox with the helpers Hugging Face templates use."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tokenspeed_aio.errors import InvalidRequestError


def _raise(message: str) -> None:
    raise InvalidRequestError(f"messages: {message}", param="messages")


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def load_template(value: str) -> str:
    """--chat-template takes a file path or the template itself."""
    path = Path(value)
    if len(value) < 4096 and path.is_file():
        return path.read_text()
    return value


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str | None]) -> None:
        self.source = source
        self.special_tokens = special_tokens  # bos_token, eos_token for the template
        _compile(source)  # fail at startup on a broken template

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        **kwargs: Any,
    ) -> str:
        try:
            return _compile(self.source).render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                **self.special_tokens,
                **kwargs,
            )
        except InvalidRequestError:
            raise
        except jinja2.TemplateError as err:
            raise InvalidRequestError(
                f"messages: the chat template could not render them: {err}", param="messages"
            ) from err
