"""A request's output does not depend on the batch it runs in (stories260K, the fused CPU step).

Seeded sampling draws from the request's own generator, so what a seeded request samples, and
the logprobs it is shown, follow from its logits alone; those must then be bitwise the same
alone and beside other requests. The fused step computes every row, its attention and its LM
head product in one fixed order whatever the batch (services/runtime/model/fused_decode.py);
the eager BLAS LM head did not (one or two rows take another kernel than more), which moved
logprobs in their last digits and could, at a near tie, move a seeded draw.
"""

from __future__ import annotations

import torch

from services.common.sampling_params import SamplingParams
from services.common.stop import StopConditions
from services.executor.config import ExecutorConfig
from services.inprocess.engine import Engine, EngineConfig
from tests.conftest import STORIES_DIR

SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=11, logprobs=3)
OTHERS = ["The little dog", "Lily wanted to play", "Tom and his mom went to the shop to buy",
          "A bird sang", "The sun"]


def run(prompts: list[str], samplings: list[SamplingParams]):
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = Engine(EngineConfig(ExecutorConfig(model=str(STORIES_DIR), dtype="fp32", device="cpu",
                                                    num_blocks=128)))
        assert engine.runner.fused_decode is not None and engine.runner.fused_decode.computes_logits
        stops = [StopConditions(max_tokens=40 + 7 * i, ignore_eos=True) for i in range(len(prompts))]
        return engine.generate_all(prompts, samplings, stops)
    finally:
        torch.set_num_threads(previous)


def test_a_seeded_requests_tokens_and_logprobs_do_not_depend_on_its_batch():
    alone = run(["Once upon a time"], [SEEDED])[0]
    batched = run(["Once upon a time", *OTHERS], [SEEDED] + [SamplingParams(temperature=0.0)] * len(OTHERS))[0]
    assert batched.token_ids == alone.token_ids and len(alone.token_ids) == 40
    values = [[(lp.logprob, lp.top_token_ids, lp.top_logprobs) for lp in run.logprobs] for run in (alone, batched)]
    assert len(values[0]) == 40
    assert values[0] == values[1]  # bitwise, not within a tolerance
