"""Architecture string (config.json's ``architectures[0]``) → model class, imported lazily.

Torch-free at import time: ``ModelConfig`` validates architectures against this table on
the control plane.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

# architecture -> (module under tokenspeed_aio.model.models, class name). Qwen2 (q/k/v
# bias) and Qwen3 (q/k RMSNorm, explicit head_dim) are Llama's decoder with the flags
# ModelConfig sets for them.
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("llama", "LlamaForCausalLM"),
}


def supported_architectures() -> tuple[str, ...]:
    return tuple(_MODELS)


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in _MODELS:
        raise ValueError(
            f"architecture {architecture!r} is not supported "
            f"(supported: {', '.join(supported_architectures())})"
        )
    module_name, class_name = _MODELS[architecture]
    module = importlib.import_module(f"tokenspeed_aio.model.models.{module_name}")
    return getattr(module, class_name)
