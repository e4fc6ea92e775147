"""Tiny random-weight Hugging Face checkpoints for tests, written with transformers.

Each checkpoint is a real HF directory (config.json, model.safetensors, tokenizer
files with a chat template) so the engine loads it exactly as it loads a real model,
and transformers serves as the reference implementation on the same files.

The tokenizer is a byte-level BPE trained offline with `tokenizers` on text that
ships with Python (``pydoc_data``), so no download is ever needed.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from tools.chat_tokens import CHAT_TEMPLATE, EOS_TOKEN, train_byte_level_bpe

ARCHS = ("llama", "llama3", "mistral", "qwen2", "qwen3")

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    initializer_range=0.5,  # sharp random logits: distinct greedy tokens, wide top-1 gaps
)


def corpus() -> list[str]:
    """Text that ships with CPython: the language reference's help topics."""
    from pydoc_data import topics

    return [topics.topics[k] for k in sorted(topics.topics)]


@functools.lru_cache(maxsize=4)
def _tokenizer_json(vocab_size: int) -> str:
    return train_byte_level_bpe(corpus(), vocab_size).to_str()


def write_tokenizer(path: Path, vocab_size: int = 512) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(_tokenizer_json(vocab_size))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": EOS_TOKEN,
                "pad_token": EOS_TOKEN,
                "chat_template": CHAT_TEMPLATE,
                "model_max_length": TINY["max_position_embeddings"],
                "clean_up_tokenization_spaces": False,
            }
        )
    )
    (path / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN})
    )


def make_checkpoint(
    path: Path,
    arch: str = "llama",
    *,
    seed: int = 0,
    vocab_size: int = 512,
    tie_word_embeddings: bool = False,
    dtype: str = "float32",
    **overrides,
) -> Path:
    """Write a tiny random checkpoint of ``arch`` (llama, llama3, mistral, qwen2, qwen3)."""
    import torch
    import transformers

    write_tokenizer(path, vocab_size)
    from tokenizers import Tokenizer

    eos_id = Tokenizer.from_file(str(path / "tokenizer.json")).token_to_id(EOS_TOKEN)
    common = dict(TINY, vocab_size=vocab_size, tie_word_embeddings=tie_word_embeddings)
    common.update(bos_token_id=None, eos_token_id=eos_id, pad_token_id=eos_id)
    if arch in ("llama", "llama3"):
        cls, cfg_cls = transformers.LlamaForCausalLM, transformers.LlamaConfig
        if arch == "llama3":
            common["rope_theta"] = 500000.0
            common["rope_scaling"] = {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            }
    elif arch == "mistral":
        cls, cfg_cls = transformers.MistralForCausalLM, transformers.MistralConfig
        common["sliding_window"] = None
    elif arch == "qwen2":
        cls, cfg_cls = transformers.Qwen2ForCausalLM, transformers.Qwen2Config
        common["use_sliding_window"] = False
    elif arch == "qwen3":
        cls, cfg_cls = transformers.Qwen3ForCausalLM, transformers.Qwen3Config
        common["head_dim"] = 32  # explicit head_dim != hidden / heads
        common["use_sliding_window"] = False
    else:
        raise ValueError(f"unknown arch {arch!r}")
    common.update(overrides)
    config = cfg_cls(**common)
    torch.manual_seed(seed)
    model = cls(config).to(getattr(torch, dtype))
    model.save_pretrained(path, safe_serialization=True)
    (path / "generation_config.json").unlink(missing_ok=True)
    return path
