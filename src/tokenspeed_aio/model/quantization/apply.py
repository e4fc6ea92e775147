"""Which of a built model's linear layers take FP8 weights, by checkpoint name."""

from __future__ import annotations

from torch import nn

from tokenspeed_aio.model.layers.linear import _Quantizable
from tokenspeed_aio.model.quantization.config import QuantConfig


def checkpoint_names(module: str, packed: dict[str, tuple[str, str | int]]) -> list[str]:
    """The checkpoint's names of the layer ``module`` (a fused layer has several)."""
    prefix, _, leaf = module.rpartition(".")
    theirs = [t for t, (ours, _) in packed.items() if ours == leaf]
    return [f"{prefix}.{t}" for t in theirs] or [module]


def quantize_linear_layers(model: nn.Module, quant: QuantConfig) -> int:
    """Give every linear layer the config does not ignore its FP8 weights (before loading);
    returns how many. A fused layer's shards must agree (vLLM's rule)."""
    packed = getattr(model, "packed_modules_mapping", {})
    count = 0
    for name, module in model.named_modules():
        if not isinstance(module, _Quantizable):
            continue
        names = checkpoint_names(name, packed)
        ignored = [quant.is_ignored(n) for n in names]
        if all(ignored):
            continue
        if any(ignored):
            raise ValueError(
                f"quantization_config ignores some but not all of {', '.join(names)}, which "
                "this model fuses into one layer"
            )
        module.use_fp8(quant)
        count += 1
    return count
