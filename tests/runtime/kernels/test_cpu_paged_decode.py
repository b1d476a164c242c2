"""The C++ CPU paged decode kernel against paged_decode_reference, and the cpu backend through
the AttentionBackend interface.

The kernel is compiled by this test run if ``make install`` has not built it already. If it
cannot be built here the tests fail (they do not skip): on every machine the project
supports, a C++ compiler is part of the install.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from tests.helpers.kernel_cases import assert_matches_reference, build_paged_batch

from services.runtime.kernels import cpu as cpu_kernels
from services.runtime.kernels.paged_decode import paged_decode_reference
from services.runtime.model.attention.registry import get_attention_backend, resolve_backend_name
from tests.conftest import REPO_ROOT

CASES = [
    # (context lens, kv_heads, heads, head_dim, block_size)
    ([1], 1, 1, 64, 16),
    ([1, 2, 15, 16, 17], 2, 8, 64, 16),          # block edges
    ([300, 7, 1025, 64], 4, 4, 128, 32),         # MHA, long contexts
    ([33, 250, 99], 1, 8, 80, 16),               # MQA, head_dim not a power of two
    ([5, 129, 512, 3, 77, 200], 4, 12, 64, 16),  # the benchmark model's shape (GQA 12/4)
    ([40, 41], 8, 8, 64, 1),                     # block size 1
    ([1, 17, 100, 255], 4, 8, 8, 16),            # stories260K's shape (head_dim 8)
    ([3, 70], 1, 2, 16, 8),                      # the other head dims compiled as constants
    ([9, 40, 41], 2, 4, 32, 16),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"ctx{len(c[0])}-kv{c[1]}-h{c[2]}-d{c[3]}-bs{c[4]}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_kernel_matches_reference(case, dtype):
    context_lens, kv_heads, heads, head_dim, block_size = case
    # Every slot a sequence does not own holds NaN: the kernel must read only its own slots.
    batch = build_paged_batch(context_lens, [1] * len(context_lens), kv_heads, head_dim, block_size, dtype,
                              torch.device("cpu"), poison=float("nan"))
    q = torch.randn(len(context_lens), heads, head_dim).to(dtype)
    scale = head_dim**-0.5
    out = cpu_kernels.paged_decode(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, scale)
    assert out.shape == q.shape and out.dtype == dtype
    assert_matches_reference(
        out, lambda q, k, v: paged_decode_reference(q, k, v, batch.block_tables, batch.context_lens, scale),
        q, batch.k_cache, batch.v_cache,
    )



# Head dims 8/16/32 take tiles of 16 positions (transposed K and, from 8 * head_dim positions at
# head dims 8 and 16, V): contexts around tile edges, tiles that straddle blocks (block sizes that
# are not multiples of 16, block size 1), MQA/MHA/GQA 3, both V forms at head dim 16.
TILED_CASES = [
    # (context lens, kv_heads, heads, head_dim, block_size)
    ([1, 15, 16, 17, 31, 33, 64, 1000], 1, 8, 8, 1),
    ([5, 16, 47, 64, 65], 8, 8, 8, 3),
    ([127, 128, 200, 1], 3, 9, 16, 32),
    ([63, 64, 65, 129], 2, 2, 32, 64),
    ([129, 2], 6, 12, 8, 7),
]


@pytest.mark.parametrize("case", TILED_CASES, ids=lambda c: f"ctx{len(c[0])}-kv{c[1]}-h{c[2]}-d{c[3]}-bs{c[4]}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_small_head_dim_tiles_match_reference(case, dtype):
    context_lens, kv_heads, heads, head_dim, block_size = case
    torch.manual_seed(len(context_lens) + head_dim)
    batch = build_paged_batch(context_lens, [1] * len(context_lens), kv_heads, head_dim, block_size, dtype,
                              torch.device("cpu"), poison=float("nan"))
    q = torch.randn(len(context_lens), heads, head_dim).to(dtype)
    scale = head_dim**-0.5
    out = cpu_kernels.paged_decode(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, scale)
    assert_matches_reference(
        out, lambda q, k, v: paged_decode_reference(q, k, v, batch.block_tables, batch.context_lens, scale),
        q, batch.k_cache, batch.v_cache,
    )


def test_softmax_weighs_far_below_the_max_as_zero_and_a_single_position_as_one():
    # Scores 200 apart: exp underflows to exactly 0, so the output is the top position's V row;
    # a one-token context gives its V row times exactly 1.
    k = torch.zeros(2, 16, 1, 8)
    v = torch.randn(2, 16, 1, 8)
    k[0, :, 0, 0] = -100.0
    k[0, 9, 0, 0] = 100.0
    q = torch.zeros(2, 1, 8)
    q[:, 0, 0] = 1.0
    tables = torch.tensor([[0], [1]], dtype=torch.int32)
    out = cpu_kernels.paged_decode(q, k, v, tables, torch.tensor([16, 1], dtype=torch.int32), 1.0)
    assert torch.equal(out[0, 0], v[0, 9, 0])
    assert torch.equal(out[1, 0], v[1, 0, 0])

def test_kernel_reads_only_through_the_block_table():
    # Two sequences share nothing; swapping the blocks of one in the pool (and its table) must
    # not change either output.
    torch.manual_seed(0)
    k = torch.randn(8, 4, 2, 16)
    v = torch.randn(8, 4, 2, 16)
    q = torch.randn(2, 4, 16)
    tables = torch.tensor([[0, 1, 2], [3, 4, 0]], dtype=torch.int32)
    lens = torch.tensor([10, 6], dtype=torch.int32)
    before = cpu_kernels.paged_decode(q, k, v, tables, lens, 0.25)
    k2, v2 = k.clone(), v.clone()
    k2[[5, 6]], v2[[5, 6]] = k[[0, 1]], v[[0, 1]]
    k2[[0, 1]] = float("nan")
    v2[[0, 1]] = float("nan")
    k2[7], v2[7] = k[2], v[2]
    after = cpu_kernels.paged_decode(q[:1], k2, v2, torch.tensor([[5, 6, 7]], dtype=torch.int32), lens[:1], 0.25)
    torch.testing.assert_close(after, before[:1], rtol=0, atol=0)


BAD_INPUTS = ["short_table", "zero_len", "dtype", "block_outside_pool", "negative_block"]
BAD_INPUT_ERRORS = {
    "short_table": r"context_lens\[0\] = 33 does not fit its block table",
    "zero_len": r"context_lens\[0\] = 0 does not fit its block table",
    "dtype": r"k_cache must match q \(torch.float16 on cpu\), got torch.float32",
    "block_outside_pool": r"block_tables\[0\]\[1\] = 4 is outside the pool of 4 blocks",
    "negative_block": r"block_tables\[0\]\[0\] = -1 is outside the pool of 4 blocks",
}


def bad_inputs(bad: str):
    k = torch.zeros(4, 16, 2, 64)
    q = torch.zeros(1, 4, 64)
    tables = torch.zeros(1, 2, dtype=torch.int32)
    lens = torch.tensor([20], dtype=torch.int32)
    if bad == "short_table":
        lens = torch.tensor([33], dtype=torch.int32)  # needs 3 blocks, the table has 2
    elif bad == "zero_len":
        lens = torch.tensor([0], dtype=torch.int32)
    elif bad == "block_outside_pool":
        tables = torch.tensor([[0, 4]], dtype=torch.int32)  # the pool has blocks 0..3
    elif bad == "negative_block":
        tables = torch.tensor([[-1, 0]], dtype=torch.int32)
    else:
        q = q.half()
    return q, k, k.clone(), tables, lens


@pytest.mark.parametrize("bad", BAD_INPUTS)
def test_kernel_refuses_inconsistent_inputs_before_entering_cpp(bad):
    # Checked in Python: an exception thrown inside the C++ kernel does not reach Python on every
    # torch build (one takes the process down with SIGSEGV instead).
    q, k, v, tables, lens = bad_inputs(bad)
    with pytest.raises(ValueError, match=BAD_INPUT_ERRORS[bad]):
        cpu_kernels.check_paged_decode_inputs(q, k, v, tables, lens)
    with pytest.raises(ValueError, match=BAD_INPUT_ERRORS[bad]):
        cpu_kernels.paged_decode(q, k, v, tables, lens, 0.125)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_write_kv_stores_strided_rows_at_their_slots(dtype):
    torch.manual_seed(0)
    k_cache = torch.zeros(6, 4, 2, 8, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    qkv = torch.randn(5, 3 * 2 * 8).to(dtype)  # k and v as views into a fused projection, as the model has them
    k, v = qkv[:, 16:32].view(5, 2, 8), qkv[:, 32:].view(5, 2, 8)
    slots = torch.tensor([23, 0, 5, 4, 17])
    cpu_kernels.write_kv(k, v, k_cache, v_cache, slots)
    expected_k, expected_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    expected_k.view(-1, 2, 8).index_copy_(0, slots, k)
    expected_v.view(-1, 2, 8).index_copy_(0, slots, v)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@pytest.mark.parametrize("slot", [-1, 24])
def test_write_kv_refuses_a_slot_outside_the_pool_before_writing(slot):
    k_cache = torch.zeros(6, 4, 2, 8)
    k = torch.ones(2, 2, 8)
    with pytest.raises(ValueError, match=rf"slot_mapping\[1\] = {slot} is outside the pool of 24 slots"):
        cpu_kernels.write_kv(k, k, k_cache, k_cache.clone(), torch.tensor([3, slot]))
    assert not k_cache.any()


def run_bad_inputs_in_a_child(call: str, error: str) -> None:
    """Run ``call`` on every refused input in a child process that must raise ``error`` each time
    and exit cleanly: a crash cannot be caught in-process, and must not take the test run down."""
    script = (
        "import pytest, sys\n"
        "sys.path.insert(0, 'tests/runtime/kernels')\n"
        "from test_cpu_paged_decode import BAD_INPUTS, bad_inputs\n"
        "from services.runtime.kernels import cpu\n"
        "for bad in BAD_INPUTS:\n"
        f"    with pytest.raises({error}):\n"
        f"        {call}\n"
        "print('survived')\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=300, env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0 and "survived" in result.stdout, (result.returncode, result.stderr[-2000:])


@pytest.mark.slow  # a child process
def test_bad_input_leaves_the_process_alive():
    run_bad_inputs_in_a_child("cpu.paged_decode(*bad_inputs(bad), 0.125)", "ValueError")


@pytest.mark.slow  # a child process
def test_kernel_own_checks_remain_a_second_line():
    # Past the Python checks (a caller that claims it checked), the C++ kernel still refuses.
    run_bad_inputs_in_a_child("cpu.paged_decode(*bad_inputs(bad), 0.125, inputs_checked=True)", "RuntimeError")


def test_backend_checks_the_step_tables_once_per_step():
    from services.runtime.model.attention.base import AttentionMetadata

    backend = get_attention_backend("cpu", torch.device("cpu"))
    k = torch.randn(4, 16, 2, 64)
    q = torch.randn(1, 4, 64)

    def meta(table, slot=19):
        return AttentionMetadata(
            slot_mapping=torch.tensor([slot]), block_tables=torch.tensor([table], dtype=torch.int32),
            context_lens=torch.tensor([20], dtype=torch.int32), query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
            query_lens_cpu=[1], context_lens_cpu=[20], max_query_len=1, max_context_len=20, block_size=16)

    with pytest.raises(ValueError, match=r"block_tables\[0\]\[1\] = 9 is outside the pool of 4 blocks"):
        backend.attend(q, k, k.clone(), meta([0, 9]), 0.125)
    new_kv = torch.zeros(1, 2, 64)
    with pytest.raises(ValueError, match=r"block_tables\[0\]\[1\] = 9 is outside the pool of 4 blocks"):
        backend.write_kv(new_kv, new_kv, k, k.clone(), meta([0, 9]))  # the layer's first call checks the step
    with pytest.raises(ValueError, match=r"slot_mapping\[0\] = 64 is outside the pool of 64 slots"):
        backend.write_kv(new_kv, new_kv, k, k.clone(), meta([0, 1], slot=64))
    good = meta([0, 1])
    first = backend.attend(q, k, k.clone(), good, 0.125)
    torch.testing.assert_close(backend.attend(q, k, k.clone(), good, 0.125), first)  # the next layer, same step


def test_auto_backend_on_cpu_is_the_cpu_kernel():
    assert resolve_backend_name("auto", torch.device("cpu")) == "cpu"
    assert get_attention_backend("auto", torch.device("cpu")).name == "cpu"
    with pytest.raises(ValueError, match="CPU only"):
        resolve_backend_name("cpu", torch.device("cuda"))
