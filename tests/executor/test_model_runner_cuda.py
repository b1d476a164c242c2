"""On a CUDA device the runner picks the Triton backend and decodes what the CPU runner decodes.

Runs where a GPU is present (`python -m benchmarks gpu` runs the whole suite there); elsewhere it
is reported as skipped with the reason (the `gpu` marker, tests/conftest.py).
"""

from __future__ import annotations

import pytest

from services.common.sampling_params import SamplingParams
from services.common.step import NewSequence, RunningSequence, StepPlan
from services.executor.config import ExecutorConfig
from services.executor.model_runner import ModelRunner

pytestmark = pytest.mark.gpu

PROMPT = [1, 403, 407, 261, 378]  # "Once upon a time"
NEW_TOKENS = 24


def greedy_tokens(runner: ModelRunner) -> list[int]:
    blocks = [0, 1]  # 2 x 16 slots hold the prompt and every new token
    plan = StepPlan(0, new=[NewSequence(0, PROMPT, len(PROMPT), 0, len(PROMPT), blocks, SamplingParams(temperature=0))])
    tokens = runner.execute(plan).outputs[0].token_ids
    for step in range(1, NEW_TOKENS):
        tokens += runner.execute(StepPlan(step, running=[RunningSequence(0, 1, [])])).outputs[0].token_ids
    return tokens


def test_cuda_runner_uses_triton_and_matches_the_cpu_runner(stories_dir):
    config = dict(model=str(stories_dir), dtype="fp32", num_blocks=64)
    cuda = ModelRunner(ExecutorConfig(device="cuda", **config))
    assert cuda.info().attention_backend == "triton" and cuda.info().device.startswith("cuda")
    cpu = ModelRunner(ExecutorConfig(device="cpu", **config))
    assert greedy_tokens(cuda) == greedy_tokens(cpu)
