"""FP8 checkpoints for tests, written from a tiny 16-bit one by the formats' own rules, and
the reference that computes what they mean.

Formats (``FORMATS``): compressed-tensors (``format: float-quantized``) with per-channel
weights and dynamic per-token activations, per-tensor weights with static activations,
128x128 block weights with per-group activations; the ``fp8`` format with per-tensor scales
(static and dynamic) and with ``weight_block_size`` + ``weight_scale_inv``. Static input
scales are calibrated as llm-compressor does: the amax of each layer's input over a few
prompts run through transformers. ``kv=True`` adds per-tensor (or ``kv="head"``: per-head) KV
cache scales (``kv_cache_scheme``).

``fake_quant_reference`` is transformers' model on the same checkpoint with every quantized
linear layer's weight replaced by its dequantized value and its input quantized and
dequantized as the scheme says (``tokenspeed_kernels.fp8``'s definitions): W8A8 in fp32.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenspeed_kernels import fp8

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# format -> (quant_method, weight strategy, activations: dynamic | static)
FORMATS = {
    "ct-channel": ("compressed-tensors", "channel", "dynamic"),
    "ct-tensor-static": ("compressed-tensors", "tensor", "static"),
    "ct-block": ("compressed-tensors", "block", "dynamic"),
    "fp8-tensor-static": ("fp8", "tensor", "static"),
    "fp8-tensor-dynamic": ("fp8", "tensor", "dynamic"),
    "fp8-block": ("fp8", "block", "dynamic"),
}


def _is_linear(name: str) -> bool:
    return any(f".{leaf}.weight" in name for leaf in LINEARS) and name.endswith(".weight")


def quantization_config(fmt: str, kv: bool | str = False) -> dict:
    method, weight, activation = FORMATS[fmt]
    kv_scheme = None
    if kv:
        strategy = "attn_head" if kv == "head" else "tensor"
        kv_scheme = {"num_bits": 8, "type": "float", "strategy": strategy, "dynamic": False,
                     "symmetric": True}  # fmt: skip
    if method == "fp8":
        config = {"quant_method": "fp8", "activation_scheme": activation, "fmt": "e4m3"}
        if weight == "block":
            config["weight_block_size"] = [128, 128]
        if kv_scheme:
            config["kv_cache_scheme"] = kv_scheme
        return config
    weights = {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "dynamic": False,
        "strategy": weight,
        "block_structure": [128, 128] if weight == "block" else None,
    }
    if weight == "block":
        acts = {
            "num_bits": 8,
            "type": "float",
            "symmetric": True,
            "dynamic": True,
            "strategy": "group",
            "group_size": 128,
        }
    elif activation == "static":
        acts = {
            "num_bits": 8,
            "type": "float",
            "symmetric": True,
            "dynamic": False,
            "strategy": "tensor",
        }
    else:
        acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True,
                "strategy": "token"}  # fmt: skip
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                      "input_activations": acts, "output_activations": None}},
        "ignore": ["lm_head"],
        "kv_cache_scheme": kv_scheme,
    }  # fmt: skip


def calibrate(src: Path, num_prompts: int = 4, length: int = 24) -> dict[str, dict[str, float]]:
    """Per linear layer (checkpoint module name): the amax of its input, and per attention
    layer the amax of each KV head's k and v (after RoPE for k), over random prompts run
    through transformers."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    amax: dict[str, torch.Tensor] = {}
    hooks = []

    def record(name):
        def hook(_module, args, output=None):
            value = (args[0] if output is None else output).detach().abs()
            if output is not None:  # k/v: per head [.., Hkv * D] -> [Hkv]
                value = value.reshape(-1, value.shape[-1] // head_dim, head_dim).amax(dim=(0, 2))
            else:
                value = value.amax()
            amax[name] = torch.maximum(amax.get(name, value), value)

        return hook

    head_dim = model.config.head_dim if hasattr(model.config, "head_dim") else None
    head_dim = head_dim or model.config.hidden_size // model.config.num_attention_heads
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in LINEARS:
            hooks.append(module.register_forward_pre_hook(record(name)))
            if name.endswith(("k_proj", "v_proj")):
                hooks.append(module.register_forward_hook(record(name + ".output")))
    gen = torch.Generator().manual_seed(123)
    with torch.no_grad():
        for _ in range(num_prompts):
            ids = torch.randint(0, model.config.vocab_size, (1, length), generator=gen)
            model(ids)
    for h in hooks:
        h.remove()
    return {k: v for k, v in amax.items()}


def write_fp8_checkpoint(src: Path, dst: Path, fmt: str, kv: bool | str = False) -> Path:
    """A copy of checkpoint ``src`` (fp32/16-bit) in FP8 format ``fmt`` (module doc)."""
    method, weight, activation = FORMATS[fmt]
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    amax = calibrate(src) if activation == "static" or kv else {}
    out = {}
    for name, t in tensors.items():
        if not _is_linear(name):
            out[name] = t
            continue
        module = name.removesuffix(".weight")
        q, s = fp8.quantize_weight(t, weight)
        out[name] = q
        if weight == "channel":
            s = s.reshape(-1, 1)  # compressed-tensors' [N, 1]
        elif weight == "tensor" and method == "fp8":
            s = s.reshape(())  # AutoFP8's scalar
        out[module + (".weight_scale_inv" if method == "fp8" and weight == "block" else
                      ".weight_scale")] = s  # fmt: skip
        if activation == "static":
            scale = fp8.scale_of(amax[module]).reshape(() if method == "fp8" else (1,))
            out[module + ".input_scale"] = scale
    if kv:
        for name in list(amax):
            if not name.endswith(".output"):
                continue
            attn, kind = name.removesuffix(".output").rsplit(".", 1)  # ...self_attn, k_proj
            per_head = fp8.scale_of(amax[name])
            scale = per_head if kv == "head" else per_head.amax().reshape(1)
            if method == "fp8":  # AutoFP8's names
                out[f"{attn}.{kind}.output_scale"] = scale
            else:
                out[f"{attn}.{kind[0]}_scale"] = scale
    save_file(out, dst / "model.safetensors")
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = quantization_config(fmt, kv)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def fake_quant_reference(path: Path, fmt: str | None = None):
    """transformers' model on ``path``, written in FP8 format ``fmt``, with its FP8 layers'
    math (module doc); ``fmt=None``: a 16-bit checkpoint quantized per channel with dynamic
    activations (``--quantization fp8``)."""
    import transformers

    config = json.loads((path / "config.json").read_text())
    tensors = load_file(path / "model.safetensors")
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(path), dtype=torch.float32
    )
    online = fmt is None
    weight = "channel" if online else FORMATS[fmt][1]
    state = {}
    for name, t in tensors.items():
        if name.endswith("_scale") or name.endswith("_scale_inv"):
            continue
        if _is_linear(name):
            module = name.removesuffix(".weight")
            if online:
                t, s = fp8.quantize_weight(t, "channel")
            else:
                s = tensors.get(module + ".weight_scale", tensors.get(module + ".weight_scale_inv"))
            s = s.float()
            state[name] = fp8.dequantize_weight(t, s if weight == "block" else s.reshape(-1))
        else:
            state[name] = t.float()
    model.load_state_dict(state, strict=False)
    if config.get("tie_word_embeddings"):
        model.tie_weights()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in LINEARS:
            static = tensors.get(name + ".input_scale")
            group = fp8.BLOCK if weight == "block" else None
            module.register_forward_pre_hook(_fake_quant_input(group, static))
    return model.eval()


def _fake_quant_input(group, static):
    def hook(_module, args):
        x = args[0]
        flat = x.reshape(-1, x.shape[-1])
        scale = None if static is None else static.float().reshape(1)
        xq, s = fp8.quantize_rows(flat, group, scale)
        return (fp8.dequantize_rows(xq, s, group).to(x.dtype).reshape(x.shape),)

    return hook
