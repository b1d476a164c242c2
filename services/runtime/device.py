"""Where and in what precision a model runs: the executor's and the drafter's one rule."""

from __future__ import annotations

import torch

from services.runtime.model.config import ModelConfig, parse_dtype


def resolve_device(name: str) -> torch.device:
    """cpu, cuda, cuda:N, or auto (cuda when available); a CUDA device without CUDA is refused."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return device


def resolve_dtype(name: str, config: ModelConfig, device: torch.device) -> torch.dtype:
    """The named dtype, or for auto the checkpoint's (bf16 for an fp32 one) off the CPU, fp32 on it."""
    if name != "auto":
        return parse_dtype(name)
    # Half precision on a CPU is slow and loses accuracy for no memory benefit worth having here.
    if device.type == "cpu":
        return torch.float32
    return config.dtype if config.dtype != torch.float32 else torch.bfloat16
