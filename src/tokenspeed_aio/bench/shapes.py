"""Named model shapes for benchmarks, written as Hugging Face checkpoint directories.

A shape is a config.json plus a tokenizer; the small ones also get real random
weights (``model.safetensors`` written by transformers), so our engine and the HF
peer load identical files and their greedy tokens can be compared. The 8B shapes
are config-only (16 GB of random weights are not worth writing): our engine runs
them with ``load_format="dummy"`` and the HF peer with ``from_config`` random
init. The math, and so the speed, is the same either way.

The tokenizer is a synthetic word-level vocabulary (``t1``..``tN``, id 0 the
end-of-text token) of exactly the model's vocab size, so every id the model can
emit detokenizes, whatever the shape.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

EOS_TOKEN = "<|endoftext|>"  # id 0: the only special token of the synthetic tokenizer

_COMMON: dict[str, Any] = {
    "hidden_act": "silu",
    "bos_token_id": None,
    "eos_token_id": 0,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
    "attention_bias": False,
}

SHAPES: dict[str, dict[str, Any]] = {
    # The tests' tiny model: sharp random logits (initializer_range 0.5) so greedy
    # tokens have wide top-1 gaps and two implementations agree on them.
    "tiny": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "initializer_range": 0.5,
        "torch_dtype": "float32",
    },
    # The overhead workload's model: the step is so cheap that the round's own
    # Python shows. A small vocabulary keeps the LM head from dominating the step.
    "overhead": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 1024,
        "hidden_size": 256,
        "intermediate_size": 1024,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "initializer_range": 0.5,
        "torch_dtype": "float32",
    },
    # Llama-3.1-8B's published config.
    "llama-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "torch_dtype": "bfloat16",
    },
    # Qwen3-8B's published config.
    "qwen3-8b": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "use_sliding_window": False,
        "torch_dtype": "bfloat16",
    },
}


def _fp8(base: str, quantization_config: dict[str, Any]) -> dict[str, Any]:
    return {**SHAPES[base], "quantization_config": quantization_config}


def _ct_fp8(weights: str, activations: dict[str, Any]) -> dict[str, Any]:
    """compressed-tensors' FP8 ``quantization_config`` (llm-compressor's)."""
    scheme = {"num_bits": 8, "type": "float", "symmetric": True}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {**scheme, "dynamic": False, "strategy": weights},
                "input_activations": {**scheme, **activations},
            }
        },
        "ignore": ["lm_head"],
    }


# The 8B shapes with FP8 weights, one per checkpoint format: dummy weights are quantized by
# the format's scheme at load (model/loader.py).
SHAPES |= {
    # RedHatAI/*-FP8-dynamic: per-channel weights, dynamic per-token activations.
    "llama-8b-fp8": _fp8("llama-8b", _ct_fp8("channel", {"dynamic": True, "strategy": "token"})),
    # RedHatAI/*-FP8 (static): per-tensor weights and activation scales.
    "llama-8b-fp8-static": _fp8(
        "llama-8b", _ct_fp8("tensor", {"dynamic": False, "strategy": "tensor"})
    ),
    # vLLM's / AutoFP8's fp8 format: per-tensor weight scales, static activations.
    "llama-8b-fp8-pertensor": _fp8(
        "llama-8b", {"quant_method": "fp8", "activation_scheme": "static"}
    ),
    # Qwen3-8B-FP8: 128x128 block scales (weight_scale_inv), dynamic per-group activations.
    "qwen3-8b-fp8-block": _fp8(
        "qwen3-8b",
        {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    ),
}

# Shapes small enough to write real random weights for (a few MB at most).
WEIGHTED_SHAPES = frozenset({"tiny", "overhead"})


def shape_config(shape: str) -> dict[str, Any]:
    if shape not in SHAPES:
        raise ValueError(f"shape: unknown shape {shape!r} (choose from {', '.join(SHAPES)})")
    return {**_COMMON, **SHAPES[shape]}


def default_root() -> Path:
    return Path(tempfile.gettempdir()) / "tokenspeed_aio-bench"


def checkpoint_dir(shape: str, root: Path | None = None, seed: int = 0) -> Path:
    """The shape's checkpoint directory, written on first use and reused after."""
    config = shape_config(shape)
    weights = shape in WEIGHTED_SHAPES
    path = (root or default_root()) / (f"{shape}-s{seed}" if weights else shape)
    if (path / "config.json").is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # Written beside the target and renamed into place: a concurrent or interrupted
    # writer never leaves a half-written checkpoint behind under the final name.
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        write_tokenizer(tmp, config["vocab_size"], config["max_position_embeddings"])
        if weights:
            _write_random_weights(tmp, seed)
        try:
            os.rename(tmp, path)
        except OSError:
            if not (path / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def write_tokenizer(path: Path, vocab_size: int, max_length: int) -> None:
    """A word-level tokenizer.json with exactly ``vocab_size`` ids (id 0: end of text)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {EOS_TOKEN: 0} | {f"t{i}": i for i in range(1, vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=EOS_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([EOS_TOKEN])
    tok.save(str(path / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "model_max_length": max_length,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))


def _write_random_weights(path: Path, seed: int) -> None:
    """transformers' own random init, saved as safetensors next to the config."""
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.to(getattr(torch, json.loads((path / "config.json").read_text())["torch_dtype"]))
    model.save_pretrained(path, safe_serialization=True)
    # generation_config.json would repeat the eos id; config.json stays the one source.
    (path / "generation_config.json").unlink(missing_ok=True)
