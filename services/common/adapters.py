"""What the engine says of a LoRA adapter an executor holds (torch-free: the scheduler and the
gateway read it; services/runtime/lora/ loads the weights)."""

from __future__ import annotations

import re
from dataclasses import dataclass

MAX_ADAPTER_NAME_CHARS = 128
"""The longest adapter name (GenerateRequest.adapter, --lora NAME=PATH)."""
MAX_ADAPTER_PATH_CHARS = 4096
"""The longest adapter directory a load may name (PATH_MAX on Linux)."""
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$")


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot name an adapter (None if it can): the rule of every place that takes
    one (--lora, the executor's and the scheduler's LoadAdapter, the gateway's admin endpoint)."""
    if not name or len(name) > MAX_ADAPTER_NAME_CHARS or not _NAME.match(name):
        return (f"adapter name {name[:MAX_ADAPTER_NAME_CHARS]!r} must be 1-{MAX_ADAPTER_NAME_CHARS} "
                f"characters of letters, digits and . _ : / -, starting with a letter or digit")
    return None


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
