"""load_model: dummy weights, dtype resolution, and the errors a user sees for bad checkpoints."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
from paged_runner import PagedRunner
from safetensors.torch import load_file, save_file

from tokenspeed_aio.model.config import ModelConfig
from tokenspeed_aio.model.kv_cache import (
    allocate_kv_cache,
    kv_cache_bytes_per_block,
    local_num_kv_heads,
)
from tokenspeed_aio.model.loader import load_model, resolve_dtype

CPU = torch.device("cpu")


def _config_only_dir(checkpoint, tmp_path, arch="qwen3"):
    shutil.copy(checkpoint(arch) / "config.json", tmp_path / "config.json")
    return tmp_path


def _load(path, **kwargs):
    config = ModelConfig.from_pretrained(path)
    kwargs.setdefault("dtype", torch.float32)
    return config, load_model(config, str(path), device=CPU, **kwargs)


def _copy_with_tensors(src, dst, edit):
    """A copy of checkpoint ``src`` whose tensors went through ``edit(dict)``."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


def test_dummy_weights_need_only_config_and_are_deterministic(checkpoint, tmp_path):
    path = _config_only_dir(checkpoint, tmp_path)
    _, a = _load(path, load_format="dummy", seed=0)
    _, b = _load(path, load_format="dummy", seed=0)
    config, c = _load(path, load_format="dummy", seed=1, dtype=torch.bfloat16)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(pa.bfloat16(), pc), name
    assert not any(p.requires_grad for p in a.parameters()) and not a.training

    runner = PagedRunner(c, config, dtype=torch.bfloat16)
    logits = runner.forward([(0, list(range(30))), (1, list(range(5)))])
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize(
    ("name", "config_dtype", "want"),
    [
        ("auto", "bfloat16", torch.bfloat16),
        ("auto", None, torch.float32),
        ("half", "bfloat16", torch.float16),
        ("float", None, torch.float32),
        ("float16", None, torch.float16),
    ],
)
def test_resolve_dtype(checkpoint, name, config_dtype, want):
    config = ModelConfig.from_pretrained(checkpoint("llama"))
    config = dataclasses.replace(config, torch_dtype=config_dtype)
    assert resolve_dtype(name, config) == want


def test_unknown_dtype_is_rejected(checkpoint):
    config = ModelConfig.from_pretrained(checkpoint("llama"))
    with pytest.raises(ValueError, match=r"dtype 'int8' is not supported"):
        resolve_dtype("int8", config)


def test_missing_weights_are_listed(checkpoint, tmp_path):
    def drop(tensors):
        del tensors["model.layers.1.self_attn.k_proj.weight"]
        del tensors["model.norm.weight"]

    path = _copy_with_tensors(checkpoint("llama"), tmp_path / "ckpt", drop)
    with pytest.raises(ValueError, match=r"lacks weights") as info:
        _load(path)
    assert "model.layers.1.self_attn.k_proj.weight" in str(info.value)
    assert "model.norm.weight" in str(info.value)


def test_shape_mismatch_names_tensor_and_both_shapes(checkpoint, tmp_path):
    def widen(tensors):
        tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(96, 64)

    path = _copy_with_tensors(checkpoint("llama"), tmp_path / "ckpt", widen)
    with pytest.raises(ValueError, match=r"up_proj\.weight' has shape \(96, 64\).*\(128, 64\)"):
        _load(path)


def test_unexpected_tensor_is_named(checkpoint, tmp_path):
    def add(tensors):
        tensors["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(4)

    path = _copy_with_tensors(checkpoint("llama"), tmp_path / "ckpt", add)
    with pytest.raises(ValueError, match=r"extra_proj\.weight' matches no parameter"):
        _load(path)


def test_no_safetensors_files(checkpoint, tmp_path):
    path = _config_only_dir(checkpoint, tmp_path)
    with pytest.raises(ValueError, match=r"no \*\.safetensors files found"):
        _load(path)


def test_kv_cache_layout_and_sizes():
    k, v = allocate_kv_cache(3, 10, 16, 2, 64, torch.bfloat16, CPU)
    assert len(k) == len(v) == 3
    assert k[0].shape == (10, 16, 2, 64) and k[0].dtype == torch.bfloat16
    assert not any(t.any() for t in k + v)
    assert kv_cache_bytes_per_block(3, 16, 2, 64, torch.bfloat16) == 2 * 3 * 16 * 2 * 64 * 2
    assert [local_num_kv_heads(8, tp) for tp in (1, 2, 8, 16)] == [8, 4, 1, 1]
    with pytest.raises(ValueError, match="not a multiple"):
        local_num_kv_heads(2, 3)
