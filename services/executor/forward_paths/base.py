"""What a forward path is: a way to run the model over one step, with its own settings.

A path class speaks twice. Before anything loads, as a class: its ``settings`` (a plain leaf
dataclass, with a ``validate`` of its own fields, that ExecutorConfig embeds as
``config.<name>``, so its fields are the executor's flags) and ``wanted`` (whether its settings,
the device and the attention backend ask for it). Once the model and the KV pool exist,
``set_up`` builds an instance (or declines, None, when the model does not suit it), and the
instance answers ``takes(step)`` and ``forward(step)`` for every step, and ``warm_up()`` once
before the executor serves.

A path is handed its own settings and its placement, never the executor's whole config: what
one path's flags imply for another's, or for the device, is checked once in
``ExecutorConfig.validate``. So nothing here imports the config, and the config imports the
settings without a circle.

This module imports no torch: the executor's config (and every command line built from it)
reads the settings without loading a model runtime. Paths import their torch code inside
``set_up``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from services.common.settings import setting  # noqa: F401 (each path declares its settings with it)

if TYPE_CHECKING:
    import torch

    from services.executor.forward_paths.step import ForwardStep
    from services.runtime.model.llama import KVCaches, LlamaForCausalLM


@dataclass(frozen=True, slots=True)
class Placement:
    """Where the model will run, known before it loads."""

    device_type: str
    """"cpu" or "cuda"."""
    attention_backend: str
    """The resolved backend name: torch, triton or cpu."""


@dataclass(frozen=True, slots=True)
class PathRuntime:
    """What a path is set up over: the loaded model and its KV pool."""

    model: LlamaForCausalLM
    kv_caches: KVCaches
    device: torch.device
    block_size: int
    max_model_len: int
    scratch_block: int
    """The first KV block past those the scheduler is told about; a path asking for
    ``scratch_blocks`` owns the blocks from here."""
    all_reduce: Any = None
    """A tensor-parallel rank 0's shared-memory all-reduce (parallel/shared_memory.py), for a
    path that sums between its layers itself (the fused CPU step); None on one rank."""
    capture_with: Any = None
    """Under tensor parallelism, ``capture_with(capture)`` runs rank 0's graph capture while the
    other ranks capture theirs (leader.capture); None on one rank."""


class ForwardPath:
    """One forward path; subclasses override what they need (see the module docstring)."""

    name: ClassVar[str]
    """The path's name, in logs and as the ExecutorConfig attribute that holds its settings."""
    settings: ClassVar[type | None] = None
    """Its settings dataclass, embedded in ExecutorConfig (None: it has no flags)."""
    plain_weights: ClassVar[bool] = False
    """When in use: load the model without weights prepacked for oneDNN."""
    scratch_blocks: ClassVar[int] = 0
    """When in use: KV blocks past the scheduler's pool that the path owns."""
    applies_lora: ClassVar[bool] = False
    """Whether its forward adds the step's LoRA adapters (``step.lora``); a step with adapters
    skips the paths that run the base model's weights alone."""
    lm_head = None
    """Set by an instance whose LM head replaces the model's for every step: a callable
    hidden [N, D] -> fp32 logits [N, V] (None: the model's own)."""

    @classmethod
    def wanted(cls, settings: Any, placement: Placement) -> bool:
        """Whether ``settings`` (an instance of ``cls.settings``; None where it has none) and the
        placement ask for this path."""
        raise NotImplementedError

    @classmethod
    def set_up(cls, settings: Any, runtime: PathRuntime) -> ForwardPath | None:
        """The path over ``runtime``, or None where the model does not suit it (logged)."""
        raise NotImplementedError

    def takes(self, step: ForwardStep) -> bool:
        raise NotImplementedError

    def forward(self, step: ForwardStep) -> torch.Tensor:
        """The model over the step's tokens: final hidden states [T, D]."""
        raise NotImplementedError

    def warm_up(self) -> dict[str, Any]:
        """Run once after the warm-up's steps, before serving; returns fields for its log line."""
        return {}
