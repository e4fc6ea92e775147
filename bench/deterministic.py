"""Deterministic inference: does ``--enable-deterministic-inference`` make a request's greedy
tokens and logprobs independent of its batch, and what does it cost?

    python bench/deterministic.py --shape llama-8b --out-dir bench/results/deterministic-h200

For the engine with the mode off and on (and on with small prefill chunks), the same
``--requests`` greedy requests (random prompts of 16-400 tokens, ``--tokens`` each, top-1
logprobs) run alone, all at once, beside fillers in a batch of 64, and again once their
prompts are in the prefix cache; every run is compared token id for token id and logprob
bit for bit with the requests run alone on the mode-on engine (the mode-off engine with its
own). Throughput: 64 concurrent requests of ``--tokens`` (ignore_eos), output tokens/s.
Dummy weights for the 8B shapes (``bench/shapes``), the tiny shape's real random ones.
Prints a table; writes ``deterministic.json`` into ``--out-dir``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import time
from pathlib import Path

from tokenspeed_aio import AsyncEngine, EngineArgs, SamplingParams
from tokenspeed_aio.bench.output import git_commit
from tokenspeed_aio.bench.shapes import WEIGHTED_SHAPES, checkpoint_dir, shape_config


def prompts(count: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(rng.randrange(16, 400))] for _ in range(count)]


async def run(engine: AsyncEngine, batch: list[list[int]], params: SamplingParams) -> list:
    async def one(ids):
        last = None
        async for out in engine.generate(prompt_token_ids=ids, sampling_params=params):
            last = out
        return [list(last.token_ids), [lp.logprob for lp in last.logprobs or []]]

    return list(await asyncio.gather(*(one(ids) for ids in batch)))


async def throughput(engine: AsyncEngine, vocab: int, tokens: int) -> float:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    batch = prompts(64, vocab, seed=9)
    await run(engine, batch[:4], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    start = time.perf_counter()
    await run(engine, batch, params)
    return 64 * tokens / (time.perf_counter() - start)


async def measure(args: EngineArgs, targets, fillers, tokens: int, vocab: int, label: str) -> dict:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    async with await AsyncEngine.start(args) as engine:
        start = time.perf_counter()
        await run(engine, [targets[0]], params)  # warm-up (compiles, graphs)
        alone = [(await run(engine, [ids], params))[0] for ids in targets]
        together = await run(engine, targets, params)
        beside = (await run(engine, targets + fillers[: 64 - len(targets)], params))[: len(targets)]
        cached = await run(engine, targets, params)  # their prompts now hit the prefix cache
        tok_s = await throughput(engine, vocab, tokens)
        seconds = time.perf_counter() - start
    return {"label": label, "alone": alone, "together": together, "beside_fillers": beside,
            "prefix_hits": cached, "output_tok_s_batch64": tok_s, "seconds": seconds}  # fmt: skip


def mismatches(runs: list, reference: list) -> int:
    return sum(run != ref for run, ref in zip(runs, reference))


def engine_args(ns: argparse.Namespace, model: Path, **kw) -> EngineArgs:
    dummy = ns.shape not in WEIGHTED_SHAPES
    return EngineArgs(
        model=str(model),
        load_format="dummy" if dummy else "auto",
        dtype="bfloat16" if dummy else "auto",
        device=ns.device,
        max_model_len=1024,
        max_num_seqs=64,
        cudagraph_capture_sizes=[1, 2, 4, 8, 16, 32, 64],
        **kw,
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="tiny", help="tiny, llama-8b, qwen3-8b, ...")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out-dir", required=True)
    ns = parser.parse_args()
    model = checkpoint_dir(ns.shape)
    vocab = shape_config(ns.shape)["vocab_size"]
    targets = prompts(ns.requests, vocab, seed=1)
    fillers = prompts(64, vocab, seed=2)
    runs = [
        ("off", engine_args(ns, model)),
        ("on", engine_args(ns, model, enable_deterministic_inference=True)),
        (
            "on, chunks of 64",
            engine_args(ns, model, enable_deterministic_inference=True, chunked_prefill_size=64),
        ),
    ]
    results = [await measure(a, targets, fillers, ns.tokens, vocab, label) for label, a in runs]
    reference = results[1]["alone"]  # the mode's own answer, alone
    rows = []
    for r in results:
        ref = r["alone"] if r["label"] == "off" else reference
        rows.append({
            "mode": r["label"],
            "alone_vs_reference": mismatches(r["alone"], ref),
            "together": mismatches(r["together"], ref),
            "beside_fillers": mismatches(r["beside_fillers"], ref),
            "prefix_hits": mismatches(r["prefix_hits"], ref),
            "output_tok_s_batch64": round(r["output_tok_s_batch64"], 1),
            "seconds": round(r["seconds"], 1),
        })  # fmt: skip
    import torch

    cost = 1 - rows[1]["output_tok_s_batch64"] / rows[0]["output_tok_s_batch64"]
    summary = {
        "command": "python bench/deterministic.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(ns).items()),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "machine": platform.processor() or platform.machine(),
        "date": time.strftime("%Y-%m-%d"),
        "commit": git_commit(),
        "requests": ns.requests, "tokens": ns.tokens, "rows": rows,
        "throughput_cost": round(cost, 4),
        "deterministic": all(r[k] == 0 for r in rows[1:] for k in
                             ("alone_vs_reference", "together", "beside_fillers", "prefix_hits")),
    }  # fmt: skip
    out = Path(ns.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "deterministic.json").write_text(json.dumps({**summary, "raw": results}, indent=1))
    print(f"{'mode':<18} {'alone':>6} {'batch':>6} {'beside64':>8} {'prefix':>6} {'tok/s@64':>9}")
    for r in rows:
        print(f"{r['mode']:<18} {r['alone_vs_reference']:>6} {r['together']:>6} "
              f"{r['beside_fillers']:>8} {r['prefix_hits']:>6} {r['output_tok_s_batch64']:>9}")  # fmt: skip
    print(f"mismatching requests out of {ns.requests}; deterministic: {summary['deterministic']}; "
          f"throughput cost of the mode at batch 64: {100 * cost:.1f} %")  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())
