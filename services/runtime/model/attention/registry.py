"""Choosing an attention backend by name.

``auto`` is triton on CUDA; on a CPU it is ``cpu`` (the torch backend with the C++ paged
decode kernel) when that kernel builds here, else ``torch``, with a warning that says why.
"""

from __future__ import annotations

import functools

import structlog
import torch

from services.runtime.model.attention.base import AttentionBackend
from services.runtime.model.attention.names import BACKEND_NAMES

log = structlog.get_logger(__name__)


@functools.cache
def _cpu_kernels_reason() -> str | None:
    """None when the C++ CPU kernels load; otherwise why not."""
    from services.runtime.kernels import cpu as cpu_kernels

    try:
        cpu_kernels.load()
    except cpu_kernels.CpuKernelsUnavailable as exc:
        return str(exc)
    return None


def resolve_backend_name(name: str, device: torch.device) -> str:
    if name not in BACKEND_NAMES:
        raise ValueError(f"attention backend must be one of {', '.join(BACKEND_NAMES)}; got {name!r}")
    if name == "cpu" and device.type != "cpu":
        raise ValueError(f"attention backend 'cpu' runs on the CPU only; the model is on {device}")
    if name != "auto":
        return name
    if device.type == "cuda":
        return "triton"
    reason = _cpu_kernels_reason()
    if reason is None:
        return "cpu"
    log.warning("attention_backend_fallback", chosen="torch", reason=reason)
    return "torch"


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    resolved = resolve_backend_name(name, device)
    if resolved == "torch":
        from services.runtime.model.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if resolved == "cpu":
        from services.runtime.model.attention.cpu_backend import CpuAttentionBackend

        return CpuAttentionBackend()
    # Imported lazily: triton is heavy to import and only needed when chosen.
    from services.runtime.model.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend()
