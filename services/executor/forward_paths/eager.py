"""The model's own forward (PyTorch and the attention backend's kernels): every step, the
last path in the registry, and the one each other path falls back to."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from services.executor.forward_paths.base import ForwardPath, PathRuntime, Placement

if TYPE_CHECKING:
    import torch

    from services.executor.forward_paths.step import ForwardStep
    from services.runtime.model.llama import KVCaches, LlamaForCausalLM


class EagerPath(ForwardPath):
    name = "eager"
    applies_lora = True

    def __init__(self, model: LlamaForCausalLM, kv_caches: KVCaches) -> None:
        self.model = model
        self.kv_caches = kv_caches

    @classmethod
    def wanted(cls, settings: Any, placement: Placement) -> bool:
        return True

    @classmethod
    def set_up(cls, settings: Any, runtime: PathRuntime) -> EagerPath:
        return cls(runtime.model, runtime.kv_caches)

    def takes(self, step: ForwardStep) -> bool:
        return True

    def forward(self, step: ForwardStep) -> torch.Tensor:
        packed = step.packed
        return self.model(packed.input_ids, packed.positions, self.kv_caches, packed.meta, step.lora)
