"""A small model's whole CPU step in one C++ call, ``--cpu-decode auto`` (the default)
(services/runtime/model/fused_decode.py).

Wanted on a CPU unless ``--cpu-decode eager``; set up where the model qualifies
(``fused_decode.why_not``: fp32 weights none of which are prepacked, or quantized weights on
a CPU kernel's path), else the executor logs why and runs eagerly, or with ``--cpu-decode
fused`` refuses to start. It takes decode steps, and steps of up to ``--cpu-fused-max-tokens``
new tokens (8 times as many for a quantized model), with or without LoRA adapters; its LM head (where the model's is a plain
fp32 matrix or a CPU kernel's quantized one) serves every step, so a row's logits never depend
on its batch.

Under tensor parallelism every rank builds one over its shard once all agree that each can
(services/executor/tensor_parallel.py); it sums through the group's shared-memory all-reduce
(``PathRuntime.all_reduce``), so a gloo group runs eagerly.

A new kind of model for this path is a change to ``why_not`` and ``FusedDecode``; a new flag
is a field of FusedDecodeSettings that ``set_up`` hands to ``FusedDecode``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog

from services.executor.forward_paths.base import ForwardPath, PathRuntime, Placement, setting

if TYPE_CHECKING:
    import torch

    from services.executor.forward_paths.step import ForwardStep
    from services.runtime.model.fused_decode import FusedDecode
    from services.runtime.model.llama import KVCaches

_log = structlog.get_logger("tokenmill.model")

CPU_DECODE_MODES = ("auto", "fused", "eager")


@dataclass(frozen=True, slots=True)
class FusedDecodeSettings:
    cpu_decode: str = setting("auto")
    """CPU decode steps: auto (small fp32 and quantized models in one C++ call, else eager), fused or eager.

    auto: the fused step where the model qualifies, else eager; fused: the same, and an
    error when the model does not qualify; eager: the PyTorch forward."""
    cpu_fused_max_tokens: int = setting(64)
    """CPU, fused step in use: steps with prompt or draft tokens run fused up to this many new tokens (0 =
    decode-only steps alone).

    Each token a row reading the paged cache up to its own position. 64: past it the largest
    fp32 model the fused step takes runs faster eagerly (docs/benchmarks.md); stories260K runs
    2-9x faster fused up to there. A quantized model runs fused up to 8 times as many
    (services/runtime/model/fused_decode.py, QUANTIZED_STEP_FACTOR)."""

    def validate(self) -> None:
        if self.cpu_decode not in CPU_DECODE_MODES:
            raise ValueError(f"cpu_decode must be one of {', '.join(CPU_DECODE_MODES)}, got {self.cpu_decode!r}")
        if self.cpu_fused_max_tokens < 0:
            raise ValueError(f"cpu_fused_max_tokens must be >= 0 (0 = decode-only steps alone), "
                             f"got {self.cpu_fused_max_tokens}")


class FusedDecodePath(ForwardPath):
    name = "fused_decode"
    settings = FusedDecodeSettings
    applies_lora = True

    def __init__(self, fused: FusedDecode, kv_caches: KVCaches) -> None:
        self.fused = fused
        self.kv_caches = kv_caches
        self.lm_head = fused.logits if fused.computes_logits else None

    @classmethod
    def wanted(cls, settings: FusedDecodeSettings, placement: Placement) -> bool:
        return placement.device_type == "cpu" and settings.cpu_decode != "eager"

    @classmethod
    def set_up(cls, settings: FusedDecodeSettings, runtime: PathRuntime) -> FusedDecodePath | None:
        from services.runtime.model.fused_decode import FusedDecode, why_not

        reason = why_not(runtime.model, runtime.kv_caches)
        if reason is not None:
            if settings.cpu_decode == "fused":
                raise ValueError(f"cpu_decode 'fused': the fused CPU decode step cannot run this model: {reason}")
            _log.info("cpu decode path", path="eager", reason=reason)
            return None
        _log.info("cpu decode path", path="fused")
        fused = FusedDecode(runtime.model, runtime.kv_caches, max_step_tokens=settings.cpu_fused_max_tokens,
                            reducer=runtime.all_reduce)
        return cls(fused, runtime.kv_caches)

    def takes(self, step: ForwardStep) -> bool:
        return self.fused.takes(step.packed.meta)

    def forward(self, step: ForwardStep) -> torch.Tensor:
        packed = step.packed
        return self.fused(packed.input_ids, packed.positions, self.kv_caches, packed.meta, step.lora)
