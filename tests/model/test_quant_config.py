"""quantization_config parsing: the schemes the engine runs, and a clear startup error naming
every other one."""

from __future__ import annotations

import pytest
from helpers.fp8_checkpoints import FORMATS, quantization_config

from tokenspeed_aio.args import EngineArgs
from tokenspeed_aio.model.quantization.config import (
    online_config,
    parse_quantization,
    resolve_quantization,
)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_every_fixture_format_parses_to_its_scheme(fmt):
    _, weight, activation = FORMATS[fmt]
    config = parse_quantization(quantization_config(fmt, kv=True))
    assert (config.weight, config.activation, config.kv_scales) == (weight, activation, True)
    assert config.block == ((128, 128) if weight == "block" else None)


def _ct(weights=None, acts=None, **top):
    raw = quantization_config("ct-channel")
    group = raw["config_groups"]["group_0"]
    group["weights"].update(weights or {})
    if acts is None or isinstance(acts, dict):
        group["input_activations"].update(acts or {})
    else:
        group["input_activations"] = None
    return raw | top


@pytest.mark.parametrize(
    "raw,message",
    [
        ({"quant_method": "awq", "bits": 4}, r"quantization method 'awq' is not supported"),
        ({"quant_method": "gptq"}, r"method 'gptq'"),
        (_ct({"type": "int", "num_bits": 4, "strategy": "group"}),
         r"scheme 'weights int4 group, input activations float8 token dynamic'"),
        (_ct(acts="none"), r"scheme 'weights float8 channel, input activations none'"),
        (_ct(acts={"strategy": "tensor", "dynamic": True}),
         r"input activations float8 tensor dynamic"),
        (_ct({"strategy": "block", "block_structure": [64, 64]}), r"weights float8 block"),
        (_ct(format="pack-quantized"), r"format 'pack-quantized' is not supported"),
        ({"quant_method": "fp8", "weight_block_size": [64, 64]},
         r"weight_block_size \[64, 64\] is not supported"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, r"fmt 'e5m2' is not supported"),
    ],
)  # fmt: skip
def test_unsupported_schemes_fail_naming_the_scheme(raw, message):
    with pytest.raises(ValueError, match=message):
        parse_quantization(raw, "ckpt/config.json")


def test_ignore_lists_match_names_and_patterns():
    config = parse_quantization(_ct(ignore=["lm_head", "re:.*layers\\.1\\.mlp\\..*"]))
    assert config.is_ignored("lm_head") and config.is_ignored("model.layers.1.mlp.down_proj")
    assert not config.is_ignored("model.layers.0.mlp.down_proj")


def test_online_quantization_and_the_flag():
    assert resolve_quantization("fp8", None) == online_config("fp8")
    checkpoint = parse_quantization(quantization_config("fp8-block"))
    assert resolve_quantization("fp8", checkpoint) is checkpoint
    assert resolve_quantization(None, None) is None
    with pytest.raises(ValueError, match="quantization: must be one of fp8"):
        EngineArgs(quantization="int8")
    with pytest.raises(ValueError, match="kv_cache_dtype: must be one of auto, fp8"):
        EngineArgs(kv_cache_dtype="int4")


@pytest.mark.parametrize(
    "shape,scheme",
    [
        ("llama-8b-fp8", "fp8-channel-dynamic"),
        ("llama-8b-fp8-static", "fp8-tensor-static"),
        ("llama-8b-fp8-pertensor", "fp8-tensor-static"),
        ("qwen3-8b-fp8-block", "fp8-block-dynamic"),
    ],
)
def test_the_fp8_bench_shapes_name_their_formats(tmp_path, shape, scheme):
    from tokenspeed_aio.bench.shapes import checkpoint_dir
    from tokenspeed_aio.model.config import ModelConfig

    config = ModelConfig.from_pretrained(checkpoint_dir(shape, tmp_path))
    assert config.quantization.scheme == scheme
