"""Tensor-parallel linear layers (Megatron style).

Column-parallel layers split the output features across ranks and need no
communication; a row-parallel layer splits the input features and all-reduces its
partial sums. A column-parallel layer feeding a row-parallel one therefore costs one
all-reduce per pair. Every ``weight_loader`` takes the FULL checkpoint tensor and
copies this rank's shard into the (already sharded) parameter. Which kernel runs a
product is model/ops/products.py's choice.

``use_fp8`` turns a layer's weight into e4m3 with its scales (model/quantization/, after the
model is built, for the layers its config quantizes); the weight loaders then fill those
(``Fp8Params``) and the products take the ``Fp8Weight`` (``operand``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from tokenspeed_aio.model.kv_cache import local_num_kv_heads
from tokenspeed_aio.model.layers.attention import QKV
from tokenspeed_aio.model.layers.norm import RMSNorm
from tokenspeed_aio.model.layers.weights import check_shape
from tokenspeed_aio.model.ops.products import linear, norm_linear, norm_linear_rope_kv
from tokenspeed_aio.model.parallel import divide, tp_all_reduce, tp_rank, tp_size

if TYPE_CHECKING:
    from tokenspeed_kernels.fp8 import Fp8Weight, QuantizedRows, SplitKPartials

    from tokenspeed_aio.model.attention.base import KVWrite
    from tokenspeed_aio.model.quantization.config import QuantConfig
    from tokenspeed_aio.model.quantization.fp8_weights import Fp8Params


class _Quantizable(nn.Module):
    """What every linear layer shares: an optional FP8 weight (module doc)."""

    fp8: Fp8Params | None = None

    def use_fp8(self, quant: QuantConfig) -> None:
        from tokenspeed_aio.model.quantization.fp8_weights import Fp8Params

        self.fp8 = Fp8Params(self, quant)

    @property
    def operand(self) -> torch.Tensor | Fp8Weight:
        """What a product takes: the weight, or its FP8 form."""
        return self.weight if self.fp8 is None else self.fp8.weight

    @property
    def fp8_weight(self) -> Fp8Weight | None:
        """The FP8 form of the weight; None for a 16-bit layer."""
        return None if self.fp8 is None else self.fp8.weight


class _ColumnShardedLinear(_Quantizable):
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
        return linear(x, self.operand, self.bias, self.act_silu_mul)

    def after_norm(
        self,
        norm: RMSNorm,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        feeds: Fp8Weight | None = None,
    ) -> tuple[torch.Tensor | QuantizedRows, torch.Tensor]:
        """``(self(norm(h)), h)`` with ``h = x + residual`` (``x`` when residual is None), the
        norm fused into the product where it can be (``norm_linear``; ``feeds``: the FP8
        weight the activation goes to, which it may come quantized for)."""
        return norm_linear(norm, x, residual, self.operand, self.bias, self.act_silu_mul, feeds)

    def _copy_rows(
        self, param: torch.Tensor, loaded: torch.Tensor, full_rows: int, src: int, dst: int, n: int
    ) -> None:
        """Copy ``loaded[src:src+n]`` into ``param[dst:dst+n]`` (rows = output features)."""
        if self.fp8 is not None and param is not self.bias:
            self.fp8.load_rows(self, param, loaded, full_rows, src, dst, n)
            return
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
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim

    def project(
        self,
        norm: RMSNorm,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv_write: KVWrite | None = None,
    ) -> tuple[QKV, torch.Tensor]:
        """``(QKV of norm(h), h)`` with ``h = x + residual``; with ``kv_write``, RoPE and the
        k/v store run as the product's epilogue where a kernel has the shape (the QKV then
        holds the rotated q alone)."""
        if kv_write is not None:
            fused = norm_linear_rope_kv(norm, x, residual, self.operand, self.bias, kv_write)
            if fused is not None:
                q, h = fused
                return QKV(q, None, None), h
        qkv, h = self.after_norm(norm, x, residual)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return QKV(q, k, v), h

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


class RowParallelLinear(_Quantizable):
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

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor | SplitKPartials:
        """The layer's output; on one rank without bias an FP8 split-K product may leave its
        partial sums to the residual-add norm that every row-parallel layer's output goes to
        (``products.linear``'s ``defer_sum``)."""
        if self.bias is None and tp_size() == 1:
            return linear(x, self.operand, defer_sum=True)
        y = tp_all_reduce(linear(x, self.operand))
        return y if self.bias is None else y + self.bias

    def weight_loader(
        self, param: torch.Tensor, loaded: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        if param is self.bias:
            check_shape(loaded, param.shape)
            param.data.copy_(loaded)
            return
        n = self.weight.shape[1]
        if self.fp8 is not None:
            self.fp8.load_cols(self, param, loaded, self.input_size, self.tp_rank * n)
            return
        check_shape(loaded, (param.shape[0], self.input_size))
        param.data.copy_(loaded.narrow(1, self.tp_rank * n, n))
