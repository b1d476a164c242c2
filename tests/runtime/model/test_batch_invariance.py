"""A request's output does not depend on what else is in the batch.

Greedy: 16 prompts of different lengths generated together give the tokens each gives
alone. Seeded sampling: a request with a seed draws the same tokens alone and in a batch
with other seeded and unseeded requests, wherever it sits in the batch. Logprobs: bitwise the
same alone and batched while every step stays within the fused CPU step's limit. stories260K
takes the fused step, which computes every row, its attention and its LM head product in one
fixed order whatever the batch; the eager BLAS LM head did not (one or two rows take another kernel than more), which moved logprobs in their
last digits and could, at a near tie, move a seeded draw.
"""

from __future__ import annotations

import pytest

from services.common.sampling_params import SamplingParams
from services.scheduler.request.stop import StopConditions
from services.executor.config import ExecutorConfig
from services.inprocess.engine import Engine, EngineConfig
from services.scheduler.core.config import SchedulerLimits
from tests.helpers.engine_runs import generate_all
from tests.helpers.forward_paths import fused_decode

GREEDY = SamplingParams(temperature=0.0)
NEW_TOKENS = 48
STOP = StopConditions(max_tokens=NEW_TOKENS, ignore_eos=True)
# (start in the story, length) of 16 prompts: 1 to 150 tokens.
PROMPT_SLICES = [(0, 1), (3, 2), (5, 3), (9, 5), (2, 8), (30, 13), (11, 21), (40, 34),
                 (17, 55), (60, 89), (23, 120), (71, 7), (80, 17), (90, 40), (100, 70), (4, 150)]


@pytest.fixture(scope="module")
def engine(stories_dir) -> Engine:
    # Prefix caching off: alone and batched, every prompt token is computed in the step.
    executor = ExecutorConfig(model=str(stories_dir), dtype="float32", device="cpu", num_blocks=512)
    return Engine(EngineConfig(executor, SchedulerLimits(enable_prefix_caching=False)))


@pytest.fixture(scope="module")
def prompts(engine) -> list[list[int]]:
    """BOS followed by slices of the model's own story: natural text, no two alike."""
    (story,) = generate_all(engine, [None], GREEDY, StopConditions(max_tokens=300, ignore_eos=True))
    bos = engine.tokenizer.bos_token_id
    return [[bos] + story.token_ids[start : start + n - 1] for start, n in PROMPT_SLICES]


def tokens(engine: Engine, prompts, sampling) -> list[list[int]]:
    return [d.token_ids for d in generate_all(engine, prompts, sampling, STOP)]


def test_sixteen_greedy_prompts_together_match_each_alone(engine, prompts):
    assert sorted(len(p) for p in prompts) == sorted(n for _, n in PROMPT_SLICES)
    alone = [tokens(engine, [p], GREEDY)[0] for p in prompts]
    together = tokens(engine, prompts, GREEDY)
    assert len({tuple(t) for t in alone}) == len(prompts)
    assert all(len(t) == NEW_TOKENS for t in together)
    for i, (a, b) in enumerate(zip(alone, together)):
        assert b == a, f"prompt {i} ({len(prompts[i])} tokens) changed in the batch"


def seeded(seed: int | None) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_p=0.9, seed=seed)


def test_seeded_sampling_is_the_same_alone_and_in_a_mixed_batch(engine, prompts):
    a, b, c = prompts[4], prompts[9], prompts[12]
    alone_a = tokens(engine, [a], seeded(1234))[0]
    alone_b = tokens(engine, [b], seeded(99))[0]
    # Seeded requests at different rows, between unseeded and greedy ones sharing their prompts.
    batch = [c, a, b, a, prompts[0], b]
    samplings = [seeded(None), seeded(1234), seeded(None), seeded(7), GREEDY, seeded(99)]
    together = [d.token_ids for d in generate_all(engine, batch, samplings, STOP)]
    assert together[1] == alone_a
    assert together[5] == alone_b
    # The draws really are random: another seed and greedy decoding take other paths.
    assert together[3] != alone_a
    assert alone_a != tokens(engine, [a], GREEDY)[0]


def test_logprobs_are_bitwise_the_same_alone_and_in_a_batch(engine, prompts):
    fused = fused_decode(engine.runner)
    assert fused is not None and fused.computes_logits
    with_logprobs = SamplingParams(temperature=0.8, top_p=0.9, seed=11, logprobs=3)
    alone = generate_all(engine, [prompts[5]], with_logprobs, STOP)[0]
    batch = [prompts[5], *prompts[:4]]
    # Every step within the fused call's limit: a step over it runs eagerly, whose sums round
    # differently in the last bits, so invariance holds per path, not across the limit.
    assert sum(len(p) for p in batch) <= fused.max_step_tokens
    together = generate_all(engine, batch, [with_logprobs] + [GREEDY] * 4, STOP)[0]
    assert together.token_ids == alone.token_ids
    values = [[(lp.logprob, lp.top_token_ids, lp.top_logprobs) for lp in run.logprobs] for run in (alone, together)]
    assert len(values[0]) == NEW_TOKENS
    assert values[0] == values[1]  # not within a tolerance: digit for digit
