"""Tensor parallelism over NCCL on two GPUs, its decode steps replayed from every rank's own
CUDA graphs (each captured at the warm-up, all ranks at once, the NCCL all-reduces inside):
the same greedy tokens as one GPU replaying its graphs.

Needs two CUDA devices: a GPU machine with one reports it as skipped with the reason, a CPU
machine through the `gpu` marker (tests/conftest.py). On a CPU the same path runs padded and
eagerly over gloo/shared memory (test_tensor_parallel.py).
"""

from __future__ import annotations

import pytest
import torch

from services.executor.config import ExecutorConfig
from services.executor.forward_paths.decode_graphs import DecodeGraphSettings
from services.executor.model_runner import ModelRunner
from services.executor.warmup import warm_up
from tests.executor.test_decode_graphs import WIDE_REQUESTS
from tests.helpers.forward_paths import decode_graphs
from tests.helpers.scripted_requests import run_requests

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def make_runner(stories_dir, tp: int) -> ModelRunner:
    return ModelRunner(ExecutorConfig(model=str(stories_dir), dtype="fp32", device="cuda", block_size=16,
                                      num_blocks=96, tensor_parallel_size=tp,
                                      decode_graphs=DecodeGraphSettings(cuda_graph_max_batch_size=8)))


def test_every_rank_replays_its_graphs_and_the_tokens_are_one_gpus(stories_dir):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs two CUDA devices (this machine has {torch.cuda.device_count()})")
    one = make_runner(stories_dir, 1)
    warm_up(one)
    want = run_requests(one, WIDE_REQUESTS)
    two = make_runner(stories_dir, 2)
    try:
        report = warm_up(two)
        assert report.path_facts["graph_batch_sizes"] == [1, 2, 4, 8]
        assert decode_graphs(two).captured_sizes == [1, 2, 4, 8]
        assert run_requests(two, WIDE_REQUESTS) == want
    finally:
        two.close()
