"""A tiny "instruct" checkpoint as current tools write one: transformers' save_pretrained
for the model (sharded safetensors with an index), the tokenizer (its chat template in
``chat_template.jinja``) and a ``generation_config.json`` with sampling defaults; and a
Hugging Face hub-cache layout holding it, for hub-id resolution offline."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from helpers.checkpoints import make_checkpoint

# A hermes-style template (Qwen 2.5/3 shape) over the test tokenizer's special tokens: it
# renders tools, assistant tool_calls (arguments as objects), tool results, and Qwen3's
# enable_thinking switch (an empty think block in the prompt).
TOOL_TEMPLATE = """\
{%- if tools %}<|system|>
You may call these tools:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|assistant|>
{% for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{% endfor %}<|end|>
{% elif message.role == "tool" %}<|user|>
<tool_response>
{{ message.content }}
</tool_response><|end|>
{% else %}<|{{ message.role }}|>
{{ message.content }}<|end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|>
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""

GENERATION_DEFAULTS = {"temperature": 0.7, "top_p": 0.8, "top_k": 20}


def make_instruct_checkpoint(path: Path) -> Path:
    import transformers
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    raw = path.parent / f"{path.name}-raw"
    make_checkpoint(raw, "llama")
    model = transformers.AutoModelForCausalLM.from_pretrained(raw)
    model.save_pretrained(path, max_shard_size="200KB")  # several shards and an index
    tok = PreTrainedTokenizerFast(tokenizer_file=str(raw / "tokenizer.json"))
    config = json.loads((raw / "tokenizer_config.json").read_text())
    tok.eos_token, tok.pad_token = config["eos_token"], config["pad_token"]
    tok.chat_template = TOOL_TEMPLATE
    tok.save_pretrained(path)
    GenerationConfig(
        do_sample=True, eos_token_id=tok.eos_token_id, **GENERATION_DEFAULTS
    ).save_pretrained(path)
    shutil.rmtree(raw)
    return path


def hub_cache(root: Path, repo_id: str, checkpoint: Path) -> Path:
    """``root`` laid out as HF_HOME with ``repo_id`` cached at one revision (files copied
    into the snapshot, as a cache written without symlinks holds them)."""
    org, name = repo_id.split("/")
    repo = root / "hub" / f"models--{org}--{name}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(checkpoint, repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    return root
