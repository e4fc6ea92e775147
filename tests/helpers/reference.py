"""HF transformers as the reference: greedy tokens and their logprobs, cached per
(checkpoint, prompt, length) so every engine configuration compares to one run."""

from __future__ import annotations

import functools
from pathlib import Path


@functools.lru_cache(maxsize=8)
def hf_model(path: str):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


@functools.lru_cache(maxsize=512)
def hf_greedy(path: str, prompt_ids: tuple[int, ...], max_tokens: int, **kw):
    """(tokens, logprob of each chosen token) from transformers' generate()."""
    import torch

    model = hf_model(path)
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
            **kw,
        )
    tokens = out.sequences[0, len(prompt_ids) :].tolist()
    logprobs = [
        torch.log_softmax(score[0].float(), -1)[tok].item()
        for score, tok in zip(out.scores, tokens)
    ]
    return tokens, logprobs


def hf_prompt_logprobs(path: str, prompt_ids: list[int]) -> list[float]:
    """Logprob of each prompt token after the first, given its prefix."""
    import torch

    model = hf_model(path)
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids])).logits[0].float()
    lps = torch.log_softmax(logits, -1)
    return [lps[i, prompt_ids[i + 1]].item() for i in range(len(prompt_ids) - 1)]


def checkpoint_path(root: Path, arch: str, **kw) -> Path:
    from helpers.checkpoints import make_checkpoint

    name = arch + "".join(f"_{k}{v}" for k, v in sorted(kw.items()))
    path = root / name
    if not (path / "config.json").exists():
        make_checkpoint(path, arch, **kw)
    return path
