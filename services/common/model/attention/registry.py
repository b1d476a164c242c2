"""Choosing an attention backend by name: ``auto`` is triton on CUDA and torch elsewhere."""

from __future__ import annotations

import torch

from services.common.model.attention.base import AttentionBackend

BACKEND_NAMES = ("auto", "torch", "triton")


def resolve_backend_name(name: str, device: torch.device) -> str:
    if name not in BACKEND_NAMES:
        raise ValueError(f"attention backend must be one of {', '.join(BACKEND_NAMES)}; got {name!r}")
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return name


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    resolved = resolve_backend_name(name, device)
    if resolved == "torch":
        from services.common.model.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    # Imported lazily: triton is heavy to import and only needed when chosen.
    from services.common.model.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend()
