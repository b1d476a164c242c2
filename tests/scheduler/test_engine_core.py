"""The engine core (services/scheduler/engine/core.py) driven through its ports.

A tiny greedy "model" behind the executor port keeps its sequences between steps exactly as
the step contract says (new in full, running as deltas, drafts verified, multi-step bursts),
so the core's loop runs as it does in front of a real executor: overlap, speculation, stop
strings, aborts and a lost executor, with every delta, reason and timing exact (the clock is
the test's). The same core behind the in-process engine is tested on the real model in
tests/inprocess/test_engine_loop.py.
"""

from __future__ import annotations

import asyncio
from collections import deque

import pytest

from services.common.detokenize import DetokenizeBatch, DetokenizeResult
from services.common.errors import InvalidArgumentError, ResourceExhaustedError, UnavailableError
from services.common.sampling_params import SamplingParams
from services.common.step import ExecutorInfo, SequenceOutput, StepPlan, StepResult
from services.scheduler.core.config import SchedulerLimits
from services.scheduler.core.speculation import SpeculationConfig
from services.scheduler.engine.core import EngineCore, model_eos_token_ids
from services.scheduler.engine.failover import NO_EXECUTOR_LEFT
from services.scheduler.request.delta import GenerationDelta, Timings, Usage
from services.scheduler.request.finish_reason import FinishReason
from services.scheduler.request.stop import StopConditions
from services.tokenizer.stop_strings import StopStringMatcher

EOS = 2
GREEDY = SamplingParams(temperature=0.0)
INFO = ExecutorInfo(num_blocks=64, block_size=4, max_model_len=64, vocab_size=100, dtype="fp32", device="cpu",
                    attention_backend="torch", model="m", architecture="LlamaForCausalLM", bos_token_id=1,
                    eos_token_ids=(EOS,))


def next_token(tokens: list[int]) -> int:
    """The model: its greedy choice after ``tokens`` (never EOS)."""
    return 10 + (tokens[-1] * 7 + len(tokens)) % 50


def continuation(prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


class CountingExecutor:
    """An ExecutorPort over ``next_token``: it runs each plan when sent and logs sends and receives."""

    def __init__(self) -> None:
        self.tokens: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}
        self.results: deque[StepResult] = deque()
        self.log: list[tuple[str, int]] = []
        self.connected = True
        self.fail_on_send: int | None = None
        self.drafts_overlapped = 0
        """Plans verifying drafts sent while another plan was in flight."""

    async def send(self, plan: StepPlan) -> None:
        if self.fail_on_send == plan.step_id:
            self.connected = False
            raise UnavailableError("the executor went away")
        self.log.append(("send", plan.step_id))
        if any(seq.draft_token_ids for seq in plan.running) and self.results:
            self.drafts_overlapped += 1
        self.results.append(self._run(plan))

    async def receive(self, step_id: int) -> StepResult:
        self.log.append(("receive", step_id))
        return self.results.popleft()

    @property
    def max_in_flight(self) -> int:
        depth = most = 0
        for kind, _ in self.log:
            depth += 1 if kind == "send" else -1
            most = max(most, depth)
        return most

    def _run(self, plan: StepPlan) -> StepResult:
        for seq_id in plan.finished_seq_ids:
            self.tokens.pop(seq_id, None)
        outputs = []
        for new in plan.new:
            self.tokens[new.seq_id] = list(new.token_ids)
            self.computed[new.seq_id] = new.num_computed_tokens
            outputs.append(self._advance(new.seq_id, new.num_scheduled_tokens, [], 1))
        for seq in plan.running:
            outputs.append(self._advance(seq.seq_id, seq.num_scheduled_tokens, seq.draft_token_ids, seq.num_steps))
        return StepResult(plan.step_id, outputs, execute_seconds=0.001)

    def _advance(self, seq_id: int, num_scheduled: int, drafts: list[int], num_steps: int) -> SequenceOutput:
        tokens = self.tokens[seq_id]
        self.computed[seq_id] += num_scheduled - len(drafts)
        if self.computed[seq_id] < len(tokens):
            return SequenceOutput(seq_id, [])  # a prefill chunk short of the end
        sampled = []
        for draft in drafts:  # greedy verification: accepted while the model agrees
            if draft != next_token(tokens):
                break
            tokens.append(draft)
            sampled.append(draft)
        for _ in range(num_steps):
            tokens.append(next_token(tokens))
            sampled.append(tokens[-1])
        self.computed[seq_id] = len(tokens) - 1
        return SequenceOutput(seq_id, sampled)


class LetterDetokenizer:
    """A DetokenizerPort whose token t reads as one letter; stop strings as the tokenizer matches them."""

    connected = True
    accepting = True

    def __init__(self) -> None:
        self.matchers: dict[int, StopStringMatcher | None] = {}
        self.batches: list[DetokenizeBatch] = []

    async def detokenize(self, batch: DetokenizeBatch) -> DetokenizeResult:
        self.batches.append(batch)
        for new in batch.new_streams:
            self.matchers[new.stream_id] = StopStringMatcher(new.stop, new.include_stop_str_in_output) if new.stop \
                else None
        result = DetokenizeResult()
        for stream_id, ids in batch.appended:
            text = "".join(chr(ord("a") + t % 26) for t in ids)
            matcher = self.matchers[stream_id]
            if matcher is not None:
                text, matched = matcher.feed(text)
                if matched is not None:
                    result.stopped[stream_id] = matched
                    del self.matchers[stream_id]
            result.texts[stream_id] = text
        for stream_id in batch.closed:
            self.matchers.pop(stream_id, None)
        return result


class OracleDrafter:
    """A DrafterPort that knows the model: its drafts are always right (or always wrong)."""

    connected = True

    def __init__(self, right: bool = True) -> None:
        self.right = right
        self.asks = 0

    async def propose(self, asks, live_seq_ids):
        self.asks += 1
        drafts = {}
        for request, k in asks:
            draft = continuation(request.all_token_ids, k)
            drafts[request.seq_id] = draft if self.right else [t + 1 for t in draft]
        return drafts

    def forget_all(self) -> None:
        pass


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 0.25
        return self.now


def make_core(executor=None, drafter=None, clock=None, **limits) -> tuple[EngineCore, CountingExecutor, list]:
    lost: list[tuple[str, str]] = []
    limits = SchedulerLimits(**{"max_num_seqs": 4, "max_num_batched_tokens": 64, **limits})
    core = EngineCore(limits, [LetterDetokenizer()], drafter=drafter,
                      speculation=SpeculationConfig(num_speculative_tokens=3, adaptive=False),
                      clock=clock or Clock(), on_executor_lost=lambda name, error: lost.append((name, error)))
    executor = executor or CountingExecutor()
    core.attach("e0", executor, INFO)
    return core, executor, lost


async def run_to_end(core: EngineCore, max_rounds: int = 200) -> None:
    for _ in range(max_rounds):
        if not core.has_unfinished():
            break
        await core.step()
        await core.publisher.drain()
    assert not core.has_unfinished()


def merged(deltas: list[GenerationDelta]) -> GenerationDelta:
    out = GenerationDelta(deltas[0].request_id)
    for delta in deltas:
        out.absorb(delta)
    assert [d.finished for d in deltas].count(True) == 1 and deltas[-1].finished
    return out


PROMPT = [5, 6, 7]


@pytest.mark.parametrize("overlap", [True, False])
async def test_greedy_tokens_follow_the_model_with_and_without_overlap(overlap):
    core, executor, _ = make_core(overlap_scheduling=overlap, num_scheduler_steps=1)
    deltas: list[GenerationDelta] = []
    core.submit("a", PROMPT, GREEDY, StopConditions(max_tokens=6), deltas.append)
    await run_to_end(core)
    out = merged(deltas)
    assert out.token_ids == continuation(PROMPT, 6) and out.finish_reason is FinishReason.LENGTH
    assert out.text == "".join(chr(ord("a") + t % 26) for t in out.token_ids)
    # With overlap the next plan is sent before the previous result is read.
    assert executor.max_in_flight == (2 if overlap else 1)
    assert (core.step_times.overlapped > 0) is overlap
    assert core.scheduler.block_manager.pool.num_free == INFO.num_blocks


async def test_drafts_are_verified_one_step_at_a_time_and_change_nothing():
    reference, _, _ = make_core(num_scheduler_steps=1)
    ref_deltas: list[GenerationDelta] = []
    reference.submit("a", PROMPT, GREEDY, StopConditions(max_tokens=12), ref_deltas.append)
    await run_to_end(reference)

    drafter = OracleDrafter()
    core, executor, _ = make_core(drafter=drafter, num_scheduler_steps=1)
    deltas: list[GenerationDelta] = []
    core.submit("a", PROMPT, GREEDY, StopConditions(max_tokens=12), deltas.append)
    await run_to_end(core)
    out = merged(deltas)
    assert out.token_ids == merged(ref_deltas).token_ids
    assert drafter.asks > 0 and out.timings.accepted_draft_tokens > 0
    assert core.scheduler.get_stats().spec_decode.num_accepted_tokens == out.timings.accepted_draft_tokens
    assert executor.drafts_overlapped == 0  # a step verifying drafts is never overlapped
    assert executor.log.count(("send", 0)) == 1 and len([e for e in executor.log if e[0] == "send"]) < 12


async def test_wrong_drafts_are_rejected_and_the_output_is_unchanged():
    core, _, _ = make_core(drafter=OracleDrafter(right=False), num_scheduler_steps=1)
    deltas: list[GenerationDelta] = []
    core.submit("a", PROMPT, GREEDY, StopConditions(max_tokens=8), deltas.append)
    await run_to_end(core)
    out = merged(deltas)
    assert out.token_ids == continuation(PROMPT, 8) and out.timings.accepted_draft_tokens == 0


async def test_a_stop_string_found_by_the_detokenizer_ends_the_request_in_the_core():
    tokens = continuation(PROMPT, 10)
    letters = "".join(chr(ord("a") + t % 26) for t in tokens)
    stop = letters[3:5]  # spans the 4th and 5th tokens
    core, executor, _ = make_core()
    deltas: list[GenerationDelta] = []
    core.submit("a", PROMPT, GREEDY, StopConditions(max_tokens=10, stop=(stop,)), deltas.append)
    await run_to_end(core)
    out = merged(deltas)
    assert (out.text, out.finish_reason, out.stop_reason) == (letters[:3], FinishReason.STOP, stop)
    # Tokens are reported up to the step whose text matched (the stop was seen one step late at most).
    assert out.token_ids == tokens[:len(out.token_ids)] and 5 <= len(out.token_ids) <= 6
    assert not core.scheduler.requests and core.scheduler.block_manager.pool.num_free == INFO.num_blocks
    detokenizer = core.detokenizers[0]
    assert detokenizer.batches[0].new_streams[0].stop == (stop,)


async def test_abort_delivers_one_final_delta_with_the_tokens_so_far_and_frees_the_blocks():
    clock = Clock()
    core, executor, _ = make_core(clock=clock, num_scheduler_steps=1)
    deltas: list[GenerationDelta] = []
    core.submit("a", PROMPT, GREEDY, StopConditions(max_tokens=20), deltas.append)  # arrives at 0.25
    await core.step()
    await core.publisher.drain()
    final = core.abort("a")
    assert final is deltas[-1] and final.finish_reason is FinishReason.ABORT
    assert final.usage == Usage(3, sum(len(d.token_ids) for d in deltas), 0)
    assert core.abort("a") is None and not core.has_unfinished()
    await run_to_end(core)
    assert core.scheduler.block_manager.pool.num_free == INFO.num_blocks
    await core.step()  # the executor is told to forget it
    assert executor.tokens == {}


async def test_timings_come_from_the_injected_clock():
    clock = Clock()
    core, _, _ = make_core(clock=clock, overlap_scheduling=False, num_scheduler_steps=1)
    deltas: list[GenerationDelta] = []
    core.submit("a", PROMPT, GREEDY, StopConditions(max_tokens=1), deltas.append)  # arrival 0.25
    await run_to_end(core)  # scheduled at 0.5; the output stage stamps 0.75
    (final,) = deltas
    assert final.timings == Timings(queue_time_ms=250.0, time_to_first_token_ms=500.0, decode_time_ms=0.0,
                                    e2e_ms=500.0)


async def test_a_lost_executors_requests_move_to_the_other_and_finish_as_if_nothing_happened():
    failing = CountingExecutor()
    failing.fail_on_send = 3
    core, _, lost = make_core(executor=failing, num_scheduler_steps=1)
    survivor = CountingExecutor()
    core.attach("e1", survivor, INFO)
    streams: dict[str, list[GenerationDelta]] = {f"r{i}": [] for i in range(6)}
    for request_id, sink in streams.items():
        core.submit(request_id, PROMPT, GREEDY, StopConditions(max_tokens=20), sink.append)
    assert {len(lane.scheduler.requests) for lane in core.lanes.values()} == {3}  # spread by load
    await run_to_end(core)
    for deltas in streams.values():
        out = merged(deltas)  # exactly one final delta
        assert (out.token_ids, out.finish_reason) == (continuation(PROMPT, 20), FinishReason.LENGTH)
    assert lost == [("e0", "the executor went away")] and list(core.lanes) == ["e1"]
    assert core.scheduler.block_manager.pool.num_free == INFO.num_blocks


async def test_with_no_executor_left_requests_wait_then_end_with_one_error():
    executor = CountingExecutor()
    executor.fail_on_send = 2
    core, _, lost = make_core(executor=executor, num_scheduler_steps=1, executor_wait_s=0.2)
    streams: dict[str, list[GenerationDelta]] = {"a": [], "b": []}
    for request_id, sink in streams.items():
        core.submit(request_id, PROMPT, GREEDY, StopConditions(max_tokens=20), sink.append)
    for _ in range(4):
        await core.step()
        await core.publisher.drain()
    assert not core.lanes and len(core.failover.parked) == 2
    assert all(not d.finished for deltas in streams.values() for d in deltas)  # a pause, not an error yet
    with pytest.raises(UnavailableError, match="executor is unavailable"):
        core.submit("c", PROMPT, GREEDY, StopConditions(max_tokens=2), lambda d: None)
    await asyncio.sleep(0.3)
    for deltas in streams.values():
        assert [d.finished for d in deltas].count(True) == 1
        assert deltas[-1].finish_reason is FinishReason.ERROR and deltas[-1].error_message == NO_EXECUTOR_LEFT
    assert not core.has_unfinished() and not core.failover.parked


async def test_a_parked_request_resumes_when_an_executor_comes_back():
    executor = CountingExecutor()
    executor.fail_on_send = 2
    core, _, _ = make_core(executor=executor, num_scheduler_steps=1)
    deltas: list[GenerationDelta] = []
    core.submit("a", PROMPT, GREEDY, StopConditions(max_tokens=12), deltas.append)
    for _ in range(4):
        await core.step()
        await core.publisher.drain()
    assert not core.lanes and len(core.failover.parked) == 1
    core.attach("e0", CountingExecutor(), INFO)  # the executor restarted
    await run_to_end(core)
    out = merged(deltas)
    assert (out.token_ids, out.finish_reason) == (continuation(PROMPT, 12), FinishReason.LENGTH)


async def test_refusals_name_the_reason_and_keep_nothing():
    core, _, _ = make_core(max_waiting_requests=1)
    core.submit("a", PROMPT, GREEDY, StopConditions(max_tokens=2), lambda d: None)
    with pytest.raises(InvalidArgumentError, match="request_id 'a' is already in use"):
        core.submit("a", PROMPT, GREEDY, StopConditions(max_tokens=2), lambda d: None)
    with pytest.raises(ResourceExhaustedError, match="max_waiting_requests=1"):
        core.submit("b", PROMPT, GREEDY, StopConditions(max_tokens=2), lambda d: None)
    with pytest.raises(ValueError, match=r"prompt_token_ids\[1\] = 100 is outside \[0, 100\)"):
        core.submit("c", [1, 100], GREEDY, StopConditions(max_tokens=2), lambda d: None)
    assert core.requests.get("b") is None and core.requests.get("c") is None and len(core.requests) == 1


def test_the_tokenizer_eos_ids_win_over_the_model_config():
    assert model_eos_token_ids([3, 4], INFO) == (3, 4)
    assert model_eos_token_ids([], INFO) == (EOS,)
