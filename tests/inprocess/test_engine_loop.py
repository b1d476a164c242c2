"""The in-process engine runs the services' loop: overlap, multi-step bursts and speculation.

The same EngineCore the scheduler service drives over gRPC runs here over local ports (a
model-runner thread, the tokenizer's DetokenizerPool, a local n-gram drafter), on the real
stories260K model. Whatever the loop does, greedy tokens are those of one step at a time.
"""

from __future__ import annotations

import pytest
import torch

from services.common.sampling_params import SamplingParams
from services.executor.config import ExecutorConfig
from services.inprocess.engine import Engine, EngineConfig
from services.scheduler.core.config import SchedulerLimits
from services.scheduler.core.speculation import SpeculationConfig
from services.scheduler.request.stop import StopConditions
from tests.conftest import STORIES_DIR
from tests.helpers.engine_runs import generate_all

GREEDY = SamplingParams(temperature=0.0)
STOP = StopConditions(max_tokens=48, ignore_eos=True)
PROMPTS = ["Once upon a time", "Tom and his dog went to the park. Tom and his dog went to the park. Tom and",
           "The cat sat on the mat and"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def engine(**settings) -> Engine:
    limits = SchedulerLimits(**{k: v for k, v in settings.items() if k != "speculation"})
    speculation = settings.get("speculation", SpeculationConfig(num_speculative_tokens=0))
    return Engine(EngineConfig(ExecutorConfig(model=str(STORIES_DIR), dtype="fp32", device="cpu", num_blocks=128),
                               limits, speculation))


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    """One step at a time: no overlap, no bursts, no drafts."""
    plain = engine(overlap_scheduling=False, num_scheduler_steps=1)
    return [d.token_ids for d in generate_all(plain, PROMPTS, GREEDY, STOP)]


def test_overlap_and_bursts_keep_steps_in_flight_and_change_no_token(reference):
    loop = engine()  # the defaults: overlap on, multi-step bursts
    assert [d.token_ids for d in generate_all(loop, PROMPTS, GREEDY, STOP)] == reference
    totals = loop.core.step_times
    assert totals.overlapped > 0, "no step was sent while another was in flight"
    assert totals.steps < 48 * len(PROMPTS)


def test_speculation_in_process_accepts_drafts_and_changes_no_token(reference):
    spec = engine(speculation=SpeculationConfig(num_speculative_tokens=4, adaptive=False))
    outputs = generate_all(spec, PROMPTS, GREEDY, STOP)
    assert [d.token_ids for d in outputs] == reference
    stats = spec.scheduler.get_stats().spec_decode
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    assert sum(d.timings.accepted_draft_tokens for d in outputs) == stats.num_accepted_tokens
