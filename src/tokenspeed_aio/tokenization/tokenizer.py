"""The frontend's tokenizer: a Hugging Face ``tokenizer.json`` through the
``tokenizers`` library (no transformers, no torch in the frontend process), plus
the checkpoint's tokenizer_config.json for special tokens and the chat template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import tokenizers

from tokenspeed_aio.errors import InvalidRequestError
from tokenspeed_aio.tokenization.chat_template import ChatTemplate, load_template


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as strings or AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _saved_template(path: Path, config: dict[str, Any]) -> str | None:
    """The checkpoint's chat template: ``chat_template.jinja`` beside the config (where
    transformers >= 4.43 saves it), ``chat_template.json`` (processors), else the config's
    ``chat_template`` field (a string, or named templates of which "default" is taken)."""
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    legacy = path / "chat_template.json"
    if legacy.is_file():
        value = json.loads(legacy.read_text()).get("chat_template")
        if value:
            return value
    source = config.get("chat_template")
    if isinstance(source, list):
        source = next((t["template"] for t in source if t.get("name") == "default"), None)
    return source


class Tokenizer:
    def __init__(self, path: str | Path, chat_template: str | None = None) -> None:
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise ValueError(f"tokenizer: {file} not found (a tokenizer.json is required)")
        self._tok = tokenizers.Tokenizer.from_file(str(file))
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.special_ids = frozenset(
            tid for tid, tok in self._tok.get_added_tokens_decoder().items() if tok.special
        )
        source = load_template(chat_template) if chat_template else _saved_template(path, config)
        self.chat_template = (
            ChatTemplate(source, {"bos_token": self.bos_token, "eos_token": self.eos_token})
            if source
            else None
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    async def encode_async(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Off the event loop: the Rust tokenizer runs on its own thread pool."""
        encoding = await self._tok.async_encode(text, add_special_tokens=add_special_tokens)
        return encoding.ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def render_chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        if self.chat_template is None:
            raise InvalidRequestError(
                "messages: this model has no chat template; pass --chat-template or use "
                "/v1/completions",
                param="messages",
            )
        return self.chat_template.render(messages, **kwargs)
