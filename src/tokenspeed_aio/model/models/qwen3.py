"""Qwen3 (dense): the Llama decoder with per-head RMSNorm on q and k before RoPE and an
explicit head_dim (often != hidden_size / num_heads).

``ModelConfig`` sets ``qk_norm`` and ``head_dim`` for this architecture and the shared
attention block acts on them, so the class adds nothing to Llama's; it exists so the
registry names it.
"""

from __future__ import annotations

from tokenspeed_aio.model.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    pass
