"""Multi-step plans through the real ModelRunner on stories260K: a sequence asked for n decode
steps (RunningSequence.num_steps) feeds each sampled token back in and returns n tokens, the
same tokens and logprobs as n plans of one step, greedy and seeded, alone and in a batch whose
members run different numbers of steps, on the eager and the fused CPU decode paths."""

from __future__ import annotations

import pytest

from services.common.sampling_params import SamplingParams
from services.common.step import NewSequence, RunningSequence, StepPlan
from services.executor.config import ExecutorConfig
from services.executor.forward_paths.fused_decode import FusedDecodeSettings
from services.executor.model_runner import ModelRunner
from tests.conftest import STORIES_DIR

BLOCK_SIZE = 4  # bursts cross block boundaries
PROMPTS = [[1, 403, 407, 261, 378, 350], [1, 288, 431, 261], [1, 426, 288, 431, 261, 378, 350, 403, 407]]
SAMPLINGS = [SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=0.9, top_p=0.9, seed=11),
             SamplingParams(temperature=0.7, seed=3, repetition_penalty=1.3, logprobs=1)]
NUM_TOKENS = 13


def make_runner(cpu_decode: str) -> ModelRunner:
    return ModelRunner(ExecutorConfig(model=str(STORIES_DIR), dtype="fp32", device="cpu", attention_backend="cpu",
                                      block_size=BLOCK_SIZE, num_blocks=64, seed=5,
                                      fused_decode=FusedDecodeSettings(cpu_decode=cpu_decode)))


def start(runner: ModelRunner) -> dict[int, tuple[list[int], list]]:
    """Prefill every prompt (each owning blocks for all its tokens); returns outputs by seq id."""
    new, offset = [], 0
    for seq_id, (prompt, sampling) in enumerate(zip(PROMPTS, SAMPLINGS)):
        width = -(-(len(prompt) + NUM_TOKENS) // BLOCK_SIZE)
        new.append(NewSequence(seq_id, list(prompt), len(prompt), 0, len(prompt),
                               list(range(offset, offset + width)), sampling))
        offset += width
    result = runner.execute(StepPlan(0, new=new))
    return {o.seq_id: (list(o.token_ids), list(o.logprobs or [])) for o in result.outputs}


def run(runner: ModelRunner, steps_per_plan: dict[int, int]) -> dict[int, tuple[list[int], list]]:
    outputs = start(runner)
    step = 0
    while any(len(outputs[s][0]) < NUM_TOKENS for s in outputs):
        step += 1
        running = [RunningSequence(s, 1, num_steps=min(steps_per_plan[s], NUM_TOKENS - len(outputs[s][0])))
                   for s in outputs if len(outputs[s][0]) < NUM_TOKENS]
        result = runner.execute(StepPlan(step, running=running))
        for seq, out in zip(running, result.outputs):
            assert len(out.token_ids) == seq.num_steps
            outputs[out.seq_id][0].extend(out.token_ids)
            outputs[out.seq_id][1].extend(out.logprobs or [])
    return outputs


def assert_same_outputs(got, want) -> None:
    """Tokens exactly; logprobs to fp32 rounding (the LM head's sums depend on the batch's size)."""
    assert {s: tokens for s, (tokens, _) in got.items()} == {s: tokens for s, (tokens, _) in want.items()}
    for s, (_, logprobs) in want.items():
        assert len(got[s][1]) == len(logprobs)
        for a, b in zip(got[s][1], logprobs):
            assert a.top_token_ids == b.top_token_ids
            assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
            assert a.top_logprobs == pytest.approx(b.top_logprobs, abs=1e-5)


@pytest.mark.parametrize("cpu_decode", ["fused", "eager"])
def test_n_steps_in_one_plan_equal_n_plans_of_one_step(cpu_decode):
    one_at_a_time = run(make_runner(cpu_decode), {0: 1, 1: 1, 2: 1})
    assert_same_outputs(run(make_runner(cpu_decode), {0: 4, 1: 1, 2: 3}), one_at_a_time)
    assert_same_outputs(run(make_runner(cpu_decode), {0: 8, 1: 8, 2: 8}), one_at_a_time)
    assert all(len(tokens) == NUM_TOKENS for tokens, _ in one_at_a_time.values())
    assert len(one_at_a_time[0][1]) == NUM_TOKENS  # logprobs asked for: one per token


def test_a_multi_step_plan_must_be_a_decode_with_blocks_for_every_position():
    runner = make_runner("fused")
    prompt = PROMPTS[0]
    runner.execute(StepPlan(0, new=[NewSequence(0, list(prompt), len(prompt), 0, len(prompt), [0, 1], SAMPLINGS[0])]))
    # Known 7 tokens, computed 6: positions 6..9 need a third block.
    with pytest.raises(ValueError, match="sequence 0: 4 decode steps reach position 9, which needs 3 blocks; "
                                         "its block table has 2"):
        runner.execute(StepPlan(1, running=[RunningSequence(0, 1, num_steps=4)]))
    with pytest.raises(ValueError, match="sequence 0: 2 decode steps need a decode of its last known token"):
        runner.execute(StepPlan(2, running=[RunningSequence(0, 1, [], [5], 2)]))


def test_the_runner_times_each_plan_it_runs():
    runner = make_runner("fused")
    prompt = PROMPTS[0]
    first = runner.execute(StepPlan(0, new=[NewSequence(0, list(prompt), len(prompt), 0, len(prompt), [0, 1, 2],
                                                          SAMPLINGS[0])]))
    burst = runner.execute(StepPlan(1, running=[RunningSequence(0, 1, num_steps=4)]))
    assert first.execute_seconds > 0 and burst.execute_seconds > 0
    assert runner.execute(StepPlan(2)).execute_seconds == 0  # nothing scheduled: nothing ran
