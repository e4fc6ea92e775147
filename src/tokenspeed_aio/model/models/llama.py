"""Llama 2/3/3.1 and Mistral; the decoder shape Qwen2 and Qwen3 reuse through config flags.

Tensor parallelism lives in the layers: this file never calls a collective.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from tokenspeed_aio.model.config import ModelConfig
from tokenspeed_aio.model.forward_context import ForwardContext
from tokenspeed_aio.model.layers.attention import Attention
from tokenspeed_aio.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tokenspeed_aio.model.layers.linear import QKVParallelLinear, RowParallelLinear
from tokenspeed_aio.model.layers.mlp import GatedMLP
from tokenspeed_aio.model.layers.norm import RMSNorm
from tokenspeed_aio.model.layers.rotary import RotaryEmbedding
from tokenspeed_aio.model.layers.weights import default_weight_loader
from tokenspeed_aio.model.quantization.names import canonical_name


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            config.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=config.attention_bias,
        )
        self.o_proj = RowParallelLinear(config.q_size, config.hidden_size, bias=config.o_proj_bias)
        self.qk_norm = config.qk_norm
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.rotary_emb = rotary_emb
        self.attn = Attention(layer_idx, self.qkv_proj.num_kv_heads, self.qkv_proj.kv_head_start)

    def forward(
        self,
        positions: torch.Tensor,
        norm: RMSNorm,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(attention(norm(h)), h)`` with ``h = hidden_states + residual`` (``hidden_states``
        when residual is None)."""
        rope = (self.rotary_emb, positions)
        # The backend norms q and k per head before RoPE (one launch with it on kernels).
        qk_norm = (self.q_norm, self.k_norm) if self.qk_norm else None
        kv_write = self.attn.kv_write(ctx, rope, qk_norm)  # the product may store k/v itself
        qkv, residual = self.qkv_proj.project(norm, hidden_states, residual, kv_write)
        return self.o_proj(self.attn(qkv, ctx, rope, qk_norm)), residual


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, rotary_emb)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual stream is carried un-normed and added inside the next norm, so each
        # add fuses with the norm that follows it, and the norm with the projection after it
        # where it can (``linear.norm_linear``).
        hidden_states, residual = self.self_attn(
            positions, self.input_layernorm, hidden_states, residual, ctx
        )
        return self.mlp(self.post_attention_layernorm, hidden_states, residual)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # One cos/sin cache shared by every layer.
        rotary_emb = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, rotary_emb) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual, ctx)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    # Checkpoint projections that live inside one fused parameter here:
    # checkpoint module name -> (our module name, shard id passed to its weight_loader).
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """[num_tokens] token ids and positions -> [num_tokens, hidden] after the final norm."""
        return self.model(input_ids, positions, ctx)

    def kv_scales(self) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """Every layer's FP8 KV-cache scales (k, v), [num_kv_heads] fp32 each."""
        return tuple(
            (layer.self_attn.attn.k_scale, layer.self_attn.attn.v_scale)
            for layer in self.model.layers
        )

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, vocab] in the model's dtype over the full vocab (gathered
        across ranks)."""
        return self.lm_head(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (full, unsharded) into this rank's parameters.

        Returns the checkpoint names consumed; a subset is fine (weight updates send only
        what changed). Compare with ``expected_weight_names()`` to find missing ones.
        """
        params = dict(self.named_parameters()) | dict(self.named_buffers())
        loaded: set[str] = set()
        for checkpoint_name, tensor in weights:
            name = canonical_name(checkpoint_name)
            if name is None or name.endswith("rotary_emb.inv_freq") or self._is_tied_head(name):
                continue
            param_name, shard_id = self._param_name(name)
            if param_name not in params:
                raise ValueError(f"checkpoint tensor {name!r} matches no parameter of the model")
            owner = self.get_submodule(param_name.rpartition(".")[0])
            loader = getattr(owner, "weight_loader", default_weight_loader)
            try:
                loader(params[param_name], tensor, shard_id)
            except ValueError as e:
                raise ValueError(f"checkpoint tensor {checkpoint_name!r} {e}") from None
            loaded.add(name)
        return loaded

    def expected_weight_names(self) -> set[str]:
        """Checkpoint names a complete load must provide (packed params unfolded)."""
        names = set()
        for param_name, param in self.named_parameters():
            if not getattr(param, "in_checkpoint", True):  # computed at load (online FP8)
                continue
            unfolded = [
                param_name.replace(f".{ours}.", f".{theirs}.")
                for theirs, (ours, _) in self.packed_modules_mapping.items()
                if f".{ours}." in param_name
            ]
            names.update(unfolded or [param_name])
        return names

    def _is_tied_head(self, name: str) -> bool:
        # Some tied checkpoints still store lm_head.weight; the embedding is authoritative.
        return self.config.tie_word_embeddings and name == "lm_head.weight"

    def _param_name(self, name: str) -> tuple[str, str | int | None]:
        for theirs, (ours, shard_id) in self.packed_modules_mapping.items():
            if f".{theirs}." in name:
                return name.replace(f".{theirs}.", f".{ours}."), shard_id
        return name, None


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral's checkpoints use Llama's names and shapes; only the sliding window differs,
    and ``ModelConfig.sliding_window`` reports it so the engine caps lengths."""
