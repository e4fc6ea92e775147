"""A linear layer's FP8 weights: e4m3 ``weight``, fp32 ``weight_scale`` and, for static
activations, ``input_scale``, and how checkpoint tensors land in them.

Held per layer (``tokenspeed_kernels.fp8``'s layout): a weight scaled per tensor or per
channel keeps one scale per output row of this rank (a merged layer's per-tensor shards each
repeat theirs over their rows, so nothing is requantized); a block-scaled one keeps its
[rows / 128, cols / 128] block scales. A merged layer's static input scale is the largest of
its shards' (they quantize the same input). ``--quantization fp8`` quantizes a 16-bit
checkpoint's rows per channel as they are loaded, on the device.

A column-parallel layer hands ``load`` its rows (``full`` checkpoint rows, ``src``..``src+n``
into ``dst``..); a row-parallel one its columns. Shard boundaries of block scales must fall
on 128-row (column) blocks.
"""

from __future__ import annotations

import torch
from tokenspeed_kernels import fp8
from tokenspeed_kernels.fp8 import Fp8Weight
from torch import nn

from tokenspeed_aio.model.layers.weights import check_shape
from tokenspeed_aio.model.quantization.config import QuantConfig

DUMMY_INPUT_SCALE = 4.0 / fp8.FP8_MAX  # dummy static activations: |x| up to 4 in range


class Fp8Params:
    """The FP8 parameters of one linear layer of [rows, cols] (this rank's shard)."""

    def __init__(self, layer: nn.Module, quant: QuantConfig) -> None:
        rows, cols = layer.weight.shape
        device = layer.weight.device
        self.quant = quant
        self.block = quant.block is not None
        layer.weight = nn.Parameter(
            torch.empty(rows, cols, dtype=fp8.FP8, device=device), requires_grad=False
        )
        if self.block:
            shape = (-(-rows // fp8.BLOCK), -(-cols // fp8.BLOCK))
        else:
            shape = (rows,)
        layer.weight_scale = nn.Parameter(
            torch.ones(shape, dtype=torch.float32, device=device), requires_grad=False
        )
        layer.weight_scale.in_checkpoint = not quant.online
        layer.input_scale = None
        if quant.activation == "static":
            layer.input_scale = nn.Parameter(
                torch.zeros(1, dtype=torch.float32, device=device), requires_grad=False
            )
        self.weight = Fp8Weight(layer.weight, layer.weight_scale, layer.input_scale)

    # -- column-parallel layers: rows ------------------------------------------------------

    def load_rows(self, layer, param, loaded, full: int, src: int, dst: int, n: int) -> None:
        if param is layer.input_scale:
            return self._load_input_scale(param, loaded)
        if param is layer.weight_scale:
            return self._load_row_scales(param, loaded, full, src, dst, n)
        check_shape(loaded, (full, layer.weight.shape[1]))
        rows = loaded.narrow(0, src, n)
        if self._quantize_online(loaded):
            q, s = fp8.quantize_weight(rows.to(param.device), "channel")
            param.data.narrow(0, dst, n).copy_(q)
            layer.weight_scale.data.narrow(0, dst, n).copy_(s)
        else:
            param.data.narrow(0, dst, n).copy_(rows)

    def _load_row_scales(self, param, loaded, full, src, dst, n) -> None:
        if self.block:
            b = fp8.BLOCK
            if src % b or dst % b or (n % b and dst + n != param.shape[0] * b):
                raise ValueError(f"splits 128-row scale blocks (rows {src}..{src + n})")
            check_shape(loaded, (-(-full // b), param.shape[1]))
            count = -(-n // b)
            param.data.narrow(0, dst // b, count).copy_(loaded.narrow(0, src // b, count))
        elif loaded.numel() == 1:  # per tensor: this shard's rows share it
            param.data.narrow(0, dst, n).fill_(float(loaded.reshape(())))
        else:
            check_shape(loaded.reshape(-1), (full,))
            param.data.narrow(0, dst, n).copy_(loaded.reshape(-1).narrow(0, src, n))

    # -- row-parallel layers: columns -------------------------------------------------------

    def load_cols(self, layer, param, loaded, full: int, src: int) -> None:
        rows, cols = layer.weight.shape
        if param is layer.input_scale:
            return self._load_input_scale(param, loaded)
        if param is layer.weight_scale:
            if self.block:
                if src % fp8.BLOCK:
                    raise ValueError(f"splits 128-column scale blocks (column {src})")
                check_shape(loaded, (param.shape[0], -(-full // fp8.BLOCK)))
                param.data.copy_(loaded.narrow(1, src // fp8.BLOCK, param.shape[1]))
            elif loaded.numel() == 1:
                param.data.fill_(float(loaded.reshape(())))
            else:
                check_shape(loaded.reshape(-1), (rows,))
                param.data.copy_(loaded.reshape(-1))
            return
        check_shape(loaded, (rows, full))
        shard = loaded.narrow(1, src, cols)
        if self._quantize_online(loaded):
            q, s = fp8.quantize_weight(shard.to(param.device), "channel")
            param.data.copy_(q)
            layer.weight_scale.data.copy_(s)
        else:
            param.data.copy_(shard)

    # -- shared -----------------------------------------------------------------------------

    def _quantize_online(self, loaded: torch.Tensor) -> bool:
        if loaded.dtype == fp8.FP8:
            if self.quant.online:
                raise ValueError(
                    "is already float8_e4m3fn: drop --quantization for this checkpoint"
                )
            return False
        if not self.quant.online:
            raise ValueError(
                f"is {loaded.dtype} but the checkpoint's quantization_config ({self.quant.scheme}) "
                "says float8_e4m3fn"
            )
        return True

    @staticmethod
    def _load_input_scale(param, loaded) -> None:
        check_shape(loaded.reshape(-1), (1,))
        param.data.copy_(torch.maximum(param.data, loaded.reshape(1).float().to(param.device)))

    def fill_dummy(self, layer, generator: torch.Generator, std: float) -> None:
        """Random weights of the configured scheme: normal(0, std) quantized."""
        w = torch.empty(layer.weight.shape, dtype=torch.float32, device=layer.weight.device)
        w.normal_(0.0, std, generator=generator)
        kind = "block" if self.block else self.quant.weight
        q, s = fp8.quantize_weight(w, kind)
        layer.weight.data.copy_(q)
        layer.weight_scale.data.copy_(s.expand(layer.weight_scale.shape))
        if layer.input_scale is not None:
            layer.input_scale.data.fill_(DUMMY_INPUT_SCALE)
