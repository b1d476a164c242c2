"""Lossless speculative sampling through the real ModelRunner (stories260K, top-k 3 at
temperature 1, unseeded): the joint distribution of the first three sampled tokens is the same
with and without drafts (two-sample chi-square over 10,000 sequences each, p > 0.01), and the
same test rejects a verifier that always keeps the first draft.

Every sequence continues one prompt whose K/V sits in shared blocks, 1,000 at a time; drafts
are the greedy continuation after the first sampled token (often right, often not).
"""

from __future__ import annotations

from collections import Counter

import pytest

import services.executor.model_runner as model_runner_module
from services.common.sampling_params import SamplingParams
from services.common.step import NewSequence, RunningSequence, StepPlan
from services.runtime.sampling.verify import emitted_tokens
from services.executor.config import ExecutorConfig
from services.executor.model_runner import ModelRunner
from tests.conftest import STORIES_DIR
from tests.executor.test_speculative_runner import PROMPT, plain_run
from tests.helpers.chi_square import homogeneity

pytestmark = pytest.mark.slow  # some 20,000 sampled sequences: tens of seconds on a small CPU

SAMPLING = SamplingParams(temperature=1.0, top_k=3)
BATCH = 1000
ROUNDS = 10
PREFIX_BLOCKS = [0, 1]  # positions 0..7 of the 10-token prompt
FIRST_OWN_BLOCK = 4


class Runs:
    def __init__(self, speculate: bool) -> None:
        self.runner = make_runner_with_blocks()
        self.speculate = speculate
        self.step = 0
        self.next_seq = 0
        self.drafts_for: dict[int, list[int]] = {}
        # The prompt's K/V: one sequence computes it and is forgotten; its blocks stay written.
        self._run(StepPlan(0, new=[NewSequence(10**6, list(PROMPT), len(PROMPT), 0, len(PROMPT),
                                               PREFIX_BLOCKS + [2, 3], SamplingParams(temperature=0.0))]))

    def _run(self, plan: StepPlan):
        self.step += 1
        return self.runner.execute(plan)

    def greedy_drafts(self, x1: int) -> list[int]:
        if x1 not in self.drafts_for:
            self.drafts_for[x1] = plain_run(SamplingParams(temperature=0.0), 2, prompt=PROMPT + [x1])[0]
        return self.drafts_for[x1]

    def one_round(self) -> list[tuple[int, int, int]]:
        ids = list(range(self.next_seq, self.next_seq + BATCH))
        self.next_seq += BATCH
        # Positions 8 and 9 of the prompt are computed here, 10..12 later: blocks 2 and 3 of the table are its own.
        new = [NewSequence(s, list(PROMPT), len(PROMPT), 8, 2, PREFIX_BLOCKS + [FIRST_OWN_BLOCK + 2 * i, FIRST_OWN_BLOCK + 2 * i + 1],
                           SAMPLING) for i, s in enumerate(ids)]
        out = {o.seq_id: list(o.token_ids) for o in self._run(StepPlan(self.step, new=new)).outputs}
        running = []
        for s in ids:
            drafts = self.greedy_drafts(out[s][0]) if self.speculate else []
            running.append(RunningSequence(s, 1 + len(drafts), [], drafts))
        for o in self._run(StepPlan(self.step, running=running)).outputs:
            out[o.seq_id] += o.token_ids
        short = [s for s in ids if len(out[s]) < 3]
        while short:
            for o in self._run(StepPlan(self.step, running=[RunningSequence(s, 1) for s in short])).outputs:
                out[o.seq_id] += o.token_ids
            short = [s for s in ids if len(out[s]) < 3]
        self._run(StepPlan(self.step, finished_seq_ids=ids))
        return [tuple(out[s][:3]) for s in ids]

    def counts(self, rounds: int = ROUNDS) -> Counter:
        counts: Counter = Counter()
        for _ in range(rounds):
            counts.update(self.one_round())
        return counts


def make_runner_with_blocks() -> ModelRunner:
    return ModelRunner(ExecutorConfig(model=str(STORIES_DIR), dtype="fp32", device="cpu", attention_backend="torch",
                                      block_size=4, num_blocks=FIRST_OWN_BLOCK + 2 * BATCH, seed=5))


@pytest.fixture(scope="module")
def plain_counts() -> Counter:
    return Runs(speculate=False).counts()


def test_speculative_sampling_through_the_runner_matches_plain_sampling(plain_counts):
    runs = Runs(speculate=True)
    spec_counts = runs.counts()
    assert sum(spec_counts.values()) == sum(plain_counts.values()) == BATCH * ROUNDS
    assert homogeneity(plain_counts, spec_counts) > 0.01
    # The drafts were tried and were right often enough to matter.
    assert len(runs.drafts_for) >= 2


def test_the_same_test_rejects_a_verifier_that_keeps_the_first_draft(plain_counts, monkeypatch):
    def keeps_first_draft(target_ids, draft_ids):
        if not draft_ids:
            return emitted_tokens(target_ids, draft_ids)
        return [draft_ids[0]] + emitted_tokens(target_ids[1:], draft_ids[1:])

    monkeypatch.setattr(model_runner_module, "emitted_tokens", keeps_first_draft)
    broken = Runs(speculate=True).counts(rounds=4)  # 4,000 sequences are plenty to see it
    assert homogeneity(plain_counts, broken) < 0.01
