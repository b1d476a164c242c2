"""Quantized KV cache (int8, fp8 e4m3 with fp16 scales per token per kv head): the quantization
rule's round-trip bounds, the Triton write against the torch rule (same bytes), the Triton paged
decode and varlen prefill kernels and the torch backend against the loop-per-sequence references
over quantized pools, and the pool's capacity at a byte budget."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from tests.helpers.kernel_cases import DTYPES, FP32_TOLERANCE, LOW_PRECISION_FACTOR, build_paged_batch, case_id, grid, \
    poisoned_like

from services.runtime.kernels.kv_quant import (
    MIN_SCALE, QMAX, ScaledCache, as_bytes, dequantize, dequantize_cache, quantize, write_quantized,
)
from services.runtime.kernels.paged_decode import paged_decode_attention, paged_decode_reference
from services.runtime.kernels.prefill_attention import prefill_attention, prefill_attention_reference
from services.runtime.kernels.reshape_and_cache import reshape_and_cache, reshape_and_cache_reference
from services.runtime.kv_cache import KVCache, num_blocks_for_budget
from services.runtime.model.config import ModelConfig

KV_DTYPES = (torch.int8, torch.float8_e4m3fn)
INT8_STEP_BOUND = 0.5 + 127 * 2.0**-10
"""Worst int8 round-trip error in units of the row's scale: half a step, plus the clamp at 127 of
a value that the fp16 rounding of amax/127 (relative error <= 2^-11) pushed up to 127.13."""
FP8_RELATIVE_BOUND = 2.0**-4
"""e4m3 keeps 3 mantissa bits: round to nearest errs by at most 2^-4 of the value (normal range)."""
FP8_SUBNORMAL_STEP = 2.0**-9
"""e4m3's subnormal spacing, in units of the scale: half of it bounds the error below 2^-6."""


def _poisoned_pool(shape, dtype, device) -> ScaledCache:
    """A pool whose every byte reads as poison: NaN scales (and NaN fp8 values), so a kernel that
    reads a slot nobody wrote produces NaN."""
    pool = ScaledCache.empty(shape, dtype, device)
    as_bytes(pool.data).fill_(0x7F)  # NaN in e4m3fn; 127 in int8
    pool.scale.fill_(float("nan"))
    return pool


def quantized_pools(batch, kv_dtype):
    """The batch's K/V (its owned slots) written into poisoned quantized pools by the torch rule."""
    pools = [_poisoned_pool(batch.k_cache.shape, kv_dtype, batch.k_cache.device) for _ in range(2)]
    kh, d = batch.k_cache.shape[2:]
    k = batch.k_cache.view(-1, kh, d)[batch.slots]
    v = batch.v_cache.view(-1, kh, d)[batch.slots]
    write_quantized(k, v, pools[0], pools[1], batch.slots)
    return pools


def assert_close_to_reference(out, reference, q, k_pool, v_pool):
    """The kernel against the reference over the same quantized pools: with fp32 queries within
    FP32_TOLERANCE; with 16-bit ones no further from the fp32 answer than LOW_PRECISION_FACTOR times
    the reference's own error in that dtype (the criterion of tests/helpers/kernel_cases.py)."""
    assert not out.isnan().any(), f"{int(out.isnan().sum())} output elements are NaN (poisoned reads)"
    expected = reference(q.float(), k_pool, v_pool)
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, expected, atol=FP32_TOLERANCE, rtol=FP32_TOLERANCE)
        return
    error = (out.float() - expected).abs().max().item()
    own = (reference(q, k_pool, v_pool).float() - expected).abs().max().item()
    assert error <= LOW_PRECISION_FACTOR * own + FP32_TOLERANCE, (error, own)


# --- the quantization rule --------------------------------------------------------------------

@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 300.0])
def test_round_trip_error_bounds(kv_dtype, magnitude):
    x = torch.randn(257, 3, 80) * magnitude
    x[5, 1] = 0.0  # an all-zero head: exact zeros back
    x[6, 2, 7] = 40 * magnitude  # an outlier sets its row's scale
    values, scale = quantize(x, kv_dtype)
    assert values.dtype == kv_dtype and scale.dtype == torch.float16 and scale.shape == x.shape[:2]
    back = dequantize(values, scale)
    error = (back - x).abs()
    s = scale.float().unsqueeze(-1)
    if kv_dtype == torch.int8:
        assert values.abs().max() <= 127
        assert (error <= INT8_STEP_BOUND * s).all(), float((error / s).max())
    else:
        assert (error <= FP8_RELATIVE_BOUND * x.abs() + FP8_SUBNORMAL_STEP / 2 * s).all()
    # per-row error relative to the row's largest magnitude (what attention sees), for rows whose
    # scale is not held up at MIN_SCALE (amax < QMAX * 2^-14: there the error is below 2^-14 instead)
    amax = x.abs().amax(-1, keepdim=True)
    relative = 0.005 if kv_dtype == torch.int8 else 0.0625
    assert (error <= torch.clamp(relative * amax, min=MIN_SCALE)).all()
    assert torch.equal(back[5, 1], torch.zeros(80)) and float(scale[5, 1]) == MIN_SCALE
    assert float(values[6, 2, 7].float()) == QMAX[kv_dtype]  # the outlier uses the full range


def test_int8_rounds_half_up():
    """The rule is floor(x / scale + 0.5): the C++ and Triton writes implement exactly that."""
    x = torch.tensor([[127.0, 0.5, -0.5, 1.5, -1.5, 2.5]])  # amax 127: scale exactly 1
    values, scale = quantize(x, torch.int8)
    assert float(scale) == 1.0
    assert values.tolist() == [[127, 1, 0, 2, -1, 3]]


# --- the Triton write ----------------------------------------------------------------------------

WRITE_CASES = grid(kv_dtype=list(KV_DTYPES), dtype=list(DTYPES), kv_heads=[1, 3, 8], head_dim=[8, 64, 80, 128],
                   block_size=[16, 32])


@pytest.mark.parametrize("case", WRITE_CASES, ids=case_id)
def test_reshape_and_cache_writes_the_rules_bytes(case, device):
    kv_heads, head_dim, block_size = case["kv_heads"], case["head_dim"], case["block_size"]
    num_blocks, num_tokens = 9, 29
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[[2, 20]] = -1  # padding tokens
    slots = slots.to(device)
    qkv = (torch.randn(num_tokens, 3 * kv_heads * head_dim, device=device) * 3).to(case["dtype"])
    k = qkv[:, kv_heads * head_dim : 2 * kv_heads * head_dim].view(num_tokens, kv_heads, head_dim)
    v = qkv[:, 2 * kv_heads * head_dim :].view(num_tokens, kv_heads, head_dim)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    pools = [_poisoned_pool(shape, case["kv_dtype"], device) for _ in range(4)]

    reshape_and_cache(k, v, pools[0], pools[1], slots)
    reshape_and_cache_reference(k, v, pools[2], pools[3], slots)

    for got, want in ((pools[0], pools[2]), (pools[1], pools[3])):
        if device.type == "cpu":  # the interpreter divides as IEEE does: the very same bytes
            assert torch.equal(as_bytes(got.data), as_bytes(want.data))
            torch.testing.assert_close(got.scale, want.scale, atol=0, rtol=0, equal_nan=True)
        else:  # a GPU's division may differ in the last bit: one step at most
            step = want.scale.float().nan_to_num(0).unsqueeze(-1)
            diff = (dequantize_cache(got, torch.float32) - dequantize_cache(want, torch.float32)).nan_to_num(0)
            assert (diff.abs() <= step * 1.01 + 1e-6).all()
    written = ~pools[0].scale.isnan()
    assert int(written.sum()) == (num_tokens - 2) * kv_heads  # padding wrote nothing


# --- attention over quantized pools ----------------------------------------------------------------

CONTEXT_LENS = [1, 17, 97, 257, 1025]
NUM_KV_HEADS = 2
ATTENTION_CASES = grid(
    strength=2,
    kv_dtype=list(KV_DTYPES),
    head_dim=[64, 80, 128],
    gqa=[1, 3, 8],
    block_size=[16, 32],
    dtype=list(DTYPES),
)


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=case_id)
def test_paged_decode_over_quantized_pools(case, device):
    head_dim, dtype = case["head_dim"], case["dtype"]
    batch = build_paged_batch(CONTEXT_LENS, [1] * len(CONTEXT_LENS), NUM_KV_HEADS, head_dim, case["block_size"],
                              torch.float32, device)
    k_pool, v_pool = quantized_pools(batch, case["kv_dtype"])
    q = torch.randn(len(CONTEXT_LENS), NUM_KV_HEADS * case["gqa"], head_dim, device=device).to(dtype)
    scale = head_dim**-0.5
    for partitions in (1, 5):
        out = poisoned_like(q)
        paged_decode_attention(q, k_pool, v_pool, batch.block_tables, batch.context_lens, scale,
                               max_context_len=batch.max_context_len, num_partitions=partitions, out=out)
        assert_close_to_reference(out, lambda q, k, v: paged_decode_reference(
            q, k, v, batch.block_tables, batch.context_lens, scale), q, k_pool, v_pool)


MIXED_BATCH = [(1, 1), (17, 17), (97, 5), (257, 1), (1025, 16), (97, 64)]


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=case_id)
def test_prefill_over_quantized_pools(case, device):
    head_dim, dtype = case["head_dim"], case["dtype"]
    context_lens, query_lens = zip(*MIXED_BATCH)
    batch = build_paged_batch(list(context_lens), list(query_lens), NUM_KV_HEADS, head_dim, case["block_size"],
                              torch.float32, device)
    k_pool, v_pool = quantized_pools(batch, case["kv_dtype"])
    q = torch.randn(sum(query_lens), NUM_KV_HEADS * case["gqa"], head_dim, device=device).to(dtype)
    scale = head_dim**-0.5
    out = poisoned_like(q)
    prefill_attention(q, k_pool, v_pool, batch.block_tables, batch.context_lens, batch.query_start_loc, scale,
                      max_query_len=batch.max_query_len, max_context_len=batch.max_context_len, out=out)
    assert_close_to_reference(out, lambda q, k, v: prefill_attention_reference(
        q, k, v, batch.block_tables, batch.context_lens, batch.query_start_loc, scale), q, k_pool, v_pool)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
def test_quantized_attention_stays_near_the_unquantized(kv_dtype, device):
    """The cost of quantizing: attention over the quantized pools against the same attention over
    the fp32 pools, bounded by the round trip: N(0, 1) values have row maxima near 3.5, so int8 errs
    by up to 0.005 x 3.5 per value and e4m3 by up to 6% of a value."""
    batch = build_paged_batch([300, 64, 5], [1, 1, 1], 2, 64, 16, torch.float32, device)
    k_pool, v_pool = quantized_pools(batch, kv_dtype)
    q = torch.randn(3, 4, 64, device=device)
    args = (batch.block_tables, batch.context_lens, 0.125)
    exact = paged_decode_attention(q, batch.k_cache, batch.v_cache, *args, max_context_len=300)
    quantized = paged_decode_attention(q, k_pool, v_pool, *args, max_context_len=300)
    error = (quantized - exact).abs().max().item()
    assert error < (0.02 if kv_dtype == torch.int8 else 0.15), error


def test_launchers_refuse_mixed_or_broken_pools(device):
    batch = build_paged_batch([20], [1], 2, 64, 16, torch.float32, device)
    k_pool, v_pool = quantized_pools(batch, torch.int8)
    q = torch.randn(1, 2, 64, device=device)
    args = (batch.block_tables, batch.context_lens, 0.125)
    with pytest.raises(ValueError, match="both be quantized or both plain"):
        paged_decode_attention(q, k_pool, batch.v_cache, *args, max_context_len=20)
    broken = ScaledCache(k_pool.data, k_pool.scale.float())
    with pytest.raises(ValueError, match="scales must be contiguous torch.float16"):
        paged_decode_attention(q, broken, v_pool, *args, max_context_len=20)


# --- capacity ---------------------------------------------------------------------------------

def _config(head_dim: int, kv_heads: int, layers: int) -> ModelConfig:
    """The three fields the pool's size reads (the rest of a ModelConfig does not matter here)."""
    return SimpleNamespace(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
def test_quantized_pool_holds_at_least_1_9x_the_tokens_of_bf16(kv_dtype):
    """SmolLM2-135M's attention shape (30 layers, 3 kv heads of 64): one byte per value plus a
    2-byte scale per 64 makes 128/66 = 1.94x the tokens of bf16 at the same budget."""
    config = _config(64, 3, 30)
    budget = 256 * 1024**2
    bf16 = num_blocks_for_budget(config, 16, torch.bfloat16, budget)
    quantized = num_blocks_for_budget(config, 16, kv_dtype, budget)
    assert quantized / bf16 >= 1.9, quantized / bf16
    pool = KVCache.allocate(config, quantized, 16, kv_dtype, torch.device("cpu"))
    assert pool.nbytes <= budget and pool.dtype == kv_dtype and pool.num_tokens == quantized * 16
    plain = KVCache.allocate(config, bf16, 16, torch.bfloat16, torch.device("cpu"))
    assert plain.nbytes <= budget


# --- the C++ CPU kernels and the backends ---------------------------------------------------------

CPU_CASES = [
    # (context lens, kv_heads, heads, head_dim, block_size)
    ([1, 2, 15, 16, 17], 2, 8, 64, 16),  # block edges
    ([300, 7, 130], 3, 9, 64, 32),  # SmolLM2's shape (GQA 9/3)
    ([33, 250, 99], 1, 8, 80, 16),  # MQA, head_dim not a power of two
    ([1, 17, 100, 255], 4, 8, 8, 16),  # stories260K's shape (head_dim 8)
    ([40, 41], 8, 8, 128, 1),  # block size 1
]


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: f"ctx{len(c[0])}-kv{c[1]}-h{c[2]}-d{c[3]}-bs{c[4]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
def test_cpu_paged_decode_over_quantized_pools(case, dtype, kv_dtype):
    from services.runtime.kernels import cpu as cpu_kernels

    context_lens, kv_heads, heads, head_dim, block_size = case
    batch = build_paged_batch(context_lens, [1] * len(context_lens), kv_heads, head_dim, block_size, torch.float32,
                              torch.device("cpu"))
    k_pool, v_pool = quantized_pools(batch, kv_dtype)
    q = torch.randn(len(context_lens), heads, head_dim).to(dtype)
    scale = head_dim**-0.5
    out = cpu_kernels.paged_decode(q, k_pool, v_pool, batch.block_tables, batch.context_lens, scale)
    assert out.dtype == dtype
    assert_close_to_reference(out, lambda q, k, v: paged_decode_reference(
        q, k, v, batch.block_tables, batch.context_lens, scale), q, k_pool, v_pool)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("kv_heads,head_dim", [(1, 8), (3, 64), (2, 80)])
def test_cpu_write_stores_the_rules_bytes(kv_heads, head_dim, kv_dtype, dtype):
    from services.runtime.kernels import cpu as cpu_kernels

    num_blocks, block_size, num_tokens = 7, 16, 40
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    qkv = (torch.randn(num_tokens, 3 * kv_heads * head_dim) * 4).to(dtype)
    k = qkv[:, kv_heads * head_dim : 2 * kv_heads * head_dim].view(num_tokens, kv_heads, head_dim)
    v = qkv[:, 2 * kv_heads * head_dim :].view(num_tokens, kv_heads, head_dim)
    k[0, 0] = 0.0  # an all-zero head
    shape = (num_blocks, block_size, kv_heads, head_dim)
    pools = [_poisoned_pool(shape, kv_dtype, torch.device("cpu")) for _ in range(4)]
    cpu_kernels.write_kv(k, v, pools[0], pools[1], slots)
    write_quantized(k, v, pools[2], pools[3], slots)
    for got, want in ((pools[0], pools[2]), (pools[1], pools[3])):
        assert torch.equal(as_bytes(got.data), as_bytes(want.data))
        torch.testing.assert_close(got.scale, want.scale, atol=0, rtol=0, equal_nan=True)


def _backend_step(backend_name: str, kv_dtype, device):
    """One mixed step (a prompt, a chunk over a cached prefix, decode rows) through a backend's
    write_kv and attend, against the reference backend over the same quantized pools."""
    from services.runtime.model.attention.base import AttentionMetadata
    from services.runtime.model.attention.reference_backend import ReferenceAttentionBackend
    from services.runtime.model.attention.registry import get_attention_backend

    context_lens, query_lens = [9, 40, 77, 1], [9, 7, 1, 1]
    batch = build_paged_batch(context_lens, query_lens, 3, 64, 16, torch.float32, device)
    prefix = torch.cat([batch.slots[sum(context_lens[:i]): sum(context_lens[:i]) + c - n]
                        for i, (c, n) in enumerate(zip(context_lens, query_lens))])
    new = batch.new_token_slots()
    outs = []
    for backend in (get_attention_backend(backend_name, device), ReferenceAttentionBackend()):
        k_pool, v_pool = (_poisoned_pool(batch.k_cache.shape, kv_dtype, device) for _ in range(2))
        write_quantized(batch.k_cache.view(-1, 3, 64)[prefix], batch.v_cache.view(-1, 3, 64)[prefix], k_pool, v_pool,
                        prefix)
        for decode_only in (False, True):
            rows = [i for i, n in enumerate(query_lens) if n == 1] if decode_only else list(range(len(query_lens)))
            lens = [query_lens[i] for i in rows]
            slots = torch.cat([new[sum(query_lens[:i]): sum(query_lens[:i]) + query_lens[i]] for i in rows])
            meta = AttentionMetadata(
                slot_mapping=slots, block_tables=batch.block_tables[rows],
                context_lens=batch.context_lens[rows],
                query_start_loc=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                                             device=device),
                query_lens_cpu=lens, context_lens_cpu=[context_lens[i] for i in rows], max_query_len=max(lens),
                max_context_len=max(context_lens[i] for i in rows), block_size=16)
            torch.manual_seed(len(rows))
            k = torch.randn(len(slots), 3, 64, device=device)
            v = torch.randn(len(slots), 3, 64, device=device)
            q = torch.randn(len(slots), 6, 64, device=device)
            backend.write_kv(k, v, k_pool, v_pool, meta)
            outs.append(backend.attend(q, k_pool, v_pool, meta, 0.125))
    half = len(outs) // 2
    for got, want in zip(outs[:half], outs[half:]):
        assert not got.isnan().any()
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_backends_over_quantized_pools_match_the_reference_backend(backend, kv_dtype, device):
    if backend == "cpu" and device.type != "cpu":
        pytest.skip("the cpu backend runs on the CPU only")
    _backend_step(backend, kv_dtype, device)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
def test_cpu_decode_widens_every_stored_value_exactly(kv_dtype):
    """A one-token context attends to its own V with weight 1: the output is float(value) * scale,
    which must equal PyTorch's conversion for every value the pool can hold (all 256 int8 bytes but
    -128; the 254 non-NaN e4m3 bytes, subnormals included: the C++ kernel widens them by bit
    arithmetic)."""
    from services.runtime.kernels import cpu as cpu_kernels

    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    if kv_dtype == torch.int8:
        codes = codes[codes.view(torch.int8) != -128]
    else:
        codes = codes[(codes & 0x7F) != 0x7F]
    rows = codes[: len(codes) // 2 * 2].view(2, 1, -1)  # two sequences of one token, one head
    d = rows.shape[-1]
    k_pool, v_pool = (ScaledCache.empty((2, 1, 1, d), kv_dtype, torch.device("cpu")) for _ in range(2))
    for pool in (k_pool, v_pool):
        as_bytes(pool.data).copy_(rows.view(2, 1, 1, d))
        pool.scale.fill_(0.5)
    out = cpu_kernels.paged_decode(torch.randn(2, 1, d), k_pool, v_pool, torch.tensor([[0], [1]], dtype=torch.int32),
                                   torch.tensor([1, 1], dtype=torch.int32), 0.125)
    expected = v_pool.data.float().view(2, 1, d) * 0.5
    assert torch.equal(out, expected)
