"""A model whose config vocab is larger than its tokenizer's (Qwen2-family checkpoints: 151,936
rows, 151,665 ids): the runner reports the tokenizer's ids as its vocabulary and never samples
a padded row, greedy or sampled, on the eager and the fused CPU paths, with speculative drafts
and multi-step bursts. The padded rows of tests/helpers/padded_vocab.py outscore the real ones,
so a runner that does not mask them samples padded ids at once."""

from __future__ import annotations

import json

import pytest

from services.common.sampling_params import SamplingParams
from services.common.step import NewSequence, RunningSequence, StepPlan
from services.executor.config import ExecutorConfig
from services.executor.forward_paths.fused_decode import FusedDecodeSettings
from services.executor.model_runner import ModelRunner
from services.runtime.model.vocab import sampled_vocab_size, tokenizer_vocab_size
from tests.conftest import STORIES_DIR
from tests.helpers.padded_vocab import TOKENIZER_VOCAB, padded_vocab_model

BLOCK_SIZE = 4
PROMPT = [1, 403, 407, 261, 378, 350]


@pytest.fixture(scope="module")
def padded_dir(tmp_path_factory):
    return padded_vocab_model(tmp_path_factory.mktemp("padded") / "stories-padded")


def test_the_sampled_vocabulary_is_the_smaller_of_config_and_tokenizer(padded_dir, tmp_path) -> None:
    assert tokenizer_vocab_size(STORIES_DIR) == TOKENIZER_VOCAB
    assert sampled_vocab_size(padded_dir, 2 * TOKENIZER_VOCAB) == TOKENIZER_VOCAB
    assert sampled_vocab_size(STORIES_DIR, 300) == 300  # a tokenizer larger than the head: the head's rows
    assert sampled_vocab_size(tmp_path, 700) == 700  # no tokenizer.json: the config's
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "Unigram", "vocab": [["a", 0.0]] * 9},
                                                         "added_tokens": [{"id": 12, "content": "<x>"}]}))
    assert tokenizer_vocab_size(tmp_path) == 13


@pytest.mark.parametrize("cpu_decode", ["eager", "fused"])
def test_padded_rows_are_never_sampled(padded_dir, cpu_decode: str) -> None:
    runner = ModelRunner(ExecutorConfig(model=str(padded_dir), dtype="fp32", device="cpu", attention_backend="cpu",
                                        block_size=BLOCK_SIZE, num_blocks=64, seed=5,
                                        fused_decode=FusedDecodeSettings(cpu_decode=cpu_decode)))
    assert runner.model_config.vocab_size == 2 * TOKENIZER_VOCAB
    assert runner.info().vocab_size == TOKENIZER_VOCAB
    samplings = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logprobs=5),
                 SamplingParams(temperature=1.0, seed=3), SamplingParams(temperature=2.0, top_k=50, seed=4)]
    new = [NewSequence(i, list(PROMPT), len(PROMPT), 0, len(PROMPT), list(range(8 * i, 8 * i + 8)), s)
           for i, s in enumerate(samplings)]
    outputs = {o.seq_id: list(o.token_ids) for o in runner.execute(StepPlan(0, new=new)).outputs}
    logprob_ids = []
    for step in range(1, 6):
        running = [RunningSequence(i, 1, num_steps=3 if step % 2 else 1) for i in outputs]
        if step == 4:  # drafts verified over the masked logits too
            running[0] = RunningSequence(0, 3, draft_token_ids=[7, 9])
        for out in runner.execute(StepPlan(step, running=running)).outputs:
            outputs[out.seq_id].extend(out.token_ids)
            logprob_ids += [t for lp in out.logprobs or () for t in lp.top_token_ids]
    sampled = [t for ids in outputs.values() for t in ids]
    assert len(sampled) > 40 and logprob_ids
    assert max(sampled + logprob_ids) < TOKENIZER_VOCAB, outputs
