"""No Triton kernel specializes on a step's lengths: the arguments that follow them (a block
table's row stride, the split-K buffers' strides and partition length) and the step metadata's
pointers (views at batch-dependent offsets into the runner's uploads) are left unspecialized,
so a new prompt length or batch size never compiles a kernel while serving. The constexprs that
follow a step are bucketed; tests/executor/test_warmup_cuda.py checks on a GPU that the
warm-up builds every variant serving uses."""

from __future__ import annotations

import inspect

import pytest

from services.runtime.kernels import paged_decode, prefill_attention, reshape_and_cache, rotary
from services.runtime.kernels._common import STEP_LENGTH_INTS, STEP_METADATA_POINTERS, is_interpreted
from services.runtime.kernels.prefill_attention import tile_rows

KERNELS = [paged_decode._paged_decode_partition_kernel, paged_decode._paged_decode_reduce_kernel,
           prefill_attention._prefill_attention_kernel, reshape_and_cache._reshape_and_cache_kernel,
           rotary._rotary_kernel]
# The constexprs a step's lengths choose, each with few values (the warm-up compiles them all),
# and those the model and pool fix once. A new constexpr must be put in one of the two.
BUCKETED_CONSTEXPRS = {"SINGLE_PARTITION", "PARTITIONS_PAD", "BLOCK_M", "BLOCK_Q"}
MODEL_CONSTEXPRS = {"HEAD_DIM", "HEAD_DIM_PAD", "QUERIES_PER_KV", "HEADS_PAD", "KV_HEADS_PAD", "NUM_KV_HEADS",
                    "HALF", "HALF_PAD", "BLOCK_SIZE", "TILE_N", "DOT_PRECISION", "DOT_UPCAST",
                    # the KV cache's storage (--kv-cache-dtype) and its quantization constants
                    "KV_QUANT", "INT8", "QMAX", "MIN_SCALE", "MAX_SCALE",
                    # a layer with a sliding window or without: two variants at most per model
                    "WINDOWED",
                    # Gemma 2 caps every layer's scores, other models none
                    "SOFTCAPPED"}


def unspecialized(kernel) -> tuple[set[str], set[str]]:
    """(ints not specialized, pointers not specialized on alignment) of a jitted or interpreted kernel."""
    if is_interpreted(kernel):
        return (set(kernel.kwargs.get("do_not_specialize") or ()),
                set(kernel.kwargs.get("do_not_specialize_on_alignment") or ()))
    return ({p.name for p in kernel.params if p.do_not_specialize},
            {p.name for p in kernel.params if p.do_not_specialize_on_alignment})


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.fn.__name__)
def test_step_dependent_arguments_are_not_specialized(kernel):
    names = set(inspect.signature(kernel.fn).parameters)
    ints, pointers = unspecialized(kernel)
    assert names & set(STEP_LENGTH_INTS) <= ints
    assert names & set(STEP_METADATA_POINTERS) <= pointers
    assert names & set(STEP_METADATA_POINTERS), "every kernel here reads some step metadata"


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.fn.__name__)
def test_every_constexpr_is_fixed_by_the_model_or_bucketed(kernel):
    constexprs = {name for name, param in inspect.signature(kernel.fn).parameters.items()
                  if "constexpr" in str(param.annotation)}
    assert constexprs and constexprs <= BUCKETED_CONSTEXPRS | MODEL_CONSTEXPRS


def test_prefill_tile_rows_take_a_few_power_of_two_values():
    for queries_per_kv in (1, 3, 4, 8):
        for head_dim in (64, 128, 256):
            values = {tile_rows(n, queries_per_kv, head_dim) for n in range(1, 5000)}
            assert len(values) <= 5 and all(v & (v - 1) == 0 for v in values)
