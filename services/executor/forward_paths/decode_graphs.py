"""Decode steps replayed from CUDA graphs (services/runtime/model/decode_graphs.py).

In use on CUDA with a capturable attention backend unless ``--enforce-eager``; on a CPU only
with ``--padded-decode-on-cpu``, a testing aid that runs the same persistent buffers, buckets
and padding eagerly. It owns one KV block past the scheduler's pool (padding rows write only
there) and captures its graphs at the end of the warm-up, when every kernel they record is
already compiled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog

from services.executor.forward_paths.base import ForwardPath, PathRuntime, Placement, setting

if TYPE_CHECKING:
    import torch

    from services.executor.forward_paths.step import ForwardStep
    from services.runtime.model.decode_graphs import DecodeGraphs

_log = structlog.get_logger("tokenmill.model")

GRAPH_BACKENDS = ("triton",)
"""Backends whose forward is capturable: no host reads of device data, no host branching on
per-step lengths beyond AttentionMetadata's bucketed fields."""


@dataclass(frozen=True, slots=True)
class DecodeGraphSettings:
    enforce_eager: bool = setting(False)
    """CUDA: run every step eagerly (no CUDA graphs for decode)."""
    cuda_graph_max_batch_size: int = setting(128)
    """CUDA: largest decode batch captured as a graph; larger batches run eagerly.

    Buckets 1, 2, 4, 8, then steps of 8 up to it."""
    padded_decode_on_cpu: bool = setting(False)
    """Testing aid: run CPU decode steps through the CUDA-graph path's padded buffers.

    Eagerly (there is nothing to capture on a CPU), so the path is tested without a GPU."""

    def validate(self) -> None:
        if self.cuda_graph_max_batch_size < 1:
            raise ValueError(f"cuda_graph_max_batch_size must be >= 1, got {self.cuda_graph_max_batch_size}")


class DecodeGraphsPath(ForwardPath):
    name = "decode_graphs"
    settings = DecodeGraphSettings
    scratch_blocks = 1

    def __init__(self, graphs: DecodeGraphs, capture_with=None) -> None:
        self.graphs = graphs
        self.capture_with = capture_with

    @classmethod
    def wanted(cls, settings: DecodeGraphSettings, placement: Placement) -> bool:
        if placement.device_type == "cuda":
            return not settings.enforce_eager and placement.attention_backend in GRAPH_BACKENDS
        return settings.padded_decode_on_cpu

    @classmethod
    def set_up(cls, settings: DecodeGraphSettings, runtime: PathRuntime) -> DecodeGraphsPath | None:
        if getattr(runtime.model, "kv_group_of", None) is not None:
            # Its step reads one block table; a model with window and full-attention KV groups
            # has one per group (services/common/kv_groups.py): the eager step runs it.
            return None
        from services.runtime.model.decode_graphs import DecodeGraphs

        if runtime.device.type == "cuda" and runtime.model.config.moe is not None:
            # The grouped experts size their products from the routing on the host: nothing to capture.
            _log.info("decode graphs", path="eager", reason="the model routes its MLP through experts")
            return None

        return cls(DecodeGraphs(
            runtime.model, runtime.kv_caches, block_size=runtime.block_size, max_model_len=runtime.max_model_len,
            max_batch_size=settings.cuda_graph_max_batch_size, scratch_block=runtime.scratch_block,
            device=runtime.device, capture=runtime.device.type == "cuda",
        ), runtime.capture_with)

    def takes(self, step: ForwardStep) -> bool:
        return self.graphs.takes(len(step.rows), [n for _, n in step.rows], step.max_blocks)

    def forward(self, step: ForwardStep) -> torch.Tensor:
        return self.graphs.run(step.decode_rows())

    def warm_up(self) -> dict[str, Any]:
        # Under tensor parallelism every rank captures at once: their graphs' all-reduces meet.
        capture = self.capture_with(self.graphs.capture) if self.capture_with else self.graphs.capture()
        if not capture.captured:
            return {}
        return {"graph_seconds": round(capture.seconds, 3), "graph_batch_sizes": list(capture.batch_sizes)}
