"""Attention backends by name. Factories import their implementation lazily, so an optional
dependency (triton, flashinfer) is imported only when that backend is chosen.

A new backend adds one ``register_backend`` call at the bottom. ``create_backend``'s keyword
arguments are construction hints every backend is offered (``max_model_len``, ...); a
factory takes the ones its backend needs and ignores the rest.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokenspeed_aio.model.attention.base import AttentionBackend

_FACTORIES: dict[str, Callable[..., AttentionBackend]] = {}


def register_backend(name: str, factory: Callable[..., AttentionBackend]) -> None:
    _FACTORIES[name] = factory


def available_backends() -> tuple[str, ...]:
    return tuple(_FACTORIES)


def create_backend(name: str, **kwargs: Any) -> AttentionBackend:
    if name not in _FACTORIES:
        raise ValueError(
            f"unknown attention backend {name!r} (available: {', '.join(available_backends())})"
        )
    try:
        return _FACTORIES[name](**kwargs)
    except ImportError as e:
        raise ValueError(
            f"attention backend {name!r} is unavailable: its dependency failed to import ({e})"
        ) from e


def _torch_backend(**_hints: Any) -> AttentionBackend:
    from tokenspeed_aio.model.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend()


def _triton_backend(*, max_model_len: int = 8192, **_hints: Any) -> AttentionBackend:
    from tokenspeed_aio.model.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend(max_model_len=max_model_len)


def _flashinfer_backend(
    *,
    page_size: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: Any,
    device: Any,
    max_model_len: int = 8192,
    **_hints: Any,
) -> AttentionBackend:
    from tokenspeed_aio.model.attention.flashinfer_backend import FlashInferAttentionBackend

    return FlashInferAttentionBackend(
        page_size=page_size,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        device=device,
        max_model_len=max_model_len,
    )


register_backend("torch", _torch_backend)
register_backend("triton", _triton_backend)
register_backend("flashinfer", _flashinfer_backend)
