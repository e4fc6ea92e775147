"""Qwen2 / Qwen2.5: the Llama decoder with bias on the q/k/v projections.

``ModelConfig`` turns the bias on for this architecture (Qwen2 configs do not state it),
so the class adds nothing to Llama's; it exists so the registry names it.
"""

from __future__ import annotations

from tokenspeed_aio.model.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass
