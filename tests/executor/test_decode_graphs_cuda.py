"""CUDA graphs for decode on a real GPU: captured at warm-up for every bucket, replayed by
decode steps, and giving the eager runner's greedy tokens over a continuous-batching run.

Runs where a GPU is present (`python -m benchmarks gpu` runs the suite there); elsewhere it is
reported as skipped with the reason (the `gpu` marker, tests/conftest.py). The buffers and
padding these graphs read are tested on a CPU in test_decode_graphs.py.
"""

from __future__ import annotations

import pytest

from services.executor.config import ExecutorConfig
from services.executor.forward_paths.decode_graphs import DecodeGraphSettings
from services.executor.model_runner import ModelRunner
from services.executor.warmup import warm_up
from tests.executor.test_decode_graphs import WIDE_REQUESTS
from tests.helpers.forward_paths import decode_graphs
from tests.helpers.scripted_requests import run_requests

pytestmark = pytest.mark.gpu


def make_runner(stories_dir, **overrides) -> ModelRunner:
    values = dict(model=str(stories_dir), dtype="fp32", device="cuda", block_size=16, num_blocks=96)
    return ModelRunner(ExecutorConfig(**{**values, **overrides}))


def test_graphs_are_captured_at_warm_up_and_replay_the_eager_tokens(stories_dir):
    graphed = make_runner(stories_dir, decode_graphs=DecodeGraphSettings(cuda_graph_max_batch_size=8))
    report = warm_up(graphed)
    assert report.path_facts["graph_batch_sizes"] == [1, 2, 4, 8] and report.path_facts["graph_seconds"] > 0
    assert decode_graphs(graphed).captured_sizes == [1, 2, 4, 8]
    eager = make_runner(stories_dir, decode_graphs=DecodeGraphSettings(enforce_eager=True))
    assert decode_graphs(eager) is None
    warm_up(eager)
    assert run_requests(graphed, WIDE_REQUESTS) == run_requests(eager, WIDE_REQUESTS)
