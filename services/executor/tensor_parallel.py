"""Rank 0 of a tensor-parallel executor (``--tensor-parallel-size N``): start the other ranks,
load this rank's shard and KV pool, agree on the pool's size.

The model runner stays the one-device runner: it plans, samples and keeps the sequences; only
its forward goes through the leader (services/runtime/parallel/leader.py), which broadcasts
the step's inputs (and which forward runs them) before rank 0 runs its shard. Every rank runs
the same path over its own shard: eagerly; on a CPU through the fused CPU step, the
shared-memory all-reduce inside its C++ loop (the ranks first agree that each can: shards
differ); or through the decode graphs, each rank's own (same buckets, its own scratch block),
captured by all ranks at once so that every graph records the same all-reduces (on a CPU,
``--padded-decode-on-cpu`` runs the same buffers and buckets eagerly). The compiled step
traces no all-reduce, so where the flags would choose it the steps run eagerly instead, and
the log line says so.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import structlog
import torch

from services.executor.config import ExecutorConfig
from services.executor.forward_paths import ForwardPath
from services.executor.forward_paths.decode_graphs import DecodeGraphsPath
from services.executor.forward_paths.eager import EagerPath
from services.executor.forward_paths.fused_decode import FusedDecodePath
from services.runtime.kv_cache import KVCache
from services.runtime.model.attention.base import AttentionBackend
from services.runtime.model.config import ModelConfig, dtype_name
from services.runtime.model.llama import LlamaForCausalLM
from services.runtime.parallel.collectives import AllReduceHooks
from services.runtime.parallel.leader import TensorParallelLeader
from services.runtime.parallel.rank import RankSpec, agree_on_fused_step, blocks_for_budget, load_shard
from services.runtime.parallel.shard import ShardPlan, plan_shards

_log = structlog.get_logger("tokenmill.executor")


@dataclass(slots=True)
class RankZero:
    leader: TensorParallelLeader
    model: LlamaForCausalLM
    """Rank 0's shard; its config is the shard's (its heads, its MLP columns)."""
    plan: ShardPlan
    hooks: AllReduceHooks
    """Rank 0's all-reduces (their time, when asked: the benchmark's share of a step)."""
    kv_cache: KVCache
    num_blocks: int
    path: type[ForwardPath]
    """The forward path every rank agreed on: the fused CPU step where each rank's can run its
    shard, else eager."""
    vocab: list[range] | None
    """Every rank's rows of a vocab-parallel LM head, by rank (None: rank 0 holds the whole head)."""


def tensor_parallel_path(chosen: type[ForwardPath]) -> type[ForwardPath]:
    """The path the flags chose, where every rank can run it with the sums between its layers
    (eager, the fused CPU step, the decode graphs), else eager."""
    if chosen not in (EagerPath, FusedDecodePath, DecodeGraphsPath):
        _log.info("tensor parallel forward path", path="eager", instead_of=chosen.name,
                  reason=f"the {chosen.name} path has no all-reduce between its layers; tensor-parallel steps "
                         "run eagerly")
        return EagerPath
    return chosen


def rank_devices(device: torch.device, world: int) -> list[torch.device]:
    """One device a rank: the CPU for all, or consecutive CUDA devices from rank 0's."""
    if device.type != "cuda":
        return [device] * world
    first = device.index if device.index is not None else torch.cuda.current_device()
    if first + world > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size {world} from {device} needs CUDA devices {first}..{first + world - 1}; "
                         f"this machine has {torch.cuda.device_count()}")
    return [torch.device("cuda", first + r) for r in range(world)]


def start_rank_zero(config: ExecutorConfig, mc: ModelConfig, device: torch.device, dtype: torch.dtype,
                    backend_name: str, backend: AttentionBackend, kv_dtype: torch.dtype,
                    path: type[ForwardPath], max_model_len: int) -> RankZero:
    """``path``: tensor_parallel_path's choice; the returned one is what every rank can run."""
    world = config.tensor_parallel_size
    graphs_max_batch_size = config.decode_graphs.cuda_graph_max_batch_size if path is DecodeGraphsPath else 0
    plan_shards(mc, world)  # heads that cannot split fail here, before any process starts
    devices = rank_devices(device, world)
    level = logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()

    def spec(rank: int, store_path: str) -> RankSpec:
        return RankSpec(model=str(config.model), dtype=dtype_name(dtype), device=str(devices[rank]),
                        attention_backend=backend_name, block_size=config.block_size,
                        kv_dtype=str(kv_dtype).removeprefix("torch."), num_blocks=config.num_blocks,
                        kv_cache_bytes=config.kv_cache_bytes, gpu_memory_utilization=config.gpu_memory_utilization,
                        rank=rank, world=world, store_path=store_path, threads=torch.get_num_threads(),
                        log_level=level if level in ("debug", "info", "warning", "error") else "info",
                        all_reduce=config.tensor_parallel_all_reduce, fused=path is FusedDecodePath,
                        lm_head=config.tensor_parallel_lm_head, experts=config.tensor_parallel_experts,
                        max_model_len=max_model_len,
                        graphs_max_batch_size=graphs_max_batch_size)

    leader = TensorParallelLeader(spec, world)  # the other ranks load while this one does
    try:
        model, hooks, plan = load_shard(config.model, mc, backend, device, dtype, world, 0,
                                        vocab_parallel=config.tensor_parallel_lm_head == "vocab",
                                        experts=config.tensor_parallel_experts)
        blocks = config.num_blocks or blocks_for_budget(model.config, config.block_size, kv_dtype, device,
                                                        config.kv_cache_bytes, config.gpu_memory_utilization)
        groups = leader.join(device, config.tensor_parallel_all_reduce)
        hooks.groups = groups
        blocks = groups.min_int(blocks)  # one pool size for the scheduler: the smallest any rank holds
        # A path's scratch blocks (the decode graphs' padding rows) lie past the scheduler's pool.
        kv_cache = KVCache.allocate(model.config, blocks + path.scratch_blocks, config.block_size, kv_dtype, device)
        leader.kv_bytes = groups.gather_ints(kv_cache.nbytes)
        if path is FusedDecodePath:
            reason = agree_on_fused_step(model, kv_cache, groups)
            if reason is not None:
                if config.fused_decode.cpu_decode == "fused":
                    raise ValueError(f"cpu_decode 'fused': the fused CPU decode step cannot run this model's "
                                     f"tensor-parallel shards: {reason}")
                _log.info("tensor parallel forward path", path="eager", instead_of=path.name, reason=reason)
                path = EagerPath
    except BaseException:
        leader.close()
        raise
    _log.info("tensor_parallel_ready", world=world, num_blocks=blocks, kv_cache_bytes_per_rank=leader.kv_bytes,
              heads=[plan.heads.start, plan.heads.stop], kv_heads=[plan.kv_heads.start, plan.kv_heads.stop])
    vocab = [p.vocab for p in plan_shards(mc, world)] if config.tensor_parallel_lm_head == "vocab" else None
    return RankZero(leader, model, plan, hooks, kv_cache, blocks, path, vocab)
