"""Tensor-parallel linear layers (Megatron style).

Column-parallel layers split the output features across ranks and need no
communication; a row-parallel layer splits the input features and all-reduces its
partial sums. A column-parallel layer feeding a row-parallel one therefore costs one
all-reduce per pair. Every ``weight_loader`` takes the FULL checkpoint tensor and
copies this rank's shard into the (already sharded) parameter.

Batch-1 products on CUDA whose weight shape has a measured Triton config
(``tokenspeed_kernels.gemv.CONFIGS``: the shapes where it read the weight faster than
cuBLAS; ``SILU_MUL_CONFIGS`` for a SwiGLU's gate/up projection with its activation as the
product's epilogue) run that kernel, and 16-bit products of 2 to 64 rows likewise
``tokenspeed_kernels.skinny_gemm`` (its tables keyed by shape and row bucket); everything
else is ``F.linear``. A column-parallel
layer fed by an RMSNorm (``after_norm``) takes the norm, and the residual add before it, as
the product's prologue where ``NORM_CONFIGS`` has its shape: one launch fewer per norm; a
batch-1 qkv projection also takes RoPE and the KV-cache write as its epilogue where
``gemv_rope_kv.ROPE_KV_CONFIGS`` has its shape (``norm_linear_rope_kv``): one launch fewer per layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from tokenspeed_aio.model.kv_cache import local_num_kv_heads
from tokenspeed_aio.model.layers.activation import silu_and_mul
from tokenspeed_aio.model.layers.norm import RMSNorm
from tokenspeed_aio.model.layers.weights import check_shape
from tokenspeed_aio.model.parallel import divide, tp_all_reduce, tp_rank, tp_size

if TYPE_CHECKING:
    from tokenspeed_aio.model.attention.base import Rope


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    act_silu_mul: bool = False,
) -> torch.Tensor:
    """``F.linear`` -- followed by ``silu_and_mul`` when ``act_silu_mul`` -- or the Triton
    product for a batch of at most 64 rows (2 to 64 in a 16-bit dtype) where it was measured
    faster."""
    rows = x.shape[0]
    # skinny_gemm's tiles were measured in 16-bit dtypes; fp32's need twice the shared memory.
    if x.is_cuda and (rows == 1 or (rows <= 64 and x.element_size() == 2)):
        if rows == 1:
            from tokenspeed_kernels import gemv as kernel

            product, key = kernel.gemv, tuple(weight.shape)
        else:
            from tokenspeed_kernels import skinny_gemm as kernel

            product, key = kernel.skinny_gemm, (*weight.shape, kernel.m_bucket(rows))
        if act_silu_mul and bias is None and key in kernel.SILU_MUL_CONFIGS:
            return product(x, weight, None, kernel.SILU_MUL_CONFIGS[key], silu_mul=True)
        config = kernel.CONFIGS.get(key)
        y = product(x, weight, bias, config) if config else F.linear(x, weight, bias)
    else:
        y = F.linear(x, weight, bias)
    return silu_and_mul(y) if act_silu_mul else y


def norm_linear(
    norm: RMSNorm,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    act_silu_mul: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(linear(norm(h), weight, bias, act_silu_mul), h)`` with ``h = x + residual`` (``x``
    when residual is None): the norm as the batch-1 Triton product's prologue where it has a
    config, else the norm layer then ``linear``. Norms are replicated, so this holds on every
    tensor-parallel rank."""
    if x.is_cuda and x.shape[0] == 1:
        from tokenspeed_kernels.gemv import NORM_CONFIGS, norm_gemv

        config = NORM_CONFIGS.get((*weight.shape, act_silu_mul))
        if config is not None:
            return norm_gemv(
                x, residual, norm.weight, norm.eps, weight, bias, config, silu_mul=act_silu_mul
            )
    if residual is None:
        h, normed = x, norm(x)
    else:
        normed, h = norm(x, residual)
    return linear(normed, weight, bias, act_silu_mul), h


def norm_linear_rope_kv(
    norm: RMSNorm,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    rope: Rope,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A batch-1 qkv projection with the norm as its prologue and, as its epilogue, RoPE on
    q and k and k/v written into the paged cache at ``slot_mapping``
    (``gemv_rope_kv.norm_gemv_rope_kv``): ``(rotated q, h)``, where ``ROPE_KV_CONFIGS`` has the
    weight's shape and RoPE covers whole heads; None elsewhere (the caller runs the
    product, then the attention backend's store)."""
    if not (x.is_cuda and x.shape[0] == 1):
        return None
    from tokenspeed_kernels.gemv_rope_kv import ROPE_KV_CONFIGS, norm_gemv_rope_kv

    rotary_emb, positions = rope
    cos_sin = rotary_emb.cos_sin_cache
    config = ROPE_KV_CONFIGS.get(tuple(weight.shape))
    if config is None or cos_sin.shape[1] != k_cache.shape[-1]:
        return None
    return norm_gemv_rope_kv(
        x, residual, norm.weight, norm.eps, weight, bias, positions, cos_sin,
        k_cache, v_cache, slot_mapping, config,
    )  # fmt: skip


class _ColumnShardedLinear(nn.Module):
    """Holds this rank's rows of W (and b); subclasses decide which rows those are.

    ``act_silu_mul`` (two sub-projections, gate and up): return the SwiGLU activation of the
    output, fused into the product where the batch-1 kernel has a config for it.
    """

    def __init__(
        self, input_size: int, local_output_size: int, bias: bool, act_silu_mul: bool = False
    ) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.input_size = input_size
        self.act_silu_mul = act_silu_mul
        self.weight = nn.Parameter(torch.empty(local_output_size, input_size))
        self.bias = nn.Parameter(torch.empty(local_output_size)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.act_silu_mul)

    def after_norm(
        self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(self(norm(h)), h)`` with ``h = x + residual`` (``x`` when residual is None), the
        norm fused into the product where it can be (``norm_linear``)."""
        return norm_linear(norm, x, residual, self.weight, self.bias, self.act_silu_mul)

    def _copy_rows(
        self, param: torch.Tensor, loaded: torch.Tensor, full_rows: int, src: int, dst: int, n: int
    ) -> None:
        """Copy ``loaded[src:src+n]`` into ``param[dst:dst+n]`` (rows = output features)."""
        check_shape(loaded, (full_rows, *param.shape[1:]))
        param.data.narrow(0, dst, n).copy_(loaded.narrow(0, src, n))


class MergedColumnParallelLinear(_ColumnShardedLinear):
    """Several column-parallel projections of the same input in one matmul (gate_up_proj).

    Each rank holds its shard of every sub-projection, back to back, so the output splits
    locally (``chunk``) with no communication.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        act_silu_mul: bool = False,
    ) -> None:
        local = [divide(size, tp_size(), "merged output size") for size in output_sizes]
        super().__init__(input_size, sum(local), bias, act_silu_mul)
        self.output_sizes = output_sizes
        self.local_sizes = local

    def weight_loader(
        self, param: torch.Tensor, loaded: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        if not isinstance(shard_id, int):
            raise ValueError(f"merged linear needs a sub-projection index, got {shard_id!r}")
        n = self.local_sizes[shard_id]
        dst = sum(self.local_sizes[:shard_id])
        self._copy_rows(param, loaded, self.output_sizes[shard_id], self.tp_rank * n, dst, n)


class QKVParallelLinear(_ColumnShardedLinear):
    """q, k and v projections fused; attention heads split across ranks.

    KV heads split like q heads when there are at least as many as ranks; with fewer
    (tp > num_kv_heads) each rank holds one KV head, shared by ``tp / num_kv_heads``
    consecutive ranks, whose q heads are exactly the ones that use it under GQA.
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
    ) -> None:
        tp = tp_size()
        num_heads = divide(total_num_heads, tp, "number of attention heads")
        num_kv_heads = local_num_kv_heads(total_num_kv_heads, tp)
        super().__init__(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias)
        self.head_dim = head_dim
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        # First KV head of this rank; the same formula covers the split and the replicated
        # case (there, tp / num_kv_heads consecutive ranks share one head).
        self.kv_head_start = tp_rank() * total_num_kv_heads // tp

    def weight_loader(
        self, param: torch.Tensor, loaded: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        d = self.head_dim
        q_rows, kv_rows = self.num_heads * d, self.num_kv_heads * d
        if shard_id == "q":
            full, src, dst, n = self.total_num_heads * d, self.tp_rank * q_rows, 0, q_rows
        elif shard_id == "k":
            full, src, dst, n = self.total_num_kv_heads * d, self.kv_head_start * d, q_rows, kv_rows
        elif shard_id == "v":
            full, src, n = self.total_num_kv_heads * d, self.kv_head_start * d, kv_rows
            dst = q_rows + kv_rows
        else:
            raise ValueError(f"QKV shard id must be 'q', 'k' or 'v', got {shard_id!r}")
        self._copy_rows(param, loaded, full, src, dst, n)


class RowParallelLinear(nn.Module):
    """W split by input features; partial products are summed across ranks.

    The bias is replicated and added once, after the all-reduce.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.tp_rank = tp_rank()
        self.input_size = input_size
        local = divide(input_size, tp_size(), "input size")
        self.weight = nn.Parameter(torch.empty(output_size, local))
        self.bias = nn.Parameter(torch.empty(output_size)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = tp_all_reduce(linear(x, self.weight))
        return y if self.bias is None else y + self.bias

    def weight_loader(
        self, param: torch.Tensor, loaded: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        if param is self.bias:
            check_shape(loaded, param.shape)
            param.data.copy_(loaded)
            return
        n = param.shape[1]
        check_shape(loaded, (param.shape[0], self.input_size))
        param.data.copy_(loaded.narrow(1, self.tp_rank * n, n))
