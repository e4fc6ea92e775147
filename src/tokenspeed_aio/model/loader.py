"""Build a model on its device and fill its weights: from safetensors, or random ("dummy").

Tensors stream one at a time from the checkpoint (CPU) into this rank's shard on the
device, so peak host memory is one tensor, not the checkpoint. With a quantization config the
linear layers it covers hold FP8 weights (model/quantization/): read as stored, quantized as
loaded (``--quantization fp8``), or, as dummies, random weights quantized by its scheme.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from tokenspeed_aio.model.config import ModelConfig
from tokenspeed_aio.model.layers.norm import RMSNorm
from tokenspeed_aio.model.parallel import tp_rank
from tokenspeed_aio.model.quantization.apply import quantize_linear_layers
from tokenspeed_aio.model.quantization.config import QuantConfig
from tokenspeed_aio.model.registry import get_model_class

LOAD_FORMATS = ("auto", "safetensors", "dummy")

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}

DUMMY_STD = 0.02  # small enough that activations stay finite through bf16 layers


def resolve_dtype(dtype: str | torch.dtype, config: ModelConfig) -> torch.dtype:
    """``"auto"`` -> the checkpoint's dtype (float32 if unstated); else a dtype name."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = (config.torch_dtype or "float32") if dtype == "auto" else dtype
    if name not in _DTYPES:
        raise ValueError(
            f"dtype {name!r} is not supported (choose from auto, {', '.join(_DTYPES)})"
        )
    return _DTYPES[name]


def load_model(
    config: ModelConfig,
    model_path: str,
    *,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str = "auto",
    seed: int = 0,
    quantization: QuantConfig | None = None,
) -> nn.Module:
    """This rank's shard of the model, on ``device``, in eval mode with no gradients;
    ``quantization`` (default: the checkpoint's, ``config.quantization``) makes its linear
    layers FP8.

    Tensor-parallel state (``init_tensor_parallel``) must be set before the call.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} is not one of {', '.join(LOAD_FORMATS)}")
    model_cls = get_model_class(config.architecture)
    quantization = quantization or config.quantization
    with torch.device(device), _default_dtype(dtype):
        model = model_cls(config)
        if quantization is not None:
            quantize_linear_layers(model, quantization)
    with torch.no_grad():
        if load_format == "dummy":
            _fill_dummy(model, seed)
        else:
            _load_safetensors(model, Path(model_path))
    model.eval()
    model.requires_grad_(False)
    return model


def meta_model(config: ModelConfig, dtype: torch.dtype) -> nn.Module:
    """The model's structure on the meta device (no memory): this rank's shard shapes, for
    checking a weight update's names and shapes with the same loaders, loading nothing."""
    with torch.device("meta"), _default_dtype(dtype):
        return get_model_class(config.architecture)(config)


def safetensors_shapes(files: list[Path]) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor of the shards, from their headers alone."""
    shapes = []
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 (handles are not iterable)
                shapes.append((name, tuple(handle.get_slice(name).get_shape())))
    return shapes


def safetensors_files(model_path: Path) -> list[Path]:
    """The checkpoint's shards: those the index names if there is one (repos such as
    Mistral's also ship a consolidated file with other tensor names), else every file."""
    index = model_path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [model_path / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(model_path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files found in {model_path}")
    return files


def iter_safetensors(
    files: list[Path], progress: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) for every tensor of every shard, one at a time."""
    total = 0
    for f in files:  # headers only: cheap, and gives the progress bar its length
        with safe_open(str(f), framework="pt", device="cpu") as handle:
            total += len(handle.keys())
    with tqdm(total=total, desc="Loading weights", unit="tensor", disable=not progress) as bar:
        for f in files:
            with safe_open(str(f), framework="pt", device="cpu") as handle:
                for name in handle.keys():  # noqa: SIM118 (handles are not iterable)
                    yield name, handle.get_tensor(name)
                    bar.update()


def _load_safetensors(model: nn.Module, model_path: Path) -> None:
    files = safetensors_files(model_path)
    loaded = model.load_weights(iter_safetensors(files, progress=tp_rank() == 0))
    missing = sorted(model.expected_weight_names() - loaded)
    if missing:
        shown = ", ".join(missing[:20]) + (
            f", ... ({len(missing)} in all)" if len(missing) > 20 else ""
        )
        raise ValueError(f"checkpoint {model_path} lacks weights the model needs: {shown}")


def _fill_dummy(model: nn.Module, seed: int) -> None:
    """Random weights, deterministic for a seed on a given device type; norms start at 1."""
    generator = None
    for module in model.modules():
        fp8 = getattr(module, "fp8", None)
        for param in module.parameters(recurse=False):
            if generator is None:
                generator = torch.Generator(device=param.device).manual_seed(seed)
            if isinstance(module, RMSNorm):
                param.fill_(1.0)
            elif fp8 is not None and param is not module.bias:
                continue  # the FP8 weights, below
            else:
                param.normal_(0.0, DUMMY_STD, generator=generator)
        if fp8 is not None:
            fp8.fill_dummy(module, generator, DUMMY_STD)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
