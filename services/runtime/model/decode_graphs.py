"""Decode steps replayed from CUDA graphs: one launch per step instead of hundreds.

A decode step of a small model is launch-bound: ~150 kernels, each a few microseconds of work
and more of Python dispatch and launch latency. A CUDA graph records the whole forward once per
batch-size bucket and replays it with one call. What a replay needs:

* **Buckets.** Graphs have fixed shapes, so a batch of B sequences runs in the graph of the
  smallest bucket >= B (``graph_batch_sizes``: 1, 2, 4, 8, then steps of 8 up to the cap).
* **Persistent inputs.** The graph reads its inputs from fixed addresses: token ids, positions,
  slot mapping, block tables and context lengths live in buffers allocated once and updated in
  place each step (one host-to-device copy per buffer).
* **Harmless padding.** Rows B..bucket-1 must neither corrupt nor read a real sequence's KV:
  each is a one-token sequence at position 0 whose block table is a scratch block that the
  executor reserves at the end of the pool and never reports to the scheduler.
* **Fixed host metadata.** Whatever the attention backend decides on the host (the split-K
  partition count) is decided at capture from the longest context the executor serves; the
  decode kernel skips partitions past each sequence's context, so one graph fits every length.

Prefill and mixed steps run eagerly: their shapes vary with every prompt.

On a CPU there is nothing to capture, but the same buffers, buckets and padding can run eagerly
(``capture=False``), so CPU tests cover everything here except the capture call itself.

The executor's flags, its choice of this path and its warm-up are in
services/executor/forward_paths/decode_graphs.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from services.runtime.model.attention.base import AttentionMetadata
from services.runtime.model.llama import KVCaches, LlamaForCausalLM

def graph_batch_sizes(max_batch_size: int) -> list[int]:
    """The buckets: 1, 2, 4, 8, then every multiple of 8 up to ``max_batch_size`` (itself included)."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    sizes = [b for b in (1, 2, 4) if b < max_batch_size] + list(range(8, max_batch_size + 1, 8))
    if not sizes or sizes[-1] != max_batch_size:
        sizes.append(max_batch_size)
    return sizes


def bucket_for(batch_size: int, sizes: list[int]) -> int | None:
    """The smallest bucket holding ``batch_size`` rows; None when it exceeds the largest."""
    for size in sizes:
        if size >= batch_size:
            return size
    return None


@dataclass(frozen=True, slots=True)
class CaptureReport:
    seconds: float
    batch_sizes: tuple[int, ...]
    captured: bool
    """False when the buckets run eagerly (no CUDA device)."""


class DecodeGraphs:
    """Runs decode-only steps through bucket-padded persistent buffers, replayed from CUDA graphs.

    ``scratch_block`` is a KV block no sequence ever owns: padding rows write and read only it.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: KVCaches,
        *,
        block_size: int,
        max_model_len: int,
        max_batch_size: int,
        scratch_block: int,
        device: torch.device,
        capture: bool,
    ):
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.batch_sizes = graph_batch_sizes(max_batch_size)
        self.max_batch_size = self.batch_sizes[-1]
        self.scratch_block = scratch_block
        self.device = device
        self.capture_enabled = capture
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        n, width = self.max_batch_size, self.max_blocks_per_seq
        # The persistent inputs: every graph reads these addresses.
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), scratch_block * block_size, dtype=torch.int64, device=device)
        self.context_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.full((n, width), scratch_block, dtype=torch.int32, device=device)
        # Every row is one query token, so the query starts are fixed: 0, 1, ..., n.
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None

    # ------------------------------------------------------------------ selection
    def takes(self, num_seqs: int, query_lens: list[int], max_blocks: int) -> bool:
        """Whether a step of ``num_seqs`` rows with these query lengths runs here."""
        return (
            0 < num_seqs <= self.max_batch_size
            and max_blocks <= self.max_blocks_per_seq
            and all(n == 1 for n in query_lens)
        )

    @property
    def captured_sizes(self) -> list[int]:
        return sorted(self._graphs)

    # ------------------------------------------------------------------ inputs
    def _metadata(self, bucket: int, context_lens_cpu: list[int]) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket],
            block_tables=self.block_tables[:bucket],
            context_lens=self.context_lens[:bucket],
            query_start_loc=self.query_start_loc[: bucket + 1],
            query_lens_cpu=[1] * bucket,
            context_lens_cpu=context_lens_cpu,
            max_query_len=1,
            max_context_len=max(context_lens_cpu),
            block_size=self.block_size,
        )

    def load(self, rows: list[tuple[int, int, list[int]]]) -> int:
        """Write one decode step into the buffers; returns its bucket.

        ``rows``: (token id, position, block ids) per sequence, the position being the token's
        index in its sequence (its KV goes to that slot; the context after the write is position + 1).
        """
        bucket = bucket_for(len(rows), self.batch_sizes)
        if bucket is None:
            raise ValueError(f"{len(rows)} rows exceed the largest decode graph ({self.max_batch_size})")
        bs, scratch = self.block_size, self.scratch_block
        pad = bucket - len(rows)
        width = max(len(blocks) for _, _, blocks in rows)
        ids = [token for token, _, _ in rows] + [0] * pad
        positions = [pos for _, pos, _ in rows] + [0] * pad
        slots = [blocks[pos // bs] * bs + pos % bs for _, pos, blocks in rows] + [scratch * bs] * pad
        context = [pos + 1 for _, pos, _ in rows] + [1] * pad
        table: list[int] = []
        for _, _, blocks in rows:
            table += blocks
            table += [scratch] * (width - len(blocks))
        table += [scratch] * (width * pad)
        longs = torch.tensor(ids + positions + slots, dtype=torch.int64)
        self.input_ids[:bucket].copy_(longs[:bucket], non_blocking=True)
        self.positions[:bucket].copy_(longs[bucket : 2 * bucket], non_blocking=True)
        self.slot_mapping[:bucket].copy_(longs[2 * bucket :], non_blocking=True)
        self.context_lens[:bucket].copy_(torch.tensor(context, dtype=torch.int32), non_blocking=True)
        # Columns past ``width`` keep stale ids: no row's context reaches them.
        self.block_tables[:bucket, :width].copy_(
            torch.tensor(table, dtype=torch.int32).view(bucket, width), non_blocking=True
        )
        self._context_cpu = context
        return bucket

    # ------------------------------------------------------------------ running
    def run(self, rows: list[tuple[int, int, list[int]]]) -> torch.Tensor:
        """The final hidden states [len(rows), D] of one decode step (a view valid until the next run)."""
        bucket = self.load(rows)
        graph = self._graphs.get(bucket)
        if graph is not None:
            graph[0].replay()
            return graph[1][: len(rows)]
        meta = self._metadata(bucket, self._context_cpu)
        hidden = self.model(self.input_ids[:bucket], self.positions[:bucket], self.kv_caches, meta)
        return hidden[: len(rows)]

    def capture(self) -> CaptureReport:
        """Record one graph per bucket, largest first (later ones reuse its memory pool)."""
        start = time.perf_counter()
        if not self.capture_enabled:
            return CaptureReport(0.0, tuple(self.batch_sizes), captured=False)
        for bucket in reversed(self.batch_sizes):
            self.load([(0, 0, [self.scratch_block])] * bucket)  # all rows padding-like: scratch block only
            # Fixed at capture: the partition count follows the longest context ever served.
            meta = self._metadata(bucket, [self.max_model_len] * bucket)
            args = (self.input_ids[:bucket], self.positions[:bucket], self.kv_caches, meta)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # first launches compile and allocate outside the capture
                self.model(*args)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = self.model(*args)
            self._pool = graph.pool()
            self._graphs[bucket] = (graph, out)
        torch.cuda.synchronize(self.device)
        return CaptureReport(time.perf_counter() - start, tuple(self.batch_sizes), captured=True)
