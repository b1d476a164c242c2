"""The decode-only forward on a CPU, compiled with torch.compile (inductor), behind ``--compile``.

A decode step of a small model is hundreds of tiny ops, each dispatched from Python; inductor
fuses the pointwise ones (norms, rotary, residual adds, SiLU) into a few generated C++ loops
and leaves the matrix products to the same libraries. Only decode-only steps (one new token
per sequence) take this path; prompts, chunks and mixed steps run the eager model.

What makes it one graph with no recompiles while serving:
- Attention goes through the C++ ops of services/runtime/kernels/cpu (``write_kv``,
  ``paged_decode``), which the graph calls as opaque ops with fake (shape-only) versions for
  tracing, and it reads only tensors (``DecodeTensors``): the step's Python lists never enter
  the graph, so nothing is specialized on a length.
- ``dynamic=True``: the batch size and block-table width are symbolic. torch specializes the
  sizes 0 and 1, so at most four graphs exist (batch 1 or more, table width 1 or more), all
  compiled by the executor's warm-up before it serves.
- The model's modules are not guarded (``skip_guard_on_all_nn_modules_unsafe``): their weights
  never change while serving, and guarding every parameter cost ~0.4 ms per call.
- The block tables and slots are checked against the pool on the host before the call, as the
  eager backend does once per step; the kernels' own checks stay as a second line.

Outputs are not bitwise those of the eager path (inductor fuses and orders some sums
differently: logits differ by ~1e-6). Inductor cannot lower oneDNN's prepacked linear, so with
this option the model keeps plain weights: a small model's step gets faster (stories260K's
forward 2x at batch 1), a large one's slower (a 100M model's matrices lose the prepacking).
Hence an option, off by default; docs/benchmarks.md ("Lean CPU step") has the measurements.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.fx.experimental._config

from services.runtime.kernels import cpu as cpu_kernels
from services.runtime.model.attention.base import AttentionMetadata
from services.runtime.model.attention.cpu_backend import CpuAttentionBackend
from services.runtime.model.llama import KVCaches, LlamaForCausalLM


class DecodeTensors(NamedTuple):
    """The part of a decode step's AttentionMetadata the compiled graph reads."""

    slot_mapping: torch.Tensor  # [B] int64
    block_tables: torch.Tensor  # [B, max_blocks] int32
    context_lens: torch.Tensor  # [B] int32


class TracedDecodeAttention:
    """Decode attention over tensors only, through the C++ ops (traceable, no host reads)."""

    name = "cpu-decode-traced"

    @staticmethod
    def write_kv(k, v, k_cache, v_cache, meta: DecodeTensors) -> None:
        torch.ops.tokenmill_cpu.write_kv(k.to(k_cache.dtype), v.to(v_cache.dtype), k_cache, v_cache,
                                         meta.slot_mapping)

    @staticmethod
    def attend(q, k_cache, v_cache, meta: DecodeTensors, scale: float, window: int | None = None) -> torch.Tensor:
        # q: [B, H, D] -> [B, H, D]
        q = q.to(k_cache.dtype).contiguous()
        out = torch.empty_like(q)
        torch.ops.tokenmill_cpu.paged_decode(out, q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale,
                                             window or 0)
        return out


@functools.cache
def _register_fake_kernels() -> None:
    """Shape-only versions of the C++ ops, for tracing (once per process)."""
    cpu_kernels.load()

    @torch.library.register_fake("tokenmill_cpu::write_kv")
    def _write_kv(k, v, k_cache, v_cache, slot_mapping):
        return None

    @torch.library.register_fake("tokenmill_cpu::paged_decode")
    def _paged_decode(out, q, k_cache, v_cache, block_tables, context_lens, scale, window=0, softcap=0.0):
        return None


class CompiledDecode:
    """``model``'s forward for decode-only steps, compiled on first use of each shape class."""

    def __init__(self, model: LlamaForCausalLM):
        if model.config.attn_logit_softcapping is not None:
            raise ValueError(f"the compiled decode step's C++ attention does not cap scores, which "
                             f"{model.config.architecture} does (attn_logit_softcapping); run it with compile off")
        if not isinstance(model.backend, CpuAttentionBackend):
            raise ValueError(f"the compiled decode step runs on the cpu attention backend; the model uses "
                             f"{model.backend.name!r}")
        _register_fake_kernels()
        # Without this, sizes and storage offsets that happen to be equal when a graph is traced
        # (the batch size and the table width, the offsets of the step's views into its two
        # uploads) are assumed equal ("duck sizing"), and a later step where they differ
        # recompiles. Process-wide, and the executor compiles nothing else.
        torch.fx.experimental._config.use_duck_shape = False
        self.backend = model.backend
        self._forward = torch.compile(
            functools.partial(model.forward_with, backend=TracedDecodeAttention),
            dynamic=True,
            options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe},
        )

    @staticmethod
    def takes(meta: AttentionMetadata) -> bool:
        """Whether this step runs compiled: one new token per sequence."""
        return meta.is_decode_only

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: KVCaches,
                 meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [B] -> final hidden states [B, D], as ``model(...)`` computes them."""
        self.backend.check_step(meta, kv_caches[0][0])
        tensors = DecodeTensors(meta.slot_mapping, meta.block_tables, meta.context_lens)
        return self._forward(input_ids, positions, kv_caches, tensors)
