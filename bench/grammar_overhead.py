"""Per-token cost of structured output: TPOT of constrained vs unconstrained decoding at
batch 1 and 64, in-process, plus xgrammar's own per-token mask fill time.

    python bench/grammar_overhead.py [--model DIR | --shape llama-8b] [--tokens 64] [--out PATH]

``--shape`` runs a named benchmark shape with dummy bf16 weights (on the GPU) and the built-in
model's tokenizer in place of the shape's synthetic one, which has no JSON punctuation: the
step is the big model's (its full vocabulary of logits is masked), the mask fill is for the
tokenizer's 4,096 tokens.

The schema keeps the model generating (an array of at least 400 integers), so every
request runs its full ``--tokens`` and the comparison is step for step.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from tokenspeed_aio import AsyncEngine, EngineArgs, SamplingParams
from tokenspeed_aio.bench.output import OUT_HELP, default_out_path, git_commit
from tokenspeed_aio.bench.shapes import checkpoint_dir
from tokenspeed_aio.model_source import DEFAULT_MODEL_DIR

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

SCHEMA = {"type": "array", "items": {"type": "integer"}, "minItems": 400}


async def tpot(engine: AsyncEngine, batch: int, tokens: int, constrained: bool) -> dict:
    params = SamplingParams(
        max_tokens=tokens,
        temperature=0.0,
        ignore_eos=True,
        json_schema=json.dumps(SCHEMA) if constrained else None,
    )

    async def one(i: int) -> list[float]:
        stamps = []
        async for _ in engine.generate(prompt_token_ids=[10 + i, 11, 12], sampling_params=params):
            stamps.append(time.perf_counter())
        return [b - a for a, b in itertools.pairwise(stamps)]

    start = time.perf_counter()
    gaps = await asyncio.gather(*(one(i) for i in range(batch)))
    wall = time.perf_counter() - start
    per_request = [statistics.mean(g) for g in gaps if g]
    return {
        "batch": batch,
        "constrained": constrained,
        "tpot_ms": 1e3 * statistics.mean(per_request),
        "output_tok_s": batch * tokens / wall,
    }


def mask_fill_us(model: Path, samples: int = 2000) -> float:
    """xgrammar's fill_next_token_bitmask per token, for this schema and tokenizer."""
    import transformers
    import xgrammar as xgr

    from tokenspeed_aio.grammar.xgrammar_backend import json_grammar

    tok = transformers.AutoTokenizer.from_pretrained(model)
    info = xgr.TokenizerInfo.from_huggingface(tok)
    compiled = xgr.GrammarCompiler(info).compile_grammar(json_grammar(json.dumps(SCHEMA)))
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    digits = [tok.convert_tokens_to_ids(t) for t in ("[", "1", ",", "2")]
    total = 0.0
    matcher.accept_token(digits[0])
    for i in range(samples):
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask, 0)
        total += time.perf_counter() - start
        matcher.accept_token(digits[1 + i % 3])
    return 1e6 * total / samples


def engine_args(ns: argparse.Namespace) -> EngineArgs:
    if not ns.shape:
        return EngineArgs(model=ns.model, dtype="float32", max_model_len=1024, max_num_seqs=64)
    model = checkpoint_dir(ns.shape, Path(tempfile.mkdtemp()))
    for name in TOKENIZER_FILES:
        shutil.copy(DEFAULT_MODEL_DIR / name, model / name)
    ns.model = str(model)
    return EngineArgs(
        model=ns.model,
        load_format="dummy",
        dtype="bfloat16",
        max_model_len=1024,
        max_num_seqs=64,
        gpu_memory_utilization=0.85,
    )


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    parser.add_argument("--shape", help="a benchmark shape (e.g. llama-8b) instead of --model")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--out", help=OUT_HELP)
    ns = parser.parse_args()
    command = "python bench/grammar_overhead.py " + " ".join(
        f"--{k} {v}" for k, v in vars(ns).items() if v and not (k == "model" and ns.shape)
    )
    args = engine_args(ns)
    rows = []
    async with await AsyncEngine.start(args) as engine:
        await tpot(engine, 1, 8, True)  # compile the grammar and warm up
        for batch in (1, 64):
            for constrained in (False, True):
                rows.append(await tpot(engine, batch, ns.tokens, constrained))
    result = {
        "command": command,
        "device": device_name(),
        "machine": platform.processor() or platform.machine(),
        "date": time.strftime("%Y-%m-%d"),
        "commit": git_commit(),
        "schema": SCHEMA,
        "rows": rows,
        "mask_fill_us_per_token": mask_fill_us(Path(ns.model)),
    }
    out = Path(ns.out) if ns.out else default_out_path("grammar-overhead")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print("| batch | unconstrained TPOT ms | constrained TPOT ms | overhead ms/token |")
    print("| --- | --- | --- | --- |")
    for batch in (1, 64):
        plain, cons = (r for r in rows if r["batch"] == batch)
        print(
            f"| {batch} | {plain['tpot_ms']:.2f} | {cons['tpot_ms']:.2f} | "
            f"{cons['tpot_ms'] - plain['tpot_ms']:.2f} |"
        )
    print(f"xgrammar mask fill: {result['mask_fill_us_per_token']:.1f} us/token; wrote {out}")


if __name__ == "__main__":
    asyncio.run(main())
