"""The decode step's memory roofline: the bytes a step must read over measured bandwidth.

A decode step of ``c`` sequences reads every weight once (the embedding table only
for the ``c`` rows it looks up, unless it doubles as the LM head) and the K and V of
every token of every sequence. Activations and the one new KV token per sequence
are ignored: they are small next to these. At bandwidth ``B`` the step cannot take
less than ``bytes / B``, and ``c`` tokens per step bound the output rate.

The bandwidth is measured in the same run with a large device-to-device copy,
counted as read + write (an H200 measures about 4.25 TB/s this way). On CPU
the same copy measures host memory bandwidth, and the report says so.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenspeed_aio.model.config import ModelConfig

DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


def projection_params(config: ModelConfig) -> int:
    """Weights of one decoder layer's linear projections (what FP8 quantizes)."""
    h, q, kv = config.hidden_size, config.q_size, config.kv_size
    return h * q + 2 * h * kv + q * h + 3 * h * config.intermediate_size


def layer_params(config: ModelConfig) -> int:
    """Parameters of one decoder layer: projections, biases, norms."""
    h, q, kv = config.hidden_size, config.q_size, config.kv_size
    attention = h * q + 2 * h * kv + q * h
    if config.attention_bias:
        attention += q + 2 * kv
    if config.o_proj_bias:
        attention += h
    if config.qk_norm:
        attention += 2 * config.head_dim
    return attention + 3 * h * config.intermediate_size + 2 * h  # + two RMSNorms


def prompt_flops(config: ModelConfig, length: int) -> float:
    """FLOPs of a fresh ``length``-token prompt: every layer's parameters once per token,
    causal QK^T and PV, and the LM head on the last position only."""
    h, layers = config.hidden_size, config.num_hidden_layers
    dense = 2 * layers * layer_params(config) * length
    attention = 2 * 2 * (length * length / 2) * config.q_size * layers
    return dense + attention + 2 * config.vocab_size * h


@dataclass(frozen=True)
class ModelBytes:
    total_weight_bytes: int  # every parameter, as stored
    step_weight_bytes: int  # what a decode step reads, without the embedding lookups
    embedding_row_bytes: int  # one looked-up embedding row
    kv_bytes_per_token: int  # K and V of one token, all layers

    @classmethod
    def of(
        cls, config: ModelConfig, dtype: str, fp8_weights: bool = False, fp8_kv: bool = False
    ) -> ModelBytes:
        """Byte counts of ``config`` with weights and KV cache in ``dtype``; ``fp8_weights``:
        the decoder layers' projections in one byte each (their scales are ignored: under a
        thousandth of them), ``fp8_kv``: the KV cache too."""
        width = DTYPE_BYTES[dtype]
        h, layers = config.hidden_size, config.num_hidden_layers
        per_layer = layer_params(config)
        embedding = config.vocab_size * h
        head = 0 if config.tie_word_embeddings else config.vocab_size * h
        params = embedding + layers * per_layer + h + head  # + the final norm
        # A tied table is read whole as the LM head; an untied one only row by row.
        step_params = params - (0 if config.tie_word_embeddings else embedding)
        saved = layers * projection_params(config) * (width - 1) if fp8_weights else 0
        return cls(
            total_weight_bytes=params * width - saved,
            step_weight_bytes=step_params * width - saved,
            embedding_row_bytes=h * width,
            kv_bytes_per_token=2 * layers * config.kv_size * (1 if fp8_kv else width),
        )

    def step_bytes(self, context_lens: list[int]) -> int:
        """Bytes one decode step over sequences of these context lengths must read."""
        lookups = 0 if self.step_weight_bytes == self.total_weight_bytes else len(context_lens)
        return (
            self.step_weight_bytes
            + lookups * self.embedding_row_bytes
            + self.kv_bytes_per_token * sum(context_lens)
        )


def resolve_dtype(dtype: str, config: ModelConfig) -> str:
    """EngineArgs' ``auto`` is the checkpoint's dtype (float32 when it states none)."""
    name = (config.torch_dtype or "float32") if dtype == "auto" else dtype
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype: {name!r} has no known width ({', '.join(DTYPE_BYTES)})")
    return name


def decode_floor(
    model: ModelBytes,
    *,
    concurrency: int,
    input_len: int,
    output_len: int,
    bandwidth: float,
    tp: int = 1,
) -> dict[str, Any]:
    """The roofline of ``concurrency`` sequences decoding ``output_len`` tokens after an
    ``input_len`` prompt, in lock step: the step that makes token ``j`` (1-based) reads
    contexts of ``input_len + j - 1`` tokens. Prefill is not counted (it is
    compute-bound). With tensor parallelism each of ``tp`` devices reads its share at
    ``bandwidth``."""
    steps = max(output_len - 1, 1)  # the first token comes out of prefill
    first = model.step_bytes([input_len + 1] * concurrency)
    last = model.step_bytes([input_len + output_len - 1] * concurrency)
    mean_bytes = (first + last) / 2  # bytes grow linearly over the steps
    step_s = mean_bytes / (bandwidth * tp)
    return {
        "concurrency": concurrency,
        "steps": steps,
        "step_bytes_first": first,
        "step_bytes_last": last,
        "step_floor_ms_first": first / (bandwidth * tp) * 1e3,
        "step_floor_ms_last": last / (bandwidth * tp) * 1e3,
        "step_floor_ms_mean": step_s * 1e3,
        "expected_output_tokens_per_s": concurrency / step_s,
    }


def measure_bandwidth(
    device: str, size_bytes: int | None = None, iters: int = 10
) -> dict[str, Any]:
    """Copy bandwidth (read + write bytes per second) of ``device`` ("cuda" or "cpu"),
    the best of ``iters`` copies of one large buffer into another."""
    import torch

    cuda = device.startswith("cuda")
    size = size_bytes or (1 << 30 if cuda else 256 << 20)
    src = torch.empty(size, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch: page faults and lazy allocation are not bandwidth
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t)
    best = min(times)
    if cuda:
        name = torch.cuda.get_device_name(torch.device(device))
        method = "device-to-device copy (CUDA events)"
    else:
        name = "CPU host memory"
        method = f"host memcpy with torch on {torch.get_num_threads()} threads (CPU, not HBM)"
    return {
        "device": name,
        "method": method,
        "bytes_copied": size,
        "iters": iters,
        "best_s": best,
        "bytes_per_s": 2 * size / best,
    }


def scaled_mm_product(a, w) -> Callable[[], Any]:
    """``a @ w.T`` (bf16 [M, K] and [N, K]) as the engine's FP8 product of many rows: both
    in e4m3, ``torch._scaled_mm`` with row-wise (unit) scales, bf16 out; a call runs it."""
    import torch

    aq, wq_t = a.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn).t()  # column-major
    sa = torch.ones(a.shape[0], 1, device=a.device)
    sw = torch.ones(1, w.shape[0], device=a.device)
    return lambda: torch._scaled_mm(aq, wq_t, scale_a=sa, scale_b=sw, out_dtype=torch.bfloat16)


def measure_matmul_peak(
    device: str, size: int = 8192, iters: int = 10, fp8: bool = False
) -> dict[str, Any]:
    """Dense matmul rate (FLOP/s) of a CUDA ``device``: the best of ``iters`` square
    ``size``-cubed products, the compute ceiling a prefill step is held to. bf16, or with
    ``fp8`` e4m3 operands through ``torch._scaled_mm`` with row-wise scales (the engine's
    FP8 product of many rows), bf16 out."""
    import torch

    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    product = scaled_mm_product(a, b) if fp8 else lambda: a @ b
    product()  # first call: cuBLAS heuristics and workspace
    best = float("inf")
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        product()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return {
        "size": size,
        "iters": iters,
        "dtype": "e4m3" if fp8 else "bfloat16",
        "best_s": best,
        "flops_per_s": 2 * size**3 / best,
    }
