"""A fixed-length run's roofline with its prefill counted, from a bench JSON.

    python bench/prefill_roofline.py RUN.json[.gz] --matmul-flops 7.86e14 [--shape llama-8b]

The bench's roofline is decode-only: every output step at (weights + KV bytes) / bandwidth.
But each request's prompt must also be computed once, and a prompt is compute-bound: its
floor is its FLOPs at the dense matmul rate (``decode_profile.py`` measures it in the same
kind of run). Per prompt of L tokens (``roofline.prompt_flops``)::

    2 * (decoder-layer parameters) * L               projections, MLPs, norms
    + 2 * (2 * L * L / 2) * q_size * layers          causal QK^T and PV
    + 2 * vocab * hidden                              the LM head, on the last position only

The floor of the whole run is then (decode-only floor time + prefill floor time), and
``achieved / that`` is what is left for the engine to win. Prints one row per level.
"""

from __future__ import annotations

import argparse
import gzip
import json
import tempfile
from pathlib import Path

from tokenspeed_aio.bench.roofline import prompt_flops
from tokenspeed_aio.bench.shapes import checkpoint_dir
from tokenspeed_aio.model.config import ModelConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a fixed-1k bench JSON (or .json.gz)")
    parser.add_argument("--matmul-flops", type=float, required=True, help="measured FLOP/s")
    parser.add_argument("--shape", help="the run's shape (default: the JSON's)")
    ns = parser.parse_args()
    raw = ns.run.read_bytes()
    doc = json.loads(gzip.decompress(raw) if ns.run.suffix == ".gz" else raw)
    shape = ns.shape or doc["target"]["shape"]
    config = ModelConfig.from_pretrained(checkpoint_dir(shape, Path(tempfile.mkdtemp())))
    input_len = doc["settings"]["input_len"]
    print(
        "| run | out tok/s | decode-only roofline | of it | prefill floor s | with prefill | of it |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for run in doc["runs"]:
        m, roof = run["metrics"], run["roofline"]
        decode_s = m["output_tokens"] / roof["expected_output_tokens_per_s"]
        prefill_s = m["num_requests"] * prompt_flops(config, input_len) / ns.matmul_flops
        with_prefill = m["output_tokens"] / (decode_s + prefill_s)
        achieved = m["output_tokens_per_s"]
        print(
            f"| {run['name']} | {achieved:,.0f} | {roof['expected_output_tokens_per_s']:,.0f} | "
            f"{achieved / roof['expected_output_tokens_per_s']:.1%} | {prefill_s:.2f} | "
            f"{with_prefill:,.0f} | {achieved / with_prefill:.1%} |"
        )


if __name__ == "__main__":
    main()
