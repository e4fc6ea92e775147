"""Sampling defaults from a checkpoint's ``generation_config.json``, applied to the fields a
request leaves unset (vLLM's ``--generation-config auto``, its default).

Only the fields vLLM takes are read (temperature, top_p, top_k, min_p, repetition_penalty,
max_new_tokens); ``do_sample`` is ignored as vLLM ignores it. ``vllm`` means no defaults
(the API's own); any other value is a directory holding a ``generation_config.json``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# generation_config.json's name -> the request field it is the default of.
FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def generation_defaults(model_dir: str | Path, setting: str = "auto") -> dict[str, Any]:
    """Request-field defaults (``{"temperature": 0.6, ...}``) for ``--generation-config``."""
    if setting == "vllm":
        return {}
    folder = Path(model_dir) if setting == "auto" else Path(setting).expanduser()
    if setting != "auto" and not folder.is_dir():
        raise ValueError(f"generation_config: {setting!r} is not a directory")
    file = folder / "generation_config.json"
    if not file.is_file():
        return {}
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"generation_config: {file} is not valid JSON ({err})") from None
    defaults = {FIELDS[k]: v for k, v in raw.items() if k in FIELDS and v is not None}
    if defaults:
        logger.info("sampling defaults from %s (a request's own values win): %s", file, defaults)
    return defaults
