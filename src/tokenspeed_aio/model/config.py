"""What the engine needs to know about a model, parsed from a HF checkpoint directory.

Torch-free on purpose: the control plane reads it (sizes, eos ids, max length) and
must never import torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenspeed_aio.model.quantization.config import QuantConfig, parse_quantization
from tokenspeed_aio.model.registry import supported_architectures

# RoPE variants the rotary layer implements; anything else must fail at startup, not
# silently produce wrong positions.
SUPPORTED_ROPE_TYPES = ("default", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # e.g. "LlamaForCausalLM"; picks the model class
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int  # explicit in the config (Qwen3) or hidden_size // num_attention_heads
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # None for plain RoPE; else has "rope_type"
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections (always on for Qwen2)
    o_proj_bias: bool  # bias on the attention output projection (Llama/Qwen3 with attention_bias)
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    sliding_window: int | None  # None: full attention; the engine must cap lengths at it
    torch_dtype: str | None  # the checkpoint's dtype, e.g. "bfloat16"; None if unstated
    eos_token_ids: tuple[int, ...]  # union of config.json and generation_config.json
    quantization: QuantConfig | None = None  # the checkpoint's FP8 scheme (quantization_config)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Parse ``path/config.json`` (and ``generation_config.json`` if present)."""
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            raise ValueError(f"{config_file}: no such file; is {path} a HF checkpoint directory?")
        raw = _read_json(config_file)
        generation_file = Path(path) / "generation_config.json"
        generation = _read_json(generation_file) if generation_file.is_file() else {}
        return cls.from_dict(raw, generation, source=str(config_file))

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], generation: dict[str, Any] | None = None, *, source: str = ""
    ) -> ModelConfig:
        where = source or "config"
        architectures = raw.get("architectures") or []
        if not architectures:
            raise ValueError(f"{where}: field 'architectures' is missing or empty")
        arch = architectures[0]
        if arch not in supported_architectures():
            raise ValueError(
                f"{where}: architecture {arch!r} is not supported "
                f"(supported: {', '.join(supported_architectures())})"
            )

        def need(key: str) -> Any:
            if key not in raw:
                raise ValueError(f"{where}: required field {key!r} is missing")
            return raw[key]

        hidden_act = raw.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"{where}: hidden_act {hidden_act!r} is not supported (only 'silu')")
        if raw.get("mlp_bias"):
            raise ValueError(f"{where}: mlp_bias=true is not supported")

        num_heads = need("num_attention_heads")
        hidden_size = need("hidden_size")
        rope_theta, rope_scaling = _parse_rope(raw, where)
        is_qwen2 = arch == "Qwen2ForCausalLM"
        attention_bias = is_qwen2 or bool(raw.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=need("vocab_size"),
            hidden_size=hidden_size,
            num_hidden_layers=need("num_hidden_layers"),
            num_attention_heads=num_heads,
            num_key_value_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or hidden_size // num_heads,
            intermediate_size=need("intermediate_size"),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            # Qwen2 biases only q/k/v; Llama and Qwen3 put attention_bias on o_proj too.
            o_proj_bias=attention_bias and not is_qwen2,
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=_sliding_window(raw, arch),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            eos_token_ids=_eos_ids(raw.get("eos_token_id"), (generation or {}).get("eos_token_id")),
            quantization=parse_quantization(raw.get("quantization_config"), where),
        )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def _parse_rope(raw: dict[str, Any], where: str) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either config style.

    transformers >= 5 writes ``rope_parameters`` = {"rope_type", "rope_theta", scaling keys};
    older versions write a top-level ``rope_theta`` and ``rope_scaling`` whose type key is
    ``rope_type`` or the legacy ``type``.
    """
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "type")}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"{where}: rope type {rope_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if rope_type == "default":
        return theta, None
    scaling["rope_type"] = rope_type
    scaling.setdefault("original_max_position_embeddings", raw.get("max_position_embeddings"))
    return theta, scaling


def _sliding_window(raw: dict[str, Any], arch: str) -> int | None:
    # Qwen configs carry a sliding_window value that is only live when use_sliding_window is
    # set; Mistral's is live whenever present.
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not raw.get("use_sliding_window"):
        return None
    if arch == "LlamaForCausalLM":
        return None
    return raw.get("sliding_window")


def _eos_ids(*values: int | list[int] | None) -> tuple[int, ...]:
    ids: list[int] = []
    for value in values:
        for i in value if isinstance(value, list) else [value]:
            if i is not None and i not in ids:
                ids.append(i)
    return tuple(ids)
