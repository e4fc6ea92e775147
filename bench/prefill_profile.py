"""Where a prefill round's GPU time goes: the eager forward of ``--prompts`` fresh prompts of
``--prompt-len`` tokens, optionally beside ``--decodes`` decode rows at ``--context`` (a
mixed round, as a chunked prefill arrives while others decode), timed with CUDA events and
broken down by kernel with the torch profiler.

    python bench/prefill_profile.py [--shape llama-8b] [--prompts 8] [--prompt-len 1024]
                                    [--decodes 0,56] [--context 1536] [--kv-cache-dtype fp8]
                                    [--quantization fp8] [--out PATH]

Builds the engine's device side as a rank does (dummy weights, the Triton backend) and runs
the runner's eager path on a batch built the way the scheduler's rows are. Reports per
decode count: the forward's GPU time, its compute floor (FLOPs at the dense matmul rate
measured in the same run: e4m3 through ``torch._scaled_mm`` when the weights are FP8, bf16
otherwise), the GEMMs' achieved rate, and every cuBLAS product of the forward's shapes timed
alone (FP8 weights: ``torch._scaled_mm`` on e4m3 operands with row-wise scales). GPU-only.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from tokenspeed_aio.args import EngineArgs
from tokenspeed_aio.bench.kernel_profile import kernel_breakdown, time_step, write_profile
from tokenspeed_aio.bench.output import OUT_HELP, default_out_path
from tokenspeed_aio.bench.roofline import (
    layer_params,
    measure_matmul_peak,
    prompt_flops,
    scaled_mm_product,
)
from tokenspeed_aio.bench.shapes import checkpoint_dir
from tokenspeed_aio.data_plane.batch_inputs import build_host_batch
from tokenspeed_aio.data_plane.device import build_device_side
from tokenspeed_aio.data_plane.specs import RankInfo
from tokenspeed_aio.model.config import ModelConfig
from tokenspeed_aio.scheduler.plan import ScheduledRow


def rows_for(
    runner, decodes: int, context: int, prompts: int, prompt_len: int, page: int, vocab: int
):
    """Decode rows first (slots 0..), then the prompts, as ``build_host_batch`` orders them;
    each slot's blocks are its own, written straight into the runner's host block table."""
    rng = np.random.default_rng(0)
    rows, next_block = [], 1
    lengths = [(context, 1)] * decodes + [(0, prompt_len)] * prompts
    for slot, (start, n) in enumerate(lengths):
        blocks = -(-(start + n) // page)
        runner.block_table[slot, :blocks] = np.arange(next_block, next_block + blocks)
        next_block += blocks
        tokens = None if start else rng.integers(0, vocab, n).tolist()
        rows.append(ScheduledRow(f"r{slot}", slot, start, n, tokens, (), 0, True, 0, None))
    return rows


def gemm_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of each product a decoder layer runs."""
    h, q, kv, inter = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    return {"qkv": (q + 2 * kv, h), "o_proj": (h, q), "gate_up": (2 * inter, h), "down": (h, inter)}


def cublas_rates(config: ModelConfig, tokens: int, peak: float, fp8: bool) -> list[dict]:
    """Each layer product's shape at ``tokens`` rows through cuBLAS alone: ``F.linear``, or
    with ``fp8`` ``torch._scaled_mm`` (row-wise scales, bf16 out) as the engine calls it."""
    out = []
    x = torch.randn(tokens, max(config.intermediate_size, config.q_size), device="cuda")
    for name, (n, k) in gemm_shapes(config).items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        a = x[:, :k].to(torch.bfloat16).contiguous()
        product = scaled_mm_product(a, w) if fp8 else lambda a=a, w=w: F.linear(a, w)
        ms = time_step(product, 20)
        flops = 2 * tokens * n * k
        out.append(
            {
                "name": name,
                "n": n,
                "k": k,
                "ms": ms,
                "tflops": flops / ms / 1e9,
                "of_peak": flops / (ms / 1e3) / peak,
            }
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-8b")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--decodes", default="0,56", help="decode rows beside the prompts")
    parser.add_argument("--context", type=int, default=1536, help="each decode row's context")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto or fp8")
    parser.add_argument("--quantization", help="fp8: quantize the shape's weights at load")
    parser.add_argument("--out", type=Path, help=OUT_HELP)
    ns = parser.parse_args()
    decode_counts = [int(d) for d in ns.decodes.split(",")]
    model_dir = checkpoint_dir(ns.shape, Path(tempfile.mkdtemp()))
    config = ModelConfig.from_pretrained(model_dir)
    fp8 = config.quantization is not None or ns.quantization is not None
    matmul = measure_matmul_peak("cuda", fp8=fp8)
    peak = matmul["flops_per_s"]
    torch.cuda.empty_cache()
    page = EngineArgs.page_size
    most = max(decode_counts)
    blocks = most * -(-(ns.context + 1) // page) + ns.prompts * -(-ns.prompt_len // page) + 1
    tokens = ns.prompts * ns.prompt_len + most
    args = EngineArgs(
        model=str(model_dir),
        load_format="dummy",
        dtype="bfloat16",
        device="cuda",
        max_model_len=8192,
        num_kv_blocks=blocks,
        max_num_seqs=most + ns.prompts,
        chunked_prefill_size=tokens,
        enforce_eager=True,
        gpu_memory_utilization=0.85,
        attention_backend="triton",
        kv_cache_dtype=ns.kv_cache_dtype,
        quantization=ns.quantization,
    )
    runner = build_device_side(args, RankInfo()).handle._runner  # past the handle on purpose
    dense = 2 * config.num_hidden_layers * layer_params(config)
    head = 2 * config.vocab_size * config.hidden_size
    results = []
    for decodes in decode_counts:
        rows = rows_for(
            runner, decodes, ns.context, ns.prompts, ns.prompt_len, page, config.vocab_size
        )
        host = build_host_batch(rows, runner.block_table, page)

        @torch.inference_mode()
        def step(host=host):
            return runner._eager(host)

        flops = ns.prompts * prompt_flops(config, ns.prompt_len) + decodes * (
            dense + head + 4 * (ns.context + 1) * config.q_size * config.num_hidden_layers
        )
        r = {
            "prompts": ns.prompts,
            "prompt_len": ns.prompt_len,
            "decodes": decodes,
            "context": ns.context,
            "tokens": host.num_tokens,
            "step_ms": time_step(step, ns.repeats),
            "flops": flops,
            **kernel_breakdown(step, steps=3),
        }
        r["floor_ms"] = flops / peak * 1e3
        r["of_floor"] = r["floor_ms"] / r["step_ms"]
        gemm_flops = host.num_tokens * dense + (ns.prompts + decodes) * head
        r["gemm_tflops"] = gemm_flops / r["by_category_ms"].get("gemm", float("nan")) / 1e9
        r["cublas_alone"] = cublas_rates(config, host.num_tokens, peak, fp8)
        results.append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "top_marginal_ms"}, indent=1))
    write_profile(ns.out or default_out_path("prefill-profile"), ns.shape, results, matmul=matmul)


if __name__ == "__main__":
    main()
