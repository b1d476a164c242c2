"""KV blocks copied between pools as bytes (services/runtime/kv_blocks.py): what one executor
sends another for disaggregated prefill. Every layer's K and V (and scales when quantized)
arrive in other block ids exactly, and the bytes are bytes_per_block per block."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from services.runtime.kernels.kv_quant import ScaledCache
from services.runtime.kv_blocks import kv_layout, read_blocks, write_blocks
from services.runtime.kv_cache import KVCache, bytes_per_block
from services.runtime.model.config import ModelConfig

CONFIG = ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=48, intermediate_size=96,
                     num_layers=3, num_heads=6, num_kv_heads=3, head_dim=8, rope_theta=10000.0, rms_norm_eps=1e-5,
                     max_position_embeddings=128, tie_word_embeddings=False, attention_bias=False,
                     dtype=torch.float32, bos_token_id=1, eos_token_ids=(2,), sliding_window=None)


def _fill(cache: KVCache, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for k, v in cache.layers:
        for pool in (k, v):
            tensors = (pool.data, pool.scale) if isinstance(pool, ScaledCache) else (pool,)
            for t in tensors:
                noise = torch.randn(t.shape, generator=generator) * 3
                t.copy_(noise.to(t.dtype) if t.dtype != torch.int8 else noise.clamp(-127, 127).to(torch.int8))


def _blocks(cache: KVCache, ids: list[int]) -> list[torch.Tensor]:
    out = []
    for k, v in cache.layers:
        for pool in (k, v):
            for t in ((pool.data, pool.scale) if isinstance(pool, ScaledCache) else (pool,)):
                out.append(t[ids].float())
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn],
                         ids=["fp32", "bf16", "int8", "fp8"])
@pytest.mark.parametrize("block_size", [1, 16])
def test_blocks_arrive_in_other_ids_exactly_and_weigh_bytes_per_block(dtype, block_size):
    source = KVCache.allocate(CONFIG, 9, block_size, dtype, torch.device("cpu"))
    target = KVCache.allocate(CONFIG, 7, block_size, dtype, torch.device("cpu"))
    _fill(source, 1)
    _fill(target, 2)
    before = _blocks(target, [1, 3, 4, 6])
    data = read_blocks(source, [8, 0, 5])
    assert sum(map(len, data)) == 3 * bytes_per_block(CONFIG, block_size, dtype)
    write_blocks(target, [2, 5, 0], data)
    for got, want in zip(_blocks(target, [2, 5, 0]), _blocks(source, [8, 0, 5])):
        assert torch.equal(got, want)
    for got, want in zip(_blocks(target, [1, 3, 4, 6]), before):  # nothing else written
        assert torch.equal(got, want)


def test_a_size_that_does_not_fit_the_pool_is_refused():
    source = KVCache.allocate(CONFIG, 4, 16, torch.float32, torch.device("cpu"))
    data = read_blocks(source, [0, 1])
    with pytest.raises(ValueError, match="bytes of KV for 3 blocks"):
        write_blocks(source, [0, 1, 2], data)
    with pytest.raises(ValueError, match="2 layers of KV for a pool of 3"):
        write_blocks(source, [0, 1], data[:2])


def test_the_layout_names_what_two_pools_must_share():
    base = kv_layout(CONFIG, 16, torch.int8, torch.float32)
    assert base == kv_layout(dataclasses.replace(CONFIG), 16, torch.int8, torch.float32)
    others = {kv_layout(CONFIG, 32, torch.int8, torch.float32), kv_layout(CONFIG, 16, torch.float32, torch.float32),
              kv_layout(dataclasses.replace(CONFIG, num_kv_heads=2), 16, torch.int8, torch.float32),
              kv_layout(CONFIG, 16, torch.int8, torch.bfloat16)}
    assert base not in others and len(others) == 4
