"""Decode-only steps through a torch.compile'd forward on a CPU, behind ``--compile``
(services/runtime/model/compiled_decode.py).

The compiled graph calls the C++ decode ops over a plain KV pool with the cpu attention
backend, and inductor cannot lower oneDNN's prepacked linear, so the model loads with plain
weights. The warm-up's decode steps compile its shape classes; it has no warm-up of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.executor.forward_paths.base import ForwardPath, PathRuntime, Placement, setting

if TYPE_CHECKING:
    import torch

    from services.executor.forward_paths.step import ForwardStep
    from services.runtime.model.compiled_decode import CompiledDecode
    from services.runtime.model.llama import KVCaches


@dataclass(frozen=True, slots=True)
class CompiledDecodeSettings:
    compile: bool = setting(False)
    """CPU: compile the decode step with torch.compile (slower start-up).

    Start-up pays the compilation; outputs may differ from the eager path's in the last bits
    of the logits."""


class CompiledDecodePath(ForwardPath):
    name = "compiled_decode"
    settings = CompiledDecodeSettings
    plain_weights = True

    def __init__(self, compiled: CompiledDecode, kv_caches: KVCaches) -> None:
        self.compiled = compiled
        self.kv_caches = kv_caches

    @classmethod
    def wanted(cls, settings: CompiledDecodeSettings, placement: Placement) -> bool:
        return settings.compile

    @classmethod
    def set_up(cls, settings: CompiledDecodeSettings, runtime: PathRuntime) -> CompiledDecodePath | None:
        if getattr(runtime.model, "kv_group_of", None) is not None:
            # Its step reads one block table; a model with window and full-attention KV groups
            # has one per group (services/common/kv_groups.py): the eager step runs it.
            return None
        # Imported only when asked for: it brings in torch.compile's machinery.
        from services.runtime.model.compiled_decode import CompiledDecode

        return cls(CompiledDecode(runtime.model), runtime.kv_caches)

    def takes(self, step: ForwardStep) -> bool:
        return self.compiled.takes(step.packed.meta)

    def forward(self, step: ForwardStep) -> torch.Tensor:
        packed = step.packed
        return self.compiled(packed.input_ids, packed.positions, self.kv_caches, packed.meta)
