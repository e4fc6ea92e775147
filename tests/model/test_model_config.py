"""ModelConfig parsing: both transformers config styles, per-architecture quirks, errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tokenspeed_aio.model.config import ModelConfig

LEGACY_LLAMA3 = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128256,
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16",
    "eos_token_id": [128001, 128008, 128009],
}


def _write(tmp_path, config, generation=None):
    (tmp_path / "config.json").write_text(json.dumps(config))
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    return tmp_path


def test_fixture_checkpoints_parse_with_their_quirks(checkpoint):
    llama3 = ModelConfig.from_pretrained(checkpoint("llama3"))
    assert llama3.architecture == "LlamaForCausalLM"
    assert (llama3.num_key_value_heads, llama3.head_dim, llama3.torch_dtype) == (2, 16, "float32")
    assert llama3.rope_theta == 500000.0
    assert llama3.rope_scaling["rope_type"] == "llama3"
    assert "rope_theta" not in llama3.rope_scaling
    assert not (llama3.attention_bias or llama3.qk_norm or llama3.tie_word_embeddings)

    qwen2 = ModelConfig.from_pretrained(checkpoint("qwen2"))
    assert qwen2.attention_bias and not qwen2.o_proj_bias  # implicit in Qwen2
    assert qwen2.rope_scaling is None and qwen2.sliding_window is None

    qwen3 = ModelConfig.from_pretrained(checkpoint("qwen3", tied=True))
    assert qwen3.qk_norm and qwen3.head_dim == 32 and qwen3.tie_word_embeddings
    assert qwen3.eos_token_ids == (0,)


def test_legacy_rope_scaling_type_key_and_eos_union(tmp_path):
    path = _write(tmp_path, LEGACY_LLAMA3, {"eos_token_id": [128009, 128010]})
    config = ModelConfig.from_pretrained(path)
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert config.head_dim == 128  # derived: hidden / heads
    assert config.torch_dtype == "bfloat16"
    assert config.eos_token_ids == (128001, 128008, 128009, 128010)


def test_mistral_sliding_window_is_reported(tmp_path):
    raw = dict(LEGACY_LLAMA3, architectures=["MistralForCausalLM"], sliding_window=4096)
    del raw["rope_scaling"]
    assert ModelConfig.from_pretrained(_write(tmp_path, raw)).sliding_window == 4096


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"architectures": ["GPT2LMHeadModel"]},
            r"architecture 'GPT2LMHeadModel' is not supported",
        ),
        ({"architectures": []}, r"'architectures' is missing"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, r"rope type 'yarn'"),
        ({"hidden_act": "gelu"}, r"hidden_act 'gelu'"),
        ({"vocab_size": None}, r"'vocab_size' is missing"),
    ],
)
def test_bad_configs_name_the_file_and_field(tmp_path, change, message):
    raw = {k: v for k, v in {**LEGACY_LLAMA3, **change}.items() if v is not None}
    with pytest.raises(ValueError, match=message) as info:
        ModelConfig.from_pretrained(_write(tmp_path, raw))
    assert "config.json" in str(info.value)


def test_missing_config_names_the_file(tmp_path):
    with pytest.raises(ValueError, match=r"config\.json: no such file"):
        ModelConfig.from_pretrained(tmp_path)


def test_config_module_imports_without_torch(tmp_path):
    path = _write(tmp_path, LEGACY_LLAMA3)
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from tokenspeed_aio.model.config import ModelConfig\n"
        f"print(ModelConfig.from_pretrained({str(path)!r}).num_hidden_layers)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "32"


@pytest.mark.parametrize("style", ["rope_parameters", "rope_scaling"])
def test_rope_parameters_and_rope_scaling_read_alike(style):
    """transformers >= 5 writes rope_parameters (theta inside); older, rope_theta beside
    rope_scaling. Both give the same RoPE."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256}  # fmt: skip
    raw = {k: v for k, v in LEGACY_LLAMA3.items() if k not in ("rope_theta", "rope_scaling")}
    if style == "rope_parameters":
        raw["rope_parameters"] = {**scaling, "rope_theta": 500000.0}
    else:
        raw.update(rope_theta=500000.0, rope_scaling=scaling)
    config = ModelConfig.from_dict(raw)
    assert config.rope_theta == 500000.0 and config.rope_scaling == scaling
