"""--generation-config: the checkpoint's sampling defaults (auto), none (vllm), or a
directory's; only the fields vLLM takes, do_sample ignored."""

from __future__ import annotations

import json

import pytest

from tokenspeed_aio.generation_config import generation_defaults


def test_auto_vllm_and_a_directory(tmp_path):
    model, other = tmp_path / "model", tmp_path / "other"
    for path, values in ((model, {"temperature": 0.6, "top_p": 0.95, "do_sample": True,
                                  "max_new_tokens": 64, "eos_token_id": 2}),
                         (other, {"top_k": 20})):  # fmt: skip
        path.mkdir()
        (path / "generation_config.json").write_text(json.dumps(values))
    assert generation_defaults(model) == {"temperature": 0.6, "top_p": 0.95, "max_tokens": 64}
    assert generation_defaults(model, "vllm") == {}
    assert generation_defaults(model, str(other)) == {"top_k": 20}
    assert generation_defaults(tmp_path) == {}  # no file: no defaults
    with pytest.raises(ValueError, match="not a directory"):
        generation_defaults(model, str(tmp_path / "missing"))
