"""What one hostile request can do to the others, inside the engine core (driven through its
ports, as tests/scheduler/test_engine_core.py does): a stream its detokenizer refuses ends that
request alone, and drafts naming ids outside the vocabulary are dropped (counted), never sent
to the executor. The same findings through real servers: tests/stack/test_hostile.py."""

from __future__ import annotations

from services.common.detokenize import DetokenizeBatch, DetokenizeResult
from services.scheduler.engine.publisher import TEXT_FAILED
from services.scheduler.request.delta import GenerationDelta
from services.scheduler.request.finish_reason import FinishReason
from services.scheduler.request.stop import StopConditions
from tests.scheduler.test_engine_core import (GREEDY, INFO, PROMPT, CountingExecutor, LetterDetokenizer, OracleDrafter,
                                              continuation, make_core, merged, run_to_end)


class RefusingDetokenizer(LetterDetokenizer):
    """Fails the stream of every request whose prompt starts with ``bad_first`` (as the tokenizer
    service reports a stream whose ids it does not have)."""

    def __init__(self, bad_first: int) -> None:
        super().__init__()
        self.bad_first = bad_first
        self.refused: set[int] = set()

    async def detokenize(self, batch: DetokenizeBatch) -> DetokenizeResult:
        bad = {n.stream_id for n in batch.new_streams if n.prompt_tail[:1] == [self.bad_first]}
        self.refused |= bad
        batch = DetokenizeBatch([n for n in batch.new_streams if n.stream_id not in bad],
                                [(s, ids) for s, ids in batch.appended if s not in self.refused], batch.closed)
        result = await super().detokenize(batch)
        result.failed.update({s: "token_ids holds 99, outside the vocabulary" for s in bad})
        return result


async def test_a_stream_the_detokenizer_refuses_ends_that_request_alone():
    core, _, _ = make_core(num_scheduler_steps=1)
    core.detokenizers[0] = core.publisher._detokenizers[0] = RefusingDetokenizer(bad_first=9)
    good: list[GenerationDelta] = []
    bad: list[GenerationDelta] = []
    core.submit("good", PROMPT, GREEDY, StopConditions(max_tokens=8), good.append)
    core.submit("bad", [9, *PROMPT], GREEDY, StopConditions(max_tokens=8), bad.append)
    await run_to_end(core)
    assert merged(good).token_ids == continuation(PROMPT, 8) and merged(good).finish_reason is FinishReason.LENGTH
    out = merged(bad)
    assert out.finish_reason is FinishReason.ERROR and out.error_message == TEXT_FAILED
    assert core.scheduler.block_manager.pool.num_free == INFO.num_blocks


class OutOfVocabDrafter(OracleDrafter):
    """Right drafts, except that every other answer names an id past the vocabulary mid-draft."""

    async def propose(self, asks, live_seq_ids):
        drafts = await super().propose(asks, live_seq_ids)
        if self.asks % 2:
            for seq_id, draft in drafts.items():
                draft[1:2] = [INFO.vocab_size + 5]
        return drafts


class RecordingExecutor(CountingExecutor):
    def __init__(self) -> None:
        super().__init__()
        self.drafts: list[int] = []

    async def send(self, plan) -> None:
        self.drafts += [t for seq in plan.running for t in seq.draft_token_ids]
        await super().send(plan)


async def test_drafts_outside_the_vocabulary_are_dropped_and_counted():
    executor = RecordingExecutor()
    core, _, lost = make_core(executor=executor, drafter=OutOfVocabDrafter(), num_scheduler_steps=1)
    deltas: list[GenerationDelta] = []
    core.submit("a", PROMPT, GREEDY, StopConditions(max_tokens=16), deltas.append)
    await run_to_end(core)
    out = merged(deltas)
    assert out.token_ids == continuation(PROMPT, 16) and out.finish_reason is FinishReason.LENGTH and not lost
    assert executor.drafts and max(executor.drafts) < INFO.vocab_size
    assert core.drafting.num_invalid_drafts > 0
    assert out.timings.accepted_draft_tokens > 0  # the valid prefix of a cut draft still counts
