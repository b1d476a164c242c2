"""The CUDA-graph decode path's buckets, persistent buffers and padding, exercised on a CPU.

On a CPU nothing is captured, but ``--padded-decode-on-cpu`` sends decode steps through the same
buffers and bucket padding the graphs replay (decode_graphs.py). These tests hold that path to
the plain runner's tokens, and check that padding rows touch nothing but the scratch block.
The capture itself is tested on CUDA (test_decode_graphs_cuda.py).
"""

from __future__ import annotations

import pytest
import torch

from services.common.sampling_params import SamplingParams
from services.common.step import NewSequence, StepPlan
from services.executor.config import ExecutorConfig
from services.executor.forward_paths.compiled_decode import CompiledDecodeSettings
from services.executor.forward_paths.decode_graphs import DecodeGraphSettings
from services.executor.model_runner import ModelRunner
from services.runtime.model.decode_graphs import bucket_for, graph_batch_sizes
from tests.conftest import STORIES_DIR
from tests.helpers.forward_paths import decode_graphs
from tests.helpers.scripted_requests import run_requests

PADDED = DecodeGraphSettings(padded_decode_on_cpu=True)

BLOCK_SIZE = 16
# Up to ten sequences at once: decode batches of 3, 5, 6, 7, 9 and 10 pad to buckets 4, 8 and
# 16, and with a cap of 8 the largest batches fall back to the eager path mid-run.
WIDE_REQUESTS = [(0, 5, 30), (1, 20, 25), (2, 1, 40), (3, 40, 20), (4, 3, 25), (5, 9, 30),
                 (6, 2, 20), (7, 17, 22), (8, 4, 18), (9, 33, 12), (30, 6, 10)]


def make_runner(**overrides) -> ModelRunner:
    values = dict(model=str(STORIES_DIR), dtype="fp32", device="cpu", attention_backend="cpu",
                  block_size=BLOCK_SIZE, num_blocks=96)
    return ModelRunner(ExecutorConfig(**{**values, **overrides}))


def test_buckets_are_powers_of_two_to_eight_then_steps_of_eight_up_to_the_cap():
    assert graph_batch_sizes(128) == [1, 2, 4, *range(8, 129, 8)]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(3) == [1, 2, 3]
    assert graph_batch_sizes(1) == [1]
    sizes = graph_batch_sizes(20)
    assert [bucket_for(b, sizes) for b in (1, 3, 5, 8, 9, 17, 20, 21)] == [1, 4, 8, 8, 16, 20, 20, None]
    with pytest.raises(ValueError, match="max_batch_size must be >= 1"):
        graph_batch_sizes(0)


@pytest.mark.parametrize("backend,kv_cache_dtype", [("cpu", "auto"), ("torch", "auto"), ("cpu", "int8")])
def test_padded_decode_gives_the_plain_runners_tokens(backend, kv_cache_dtype):
    plain = run_requests(make_runner(attention_backend=backend, kv_cache_dtype=kv_cache_dtype), WIDE_REQUESTS)
    padded_runner = make_runner(attention_backend=backend, kv_cache_dtype=kv_cache_dtype,
                                decode_graphs=DecodeGraphSettings(padded_decode_on_cpu=True,
                                                                  cuda_graph_max_batch_size=8))
    assert decode_graphs(padded_runner) is not None
    assert decode_graphs(padded_runner).batch_sizes == [1, 2, 4, 8]
    assert run_requests(padded_runner, WIDE_REQUESTS) == plain
    assert padded_runner.sequences == {}


def test_the_scratch_block_is_reserved_and_padding_writes_nowhere_else():
    runner = make_runner(decode_graphs=PADDED)
    plain = make_runner()
    # One block more in the pool than the scheduler is told about: the padding rows' block.
    assert runner.info().num_blocks == plain.info().num_blocks == 96
    assert runner.kv_cache.num_blocks == 97 and plain.kv_cache.num_blocks == 96
    assert decode_graphs(runner).scratch_block == 96
    with pytest.raises(ValueError, match="block id 96 is outside the KV pool of 96 blocks"):
        runner.execute(StepPlan(0, new=[NewSequence(0, [1, 2], 2, 0, 2, [96], SamplingParams(temperature=0.0))]))
    for layer in runner.kv_cache.layers:
        for cache in layer:
            cache.fill_(7.0)
    run_requests(runner, [(0, 3, 6), (0, 5, 6), (0, 18, 6)])  # three sequences: batch 3 pads to 4
    used = {0, 1, 2, 3}  # blocks the scripted scheduler handed out: 1 + 1 + 2 (the long one grows into none)
    for layer in runner.kv_cache.layers:
        for cache in layer:
            untouched = [b for b in range(96) if b not in used]
            assert torch.all(cache[untouched] == 7.0), "a padding row wrote into a block it does not own"
            assert torch.all(cache[96, 1:] == 7.0), "padding rows write only slot 0 of the scratch block"
            assert not torch.all(cache[96, 0] == 7.0), "the padding rows did not run"


def test_prefill_and_mixed_steps_run_eagerly_beside_padded_decode():
    graphs = decode_graphs(make_runner(decode_graphs=PADDED))
    assert graphs.takes(3, [1, 1, 1], max_blocks=2)
    assert not graphs.takes(2, [1, 5], max_blocks=2), "a mixed step is not a decode step"
    assert not graphs.takes(129, [1] * 129, max_blocks=1), "beyond the largest bucket runs eagerly"
    assert not graphs.takes(1, [1], max_blocks=graphs.max_blocks_per_seq + 1)


def test_padded_decode_is_off_unless_asked_and_never_with_compile():
    assert decode_graphs(make_runner()) is None
    compiled = make_runner(decode_graphs=PADDED, compiled_decode=CompiledDecodeSettings(compile=True))
    assert decode_graphs(compiled) is None
    with pytest.raises(ValueError, match="cuda_graph_max_batch_size must be >= 1"):
        ExecutorConfig(model=str(STORIES_DIR),
                       decode_graphs=DecodeGraphSettings(cuda_graph_max_batch_size=0)).validate()
