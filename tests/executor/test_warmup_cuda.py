"""On CUDA, after the warm-up no request compiles a Triton kernel: new prompt lengths, batch
sizes and table widths reuse the variants the warm-up built; and warm-up changes no output.

Runs where a GPU is present; elsewhere it is reported as skipped with the reason (the `gpu`
marker, tests/conftest.py).
"""

from __future__ import annotations

import pytest

from services.executor.config import ExecutorConfig
from services.executor.model_runner import ModelRunner
from services.executor.warmup import warm_up
from tests.helpers.scripted_requests import run_requests

pytestmark = pytest.mark.gpu

# Prompts from 1 token to 300 (prefill tiles of every size), contexts past 256 tokens (split-K
# decode), batches of 1 to 4.
REQUESTS = [(0, 1, 40), (2, 37, 30), (5, 300, 20), (9, 130, 25), (30, 7, 10), (31, 64, 5)]


def triton_variants() -> dict[str, int]:
    """Compiled variants per kernel, over every device."""
    from services.runtime.kernels import paged_decode, prefill_attention, reshape_and_cache, rms_norm, rotary
    from services.runtime.kernels import silu_and_mul

    kernels = [paged_decode._paged_decode_partition_kernel, paged_decode._paged_decode_reduce_kernel,
               prefill_attention._prefill_attention_kernel, reshape_and_cache._reshape_and_cache_kernel,
               rms_norm._rms_norm_kernel, rotary._rotary_kernel, silu_and_mul._silu_and_mul_kernel]
    return {k.fn.__name__: sum(len(cache[0]) for cache in k.device_caches.values()) for k in kernels}


def cuda_runner(stories_dir) -> ModelRunner:
    return ModelRunner(ExecutorConfig(model=str(stories_dir), device="cuda", dtype="fp32", num_blocks=256))


def test_after_warm_up_serving_compiles_no_triton_kernel(stories_dir):
    runner = cuda_runner(stories_dir)
    report = warm_up(runner)
    assert runner.sequences == {} and report.kernel_launches > 0
    built = triton_variants()
    assert all(built.values()), f"warm-up left kernels unbuilt: {built}"
    run_requests(runner, REQUESTS)
    assert triton_variants() == built


def test_warm_up_changes_no_greedy_output_on_cuda(stories_dir):
    warmed = cuda_runner(stories_dir)
    warm_up(warmed)
    assert run_requests(warmed, REQUESTS) == run_requests(cuda_runner(stories_dir), REQUESTS)
