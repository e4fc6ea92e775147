"""Which FP8 scheme a model's linear layers use: parsed from a checkpoint's
``quantization_config`` or chosen online (``--quantization fp8``). Torch-free: the
control plane reads ModelConfig, which carries it.

Formats read (see docs/quantization.md for the tensors each one stores):

- ``compressed-tensors`` (llm-compressor, ``RedHatAI/*-FP8``), ``format: float-quantized``:
  float8_e4m3fn weights with per-tensor, per-channel or 128x128 block scales
  (``weight_scale``); activations quantized per token (dynamic), per 128-wide group of a
  token (dynamic, block weights) or per tensor with a stored ``input_scale`` (static).
- ``fp8`` (vLLM's and AutoFP8's, DeepSeek's and Qwen3-FP8's): per-tensor ``weight_scale``
  with a static ``input_scale`` or dynamic activations, or ``weight_block_size: [128, 128]``
  with ``weight_scale_inv`` (despite the name, the multiplier that dequantizes).
- online: a 16-bit checkpoint's linear weights quantized at load, one scale per output
  channel, activations per token (as vLLM's ``--quantization fp8``, which scales per tensor).

Every dynamic activation scale is per token (per token and 128-group with block weights),
including the ``fp8`` format's ``activation_scheme: dynamic`` that vLLM scales per tensor:
finer, and the same kernels. Anything else fails here, at startup, naming the scheme.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

FP8_BLOCK = (128, 128)  # the one block shape the kernels take (DeepSeek-V3, Qwen3-FP8)
ONLINE_METHODS = ("fp8",)


@dataclass(frozen=True)
class QuantConfig:
    source: str  # "compressed-tensors" | "fp8" | "online": how the checkpoint stores it
    weight: str  # "tensor" | "channel" | "block": one scale per tensor, output row, block
    activation: str  # "dynamic" (per token, or per token-group with block) | "static"
    ignore: tuple[str, ...] = ()  # modules kept in 16 bits (names, or "re:" patterns)
    kv_scales: bool = False  # the checkpoint stores k/v cache scales (kv_cache_scheme)

    @property
    def block(self) -> tuple[int, int] | None:
        return FP8_BLOCK if self.weight == "block" else None

    @property
    def online(self) -> bool:
        return self.source == "online"

    @property
    def scheme(self) -> str:
        """A short name for logs and reports, e.g. ``fp8-channel-dynamic``."""
        return f"fp8-{self.weight}-{self.activation}"

    def is_ignored(self, module: str) -> bool:
        """Whether the linear layer ``module`` (checkpoint name, e.g.
        ``model.layers.0.mlp.down_proj``) stays unquantized."""
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.fullmatch(pattern[3:], module):
                    return True
            elif module == pattern or module.endswith("." + pattern):
                return True
        return False


def online_config(method: str) -> QuantConfig:
    if method not in ONLINE_METHODS:
        raise ValueError(
            f"quantization: {method!r} is not supported (choose from {', '.join(ONLINE_METHODS)})"
        )
    return QuantConfig(source="online", weight="channel", activation="dynamic")


def resolve_quantization(flag: str | None, checkpoint: QuantConfig | None) -> QuantConfig | None:
    """The scheme a model runs: its checkpoint's, else ``--quantization``'s online one."""
    if flag is None or checkpoint is not None:
        return checkpoint
    return online_config(flag)


def parse_quantization(raw: dict[str, Any] | None, where: str = "config") -> QuantConfig | None:
    """A checkpoint's ``quantization_config`` (None: not quantized); ValueError naming the
    scheme when it is one the engine does not run."""
    if not raw:
        return None
    method = raw.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(raw, f"{where}: compressed-tensors")
    if method == "fp8":
        return _fp8(raw, f"{where}: fp8 quantization")
    raise ValueError(
        f"{where}: quantization method {method!r} is not supported (supported: fp8, "
        "compressed-tensors FP8 (float-quantized))"
    )


def _fp8(raw: dict[str, Any], where: str) -> QuantConfig:
    fmt = raw.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"{where}: fmt {fmt!r} is not supported (only e4m3)")
    activation = raw.get("activation_scheme", "dynamic")
    if activation not in ("dynamic", "static"):
        raise ValueError(f"{where}: activation_scheme {activation!r} is not supported")
    block = raw.get("weight_block_size")
    if block is not None and tuple(block) != FP8_BLOCK:
        raise ValueError(
            f"{where}: weight_block_size {list(block)} is not supported (only {list(FP8_BLOCK)})"
        )
    if block is not None and activation != "dynamic":
        raise ValueError(f"{where}: block-wise weights with static activations are not supported")
    ignore = raw.get("ignored_layers") or raw.get("modules_to_not_convert") or ()
    return QuantConfig(
        source="fp8",
        weight="block" if block else "tensor",
        activation=activation,
        ignore=tuple(ignore),
        kv_scales=bool(raw.get("kv_cache_scheme")),
    )


def _scheme_name(args: dict[str, Any] | None) -> str:
    if not args:
        return "none"
    kind = args.get("type", "int")
    name = f"{kind}{args.get('num_bits')} {args.get('strategy')}"
    return name + (" dynamic" if args.get("dynamic") else "")


def _compressed_tensors(raw: dict[str, Any], where: str) -> QuantConfig:
    fmt = raw.get("format")
    if fmt not in ("float-quantized", None):
        raise ValueError(f"{where}: format {fmt!r} is not supported (only float-quantized FP8)")
    groups = list((raw.get("config_groups") or {}).values())
    if not groups:
        raise ValueError(f"{where}: config_groups is missing or empty")
    schemes = {(repr(g.get("weights")), repr(g.get("input_activations"))) for g in groups}
    if len(schemes) > 1:
        raise ValueError(f"{where}: several quantization schemes in one model are not supported")
    group = groups[0]
    targets = group.get("targets") or []
    if targets != ["Linear"]:
        raise ValueError(f"{where}: targets {targets} are not supported (only ['Linear'])")
    weights, acts = group.get("weights"), group.get("input_activations")
    scheme = f"weights {_scheme_name(weights)}, input activations {_scheme_name(acts)}"
    if group.get("output_activations"):
        raise ValueError(f"{where}: output activation quantization ({scheme}) is not supported")
    weight = _weight_strategy(weights, acts)
    activation = _activation_strategy(acts, weight) if weight else None
    if weight is None or activation is None:
        raise ValueError(
            f"{where}: scheme '{scheme}' is not supported (supported: FP8 weights per tensor, "
            "channel or 128x128 block, with FP8 activations per token (dynamic), per "
            "128-group (dynamic, block weights) or per tensor (static))"
        )
    return QuantConfig(
        source="compressed-tensors",
        weight=weight,
        activation=activation,
        ignore=tuple(raw.get("ignore") or ()),
        kv_scales=bool(raw.get("kv_cache_scheme")),
    )


def _is_fp8(args: dict[str, Any] | None) -> bool:
    return bool(args) and args.get("type") == "float" and args.get("num_bits") == 8


def _weight_strategy(weights: dict[str, Any] | None, acts: dict[str, Any] | None) -> str | None:
    if not _is_fp8(weights) or not _is_fp8(acts) or weights.get("dynamic"):
        return None
    if not weights.get("symmetric", True):
        return None
    strategy = weights.get("strategy")
    if strategy == "block":
        return "block" if tuple(weights.get("block_structure") or ()) == FP8_BLOCK else None
    return strategy if strategy in ("tensor", "channel") else None


def _activation_strategy(acts: dict[str, Any], weight: str | None) -> str | None:
    strategy, dynamic = acts.get("strategy"), bool(acts.get("dynamic"))
    if not acts.get("symmetric", True):
        return None
    if weight == "block":
        ok = dynamic and strategy == "group" and acts.get("group_size") == FP8_BLOCK[1]
        return "dynamic" if ok else None
    if strategy == "token" and dynamic:
        return "dynamic"
    if strategy == "tensor" and not dynamic:
        return "static"
    return None
