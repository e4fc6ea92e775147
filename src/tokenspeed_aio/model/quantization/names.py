"""Checkpoint tensor names of the FP8 formats, mapped onto this model's names.

- ``*.weight_scale_inv`` (the ``fp8`` format's block scales) is ``*.weight_scale``;
- KV-cache scales: ``self_attn.k_scale`` / ``v_scale`` (compressed-tensors'
  ``kv_cache_scheme``) and ``self_attn.k_proj.output_scale`` / ``v_proj.output_scale``
  (AutoFP8's) are the attention layer's ``self_attn.attn.k_scale`` / ``v_scale``;
- the scales of q and of the attention probabilities some checkpoints add
  (``self_attn.q_scale``, ``q_proj.output_scale``, ``self_attn.prob_scale``) are not used:
  None (skipped), as the engine keeps q and the probabilities in 16 bits.
"""

from __future__ import annotations

import re

_KV_SCALE = re.compile(r"(.*\.self_attn)\.(?:([kv])_scale|([kv])_proj\.output_scale)$")
_UNUSED = re.compile(r".*\.self_attn\.(?:q_scale|prob_scale|q_proj\.output_scale)$")


def canonical_name(name: str) -> str | None:
    """The model's name for checkpoint tensor ``name``; None for one it does not use."""
    if name.endswith(".weight_scale_inv"):
        return name.removesuffix("_inv")
    if _UNUSED.match(name):
        return None
    kv = _KV_SCALE.match(name)
    if kv:
        return f"{kv.group(1)}.attn.{kv.group(2) or kv.group(3)}_scale"
    return name
