"""Tensor-parallel shard plans and slices (services/runtime/parallel/shard.py), no processes:
which heads, KV heads and MLP columns each rank owns, the counts that cannot split, and
quantized slices whose dequantized numbers are the unsharded weight's bit for bit."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from services.runtime.model.config import ModelConfig
from services.runtime.model.quant.formats import QuantizedWeight, dequantize, quantize
from services.runtime.parallel.shard import plan_shards, shard_checkpoint, shard_config, slice_columns, slice_rows
from tests.conftest import STORIES_DIR

BASE = ModelConfig.from_model_dir(STORIES_DIR)  # 8 heads, 4 KV heads, MLP 172


def config(heads: int, kv_heads: int, ffn: int = 1536) -> ModelConfig:
    return dataclasses.replace(BASE, num_heads=heads, num_kv_heads=kv_heads, intermediate_size=ffn)


def spans(plans, attr: str) -> list[tuple[int, int]]:
    return [(getattr(p, attr).start, getattr(p, attr).stop) for p in plans]


@pytest.mark.parametrize("heads,kv,world,want_heads,want_kv", [
    (8, 4, 2, [(0, 4), (4, 8)], [(0, 2), (2, 4)]),
    (8, 4, 3, [(0, 4), (4, 6), (6, 8)], [(0, 2), (2, 3), (3, 4)]),  # uneven, larger share first
    (9, 3, 2, [(0, 6), (6, 9)], [(0, 2), (2, 3)]),  # SmolLM2: whole KV groups
    (9, 3, 3, [(0, 3), (3, 6), (6, 9)], [(0, 1), (1, 2), (2, 3)]),
    (8, 1, 2, [(0, 4), (4, 8)], [(0, 1), (0, 1)]),  # MQA: the KV head replicated
    (8, 2, 4, [(0, 2), (2, 4), (4, 6), (6, 8)], [(0, 1), (0, 1), (1, 2), (1, 2)]),
])
def test_heads_split_by_kv_group_and_kv_heads_replicate_below_the_rank_count(heads, kv, world, want_heads, want_kv):
    plans = plan_shards(config(heads, kv), world)
    assert spans(plans, "heads") == want_heads
    assert spans(plans, "kv_heads") == want_kv
    group = heads // kv
    for p in plans:  # every rank's attention is plain GQA over its own KV heads
        assert {h // group for h in p.heads} == set(p.kv_heads)


def test_mlp_columns_split_evenly_and_on_quantization_groups():
    assert spans(plan_shards(BASE, 3), "ffn") == [(0, 58), (58, 115), (115, 172)]
    assert spans(plan_shards(config(8, 4, 1536), 2, ffn_align=32), "ffn") == [(0, 768), (768, 1536)]
    assert spans(plan_shards(config(8, 4, 32 * 5), 2, ffn_align=32), "ffn") == [(0, 96), (96, 160)]


@pytest.mark.parametrize("heads,kv,world,message", [
    (8, 2, 3, "tensor_parallel_size 3 is more than num_key_value_heads \\(2\\).*multiple of num_key_value_heads"),
    (6, 1, 4, "divide num_attention_heads \\(6\\)"),
])
def test_counts_that_cannot_split_name_both(heads, kv, world, message):
    with pytest.raises(ValueError, match=message):
        plan_shards(config(heads, kv), world)


def test_a_float_checkpoint_shards_to_the_local_config():
    torch.manual_seed(0)
    mc = config(8, 4, 172)
    d, hd, f = mc.hidden_size, mc.head_dim, mc.intermediate_size
    full = {"model.layers.0.self_attn.q_proj.weight": torch.randn(8 * hd, d),
            "model.layers.0.self_attn.k_proj.weight": torch.randn(4 * hd, d),
            "model.layers.0.self_attn.o_proj.weight": torch.randn(d, 8 * hd),
            "model.layers.0.mlp.gate_proj.weight": torch.randn(f, d),
            "model.layers.0.mlp.down_proj.weight": torch.randn(d, f),
            "model.layers.0.input_layernorm.weight": torch.randn(d),
            "model.embed_tokens.weight": torch.randn(mc.vocab_size, d)}
    plan = plan_shards(mc, 3)[1]  # heads 4..6, KV head 2, MLP 58..115
    local = shard_checkpoint(dict(full), mc, plan)
    assert torch.equal(local["model.layers.0.self_attn.q_proj.weight"], full["model.layers.0.self_attn.q_proj.weight"][4 * hd:6 * hd])
    assert torch.equal(local["model.layers.0.self_attn.k_proj.weight"], full["model.layers.0.self_attn.k_proj.weight"][2 * hd:3 * hd])
    assert torch.equal(local["model.layers.0.self_attn.o_proj.weight"], full["model.layers.0.self_attn.o_proj.weight"][:, 4 * hd:6 * hd])
    assert torch.equal(local["model.layers.0.mlp.gate_proj.weight"], full["model.layers.0.mlp.gate_proj.weight"][58:115])
    assert torch.equal(local["model.layers.0.mlp.down_proj.weight"], full["model.layers.0.mlp.down_proj.weight"][:, 58:115])
    for name in ("model.layers.0.input_layernorm.weight", "model.embed_tokens.weight"):  # replicated
        assert torch.equal(local[name], full[name])
    local_config = shard_config(mc, plan)
    assert (local_config.num_heads, local_config.num_kv_heads, local_config.intermediate_size) == (2, 1, 57)


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0", "int8"])
def test_quantized_slices_dequantize_to_the_unsharded_weights_bit_for_bit(fmt):
    torch.manual_seed(1)
    weight = quantize(torch.randn(96, 256), fmt)
    full = dequantize(weight)
    for start, stop in [(0, 40), (40, 96), (17, 18)]:  # output rows: any split
        assert torch.equal(dequantize(slice_rows(weight, start, stop)), full[start:stop])
    for start, stop in [(0, 128), (128, 256), (64, 96)]:  # input columns: on group boundaries
        assert torch.equal(dequantize(slice_columns(weight, start, stop)), full[:, start:stop])


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k", "q5_0"])
def test_whole_gguf_block_slices_dequantize_to_the_unsharded_weights_bit_for_bit(fmt):
    import numpy as np

    from tests.helpers.kquants import random_blocks

    weight = QuantizedWeight.from_parts(fmt, {"qweight": torch.from_numpy(
        random_blocks(24, 768, fmt, np.random.default_rng(0)))}, 32)
    full = dequantize(weight)
    assert torch.equal(dequantize(slice_rows(weight, 5, 17)), full[5:17])
    for start, stop in [(0, 256), (256, 768)]:
        assert torch.equal(dequantize(slice_columns(weight, start, stop)), full[:, start:stop])
    if fmt != "q5_0":
        with pytest.raises(ValueError, match=f"cuts its {fmt} groups of 256"):
            slice_columns(weight, 0, 384)


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0"])
def test_a_column_split_inside_a_group_is_refused(fmt):
    weight = quantize(torch.randn(8, 128), fmt)
    with pytest.raises(ValueError, match=f"o_proj: a tensor-parallel split at input columns 16..128 cuts its {fmt} "
                                         "groups of 32"):
        slice_columns(weight, 16, 128, name="o_proj")


@pytest.mark.parametrize("tied", [True, False])
def test_a_vocab_parallel_head_is_each_ranks_rows_of_the_head(tied):
    torch.manual_seed(0)
    mc = dataclasses.replace(config(8, 4, 172), tie_word_embeddings=tied)  # 512 ids: 171, 171, 170 at TP=3
    d = mc.hidden_size
    full = {"model.embed_tokens.weight": torch.randn(mc.vocab_size, d)}
    if not tied:
        full["lm_head.weight"] = torch.randn(mc.vocab_size, d)
    head = full["model.embed_tokens.weight" if tied else "lm_head.weight"]
    plans = plan_shards(mc, 3)
    assert spans(plans, "vocab") == [(0, 171), (171, 342), (342, 512)]
    for plan in plans:
        local = shard_checkpoint(dict(full), mc, plan, vocab_parallel=True)
        assert torch.equal(local["lm_head.weight"], head[plan.vocab.start:plan.vocab.stop])
        assert torch.equal(local["model.embed_tokens.weight"], full["model.embed_tokens.weight"])  # the lookup: whole
        assert not shard_config(mc, plan, vocab_parallel=True).tie_word_embeddings
    assert "lm_head.weight" not in shard_checkpoint(dict(full), mc, plans[0]) or not tied  # replicated: as it was
