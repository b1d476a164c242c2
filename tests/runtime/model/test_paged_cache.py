"""Where K/V live must not change what is generated.

Block size, which physical blocks a sequence gets (shuffled, interleaved with other
sequences), how a step mixes prompts of very different lengths, whether a prompt is
computed in one step or in chunks, and whether its prefix comes from the prefix cache:
greedy outputs are compared token for token against a plain arrangement.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from services.common.sampling_params import SamplingParams
from services.scheduler.request.stop import StopConditions
from services.common.step import NewSequence, RunningSequence, StepPlan
from services.executor.config import ExecutorConfig
from services.executor.model_runner import ModelRunner
from services.inprocess.engine import Engine, EngineConfig
from services.scheduler.core.config import SchedulerLimits
from tests.helpers.engine_runs import generate_all

GREEDY = SamplingParams(temperature=0.0)
KV_CAPACITY_TOKENS = 4096


def make_engine(model_dir: Path, block_size: int = 16, **limits) -> Engine:
    executor = ExecutorConfig(model=str(model_dir), dtype="float32", device="cpu", block_size=block_size,
                              num_blocks=KV_CAPACITY_TOKENS // block_size)
    return Engine(EngineConfig(executor, SchedulerLimits(**limits)))


def greedy_tokens(engine: Engine, prompts, max_tokens: int) -> list[list[int]]:
    stop = StopConditions(max_tokens=max_tokens, ignore_eos=True)
    return [d.token_ids for d in generate_all(engine, prompts, GREEDY, stop)]


def record_plans(engine: Engine) -> list[StepPlan]:
    """Keep every plan the engine sends to its model runner."""
    plans: list[StepPlan] = []
    execute = engine.runner.execute

    def recording(plan: StepPlan):
        plans.append(plan)
        return execute(plan)

    engine.runner.execute = recording
    return plans


def story_ids(engine: Engine, length: int) -> list[int]:
    """A natural-text prompt of exactly ``length`` tokens: BOS plus the model's own story."""
    (out,) = generate_all(engine, [None], GREEDY, StopConditions(max_tokens=length - 1, ignore_eos=True))
    return [engine.tokenizer.bos_token_id] + out.token_ids


@pytest.fixture(scope="module")
def engine16(stories_dir) -> Engine:
    return make_engine(stories_dir)


@pytest.fixture(scope="module")
def long_story(engine16) -> list[int]:
    return story_ids(engine16, 300)


# ---------------------------------------------------------------------------- block size


def test_block_sizes_1_16_32_generate_the_same_tokens(stories_dir, engine16):
    prompts = [None, "Once upon a time", "The little bird sang a song about the big tree"]
    expected = greedy_tokens(engine16, prompts, 64)
    assert len({tuple(t) for t in expected}) == 3
    for block_size in (1, 32):
        assert greedy_tokens(make_engine(stories_dir, block_size), prompts, 64) == expected, block_size


# ---------------------------------------------------------------------------- block placement


def run_greedy_on_runner(runner: ModelRunner, prompts: list[list[int]], steps: int,
                         block_pool: list[int]) -> list[list[int]]:
    """Drive the runner like a scheduler: all prompts in one step, then decode steps that
    append a block from ``block_pool`` (taken in order) whenever a sequence needs one."""
    bs = runner.block_size
    pool = list(block_pool)
    tables: list[list[int]] = []
    new = []
    for seq_id, prompt in enumerate(prompts):
        table = [pool.pop(0) for _ in range(-(-len(prompt) // bs))]
        tables.append(table)
        new.append(NewSequence(seq_id, list(prompt), len(prompt), 0, len(prompt), list(table), GREEDY))
    result = runner.execute(StepPlan(0, new=new))
    outputs = [o.token_ids[:] for o in result.outputs]
    for step in range(1, steps):
        running = []
        for seq_id, prompt in enumerate(prompts):
            position = len(prompt) + len(outputs[seq_id]) - 1  # the last sampled token is computed now
            appended = []
            if position // bs >= len(tables[seq_id]):
                appended.append(pool.pop(0))
                tables[seq_id].extend(appended)
            running.append(RunningSequence(seq_id, 1, appended))
        result = runner.execute(StepPlan(step, running=running))
        for o in result.outputs:
            outputs[o.seq_id].extend(o.token_ids)
    return outputs


@pytest.mark.parametrize("model", ["stories260K", "llama-gqa-8-2"])
def test_shuffled_non_contiguous_blocks_match_contiguous(stories_dir, random_model_dirs, model):
    model_dir = stories_dir if model == "stories260K" else random_model_dirs[model]
    num_blocks = 256
    block_size = 4  # small blocks: every sequence crosses many block boundaries
    rng = random.Random(5)
    prompts = [[1] + [rng.randrange(3, 512) for _ in range(n - 1)] for n in (1, 6, 23, 64)]
    config = ExecutorConfig(model=str(model_dir), dtype="float32", device="cpu", block_size=block_size,
                            num_blocks=num_blocks)
    contiguous = run_greedy_on_runner(ModelRunner(config), prompts, 40, list(range(num_blocks)))
    shuffled_pool = list(range(num_blocks))
    rng.shuffle(shuffled_pool)
    # The first and last physical blocks are taken early (index edge cases): the last one
    # starts the second prompt's table, block 0 sits in the middle of the longest prompt's.
    for index, block in ((1, num_blocks - 1), (20, 0)):
        j = shuffled_pool.index(block)
        shuffled_pool[index], shuffled_pool[j] = shuffled_pool[j], shuffled_pool[index]
    shuffled = run_greedy_on_runner(ModelRunner(config), prompts, 40, shuffled_pool)
    assert all(len(t) == 40 for t in contiguous)
    assert shuffled == contiguous


# ---------------------------------------------------------------------------- mixed lengths


def test_prompts_of_1_5_100_300_tokens_in_one_step_match_each_alone(stories_dir, long_story):
    # Different slices of one story after BOS: no two prompts share a block, and caching is
    # off, so alone and together compute every prompt token from scratch.
    prompts = [[1] + long_story[start : start + n - 1] for start, n in ((0, 1), (7, 5), (20, 100), (1, 300))]
    engine = make_engine(stories_dir, enable_prefix_caching=False)
    alone = [greedy_tokens(engine, [p], 32)[0] for p in prompts]
    plans = record_plans(engine)
    together = greedy_tokens(engine, prompts, 32)
    first = plans[0]
    assert [(len(s.token_ids), s.num_computed_tokens, s.num_scheduled_tokens) for s in first.new] == [
        (1, 0, 1), (5, 0, 5), (100, 0, 100), (300, 0, 300)
    ]
    assert len({tuple(t) for t in alone}) == 4
    assert together == alone


# ---------------------------------------------------------------------------- chunked prefill


def test_chunked_prefill_matches_whole_prompts(stories_dir, long_story):
    prompts = [long_story[:300], long_story[:5], long_story[:100] + [400, 371, 262]]
    whole = greedy_tokens(make_engine(stories_dir, enable_prefix_caching=False), prompts, 48)
    chunked_engine = make_engine(stories_dir, max_num_seqs=4, max_num_batched_tokens=32,
                                 enable_prefix_caching=False)
    plans = record_plans(chunked_engine)
    assert greedy_tokens(chunked_engine, prompts, 48) == whole
    # The 300-token prompt really went in pieces of at most 32 tokens.
    assert max(p.num_scheduled_tokens for p in plans) <= 32
    first_chunk = next(s for p in plans for s in p.new if len(s.token_ids) == 300)
    assert first_chunk.num_scheduled_tokens < 300


# ---------------------------------------------------------------------------- prefix caching


def test_prefix_caching_on_and_off_generate_the_same_tokens(stories_dir, long_story):
    shared = long_story[:200]
    first = shared + [400, 371, 262]
    followers = [shared + [302, 322], shared + [442, 263, 280, 431]]
    results = {}
    for caching in (True, False):
        engine = make_engine(stories_dir, enable_prefix_caching=caching)
        stop = StopConditions(max_tokens=40, ignore_eos=True)
        (lead,) = generate_all(engine, [first], GREEDY, stop)
        rest = generate_all(engine, followers, GREEDY, stop)
        results[caching] = [d.token_ids for d in (lead, *rest)]
        cached = [d.usage.cached_tokens for d in (lead, *rest)]
        # 200 shared tokens fill 12 blocks of 16 (192 tokens); the 13th also holds the suffix.
        assert cached == ([0, 192, 192] if caching else [0, 0, 0])
    assert results[True] == results[False]
