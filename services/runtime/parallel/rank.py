"""One rank's model shard and KV pool, the same on rank 0 and on the others.

Each rank reads the whole checkpoint and keeps its slice (shard.py): simple, and a rank's
peak host memory is the full checkpoint plus one layer, not its 1/N share. Reading only the
slice (safetensors' get_slice) is the next step where host memory is what limits.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import torch

from services.runtime.kv_cache import KVCache, cuda_kv_budget, num_blocks_for_budget
from services.runtime.model.attention.base import AttentionBackend
from services.runtime.model.config import ModelConfig
from services.runtime.model.families import model_class
from services.runtime.model.olmoe import SpanNorm
from services.runtime.model.llama import LlamaForCausalLM
from services.runtime.model.weights import load_checkpoint
from services.runtime.parallel.collectives import AllReduceHooks, RankGroups
from services.runtime.parallel.expert_parallel import split_experts
from services.runtime.parallel.shard import ShardPlan, ffn_alignment, plan_shards, shard_checkpoint, shard_config

KV_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.int8,
                                                         torch.float8_e4m3fn)}


@dataclass(frozen=True, slots=True)
class RankSpec:
    """What a rank other than 0 is told at its start (as JSON on its command line)."""

    model: str
    dtype: str
    """torch dtype name without ``torch.`` (float32, bfloat16, float16)."""
    device: str
    attention_backend: str
    """The resolved backend name."""
    block_size: int
    kv_dtype: str
    """The pool's storage dtype name (the model's, or int8 / float8_e4m3fn)."""
    num_blocks: int
    """0: from the budget below; the ranks then take the smallest count any of them can hold."""
    kv_cache_bytes: int
    gpu_memory_utilization: float
    rank: int
    world: int
    store_path: str
    """The group's FileStore, in rank 0's private directory (leader.py)."""
    threads: int
    log_level: str
    all_reduce: str = "auto"
    """collectives.ALL_REDUCE_BACKENDS: how the CPU ranks sum."""
    fused: bool = False
    """Whether rank 0 runs the fused CPU step: the rank builds its own over its shard then."""
    lm_head: str = "replicated"
    """vocab_head.LM_HEADS: whether this rank holds and runs its share of the LM head."""
    experts: str = "all_reduce"
    """ExecutorConfig.tensor_parallel_experts: how a sparse layer's experts are held and run."""
    max_model_len: int = 0
    graphs_max_batch_size: int = 0
    """Whether rank 0 runs the decode graphs (> 0: their largest bucket): the rank builds its own
    over its shard then, with one scratch block past the pool for the padding rows."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "RankSpec":
        return cls(**json.loads(text))


def load_shard(model_dir: str, config: ModelConfig, backend: AttentionBackend, device: torch.device,
               dtype: torch.dtype, world: int, rank: int, prepack: bool = True, vocab_parallel: bool = False,
               experts: str = "all_reduce") -> tuple[LlamaForCausalLM, AllReduceHooks, ShardPlan]:
    """The model cut to ``rank``'s shard, its all-reduce hooks not yet joined to a group;
    ``vocab_parallel``: its LM head is the rank's vocabulary rows (on rank 0 too); ``experts``:
    ExecutorConfig.tensor_parallel_experts (sparse layers' experts split, or replicated)."""
    weights = load_checkpoint(model_dir, config, dtype)
    plan = plan_shards(config, world, ffn_alignment(weights, config))[rank]
    local = shard_config(config, plan, vocab_parallel)
    model = model_class(config)(local, shard_checkpoint(weights, config, plan, vocab_parallel), backend, device, prepack)
    hooks = AllReduceHooks(model)
    if config.qk_norm and not config.qk_norm_per_head:  # OLMoE's q/k norms span every rank's heads
        span = SpanNorm(lambda t: hooks.groups.all_reduce(t), config.num_heads * config.head_dim,
                        config.num_kv_heads * config.head_dim, max(1, world // config.num_kv_heads))
        for layer in model.layers:
            layer.span_norm = span
    if experts != "replicated":
        hooks.expert_layers = split_experts(model, world, rank, experts)
    return model, hooks, plan


def agree_on_fused_step(model: LlamaForCausalLM, kv_cache: KVCache, groups: RankGroups) -> str | None:
    """Whether every rank's fused CPU step can run its shard (a collective: each rank calls it
    after allocating its pool): None when all can, else why not. Shards differ (SmolLM2's 6/2
    and 3/1 heads), so one rank's answer is not the others'."""
    from services.runtime.model.fused_decode import why_not

    if groups.shm is None:
        reason = "the fused step sums through the shared-memory all-reduce, which this group does not use"
    else:
        reason = why_not(model, kv_cache.layers)
    answers = groups.gather_ints(int(reason is None))
    if all(answers):
        return None
    return reason or f"rank {answers.index(0)} cannot run it on its shard (its log says why)"


def blocks_for_budget(local: ModelConfig, block_size: int, kv_dtype: torch.dtype, device: torch.device,
                      kv_cache_bytes: int, gpu_memory_utilization: float) -> int:
    """The blocks one rank's pool of its own KV heads holds: ``kv_cache_bytes`` on a CPU (per
    rank), on CUDA what its device has left (10% kept for activations, as on one device)."""
    if device.type == "cuda":
        budget = int(cuda_kv_budget(device, gpu_memory_utilization) * 0.9)
    else:
        budget = kv_cache_bytes
    return num_blocks_for_budget(local, block_size, kv_dtype, budget)
