"""A tensor-parallel rank other than 0: ``python -m services.runtime.parallel.worker SPEC_JSON``.

It loads its shard and its KV pool, joins the groups, then runs every step rank 0 broadcasts
until a stop header, rank 0's death (its sockets close, or this process finds itself
orphaned) or an error; any of those ends the process, which rank 0's watcher reports.
"""

from __future__ import annotations

import os
import signal
import sys

import structlog
import torch

from services.common.logging import configure_logging
from services.common.parent_watch import end_with_parent
from services.runtime.kv_cache import KVCache
from services.runtime.model.attention.registry import get_attention_backend
from services.runtime.model.config import ModelConfig, parse_dtype
from services.runtime.parallel.collectives import CAPTURE, STEP_FUSED, STEP_GRAPHS, RankGroups
from services.runtime.parallel.leader import open_store
from services.runtime.parallel.pair_auth import SECRET_BYTES
from services.runtime.parallel.rank import KV_DTYPES, RankSpec, agree_on_fused_step, blocks_for_budget, load_shard
from services.runtime.parallel.shard import plan_shards
from services.runtime.parallel.vocab_head import VocabParallelHead

_log = structlog.get_logger("tokenmill.parallel")


def run(spec: RankSpec, secret: bytes) -> None:
    """``secret``: the launch's, which every connection of the group proves (pair_auth.py)."""
    torch.set_num_threads(spec.threads)
    device = torch.device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL binds a rank's communicator to the current device
    config = ModelConfig.from_model_dir(spec.model)
    backend = get_attention_backend(spec.attention_backend, device)
    model, hooks, plan = load_shard(spec.model, config, backend, device, parse_dtype(spec.dtype), spec.world,
                                    spec.rank, vocab_parallel=spec.lm_head == "vocab", experts=spec.experts)
    kv_dtype = KV_DTYPES[spec.kv_dtype]
    blocks = spec.num_blocks or blocks_for_budget(model.config, spec.block_size, kv_dtype, device,
                                                  spec.kv_cache_bytes, spec.gpu_memory_utilization)
    store = open_store(spec.store_path, spec.world)
    store.set(f"loaded/{spec.rank}", "1")
    groups = RankGroups.join(store, spec.rank, spec.world, device, spec.all_reduce, secret=secret)
    hooks.groups = groups
    blocks = groups.min_int(blocks)
    scratch = 1 if spec.graphs_max_batch_size else 0  # the decode graphs' padding rows write there
    kv_cache = KVCache.allocate(model.config, blocks + scratch, spec.block_size, kv_dtype, device)
    groups.gather_ints(kv_cache.nbytes)
    fused = None
    if spec.fused:
        reason = agree_on_fused_step(model, kv_cache, groups)
        if reason is None:
            from services.runtime.model.fused_decode import FusedDecode

            fused = FusedDecode(model, kv_cache.layers, reducer=groups.shm)
        else:
            _log.info("tensor_parallel_rank_fused_step", rank=spec.rank, path="eager", reason=reason)
    graphs = None
    if spec.graphs_max_batch_size:
        from services.runtime.model.decode_graphs import DecodeGraphs

        graphs = DecodeGraphs(model, kv_cache.layers, block_size=spec.block_size, max_model_len=spec.max_model_len,
                              max_batch_size=spec.graphs_max_batch_size, scratch_block=blocks, device=device,
                              capture=device.type == "cuda")
    head = None
    if spec.lm_head == "vocab":
        local = fused.logits if fused is not None and fused.computes_logits else model.compute_logits
        head = VocabParallelHead(groups, local, [p.vocab for p in plan_shards(config, spec.world)])
    _log.info("tensor_parallel_rank_ready", rank=spec.rank, world=spec.world, heads=[plan.heads.start, plan.heads.stop],
              kv_heads=[plan.kv_heads.start, plan.kv_heads.stop], ffn=[plan.ffn.start, plan.ffn.stop],
              num_blocks=blocks, kv_cache_bytes=kv_cache.nbytes, device=str(device))
    with torch.inference_mode():
        while (step := groups.receive_step(spec.block_size, device)) is not None:
            if step.kind == CAPTURE:
                graphs.capture()
                continue
            if step.kind == STEP_GRAPHS:
                hidden = graphs.run(step.decode_rows)
            else:
                forward = fused if step.kind == STEP_FUSED else model
                hidden = forward(step.input_ids, step.positions, kv_cache.layers, step.meta)
            if head is not None and step.logit_rows.numel():
                head.contribute(hidden[step.logit_rows])
    _log.info("tensor_parallel_rank_stopped", rank=spec.rank)


def main(argv: list[str]) -> int:
    spec = RankSpec.from_json(argv[0])
    configure_logging(f"executor-rank{spec.rank}", spec.log_level)
    # Ctrl-C reaches the whole process group; rank 0 decides when this rank stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A SIGKILLed rank 0 may leave this rank waiting in a collective on a socket that stays open.
    end_with_parent(on_orphaned=lambda: os._exit(3))
    secret = sys.stdin.buffer.read(SECRET_BYTES)  # rank 0 writes it there, where no other process reads
    if len(secret) != SECRET_BYTES:
        raise SystemExit(f"tensor-parallel rank {spec.rank}: rank 0 wrote no secret on stdin")
    run(spec, secret)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
