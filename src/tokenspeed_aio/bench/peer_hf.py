"""The peer: HF transformers' continuous batching (``model.generate_batch``) on the same
checkpoint, prompts and lengths, in the same process after our engine has stopped.

``generate_batch`` takes one prompt list and one ``max_new_tokens``: it runs the
runs whose requests all have the same lengths and arrive at once (fixed-1k,
latency, overhead); timed arrivals and multi-turn conversations have no equivalent and
are reported as skipped. A run's concurrency becomes ``max_requests_per_batch``.
``eos_token_id=-1`` disables EOS, so every reply has exactly the asked length.

Weights: a checkpoint with safetensors is loaded as is (both engines read the same
files, and greedy tokens can be compared); a config-only checkpoint (the 8B shapes,
which our engine runs with dummy weights) is built with transformers' random init
(``from_config``) directly on the device: other numbers, the same math.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenspeed_aio.bench.metrics import percentiles
from tokenspeed_aio.bench.workloads import Run


def has_weights(model_dir: str | Path) -> bool:
    return any(Path(model_dir).glob("*.safetensors"))


def load_model(model_dir: str | Path, dtype: str, device: str, *, random_init: bool):
    """The HF model on ``device`` in ``dtype``: the checkpoint's weights, or random ones."""
    import torch
    import transformers

    torch_dtype = getattr(torch, {"float": "float32", "half": "float16"}.get(dtype, dtype))
    if random_init:
        config = transformers.AutoConfig.from_pretrained(model_dir)
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    else:
        # Loaded on the host, then moved: a device_map would need accelerate.
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype)
        model.to(device)
    return model.eval()


def warm_up(model) -> None:
    """A tiny batch first, so one-time setup is not part of the first measured run."""
    from transformers import GenerationConfig

    generation = GenerationConfig(
        max_new_tokens=4, do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    model.generate_batch(
        inputs=[[1, 2, 3], [4, 5, 6, 7]],
        generation_config=generation,
        continuous_batching_config=batching_config(2, 8, 64),
    )


def skip_reason(run: Run) -> str | None:
    if run.uniform_lengths() is None:
        return "generate_batch takes one max_new_tokens and no arrival times or conversations"
    return None


def batching_config(concurrency: int, seq_len: int, max_batch_tokens: int):
    """HF's continuous-batching knobs matched to ours: ``concurrency`` requests per batch,
    our per-round token budget, and a KV cache sized for the run. Left to itself on CPU,
    HF sizes the cache to 60% of RAM and fills a [batch tokens × cache tokens] attention
    mask buffer to match (seconds per manager, gigabytes of memset)."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    # ``page_size`` was ``block_size`` before transformers 5.18 (the GPU machine has 5.17).
    page = (
        getattr(ContinuousBatchingConfig, "page_size", None) or ContinuousBatchingConfig.block_size
    )
    blocks_per_seq = -(-seq_len // page) + 1  # +1: a sequence may straddle one more page
    return ContinuousBatchingConfig(
        max_requests_per_batch=concurrency,
        max_batch_tokens=max_batch_tokens,
        num_blocks=concurrency * blocks_per_seq,
    )


def run_peer(model, run: Run, max_batch_tokens: int) -> dict[str, Any]:
    """Run the run's prompts through ``generate_batch``; throughput and per-token times
    (``record_timestamps``) as our engine's metrics define them."""
    from transformers import GenerationConfig

    input_len, output_len = run.uniform_lengths()
    prompts = [s.turns[0].new_ids for s in run.conversations]
    generation = GenerationConfig(
        max_new_tokens=output_len, do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    batching = batching_config(run.concurrency, input_len + output_len, max_batch_tokens)
    results = model.generate_batch(
        inputs=prompts,
        generation_config=generation,
        continuous_batching_config=batching,
        record_timestamps=True,
    )
    outputs = list(results.values())
    # From the first request created to the last token, as for our engine: the
    # manager's startup and warmup (CUDA graph capture) are not part of the run.
    ends = [o.timestamps[-1] for o in outputs if o.timestamps]
    duration = max(ends) - min(o.created_time for o in outputs)
    failed = [o for o in outputs if o.error is not None]
    output_tokens = sum(len(o.generated_tokens) for o in outputs)
    prompt_tokens = sum(len(p) for p in prompts)
    ttft, tpot = [], []
    for o in outputs:
        ts = o.timestamps or []
        if ts:
            ttft.append(ts[0] - o.created_time)
        if len(ts) > 1:
            tpot.append((ts[-1] - ts[0]) / (len(ts) - 1))
    return {
        "engine": "transformers generate_batch",
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "num_requests": len(prompts),
        "completed": len(outputs) - len(failed),
        "failed": len(prompts) - len(outputs) + len(failed),
        "duration_s": duration,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / duration,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / duration,
        # generate_batch queues every prompt at once: where a run has more requests than
        # its concurrency, the peer's TTFT includes the wait for a slot (ours does not).
        "ttft_ms": percentiles(ttft, 1e3),
        "tpot_ms": percentiles(tpot, 1e3),
        "output_ids": [o.generated_tokens for o in outputs],
    }


def token_agreement(ours: list[list[int]], peer: list[list[int]]) -> dict[str, Any]:
    """How far two engines' greedy outputs agree: requests identical end to end, and the
    mean fraction of each reply before the first differing token."""
    prefix = []
    for a, b in zip(ours, peer):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix.append(n / max(len(a), len(b), 1))
    return {
        "compared": len(prefix),
        "identical_requests": sum(a == b for a, b in zip(ours, peer)),
        "mean_matching_prefix": sum(prefix) / len(prefix) if prefix else None,
    }
