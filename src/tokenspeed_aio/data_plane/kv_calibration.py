"""Per-layer, per-KV-head scales of an FP8 KV cache, calibrated at startup.

An FP8 cache stores ``e4m3(k / k_scale[head])`` (and v likewise). With a scale of 1.0, the
default where a checkpoint stores none, a real model's values -- a few hundredths -- sit in
e4m3's subnormal range (below 2**-6) and keep one or two significant bits. Calibration runs
one prefill of a fixed text (``CALIBRATION_TEXT`` through the model's tokenizer; seeded token
ids where the checkpoint has none) through a temporary 16-bit cache, takes each layer's and
head's amax of the k and v values written there, and sets

    scale = max(amax * HEADROOM, MIN_AMAX) / 448

so the calibration's largest value maps to 448 / HEADROOM. It runs before the KV pool and
the CUDA graphs exist; the scales are the attention layers' buffers, which the graphs
capture, so they are updated in place. Each tensor-parallel rank calibrates its own heads;
every rank runs the same forward on the same tokens (the forward's collectives need all of
them).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tokenspeed_aio.data_plane.memory_profile import prefill_forward
from tokenspeed_aio.guards.host_sync import allow_host_sync
from tokenspeed_aio.model.kv_cache import allocate_kv_cache

if TYPE_CHECKING:
    from tokenspeed_aio.args import EngineArgs
    from tokenspeed_aio.model.config import ModelConfig

logger = logging.getLogger(__name__)

FP8_MAX = 448.0
# How far above the calibration's amax a later value may go before it saturates. One text
# cannot show every value a head will see: RoPE alone moves a rotated pair's magnitude
# between its two coordinates, so a coordinate may reach sqrt(2) times the largest seen over
# a few hundred positions, and other prompts have their own outliers. The cost is almost
# nothing: e4m3 keeps 3 mantissa bits over its whole normal range (2**-6 .. 448, a ratio of
# 2**14.8), so a value keeps its relative precision unless it is below amax * 4 / 28672
# (1/7168 of the head's largest value: a negligible share of any dot product), and only
# those smaller values move into the subnormals.
HEADROOM = 4.0
# The amax of a head that is zero everywhere (a scale must not be 0).
MIN_AMAX = 1e-6
# At most this many calibration tokens (and never more than max_model_len).
MAX_TOKENS = 512
SEED = 0

CALIBRATION_TEXT = """\
The library opened at nine, and by ten the reading room was full: students with laptops,
a retired engineer working through a book on bridges, two children arguing quietly over a
map of the world. Outside, the rain had stopped, and the street smelled of wet stone and
coffee. The librarian, who had worked there for thirty years, knew most of them by name.
She said that people came for the quiet, but stayed for the questions: why the sky is blue,
how vaccines train the body, what the capital of a country was before the war, and whether
the moon really moves away from the Earth every year (it does, by about four centimetres).

Summary of the meeting, 14 March: the team agreed to ship version 2.3 on Friday, after the
last three bugs are fixed. Revenue grew 12% in the first quarter; costs grew 4%. Questions
about the new pricing should go to the sales lead. Next steps: update the documentation,
write the release notes, and schedule a review for the 28th.

```python
def merge_sorted(a: list[int], b: list[int]) -> list[int]:
    \"\"\"Merge two sorted lists into one sorted list.\"\"\"
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    return out + a[i:] + b[j:]


class Cache:
    def __init__(self, capacity: int = 128) -> None:
        self.capacity = capacity
        self.items: dict[str, bytes] = {}

    def get(self, key: str) -> bytes | None:
        return self.items.get(key)
```

SELECT name, COUNT(*) AS orders FROM customers JOIN orders USING (id) GROUP BY name;

Q: What is 17 times 23? A: 391. Q: List the primary colours. A: Red, yellow and blue.
"""


def calibration_token_ids(tokenizer_path: str | Path | None, vocab_size: int, max_len: int):
    """The calibration sequence: ``CALIBRATION_TEXT`` tokenized (special tokens included, as
    a prompt's are), or, where ``tokenizer_path`` has no ``tokenizer.json``, seeded ids;
    at most ``min(MAX_TOKENS, max_len)`` tokens."""
    n = min(MAX_TOKENS, max_len)
    ids = None
    if tokenizer_path is not None and (Path(tokenizer_path) / "tokenizer.json").is_file():
        from tokenspeed_aio.tokenization.tokenizer import Tokenizer

        ids = Tokenizer(tokenizer_path).encode(CALIBRATION_TEXT)
        ids = [i for i in ids if i < vocab_size] or None  # a tokenizer larger than the model
    if ids is None:
        gen = torch.Generator().manual_seed(SEED)
        ids = torch.randint(0, vocab_size, (n,), generator=gen).tolist()
    return ids[:n]


def scales_of_amax(amax: torch.Tensor) -> torch.Tensor:
    """Scales [..., Hkv] fp32 of per-head amaxes."""
    return torch.clamp(amax.float() * HEADROOM, min=MIN_AMAX) / FP8_MAX


@torch.inference_mode()
def calibrate_kv_scales(
    model: torch.nn.Module,
    backend,
    token_ids: list[int],
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,  # the activations': the temporary cache's
    device: torch.device,
    page_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sets every attention layer's ``k_scale``/``v_scale`` (``model.kv_scales()``) in place
    from one prefill of ``token_ids``; returns the k and v scales [num_layers, Hkv]."""
    n = len(token_ids)
    blocks = -(-n // page_size)
    with allow_host_sync():
        k_caches, v_caches = allocate_kv_cache(
            num_layers, blocks + 1, page_size, num_kv_heads, head_dim, dtype, device
        )
        input_ids = torch.tensor(token_ids, dtype=torch.int64, device=device)
        prefill_forward(model, backend, input_ids, k_caches, v_caches, page_size=page_size)

        def amax(caches) -> torch.Tensor:  # [num_layers, Hkv] over the written slots
            written = [c.flatten(0, 1)[page_size : page_size + n] for c in caches]
            return torch.stack([w.float().abs().amax(dim=(0, 2)) for w in written])

        k_scales, v_scales = scales_of_amax(amax(k_caches)), scales_of_amax(amax(v_caches))
        for (k_scale, v_scale), k, v in zip(model.kv_scales(), k_scales, v_scales, strict=True):
            k_scale.copy_(k)
            v_scale.copy_(v)
        del k_caches, v_caches
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return k_scales, v_scales


def set_unit_kv_scales(model: torch.nn.Module) -> None:
    """Every layer's k/v scale 1.0 (``--kv-cache-scales unit``)."""
    with torch.inference_mode():
        for k_scale, v_scale in model.kv_scales():
            k_scale.fill_(1.0)
            v_scale.fill_(1.0)


def log_scales(k_scales: torch.Tensor, v_scales: torch.Tensor, num_tokens: int) -> None:
    logger.info(
        "FP8 KV cache scales calibrated over %d tokens (%d layers x %d heads, headroom %gx): "
        "k %.3g .. %.3g, v %.3g .. %.3g",
        num_tokens,
        k_scales.shape[0],
        k_scales.shape[1],
        HEADROOM,
        float(k_scales.min()),
        float(k_scales.max()),
        float(v_scales.min()),
        float(v_scales.max()),
    )


def set_kv_scales(
    args: EngineArgs,
    config: ModelConfig,
    model: torch.nn.Module,
    backend,
    kv_heads: int,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
) -> None:
    """An FP8 cache's scales per ``--kv-cache-scales``: the checkpoint's (auto, where it
    stores them), 1.0 (unit), else calibrated by one 16-bit prefill (above)."""
    stored = config.quantization is not None and config.quantization.kv_scales
    mode = args.kv_cache_scales
    if mode == "unit":
        set_unit_kv_scales(model)
        return
    if mode == "auto" and stored:
        return
    ids = calibration_token_ids(args.tokenizer or args.model, config.vocab_size, max_model_len)
    k_scales, v_scales = calibrate_kv_scales(
        model, backend, ids, num_layers=config.num_hidden_layers, num_kv_heads=kv_heads,
        head_dim=config.head_dim, dtype=dtype, device=device, page_size=args.page_size,
    )  # fmt: skip
    log_scales(k_scales, v_scales, len(ids))
