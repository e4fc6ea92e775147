"""The packaged default model (built by tools/train_default_model.py) and the model resolver."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tokenspeed_aio.model_source import DEFAULT_MODEL_DIR, resolve_model_path

FILES = [
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "README.md",
]
SPECIAL = ["<|endoftext|>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)


@pytest.fixture(scope="module")
def hf_model():
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float32).eval()


def test_packaged_files_present_and_small():
    for name in FILES:
        assert (DEFAULT_MODEL_DIR / name).is_file(), name
    # Shipped inside the wheel: keep it small.
    assert (DEFAULT_MODEL_DIR / "model.safetensors").stat().st_size <= 10 * 1024 * 1024
    readme = (DEFAULT_MODEL_DIR / "README.md").read_text()
    assert "not a useful assistant" in readme
    assert "PSF" in readme
    assert "python tools/train_default_model.py" in readme


def test_config_is_small_llama():
    config = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert config["num_key_value_heads"] < config["num_attention_heads"]  # GQA
    assert config["tie_word_embeddings"] is True
    assert config["torch_dtype"] == "bfloat16"
    generation = json.loads((DEFAULT_MODEL_DIR / "generation_config.json").read_text())
    assert config["eos_token_id"] in generation["eos_token_id"]


def test_tokenizer_round_trips_and_knows_special_tokens():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(DEFAULT_MODEL_DIR / "tokenizer.json"))
    text = 'for x in range(3):\n    print(f"{x!r} — naïve 日本")  # ok\n'
    assert tok.decode(tok.encode(text).ids) == text
    for special in SPECIAL:
        assert tok.encode(special).ids == [tok.token_to_id(special)]
    assert 4000 <= tok.get_vocab_size() <= 4200


def test_chat_template_renders(hf_tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is a list?"},
    ]
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|system|>\nBe brief.<|end|>\n<|user|>\nWhat is a list?<|end|>\n<|assistant|>\n"
    )
    without = hf_tokenizer.apply_chat_template(messages, tokenize=False)
    assert not without.endswith("<|assistant|>\n")
    assert hf_tokenizer.eos_token == "<|endoftext|>"


def test_greedy_generation_is_deterministic(hf_tokenizer, hf_model):
    ids = hf_tokenizer("The for statement", return_tensors="pt").input_ids
    runs = [
        hf_model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)[
            0, ids.shape[1] :
        ]
        for _ in range(2)
    ]
    assert runs[0].tolist() == runs[1].tolist()
    assert len(runs[0]) == 8
    # A trained model continues with words, not special tokens or a single repeated id.
    assert any(c.isalpha() for c in hf_tokenizer.decode(runs[0], skip_special_tokens=True))
    assert len(set(runs[0].tolist())) > 1


def test_resolve_model_path(tmp_path):
    assert resolve_model_path(None) == DEFAULT_MODEL_DIR
    assert resolve_model_path(str(tmp_path)) == tmp_path.resolve()
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match="no such directory, and not a Hugging Face hub id"):
        resolve_model_path(str(missing))
    file = tmp_path / "config.json"
    file.write_text("{}")
    with pytest.raises(ValueError, match="is a file"):
        resolve_model_path(str(file))


def test_model_source_imports_without_torch():
    code = "import sys, tokenspeed_aio.model_source; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
