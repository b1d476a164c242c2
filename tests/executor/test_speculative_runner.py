"""Speculative steps through the real ModelRunner on stories260K: 1 + k scheduled tokens per
drafted sequence, verified in the same varlen step.

Drafts are taken from a plain run's own output (so some are right) and corrupted at chosen
places (so some are not): greedy and seeded outputs must equal the plain run's token for
token, with identical logprobs, whatever the drafts.
"""

from __future__ import annotations

import random

import pytest

from services.common.sampling_params import SamplingParams
from services.common.step import NewSequence, RunningSequence, StepPlan
from services.executor.config import ExecutorConfig
from services.executor.model_runner import ModelRunner
from tests.conftest import STORIES_DIR

BLOCK_SIZE = 4  # small blocks: drafts cross block boundaries
PROMPT = [1, 403, 407, 261, 378, 350, 426, 288, 431, 261]


def make_runner() -> ModelRunner:
    return ModelRunner(ExecutorConfig(model=str(STORIES_DIR), dtype="fp32", device="cpu",
                                      attention_backend="torch", block_size=BLOCK_SIZE, num_blocks=64, seed=5))


def blocks_for(n: int, offset: int) -> list[int]:
    return list(range(offset, offset + -(-n // BLOCK_SIZE)))


def plain_run(sampling: SamplingParams, num_tokens: int, prompt=PROMPT):
    runner = make_runner()
    total = len(prompt) + num_tokens
    blocks = blocks_for(total, 0)
    step = 0
    result = runner.execute(StepPlan(step, new=[NewSequence(0, list(prompt), len(prompt), 0, len(prompt), blocks, sampling)]))
    out = list(result.outputs[0].token_ids)
    lps = list(result.outputs[0].logprobs or [])
    while len(out) < num_tokens:
        step += 1
        result = runner.execute(StepPlan(step, running=[RunningSequence(0, 1)]))
        out += result.outputs[0].token_ids
        lps += result.outputs[0].logprobs or []
    return out, lps


def speculative_run(sampling: SamplingParams, num_tokens: int, reference: list[int], rng: random.Random,
                    prompt=PROMPT):
    """Each step drafts up to 4 tokens from ``reference`` (what plain decoding produced),
    corrupting each with probability 0.3; returns the outputs, logprobs and (drafts, accepted)."""
    runner = make_runner()
    total = len(prompt) + num_tokens + 8
    blocks = blocks_for(total, 0)
    result = runner.execute(StepPlan(0, new=[NewSequence(0, list(prompt), len(prompt), 0, len(prompt), blocks, sampling)]))
    out = list(result.outputs[0].token_ids)
    lps = list(result.outputs[0].logprobs or [])
    verified = []
    step = 0
    while len(out) < num_tokens:
        step += 1
        k = rng.randrange(0, 5)
        drafts = [t if rng.random() > 0.3 else (t + 7) % 512 for t in reference[len(out): len(out) + k]]
        result = runner.execute(StepPlan(step, running=[RunningSequence(0, 1 + len(drafts), [], drafts)]))
        emitted = result.outputs[0].token_ids
        assert 1 <= len(emitted) <= len(drafts) + 1 and emitted[:-1] == drafts[: len(emitted) - 1]
        verified.append((drafts, len(emitted) - 1))
        out += emitted
        lps += result.outputs[0].logprobs or []
        state = runner.sequences[0]
        assert state.token_ids == list(prompt) + out and state.num_computed_tokens == len(state.token_ids) - 1
    return out[:num_tokens], lps[:num_tokens], verified


@pytest.mark.parametrize("sampling", [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.4, logprobs=3),
    SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02, presence_penalty=0.3,
                   logit_bias={300: 2.0}, seed=11, logprobs=2),
], ids=["greedy", "greedy-penalties-logprobs", "seeded-sampling"])
def test_speculation_gives_the_plain_tokens_and_logprobs(sampling):
    reference, reference_lps = plain_run(sampling, 40)
    out, lps, verified = speculative_run(sampling, 40, reference, random.Random(3))
    assert out == reference
    if sampling.logprobs is not None:
        assert [lp.top_token_ids for lp in lps] == [lp.top_token_ids for lp in reference_lps]
        assert [lp.logprob for lp in lps] == pytest.approx([lp.logprob for lp in reference_lps], abs=1e-4)
    # The drafts were partly right: some steps accepted several, some rejected.
    assert any(accepted >= 2 for _, accepted in verified)
    assert any(accepted < len(drafts) for drafts, accepted in verified)


def test_a_wrong_draft_is_never_accepted_under_greedy():
    sampling = SamplingParams(temperature=0.0)
    reference, _ = plain_run(sampling, 12)
    runner = make_runner()
    blocks = blocks_for(len(PROMPT) + 20, 0)
    runner.execute(StepPlan(0, new=[NewSequence(0, list(PROMPT), len(PROMPT), 0, len(PROMPT), blocks, sampling)]))
    wrong = [(reference[1] + 1) % 512, reference[2]]
    result = runner.execute(StepPlan(1, running=[RunningSequence(0, 3, [], wrong)]))
    assert result.outputs[0].token_ids == [reference[1]]
    right = reference[2:6]
    result = runner.execute(StepPlan(2, running=[RunningSequence(0, 5, [], right)]))
    assert result.outputs[0].token_ids == reference[2:7], "all four accepted plus the bonus token"


def test_drafted_and_plain_sequences_share_one_step():
    sampling = SamplingParams(temperature=0.0)
    other = [1, 300, 301, 302, 303]
    ref_a, _ = plain_run(sampling, 10)
    ref_b, _ = plain_run(sampling, 10, prompt=other)
    runner = make_runner()
    runner.execute(StepPlan(0, new=[
        NewSequence(0, list(PROMPT), len(PROMPT), 0, len(PROMPT), blocks_for(40, 0), sampling),
        NewSequence(1, list(other), len(other), 0, len(other), blocks_for(40, 20), sampling),
    ]))
    result = runner.execute(StepPlan(1, running=[RunningSequence(0, 4, [], ref_a[1:4]), RunningSequence(1, 1)]))
    assert result.outputs[0].token_ids == ref_a[1:5]
    assert result.outputs[1].token_ids == ref_b[1:2]


def test_malformed_drafts_are_refused_with_the_field_named():
    sampling = SamplingParams(temperature=0.0)
    runner = make_runner()
    runner.execute(StepPlan(0, new=[NewSequence(0, list(PROMPT), len(PROMPT), 0, len(PROMPT), blocks_for(40, 0), sampling)]))
    with pytest.raises(ValueError, match="expected 1 \\+ 2"):
        runner.execute(StepPlan(1, running=[RunningSequence(0, 2, [], [5, 6])]))
    runner = make_runner()
    runner.execute(StepPlan(0, new=[NewSequence(0, list(PROMPT), len(PROMPT), 0, len(PROMPT), blocks_for(40, 0), sampling)]))
    with pytest.raises(ValueError, match=r"draft_token_ids\[1\] = 9999 is outside \[0, 512\)"):
        runner.execute(StepPlan(1, running=[RunningSequence(0, 3, [], [5, 9999])]))
