"""End to end: the (interpreted, on CPU) Triton backend gives the torch backend's greedy tokens."""

from __future__ import annotations

import pytest

from services.common.sampling_params import SamplingParams
from services.scheduler.request.stop import StopConditions
from services.executor.config import ExecutorConfig
from services.inprocess.engine import Engine, EngineConfig
from services.scheduler.core.config import SchedulerLimits
from tests.conftest import STORIES_DIR
from tests.helpers.engine_runs import generate_all

# slow: the whole model through Triton kernels in the interpreter
pytestmark = pytest.mark.slow

PROMPTS = [None, "Once upon a time", "The little dog wanted"]


def greedy(backend: str) -> list[list[int]]:
    # max_num_batched_tokens 8 forces chunked prefill, so the prefill kernel also sees cached
    # prefixes and mixed decode/prefill steps, and the decode kernel runs once prompts are done.
    engine = Engine(EngineConfig(ExecutorConfig(model=str(STORIES_DIR), attention_backend=backend, num_blocks=64),
                                 SchedulerLimits(max_num_batched_tokens=8, max_num_seqs=8)))
    outs = generate_all(engine, PROMPTS, SamplingParams(temperature=0.0), StopConditions(max_tokens=16, ignore_eos=True))
    assert engine.runner.model.ops.name == backend
    return [o.token_ids for o in outs]


@pytest.mark.timeout(900)
def test_triton_backend_matches_torch_backend_greedy():
    assert greedy("triton") == greedy("torch")
