"""Where a model's files come from: the packaged default model or a local directory.

Kept free of torch and transformers so the CLI can validate ``--model`` before importing them.
"""

from __future__ import annotations

from pathlib import Path

# A ~4M-parameter toy Llama trained on Python's docs (see default_model/README.md); it lets
# `serve` with no model answer offline.
DEFAULT_MODEL_DIR: Path = Path(__file__).resolve().parent / "default_model"


def resolve_model_path(model: str | None) -> Path:
    """The checkpoint directory for ``model``: the packaged default for None, else a local dir.

    Hub ids are not downloaded: the engine never reaches the network for weights.
    """
    if model is None:
        return DEFAULT_MODEL_DIR
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ValueError(
            f"model path {model!r} does not exist or is not a directory; only local model "
            "directories are supported (no downloads from the Hugging Face Hub)"
        )
    return path.resolve()
