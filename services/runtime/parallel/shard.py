"""Which part of a Llama each tensor-parallel rank owns, and slicing a checkpoint to it.

Megatron's split, as vLLM and gpt-fast do it: q|k|v and gate|up are column-parallel (each rank
computes its own heads and its own MLP columns), o_proj and down row-parallel (each rank
multiplies its heads' / columns' share of the input, and an all-reduce sums the partial
outputs). The embedding, the norms and the LM head are replicated: every rank embeds the step's
tokens itself, and only rank 0 computes logits.

Heads go by KV group (a KV head and the query heads that read it), so every rank's attention is
plain GQA over its own KV heads. With at least as many KV heads as ranks, the groups are split
as evenly as they go, the larger shares first (9 query / 3 KV heads over 2 ranks: 6/2 and 3/1);
with fewer, each KV head is replicated on ``world / num_kv_heads`` ranks, which split its
query heads (vLLM's rule: both counts must divide).

Quantized weights (quant/formats.py) are quantized along the input axis in groups, so a
column-parallel slice (output rows) is a slice of every part, and a row-parallel slice (input
columns) must start and stop on group boundaries: the MLP's columns are split in whole groups,
and an o_proj split inside a group is refused with the sizes named. A slice's dequantized
numbers are then the unsharded weight's, bit for bit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from services.runtime.model.config import ModelConfig
from services.runtime.model.quant.formats import QuantizedWeight

Weight = torch.Tensor | QuantizedWeight


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """What rank ``rank`` of ``world`` owns: query heads, KV heads and MLP columns (half-open),
    and the LM head's vocabulary rows where the head is vocab-parallel."""

    rank: int
    world: int
    heads: range
    kv_heads: range
    ffn: range
    vocab: range = range(0)


def _split(units: int, parts: int) -> list[range]:
    """``units`` in ``parts`` contiguous runs as even as they go, the longer runs first."""
    base, extra = divmod(units, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (i < extra))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def ffn_alignment(weights: dict[str, Weight] | None, config: ModelConfig) -> int:
    """The MLP columns' unit of splitting: the quantized down projections' group size, else 1."""
    if weights is None:
        return 1
    sizes = {w.group_size for name, w in weights.items()
             if name.endswith("mlp.down_proj.weight") and isinstance(w, QuantizedWeight) and w.fmt != "int8"}
    return max(sizes, default=1)


def plan_shards(config: ModelConfig, world: int, ffn_align: int = 1) -> list[ShardPlan]:
    """Every rank's plan; ValueError naming the counts when the heads cannot be split ``world`` ways."""
    if world < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {world}")
    heads, kv_heads = config.num_heads, config.num_kv_heads
    group = heads // kv_heads
    if kv_heads >= world:
        kv_runs = _split(kv_heads, world)
        head_runs = [range(r.start * group, r.stop * group) for r in kv_runs]
    else:
        if world % kv_heads or heads % world:
            raise ValueError(
                f"tensor_parallel_size {world} is more than num_key_value_heads ({kv_heads}), so KV heads are "
                f"replicated: it must be a multiple of num_key_value_heads and divide num_attention_heads "
                f"({heads})")
        per_rank = heads // world
        head_runs = [range(r * per_rank, (r + 1) * per_rank) for r in range(world)]
        kv_runs = [range(h.start // group, h.start // group + 1) for h in head_runs]
    if config.intermediate_size % ffn_align:
        raise ValueError(f"intermediate_size {config.intermediate_size} is not a multiple of the quantization "
                         f"group size {ffn_align}")
    if config.intermediate_size // ffn_align < world:
        raise ValueError(f"tensor_parallel_size {world} exceeds the {config.intermediate_size // ffn_align} "
                         f"MLP column groups of {ffn_align}")
    ffn_runs = [range(r.start * ffn_align, r.stop * ffn_align)
                for r in _split(config.intermediate_size // ffn_align, world)]
    vocab_runs = _split(config.vocab_size, world)
    return [ShardPlan(rank, world, h, kv, f, v)
            for rank, (h, kv, f, v) in enumerate(zip(head_runs, kv_runs, ffn_runs, vocab_runs))]


def shard_config(config: ModelConfig, plan: ShardPlan, vocab_parallel: bool = False) -> ModelConfig:
    """The model config one rank builds its layers and its KV pool from (a vocab-parallel head
    is its own matrix, never the embedding's: the lookup needs every row)."""
    local = dataclasses.replace(config, num_heads=len(plan.heads), num_kv_heads=len(plan.kv_heads),
                                intermediate_size=len(plan.ffn))
    return dataclasses.replace(local, tie_word_embeddings=False) if vocab_parallel else local


def slice_rows(weight: Weight, start: int, stop: int) -> Weight:
    """Output rows [start, stop) (a copy, so the full tensor's memory can go)."""
    if isinstance(weight, QuantizedWeight):
        parts = {name: t[start:stop].clone() for name, t in weight.parts().items()}
        return QuantizedWeight(weight.fmt, stop - start, weight.in_features, weight.group_size, **parts)
    return weight[start:stop].clone()


def slice_columns(weight: Weight, start: int, stop: int, name: str = "weight") -> Weight:
    """Input columns [start, stop); a quantized weight only on its group boundaries."""
    if not isinstance(weight, QuantizedWeight):
        return weight[:, start:stop].contiguous()
    w = weight
    if w.fmt == "int8":  # one scale per output row: any column range keeps them
        return QuantizedWeight(w.fmt, w.out_features, stop - start, stop - start,
                               w.qweight[:, start:stop].contiguous(), w.scales.clone())
    if start % w.group_size or stop % w.group_size:
        raise ValueError(f"{name}: a tensor-parallel split at input columns {start}..{stop} cuts its {w.fmt} "
                         f"groups of {w.group_size}")
    if w.scales is None:  # whole GGUF blocks (quant/gguf_blocks.py): a row's blocks are its bytes in order
        per_block = w.qweight.shape[1] // (w.in_features // w.group_size)
        b0, b1 = start // w.group_size * per_block, stop // w.group_size * per_block
        return QuantizedWeight(w.fmt, w.out_features, stop - start, w.group_size, w.qweight[:, b0:b1].contiguous())
    per_byte = 2 if w.fmt in ("q4_0", "q4_1") else 1
    g0, g1 = start // w.group_size, stop // w.group_size
    parts = {"qweight": w.qweight[:, start // per_byte:stop // per_byte].contiguous(),
             "scales": w.scales[:, g0:g1].contiguous()}
    if w.mins is not None:
        parts["mins"] = w.mins[:, g0:g1].contiguous()
    return QuantizedWeight(w.fmt, w.out_features, stop - start, w.group_size, **parts)


def shard_checkpoint(weights: dict[str, Weight], config: ModelConfig, plan: ShardPlan,
                     vocab_parallel: bool = False) -> dict[str, Weight]:
    """The checkpoint (load_checkpoint's dict) cut to one rank's shard; the input dict is emptied
    as it goes, so at most one full layer's weights are held twice. ``vocab_parallel``: the LM
    head (the embedding, where tied) cut to the rank's vocabulary rows."""
    out: dict[str, Weight] = {}
    if vocab_parallel:
        head = weights["model.embed_tokens.weight"] if config.tie_word_embeddings else weights.pop("lm_head.weight")
        out["lm_head.weight"] = slice_rows(head, plan.vocab.start, plan.vocab.stop)
    hd = config.head_dim
    q = (plan.heads.start * hd, plan.heads.stop * hd)
    kv = (plan.kv_heads.start * hd, plan.kv_heads.stop * hd)
    f = (plan.ffn.start, plan.ffn.stop)
    column_parallel = {"self_attn.q_proj": q, "self_attn.k_proj": kv, "self_attn.v_proj": kv,
                       "mlp.gate_proj": f, "mlp.up_proj": f}
    if config.qk_norm and not config.qk_norm_per_head:  # OLMoE: norm weights over the whole q and k widths
        column_parallel |= {"self_attn.q_norm": q, "self_attn.k_norm": kv}
    row_parallel = {"self_attn.o_proj.weight": q, "mlp.down_proj.weight": f}
    for name in list(weights):
        weight = weights.pop(name)
        if name.startswith("model.layers."):
            module, _, kind = name.rpartition(".")
            local = module.split(".", 3)[3]  # "self_attn.q_proj" of "model.layers.7.self_attn.q_proj"
            if local in column_parallel:
                weight = slice_rows(weight, *column_parallel[local])
            elif f"{local}.{kind}" in row_parallel:
                weight = slice_columns(weight, *row_parallel[f"{local}.{kind}"], name=name)
        out[name] = weight
    return out
