"""Where a model's files come from: the packaged default model, a local directory, or a
Hugging Face hub id resolved through the local HF cache (``HF_HOME``), downloaded only
when the machine may go online (``HF_HUB_OFFLINE`` unset).

Kept free of torch and transformers so the CLI can validate ``--model`` before importing
them; ``huggingface_hub`` is imported only for a hub id.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# A ~4M-parameter toy Llama trained on Python's docs (see default_model/README.md); it lets
# `serve` with no model answer offline.
DEFAULT_MODEL_DIR: Path = Path(__file__).resolve().parent / "default_model"

# ORG/NAME as the hub spells repository ids (an optional @revision after it).
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")
# What serving needs of a repository: configs, tokenizer, template, weights.
_SERVING_FILES = ["*.json", "*.jinja", "*.safetensors", "tokenizer.model", "*.txt"]


class ModelSourceError(ValueError):
    """``--model`` names nothing servable; the message is one line saying why."""


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def resolve_model_path(model: str | None) -> Path:
    """The checkpoint directory for ``model``: the packaged default for None, a local
    directory as is, else a hub id from the local HF cache (downloading it when online)."""
    if model is None:
        return DEFAULT_MODEL_DIR
    path = Path(model).expanduser()
    if path.is_dir():
        return path.resolve()
    if path.exists():
        raise ModelSourceError(f"--model {model!r} is a file; give the checkpoint's directory")
    if not _HUB_ID.match(model) or model.startswith((".", "/", "~")):
        raise ModelSourceError(
            f"--model {model!r}: no such directory, and not a Hugging Face hub id (ORG/NAME)"
        )
    return _from_hub(model)


def _from_hub(model: str) -> Path:
    repo_id, _, revision = model.partition("@")
    try:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError:  # pragma: no cover - transformers brings it
        raise ModelSourceError(
            f"--model {model!r} looks like a hub id, but huggingface_hub is not installed"
        ) from None
    kwargs = dict(repo_id=repo_id, revision=revision or None, allow_patterns=_SERVING_FILES)
    try:  # the cache first: no network round trip when the snapshot is there
        return Path(snapshot_download(**kwargs, local_files_only=True))
    except LocalEntryNotFoundError:
        if _offline():
            raise ModelSourceError(
                f"--model {model!r} is not in the local Hugging Face cache "
                f"({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE=1 forbids downloading it"
            ) from None
    except (OSError, ValueError) as err:
        raise ModelSourceError(
            f"--model {model!r}: the cached snapshot is unusable ({err})"
        ) from None
    try:
        return Path(snapshot_download(**kwargs))
    except (HfHubHTTPError, OSError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ModelSourceError(f"--model {model!r} could not be downloaded: {first}") from None


def check_model_dir(path: Path, model: str | None) -> None:
    """A one-line error unless ``path`` holds a checkpoint's config.json."""
    if not (path / "config.json").is_file():
        raise ModelSourceError(
            f"--model {model!r}: {path} has no config.json; is it a Hugging Face checkpoint?"
        )
