"""A batch-64 decode step's layers on a GPU: which product goes through cuBLAS and which
through ``skinny_gemm`` (and its tiles), with programmatic dependent launch on and off.

    python kernels/bench_decode_chain.py [--shape qwen3-8b llama-8b] [--json OUT.json]
                                         [--write-config]

``bench_skinny_gemm.py`` times one product alone. In a decode step a product sits between a
norm and attention, and with PDL its programs start while the kernel before it finishes, so
the choice that wins alone need not win there. This replays a model's layers at 64 rows --
residual add + norm, qkv, decode attention over 1,025 keys a row (an ordinary launch), o_proj,
residual add + norm, gate_up with the SwiGLU, down -- from one CUDA graph (dummy weights,
more bytes than the L2 holds) and reports the replay time per step:

1. the choice ``skinny_gemm``'s tables make now, without PDL and with it;
2. coordinate descent with PDL on: each product in turn tries ``CANDIDATES``' tiles (and
   cuBLAS) with the others at the best so far;
3. the tables' choice and the best one again, alternating, with PDL on and off.

A candidate whose tiles do not fit the shared memory is reported and skipped. The best
choice is only a lead: the model's decode graph (``bench/decode_profile.py``, which also has
the embedding, the new token's RoPE and KV write, the head and the argmax) decides what goes
into the tables. ``--write-config`` writes it into this GPU's ``skinny_gemm`` (gate_up:
``skinny_gemm_silu_mul``) table at the 64-row bucket, cuBLAS as a removed key
(``tokenspeed_kernels/tuning.py``); a shape two models share keeps the last model's choice.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F
from bench_kernels import copy_bandwidth, replayed_ms, run_info
from tokenspeed_kernels import fused_add_rms_norm, pdl, tuning
from tokenspeed_kernels import skinny_gemm as sg
from tokenspeed_kernels.activation import silu_and_mul
from tokenspeed_kernels.decode_attention import decode_attention
from triton.runtime.errors import OutOfResources

ROWS, CONTEXT, PAGE, HEAD_DIM = 64, 1024, 16, 128
SHAPES = {
    "qwen3-8b": dict(layers=36, hidden=4096, heads=32, kv_heads=8, intermediate=12288),
    "llama-8b": dict(layers=32, hidden=4096, heads=32, kv_heads=8, intermediate=14336),
}
PRODUCTS = ("qkv", "o", "gate_up", "down")
# Per product: cuBLAS and the best tiles of bench_skinny_gemm.py's 64-row search on the H200,
# plus a few neighbours.
CANDIDATES = {
    "qkv": ["cublas", (64, 128, 1, 4, 5), (64, 128, 1, 8, 5), (64, 128, 1, 4, 4),
            (64, 256, 1, 4, 4), (128, 128, 2, 4, 4), (64, 64, 1, 4, 5), (32, 128, 1, 4, 4)],
    "o": ["cublas", (64, 128, 2, 4, 5), (64, 128, 2, 8, 4), (64, 128, 2, 4, 4),
          (128, 128, 4, 4, 4), (64, 128, 1, 4, 5), (32, 128, 1, 4, 4), (32, 256, 2, 4, 4)],
    "gate_up": ["cublas", (64, 64, 1, 4, 4), (64, 128, 1, 4, 4), (64, 64, 1, 8, 4),
                (64, 128, 1, 8, 4), (32, 128, 1, 4, 4), (64, 64, 1, 4, 5), (64, 128, 1, 4, 3)],
    "down": ["cublas", (64, 128, 2, 4, 5), (128, 128, 4, 4, 4), (64, 128, 2, 4, 4),
             (64, 128, 2, 8, 5), (64, 256, 2, 4, 4), (128, 128, 2, 4, 4), (64, 128, 4, 4, 4),
             (128, 128, 4, 4, 3)],
}  # fmt: skip


def weight_shapes(shape: str) -> dict[str, tuple[int, int]]:
    d = SHAPES[shape]
    hidden, inter = d["hidden"], d["intermediate"]
    qkv = (d["heads"] + 2 * d["kv_heads"]) * HEAD_DIM
    return {"qkv": (qkv, hidden), "o": (hidden, hidden), "gate_up": (2 * inter, hidden),
            "down": (hidden, inter)}  # fmt: skip


def tables_choice(shape: str) -> dict:
    """What this GPU's ``skinny_gemm`` tables pick at 64 rows (gate_up: the SwiGLU's)."""
    choice = {}
    for name, (n, k) in weight_shapes(shape).items():
        table = sg.configs(silu_mul=name == "gate_up")
        choice[name] = table.get((n, k, sg.m_bucket(ROWS)), "cublas")
    return choice


def write_choice(shape: str, choice: dict) -> None:
    """``choice`` into this GPU's tables at the 64-row bucket (cuBLAS: the key removed)."""
    for name, (n, k) in weight_shapes(shape).items():
        table = "skinny_gemm_silu_mul" if name == "gate_up" else "skinny_gemm"
        config = None if choice[name] == "cublas" else choice[name]
        file = tuning.update(table, {(n, k, sg.m_bucket(ROWS)): config})
        print(f"{shape} {name}: {choice[name]} -> {file}")


def build(shape: str) -> dict:
    d = SHAPES[shape]

    def rand(*size):
        return (torch.randn(*size, device="cuda") * 0.02).to(torch.bfloat16)

    blocks = CONTEXT // PAGE + 1  # 1,025 keys a row
    cache = (1 + ROWS * blocks, PAGE, d["kv_heads"], HEAD_DIM)
    layers = []
    for _ in range(d["layers"]):
        layer = {name: rand(*size) for name, size in weight_shapes(shape).items()}
        layer.update(norm1=rand(d["hidden"]) + 1, norm2=rand(d["hidden"]) + 1)
        layers.append(dict(layer, k=rand(*cache), v=rand(*cache)))
    tables = torch.arange(1, 1 + ROWS * blocks, dtype=torch.int32, device="cuda")
    return dict(
        heads=d["heads"], layers=layers, block_tables=tables.view(ROWS, blocks),
        seq_lens=torch.full((ROWS,), CONTEXT + 1, dtype=torch.int32, device="cuda"),
        x=rand(ROWS, d["hidden"]) * 5, residual=rand(ROWS, d["hidden"]) * 5,
    )  # fmt: skip


def product(x, weight, choice, silu_mul=False):
    if choice == "cublas":
        y = F.linear(x, weight)
        return silu_and_mul(y) if silu_mul else y
    return sg.skinny_gemm(x, weight, config=choice, silu_mul=silu_mul)


def step(model: dict, choice: dict) -> torch.Tensor:
    x, residual = model["x"], model["residual"]
    for w in model["layers"]:
        normed, h = fused_add_rms_norm(x, residual, w["norm1"], 1e-6)
        q = product(normed, w["qkv"], choice["qkv"])[:, : model["heads"] * HEAD_DIM]
        attn = decode_attention(
            q.view(ROWS, model["heads"], HEAD_DIM), w["k"], w["v"], model["block_tables"],
            model["seq_lens"], HEAD_DIM**-0.5, 1,
        )  # fmt: skip
        a = product(attn.view(ROWS, -1), w["o"], choice["o"])
        normed, residual = fused_add_rms_norm(a, h, w["norm2"], 1e-6)
        x = product(
            product(normed, w["gate_up"], choice["gate_up"], True), w["down"], choice["down"]
        )
    return x


def step_ms(model: dict, choice: dict, pdl_on: bool, replays: int = 30) -> float:
    """One graph of the whole step, replayed; ms per replay. ``pdl.enabled`` is swapped for
    the capture: the launches read it."""
    saved = pdl.enabled
    pdl.enabled = lambda: pdl_on
    try:
        step(model, choice)  # compile
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step(model, choice)
    finally:
        pdl.enabled = saved
    return replayed_ms(graph, replays)


def search(shape: str) -> dict:
    model = build(shape)
    trials = []

    def trial(choice: dict, pdl_on: bool, tag: str) -> float:
        try:
            ms = step_ms(model, choice, pdl_on)
        except OutOfResources as e:
            print(f"{shape} {tag}: does not fit ({e})", file=sys.stderr)
            return float("inf")
        trials.append({"tag": tag, "pdl": pdl_on, "ms": ms, "choice": dict(choice)})
        print(f"{shape} {tag} pdl={pdl_on}: {ms:.4f} ms {choice}", file=sys.stderr)
        return ms

    tables = tables_choice(shape)
    trial(tables, False, "tables")
    best, best_ms = dict(tables), trial(tables, True, "tables")
    for name in PRODUCTS:
        for candidate in CANDIDATES[name]:
            if candidate != best[name]:
                choice = {**best, name: candidate}
                ms = trial(choice, True, f"{name}={candidate}")
                if ms < best_ms:
                    best, best_ms = choice, ms
    for round_ in range(2):
        for choice, tag in ((tables, "tables"), (best, "best")):
            for pdl_on in (False, True):
                trial(choice, pdl_on, f"final-{tag}-{round_}")
    return {"tables": tables, "best": best, "trials": trials}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--json", help="write every timing here")
    parser.add_argument(
        "--write-config", action="store_true", help="write the best choice into this GPU's tables"
    )
    args = parser.parse_args()
    start = time.time()
    report = {**run_info(copy_bandwidth()), "rows": ROWS, "context": CONTEXT + 1, "shapes": {}}
    for shape in args.shape:
        report["shapes"][shape] = search(shape)
        torch.cuda.empty_cache()
        best = report["shapes"][shape]["best"]
        print(f"{shape}: best {best}, tables {report['shapes'][shape]['tables']}")
        if args.write_config:
            write_choice(shape, best)
    report["elapsed_s"] = time.time() - start
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)


if __name__ == "__main__":
    main()
