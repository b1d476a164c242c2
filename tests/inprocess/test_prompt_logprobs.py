"""Prompt logprobs (SamplingParams.prompt_logprobs) against transformers' logits on stories260K:
each prompt token's logprob given the tokens before it and the top alternatives, computed over
chunked prefill (chunks of 7: the fused CPU step's size) and over one whole-prompt step, and
not skipped by the prefix cache (a request that asks reads none of it)."""

from __future__ import annotations

import pytest
import torch
import transformers

from services.common.sampling_params import SamplingParams
from services.executor.config import ExecutorConfig
from services.inprocess.engine import Engine, EngineConfig
from services.scheduler.core.config import SchedulerLimits
from services.scheduler.request.stop import StopConditions
from tests.helpers.engine_runs import generate_all
from tests.helpers.service_harness import STORIES_DIR

PROMPT = ("Once upon a time there was a little girl named Lily. She liked to play in the park with her friends. "
          "One day she saw a big red ball under a tree and she ran to get it. ") * 2
TOP = 3
STOP = StopConditions(max_tokens=2, ignore_eos=True)


@pytest.fixture(scope="module")
def reference():
    model = transformers.AutoModelForCausalLM.from_pretrained(STORIES_DIR, dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)  # [P, V]

    return logprobs


@pytest.mark.parametrize("chunk", [7, 0], ids=["chunked", "whole"])
def test_prompt_logprobs_match_transformers_and_skip_the_prefix_cache(reference, chunk):
    engine = Engine(EngineConfig(ExecutorConfig(model=str(STORIES_DIR), dtype="float32", device="cpu", num_blocks=64),
                                 SchedulerLimits(long_prefill_token_threshold=chunk)))
    ids = engine.encode_prompt(PROMPT)
    assert len(ids) > 64  # past the fused CPU step's size: the whole prompt runs eagerly
    (warm,) = generate_all(engine, [PROMPT], SamplingParams(temperature=0.0), STOP)  # fills the prefix cache
    assert warm.prompt_logprobs is None
    deltas = [d for _, d in engine.generate([PROMPT], SamplingParams(temperature=0.0, prompt_logprobs=TOP), STOP)]
    got = deltas[0].prompt_logprobs
    assert all(d.prompt_logprobs is None for d in deltas[1:])
    assert deltas[-1].usage.cached_tokens == 0  # the cached prefix was not read
    assert [token_id for token_id, _ in got] == ids
    assert got[0][1].logprob == 0.0 and not got[0][1].top_token_ids  # nothing predicts the first token
    expected = reference(ids)
    for position, (token_id, entry) in enumerate(got[1:]):
        row = expected[position]
        assert entry.logprob == pytest.approx(row[token_id].item(), abs=1e-4), position
        values, top_ids = row.topk(TOP)
        assert entry.top_logprobs == pytest.approx(values.tolist(), abs=1e-4), position
        assert entry.top_token_ids == top_ids.tolist() or len(set(values.tolist())) < TOP, position
    again = generate_all(engine, [PROMPT], SamplingParams(temperature=0.0), STOP)[0]
    assert again.usage.cached_tokens > 0 and again.token_ids == warm.token_ids
