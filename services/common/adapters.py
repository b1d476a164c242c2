"""What the engine says of a LoRA adapter an executor holds (torch-free: the scheduler and the
gateway read it; services/runtime/lora/ loads the weights)."""

from __future__ import annotations

from dataclasses import dataclass

MAX_ADAPTER_NAME_CHARS = 128
"""The longest adapter name (GenerateRequest.adapter, --lora NAME=PATH)."""


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    name: str
    """What requests name it by (GenerateRequest.adapter; the gateway's OpenAI ``model``)."""
    path: str
    """Its directory on the executor (adapter_config.json, adapter_model.safetensors)."""
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    fingerprint: str
    """A hash of its files: its identity in the prefix cache, so a name loaded again with
    other weights never reuses the blocks the old weights computed."""
