"""Scheduler: schedule -> hand-made StepResult -> update, with exact plans and outcomes."""

from __future__ import annotations

import dataclasses
import random
import zlib

import pytest

from services.common.sampling_params import SamplingParams
from services.common.step import MinTokensBan
from services.scheduler.request.stop import StopConditions
from services.common.step import (
    NewSequence,
    RunningSequence,
    SequenceOutput,
    StepPlan,
    StepResult,
    TokenLogprobs,
)
from services.scheduler.core import QueueFullError, Scheduler, SchedulerConfig, SchedulerLimits
from services.scheduler.request.finish_reason import FinishReason
from services.scheduler.request.request import Request, RequestStatus
from services.scheduler.request.update import RequestUpdate

TOKEN = 7  # what the fake executor samples unless told otherwise


LIMIT_NAMES = {f.name for f in dataclasses.fields(SchedulerLimits)}


def make_config(**overrides) -> SchedulerConfig:
    """Limits and executor facts in one set of keyword arguments."""
    values = dict(
        max_model_len=64,
        num_blocks=64,
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        vocab_size=32000,
        overlap_scheduling=False,  # one step in flight; tests/scheduler/test_overlap.py overlaps
    )
    values.update(overrides)
    limits = SchedulerLimits(**{name: values.pop(name) for name in LIMIT_NAMES & values.keys()})
    return SchedulerConfig(limits, **values)


def make_scheduler(**overrides) -> Scheduler:
    return Scheduler(make_config(**overrides))


def prompt_for(request_id: str, length: int) -> list[int]:
    """Distinct prompts per request id, so no prefix is shared unless a test says so."""
    start = 1000 + (zlib.crc32(request_id.encode()) % 1000) * 20
    return list(range(start, start + length))


def make_request(
    request_id: str,
    prompt_len: int = 4,
    *,
    token_ids: list[int] | None = None,
    priority: int = 0,
    arrival_time: float = 0.0,
    sampling: SamplingParams | None = None,
    eos_token_ids: tuple[int, ...] = (),
    **stop_fields,
) -> Request:
    return Request(
        request_id,
        token_ids if token_ids is not None else prompt_for(request_id, prompt_len),
        sampling=sampling,
        stop=StopConditions(**stop_fields),
        eos_token_ids=eos_token_ids,
        priority=priority,
        arrival_time=arrival_time,
    )


def add(scheduler: Scheduler, *requests: Request) -> None:
    for request in requests:
        scheduler.add_request(request)


def result_for(scheduler: Scheduler, plan: StepPlan, tokens: dict[str, list[int]] | None = None) -> StepResult:
    """A fake executor: a token (or the given ones) for every sequence that reaches its end."""
    tokens = tokens or {}
    by_seq_id = {request.seq_id: request for request in scheduler.requests.values()}
    outputs = []
    for seq in plan.new:
        request = by_seq_id[seq.seq_id]
        reaches_end = seq.num_computed_tokens + seq.num_scheduled_tokens >= len(seq.token_ids)
        outputs.append(SequenceOutput(seq.seq_id, tokens.get(request.request_id, [TOKEN]) if reaches_end else []))
    for seq in plan.running:
        request = by_seq_id[seq.seq_id]
        reaches_end = request.num_computed_tokens + seq.num_scheduled_tokens >= request.num_tokens
        outputs.append(SequenceOutput(seq.seq_id, tokens.get(request.request_id, [TOKEN]) if reaches_end else []))
    return StepResult(plan.step_id, outputs)


def step(scheduler: Scheduler, tokens: dict[str, list[int]] | None = None) -> tuple[StepPlan, list[RequestUpdate]]:
    plan = scheduler.schedule()
    return plan, scheduler.update(plan, result_for(scheduler, plan, tokens))


def run_to_completion(scheduler: Scheduler, max_steps: int = 1000) -> None:
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return
        step(scheduler)
    raise AssertionError("requests did not finish")


def assert_all_blocks_free(scheduler: Scheduler) -> None:
    assert scheduler.block_manager.pool.num_free == scheduler.config.num_blocks
    assert all(block.ref_count == 0 for block in scheduler.block_manager.pool.blocks)


# ---- one request, then continuous batching ----------------------------------------------


def test_one_request_from_prefill_to_max_tokens():
    scheduler = make_scheduler()
    request = make_request("a", 7, max_tokens=3)
    add(scheduler, request)
    assert request.seq_id == 0

    plan, updates = step(scheduler, {"a": [11]})
    assert plan.new == [
        NewSequence(
            seq_id=0,
            token_ids=prompt_for("a", 7),
            prompt_len=7,
            num_computed_tokens=0,
            num_scheduled_tokens=7,
            block_ids=[0, 1],
            sampling=request.sampling,
        )
    ]
    assert plan.running == [] and plan.finished_seq_ids == []
    assert updates == [RequestUpdate("a", 0, [11], None, None, None)]
    assert (request.num_computed_tokens, request.num_tokens) == (7, 8)

    plan, updates = step(scheduler, {"a": [12]})
    assert plan.new == [] and plan.running == [RunningSequence(0, 1, [], [])]
    assert updates == [RequestUpdate("a", 0, [12], None, None, None)]

    plan, updates = step(scheduler, {"a": [13]})
    assert plan.running == [RunningSequence(0, 1, [2], [])]  # position 8 opens a third block
    assert updates == [RequestUpdate("a", 0, [13], None, FinishReason.LENGTH, None)]
    assert request.output_token_ids == [11, 12, 13]
    assert request.status is RequestStatus.FINISHED_LENGTH
    assert request.block_ids == []
    assert_all_blocks_free(scheduler)
    assert not scheduler.has_unfinished_requests()

    plan = scheduler.schedule()
    assert plan.is_empty and plan.finished_seq_ids == [0]
    assert scheduler.update(plan, StepResult(plan.step_id)) == []
    assert scheduler.schedule().finished_seq_ids == []


def test_requests_join_and_leave_the_running_batch():
    scheduler = make_scheduler()
    first = make_request("a", 4, max_tokens=3, arrival_time=0.0)
    second = make_request("b", 5, max_tokens=3, arrival_time=1.0)
    add(scheduler, first)
    plan, _ = step(scheduler)
    assert [s.seq_id for s in plan.new] == [0] and plan.running == []

    add(scheduler, second)
    plan, updates = step(scheduler)
    assert plan.running == [RunningSequence(0, 1, [1], [])]
    assert [(s.seq_id, s.num_scheduled_tokens, s.block_ids) for s in plan.new] == [(1, 5, [2, 3])]
    assert [u.request_id for u in updates] == ["b", "a"]  # result order: new first, then running

    plan, updates = step(scheduler)  # a's third token ends it; b has two
    assert [(s.seq_id, s.num_scheduled_tokens) for s in plan.running] == [(0, 1), (1, 1)]
    assert [(u.request_id, u.finish_reason) for u in updates] == [("a", FinishReason.LENGTH), ("b", None)]

    plan, updates = step(scheduler)
    assert plan.finished_seq_ids == [0]
    assert [s.seq_id for s in plan.running] == [1]
    assert [(u.request_id, u.finish_reason) for u in updates] == [("b", FinishReason.LENGTH)]
    assert scheduler.schedule().finished_seq_ids == [1]
    assert_all_blocks_free(scheduler)


# ---- budgets ----------------------------------------------------------------------------


def test_token_budget_is_filled_in_arrival_order_then_chunked():
    scheduler = make_scheduler(max_num_batched_tokens=16)
    add(scheduler, *(make_request(name, 10, arrival_time=t) for t, name in enumerate("abc")))
    plan, _ = step(scheduler)
    assert [(s.seq_id, s.num_scheduled_tokens) for s in plan.new] == [(0, 10), (1, 6)]
    assert plan.num_scheduled_tokens == 16
    assert scheduler.get_stats().num_waiting == 1

    plan, _ = step(scheduler)
    # a decodes one token, b finishes its prompt (4 left), c takes the remaining 11.
    assert [(s.seq_id, s.num_scheduled_tokens) for s in plan.running] == [(0, 1), (1, 4)]
    assert [(s.seq_id, s.num_scheduled_tokens) for s in plan.new] == [(2, 10)]
    assert plan.num_scheduled_tokens == 15


def test_max_num_seqs_caps_the_running_batch():
    scheduler = make_scheduler(max_num_seqs=2)
    add(scheduler, make_request("a", max_tokens=1), make_request("b", max_tokens=2), make_request("c", max_tokens=1))
    plan, updates = step(scheduler)
    assert [s.seq_id for s in plan.new] == [0, 1]
    assert [u.finish_reason for u in updates] == [FinishReason.LENGTH, None]
    plan, _ = step(scheduler)  # a left: c joins
    assert [s.seq_id for s in plan.running] == [1] and [s.seq_id for s in plan.new] == [2]
    assert plan.finished_seq_ids == [0]


def test_chunked_prefill_splits_a_long_prompt_exactly():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    request = make_request("a", 20, max_tokens=2)
    add(scheduler, request)

    plan, updates = step(scheduler)
    assert [(s.num_computed_tokens, s.num_scheduled_tokens, s.block_ids) for s in plan.new] == [(0, 8, [0, 1])]
    assert updates == [] and request.num_computed_tokens == 8

    plan, updates = step(scheduler)
    assert plan.running == [RunningSequence(0, 8, [2, 3], [])]
    assert updates == [] and request.num_computed_tokens == 16

    plan, updates = step(scheduler, {"a": [5]})
    assert plan.running == [RunningSequence(0, 4, [4], [])]
    assert updates == [RequestUpdate("a", 0, [5], None, None, None)]

    plan, updates = step(scheduler)
    assert plan.running == [RunningSequence(0, 1, [5], [])]
    assert updates[0].finish_reason is FinishReason.LENGTH
    assert_all_blocks_free(scheduler)


def test_decodes_take_the_budget_before_a_prefill_chunk():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    add(scheduler, make_request("a", 3, arrival_time=0.0))
    step(scheduler)
    add(scheduler, make_request("b", 20, arrival_time=1.0))
    plan, _ = step(scheduler)
    assert [(s.seq_id, s.num_scheduled_tokens) for s in plan.running] == [(0, 1)]
    assert [(s.seq_id, s.num_scheduled_tokens) for s in plan.new] == [(1, 7)]


def test_long_prefill_token_threshold_caps_each_request_per_step():
    scheduler = make_scheduler(long_prefill_token_threshold=6)
    add(scheduler, make_request("a", 14, arrival_time=0.0), make_request("b", 14, arrival_time=1.0))
    scheduled = []
    for _ in range(3):
        plan, _ = step(scheduler)
        scheduled.append([s.num_scheduled_tokens for s in plan.new + plan.running])
    assert scheduled == [[6, 6], [6, 6], [2, 2]]


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_room():
    scheduler = make_scheduler(enable_chunked_prefill=False, max_model_len=32, max_num_batched_tokens=32)
    add(scheduler, make_request("a", 20, arrival_time=0.0), make_request("b", 20, arrival_time=1.0))
    plan, _ = step(scheduler)
    assert [(s.seq_id, s.num_scheduled_tokens) for s in plan.new] == [(0, 20)]
    assert scheduler.get_stats().num_waiting == 1
    plan, _ = step(scheduler)  # a's decode + b's 20 tokens fit in 32
    assert [(s.seq_id, s.num_scheduled_tokens) for s in plan.running] == [(0, 1)]
    assert [(s.seq_id, s.num_scheduled_tokens) for s in plan.new] == [(1, 20)]


# ---- preemption -------------------------------------------------------------------------


def _two_requests_filling_six_blocks(enable_prefix_caching: bool) -> tuple[Scheduler, Request, Request]:
    """a and b (prompts of 8) hold 3 blocks each after step 1; at step 5 a needs a 4th."""
    scheduler = make_scheduler(
        max_model_len=24, num_blocks=6, enable_prefix_caching=enable_prefix_caching
    )
    first = make_request("a", 8, max_tokens=7, arrival_time=0.0)
    second = make_request("b", 8, max_tokens=10, arrival_time=1.0)
    add(scheduler, first, second)
    plan, _ = step(scheduler, {"a": [1], "b": [101]})
    assert [s.block_ids for s in plan.new] == [[0, 1], [2, 3]]
    plan, _ = step(scheduler, {"a": [2], "b": [102]})
    assert [s.new_block_ids for s in plan.running] == [[4], [5]]
    for position in range(3, 6):
        step(scheduler, {"a": [position], "b": [100 + position]})
    assert scheduler.block_manager.pool.num_free == 0
    return scheduler, first, second


def test_out_of_blocks_preempts_the_latest_arrival_and_resumes_it_in_full():
    scheduler, first, second = _two_requests_filling_six_blocks(enable_prefix_caching=False)
    plan, _ = step(scheduler, {"a": [6]})
    assert plan.finished_seq_ids == [1]
    assert plan.running == [RunningSequence(0, 1, [5], [])]  # b's blocks went back as 5, 3, 2
    # A step that preempted for blocks starts nothing new (b itself waits at least a step).
    assert scheduler.block_manager.pool.num_free == 2
    assert plan.new == []
    assert second.status is RequestStatus.PREEMPTED
    assert (second.block_ids, second.num_computed_tokens) == ([], 0)
    # (Added only now: waiting at the preemption, c would have preempted b for priority and
    # started in that same step.)
    small = make_request("c", 4, max_tokens=1, priority=-1, arrival_time=2.0)  # ahead of b
    add(scheduler, small)
    stats = scheduler.get_stats()
    assert (stats.num_preemptions, stats.num_running, stats.num_waiting) == (1, 1, 2)

    plan, updates = step(scheduler, {"a": [7]})  # a's 7th token ends it, c starts and ends
    assert [(u.request_id, u.finish_reason) for u in updates] == [
        ("c", FinishReason.LENGTH),
        ("a", FinishReason.LENGTH),
    ]
    assert [s.seq_id for s in plan.new] == [small.seq_id]  # b needs 4 blocks, 2 were free

    plan, _ = step(scheduler)
    assert plan.finished_seq_ids == [2, 0]
    assert plan.new == [
        NewSequence(
            seq_id=1,
            token_ids=prompt_for("b", 8) + [101, 102, 103, 104, 105],
            prompt_len=8,
            num_computed_tokens=0,
            num_scheduled_tokens=13,
            block_ids=[2, 3, 5, 4],
            sampling=second.sampling,
        )
    ]
    assert second.num_preemptions == 1
    run_to_completion(scheduler)
    assert second.output_token_ids[:5] == [101, 102, 103, 104, 105]
    assert second.num_output_tokens == 10
    assert_all_blocks_free(scheduler)


def test_a_resumed_request_reuses_its_own_cached_prefix():
    scheduler, first, second = _two_requests_filling_six_blocks(enable_prefix_caching=True)
    step(scheduler, {"a": [6]})  # preempts b; a takes b's last block (5), evicting its hash
    step(scheduler, {"a": [7]})  # a finishes
    plan, _ = step(scheduler)
    assert [(s.seq_id, s.num_computed_tokens, s.num_scheduled_tokens, s.block_ids) for s in plan.new] == [
        (1, 8, 5, [2, 3, 5, 4])
    ]
    assert second.num_cached_tokens == 0  # usage reports the hit at the first schedule only
    stats = scheduler.get_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (8 + 8 + 13, 8)


def test_the_victim_is_the_lowest_priority_even_if_it_arrived_first():
    scheduler = make_scheduler(max_model_len=16, num_blocks=4)
    urgent = make_request("urgent", 4, priority=0, arrival_time=5.0)
    lazy = make_request("lazy", 4, priority=1, arrival_time=0.0)
    add(scheduler, lazy, urgent)
    plan, _ = step(scheduler)
    assert [s.seq_id for s in plan.new] == [urgent.seq_id, lazy.seq_id]
    for _ in range(4):  # positions 4..7 fill the second blocks
        step(scheduler)
    plan, _ = step(scheduler)  # urgent's position 8 needs a block
    assert plan.finished_seq_ids == [lazy.seq_id]
    assert [s.seq_id for s in plan.running] == [urgent.seq_id]
    assert lazy.status is RequestStatus.PREEMPTED


def test_a_more_urgent_request_joins_ahead_of_running_ones_and_is_spared():
    scheduler = make_scheduler(max_model_len=16, num_blocks=4)
    lazy = make_request("lazy", 4, priority=1, arrival_time=0.0)
    add(scheduler, lazy)
    step(scheduler)  # lazy [0]
    urgent = make_request("urgent", 4, priority=0, arrival_time=1.0)
    add(scheduler, urgent)
    plan, _ = step(scheduler)  # lazy's position 4 -> [1]; urgent -> [2]
    assert [(s.seq_id, s.new_block_ids) for s in plan.running] == [(lazy.seq_id, [1])]
    assert [(s.seq_id, s.block_ids) for s in plan.new] == [(urgent.seq_id, [2])]
    plan, _ = step(scheduler)  # urgent now runs first; its position 4 takes the last block
    assert [(s.seq_id, s.new_block_ids) for s in plan.running] == [(urgent.seq_id, [3]), (lazy.seq_id, [])]
    for _ in range(3):  # positions 5..7 for urgent, 6..8 for lazy: lazy needs a block first
        plan, _ = step(scheduler)
    assert plan.finished_seq_ids == [lazy.seq_id]
    assert [s.seq_id for s in plan.running] == [urgent.seq_id]
    assert lazy.status is RequestStatus.PREEMPTED


def test_a_request_that_cannot_grow_preempts_itself_when_it_is_the_least_urgent():
    scheduler = make_scheduler(max_model_len=16, num_blocks=4)
    urgent = make_request("urgent", 9, priority=0, max_tokens=7)
    lazy = make_request("lazy", 4, priority=1)
    add(scheduler, urgent, lazy)
    plan, _ = step(scheduler)
    assert [s.block_ids for s in plan.new] == [[0, 1, 2], [3]]
    plan, _ = step(scheduler)  # lazy's position 4 needs a block; nobody is less urgent
    assert plan.finished_seq_ids == [lazy.seq_id]
    assert plan.running == [RunningSequence(urgent.seq_id, 1, [], [])]
    assert lazy.status is RequestStatus.PREEMPTED
    plan, _ = step(scheduler)
    assert plan.new == []  # lazy's block went to the free queue, but it needs 2
    step(scheduler)
    plan, _ = step(scheduler)
    assert plan.running == [RunningSequence(urgent.seq_id, 1, [3], [])]  # position 12
    run_to_completion(scheduler)
    assert scheduler.num_preemptions == 1
    assert_all_blocks_free(scheduler)


# ---- priority ---------------------------------------------------------------------------


def test_waiting_requests_start_by_priority_then_arrival_not_by_add_order():
    scheduler = make_scheduler(max_num_seqs=1)
    add(
        scheduler,
        make_request("late", priority=0, arrival_time=2.0, max_tokens=1),
        make_request("early", priority=0, arrival_time=1.0, max_tokens=1),
        make_request("urgent", priority=-1, arrival_time=3.0, max_tokens=1),
        make_request("lazy", priority=1, arrival_time=0.0, max_tokens=1),
    )
    order = []
    for _ in range(4):
        _, updates = step(scheduler)
        order += [u.request_id for u in updates]
    assert order == ["urgent", "early", "late", "lazy"]


# ---- abort, finish, queue limits --------------------------------------------------------


def test_abort_of_a_running_request_frees_its_blocks_at_once():
    scheduler = make_scheduler()
    request = make_request("a", 9)
    add(scheduler, request)
    step(scheduler)
    assert scheduler.block_manager.pool.num_free == 61
    assert scheduler.finish_request("a", FinishReason.ABORT) is True
    assert request.status is RequestStatus.FINISHED_ABORTED
    assert request.finish_reason is FinishReason.ABORT
    assert_all_blocks_free(scheduler)
    assert scheduler.finish_request("a", FinishReason.ABORT) is False
    assert scheduler.finish_request("nobody", FinishReason.ABORT) is False
    assert scheduler.schedule().finished_seq_ids == [request.seq_id]


def test_abort_of_a_waiting_request_tells_the_executor_nothing():
    scheduler = make_scheduler()
    add(scheduler, make_request("a"))
    assert scheduler.finish_request("a", FinishReason.ABORT) is True
    plan = scheduler.schedule()
    assert plan.is_empty and plan.finished_seq_ids == []
    assert not scheduler.has_unfinished_requests()


def test_outputs_of_a_request_aborted_during_the_step_are_ignored():
    scheduler = make_scheduler()
    first, second = make_request("a"), make_request("b")
    add(scheduler, first, second)
    plan = scheduler.schedule()
    scheduler.finish_request("a", FinishReason.ABORT)
    result = StepResult(plan.step_id, [SequenceOutput(0, [5]), SequenceOutput(1, [6])])
    assert scheduler.update(plan, result) == [RequestUpdate("b", 1, [6], None, None, None)]
    assert first.output_token_ids == []
    assert scheduler.block_manager.pool.num_free == 63  # only b's block is held
    assert scheduler.schedule().finished_seq_ids == [0]


def test_a_request_finished_during_the_step_may_have_no_output():
    scheduler = make_scheduler()
    add(scheduler, make_request("a"), make_request("b"))
    plan = scheduler.schedule()
    scheduler.finish_request("a", FinishReason.ERROR)
    updates = scheduler.update(plan, StepResult(plan.step_id, [SequenceOutput(1, [6])]))
    assert [u.request_id for u in updates] == ["b"]


def test_finish_request_for_a_stop_string():
    scheduler = make_scheduler()
    request = make_request("a")
    add(scheduler, request)
    step(scheduler)
    assert scheduler.finish_request("a", FinishReason.STOP, stop_reason="###") is True
    assert (request.status, request.finish_reason, request.stop_reason) == (
        RequestStatus.FINISHED_STOPPED,
        FinishReason.STOP,
        "###",
    )
    assert scheduler.schedule().finished_seq_ids == [0]
    assert_all_blocks_free(scheduler)


def test_add_request_raises_queue_full_beyond_max_waiting_requests():
    scheduler = make_scheduler(max_waiting_requests=2)
    add(scheduler, make_request("a"), make_request("b"))
    with pytest.raises(QueueFullError, match="max_waiting_requests=2"):
        scheduler.add_request(make_request("c"))
    assert scheduler.requests.get("c") is None
    step(scheduler)  # both start running: the queue has room again
    add(scheduler, make_request("c"))
    assert scheduler.requests.get("c").seq_id == 2


# ---- validation -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("token_ids", "stop_fields", "message"),
    [
        ([], {}, r"prompt_token_ids is empty"),
        (list(range(16)), {}, r"prompt length 16 .*max_model_len=16"),
        (list(range(10)), {"max_tokens": 7}, r"prompt length 10 \+ max_tokens=7 = 17 exceeds max_model_len=16"),
        ([1, 2, 3, 32000], {}, r"prompt_token_ids\[3\] = 32000 is outside \[0, 32000\)"),
        ([1, -1], {}, r"prompt_token_ids\[1\] = -1 is outside"),
        ([1], {"max_tokens": 0}, r"max_tokens must be >= 1"),
        ([1], {"max_tokens": 2, "min_tokens": 3}, r"min_tokens=3 must not exceed max_tokens=2"),
        ([1], {"stop_token_ids": (32000,)}, r"stop_token_ids entry 32000 is outside \[0, 32000\)"),
        ([1], {"eos_token_ids": (-2,)}, r"eos_token_ids entry -2"),
    ],
)
def test_invalid_requests_are_rejected_naming_the_field(token_ids, stop_fields, message):
    scheduler = make_scheduler(max_model_len=16, vocab_size=32000)
    with pytest.raises(ValueError, match=message):
        scheduler.add_request(make_request("bad", token_ids=token_ids, **stop_fields))
    assert not scheduler.has_unfinished_requests()
    good = make_request("good")
    scheduler.add_request(good)
    assert good.seq_id == 0  # a rejected request consumes no seq id


def test_sampling_params_are_validated_and_new_sequences_carry_the_min_tokens_ban():
    scheduler = make_scheduler()
    with pytest.raises(ValueError, match="top_p"):
        scheduler.add_request(make_request("a", sampling=SamplingParams(top_p=0.0)))
    banning = make_request("b", min_tokens=2, stop_token_ids=(5,), eos_token_ids=(2,))
    ignoring = make_request("c", min_tokens=2, stop_token_ids=(5,), eos_token_ids=(2,), ignore_eos=True)
    plain = make_request("d", stop_token_ids=(5,), eos_token_ids=(2,))
    add(scheduler, banning, ignoring, plain)
    plan, _ = step(scheduler)
    # The sampler's ban is derived from the stop rules (StopConditions.min_tokens_ban): stop
    # ids, then EOS unless ignore_eos; nothing without min_tokens.
    assert [seq.min_tokens_ban for seq in plan.new] == [MinTokensBan(2, (5, 2)), MinTokensBan(2, (5,)), None]


def test_duplicate_request_id_is_rejected():
    scheduler = make_scheduler()
    add(scheduler, make_request("a"))
    with pytest.raises(ValueError, match="request_id 'a' is already in use"):
        scheduler.add_request(make_request("a"))


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        (dict(enable_chunked_prefill=False, max_model_len=200, max_num_batched_tokens=100, num_blocks=64),
         ["max_num_batched_tokens=100", "max_model_len=200"]),
        (dict(max_num_batched_tokens=4, max_num_seqs=8), ["max_num_batched_tokens=4", "max_num_seqs=8"]),
        (dict(num_blocks=3, block_size=4, max_model_len=16), ["num_blocks=3", "block_size=4", "max_model_len=16"]),
        (dict(enable_chunked_prefill=False, long_prefill_token_threshold=8),
         ["long_prefill_token_threshold=8", "enable_chunked_prefill"]),
        (dict(max_num_seqs=0), ["max_num_seqs"]),
        (dict(long_prefill_token_threshold=-1), ["long_prefill_token_threshold"]),
    ],
)
def test_config_conflicts_name_both_values(overrides, names):
    with pytest.raises(ValueError) as error:
        make_config(**overrides).validate()
    for name in names:
        assert name in str(error.value)


def test_a_step_budget_below_the_block_size_is_fine():
    make_config(max_num_batched_tokens=8, max_num_seqs=8, block_size=16).validate()


# ---- stop conditions --------------------------------------------------------------------


def generate(scheduler: Scheduler, request: Request, tokens: list[int]) -> list[RequestUpdate]:
    """Feed one token per step until the request finishes or the tokens run out."""
    add(scheduler, request)
    updates = []
    for token in tokens:
        _, step_updates = step(scheduler, {request.request_id: [token]})
        updates += step_updates
        if request.is_finished:
            break
    return updates


def test_stop_token_ends_with_stop_and_names_the_token():
    scheduler = make_scheduler()
    request = make_request("a", stop_token_ids=(50,), eos_token_ids=(2,))
    updates = generate(scheduler, request, [7, 50, 8])
    assert request.output_token_ids == [7, 50]
    assert (updates[-1].finish_reason, updates[-1].stop_reason) == (FinishReason.STOP, 50)
    assert_all_blocks_free(scheduler)


def test_eos_ends_with_eos():
    scheduler = make_scheduler()
    request = make_request("a", eos_token_ids=(2, 3))
    updates = generate(scheduler, request, [7, 3, 8])
    assert request.output_token_ids == [7, 3]
    assert (updates[-1].finish_reason, updates[-1].stop_reason) == (FinishReason.EOS, None)


def test_ignore_eos_generates_through_eos():
    scheduler = make_scheduler()
    request = make_request("a", eos_token_ids=(2,), ignore_eos=True, max_tokens=3)
    updates = generate(scheduler, request, [2, 2, 2, 2])
    assert request.output_token_ids == [2, 2, 2]
    assert updates[-1].finish_reason is FinishReason.LENGTH


def test_min_tokens_defers_eos_and_stop_tokens():
    scheduler = make_scheduler()
    request = make_request("a", eos_token_ids=(2,), stop_token_ids=(50,), min_tokens=2)
    updates = generate(scheduler, request, [2, 50, 2, 9])
    assert request.output_token_ids == [2, 50, 2]  # the 3rd token is the first that may stop
    assert updates[-1].finish_reason is FinishReason.EOS


def test_stop_token_is_checked_before_max_tokens():
    scheduler = make_scheduler()
    request = make_request("a", stop_token_ids=(50,), max_tokens=2)
    updates = generate(scheduler, request, [7, 50])
    assert (updates[-1].finish_reason, updates[-1].stop_reason) == (FinishReason.STOP, 50)


def test_max_model_len_ends_a_request_without_max_tokens():
    scheduler = make_scheduler(max_model_len=16)
    request = make_request("a", 13)
    updates = generate(scheduler, request, [7] * 10)
    assert request.num_output_tokens == 3 and request.num_tokens == 16
    assert updates[-1].finish_reason is FinishReason.LENGTH


def test_logprobs_follow_their_tokens():
    scheduler = make_scheduler()
    request = make_request("a", max_tokens=2, sampling=SamplingParams(logprobs=1))
    add(scheduler, request)
    plan = scheduler.schedule()
    lp = TokenLogprobs(-0.5, [7, 8], [-0.5, -1.5])
    updates = scheduler.update(plan, StepResult(plan.step_id, [SequenceOutput(0, [7], [lp])]))
    assert updates[0].new_logprobs == [lp]
    assert request.output_logprobs == [lp]


# ---- speculative tokens -----------------------------------------------------------------


def _decoding_request(scheduler: Scheduler, **stop_fields) -> Request:
    request = make_request("a", 7, **stop_fields)
    add(scheduler, request)
    step(scheduler, {"a": [11]})
    assert (request.num_computed_tokens, request.num_tokens) == (7, 8)
    return request


def test_drafts_are_scheduled_as_one_plus_k_and_accepted_ones_appended():
    scheduler = make_scheduler()
    request = _decoding_request(scheduler)
    request.spec_token_ids = [21, 22, 23]
    plan = scheduler.schedule()
    assert plan.running == [RunningSequence(0, 4, [2], [21, 22, 23])]  # positions 7..10
    assert request.spec_token_ids == []
    updates = scheduler.update(plan, StepResult(plan.step_id, [SequenceOutput(0, [21, 22, 99])]))
    assert updates == [RequestUpdate("a", 0, [21, 22, 99], None, None, None)]
    assert request.output_token_ids == [11, 21, 22, 99]
    assert (request.num_computed_tokens, request.num_tokens) == (10, 11)
    plan, _ = step(scheduler)
    assert plan.running == [RunningSequence(0, 1, [], [])]  # position 10, block 2 holds it


def test_all_drafts_rejected_leaves_one_token():
    scheduler = make_scheduler()
    request = _decoding_request(scheduler)
    request.spec_token_ids = [21, 22]
    plan = scheduler.schedule()
    scheduler.update(plan, StepResult(plan.step_id, [SequenceOutput(0, [5])]))
    assert request.output_token_ids == [11, 5]
    assert (request.num_computed_tokens, request.num_tokens) == (8, 9)


def test_a_stop_inside_accepted_drafts_cuts_the_rest():
    scheduler = make_scheduler()
    request = _decoding_request(scheduler, stop_token_ids=(50,))
    request.spec_token_ids = [7, 50, 8]
    plan = scheduler.schedule()
    lps = [TokenLogprobs(-float(i)) for i in range(4)]
    updates = scheduler.update(plan, StepResult(plan.step_id, [SequenceOutput(0, [7, 50, 8, 9], lps)]))
    assert updates == [RequestUpdate("a", 0, [7, 50], lps[:2], FinishReason.STOP, 50)]
    assert request.output_token_ids == [11, 7, 50]
    assert_all_blocks_free(scheduler)


def test_drafts_are_capped_by_max_tokens_and_budget():
    scheduler = make_scheduler()
    request = _decoding_request(scheduler, max_tokens=3)
    request.spec_token_ids = [1, 2, 3, 4]
    plan = scheduler.schedule()  # one output so far: at most 2 more, so 1 draft + 1 bonus
    assert plan.running == [RunningSequence(0, 2, [2], [1])]  # positions 7, 8

    scheduler = make_scheduler(max_num_batched_tokens=8)
    request = _decoding_request(scheduler)
    add(scheduler, make_request("b", 20, arrival_time=-1.0))  # earlier, but running ones go first
    request.spec_token_ids = list(range(1, 20))
    plan = scheduler.schedule()
    assert plan.running == [RunningSequence(0, 8, [2, 3], list(range(1, 8)))]  # positions 7..14
    assert plan.new == []


def test_drafts_wait_while_the_prompt_is_still_being_prefilled():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    request = make_request("a", 20)
    add(scheduler, request)
    step(scheduler)
    request.spec_token_ids = [1, 2]
    plan = scheduler.schedule()
    assert plan.running == [RunningSequence(0, 8, [2, 3], [])]


def test_output_that_contradicts_the_drafts_is_rejected():
    scheduler = make_scheduler()
    request = _decoding_request(scheduler)
    request.spec_token_ids = [21, 22]
    plan = scheduler.schedule()
    with pytest.raises(ValueError, match="not a prefix of the drafts"):
        scheduler.update(plan, StepResult(plan.step_id, [SequenceOutput(0, [21, 30, 5])]))
    with pytest.raises(ValueError, match="expected 1 to 3"):
        scheduler.update(plan, StepResult(plan.step_id, [SequenceOutput(0, [21, 22, 5, 6])]))


# ---- protocol errors --------------------------------------------------------------------


def test_update_rejects_results_that_do_not_match_the_plan():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    add(scheduler, make_request("a", 20), make_request("b", 2))
    plan = scheduler.schedule()
    with pytest.raises(RuntimeError, match="update\\(\\) was not called"):
        scheduler.schedule()
    with pytest.raises(ValueError, match="does not match plan.step_id"):
        scheduler.update(plan, StepResult(plan.step_id + 1))
    with pytest.raises(ValueError, match="no output for scheduled seq ids \\[0\\]"):
        scheduler.update(plan, StepResult(plan.step_id))
    with pytest.raises(ValueError, match="seq id 5, which was not scheduled"):
        scheduler.update(plan, StepResult(plan.step_id, [SequenceOutput(5, [1])]))
    with pytest.raises(ValueError, match="prefill chunk that does not reach the end"):
        scheduler.update(plan, StepResult(plan.step_id, [SequenceOutput(0, [1])]))
    assert scheduler.update(plan, StepResult(plan.step_id, [SequenceOutput(0, [])])) == []


def test_recovery_after_an_executor_failure():
    scheduler = make_scheduler()
    add(scheduler, make_request("a"), make_request("b"))
    plan = scheduler.schedule()
    for request_id in ("a", "b"):
        scheduler.finish_request(request_id, FinishReason.ERROR)
    assert scheduler.update(plan, StepResult(plan.step_id)) == []
    assert scheduler.schedule().finished_seq_ids == [0, 1]
    assert_all_blocks_free(scheduler)


# ---- prefix caching through the scheduler -----------------------------------------------


def test_a_later_request_starts_from_a_cached_prefix():
    scheduler = make_scheduler()
    shared = prompt_for("a", 10)
    add(scheduler, make_request("a", token_ids=shared, max_tokens=1))
    step(scheduler)  # a computes [0, 1, 2], caches the two full blocks and finishes
    later = make_request("b", token_ids=shared[:8] + [5, 6, 7])
    add(scheduler, later)
    plan, _ = step(scheduler)
    assert [(s.num_computed_tokens, s.num_scheduled_tokens, s.block_ids) for s in plan.new] == [
        (8, 3, [0, 1, 3])
    ]
    assert later.num_cached_tokens == 8
    stats = scheduler.get_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (21, 8)
    assert stats.prefix_cache_hit_rate == pytest.approx(8 / 21)


# ---- many requests: the executor contract holds throughout ------------------------------


def test_random_workload_keeps_every_invariant_and_frees_everything():
    rng = random.Random(1234)
    config = make_config(num_blocks=16, max_model_len=64, max_num_batched_tokens=24, max_num_seqs=6)
    scheduler = Scheduler(config)
    shared_prefix = list(range(500, 516))
    requests = []
    for index in range(40):
        prompt = shared_prefix[: rng.randrange(0, 16)] + [rng.randrange(1, 400) for _ in range(rng.randrange(1, 30))]
        request = make_request(
            f"r{index}",
            token_ids=prompt,
            max_tokens=rng.randrange(1, min(20, 64 - len(prompt)) + 1),
            priority=rng.randrange(0, 3),
            arrival_time=float(index),
        )
        requests.append(request)
    executor_known: dict[int, int] = {}  # seq_id -> tokens the fake executor has K/V for
    pending = list(requests)
    for step_index in range(2000):
        while pending and rng.random() < 0.5:
            scheduler.add_request(pending.pop(0))
        if not pending and not scheduler.has_unfinished_requests():
            break
        if rng.random() < 0.03 and scheduler.requests:
            scheduler.finish_request(rng.choice(sorted(scheduler.requests)), FinishReason.ABORT)
        for request in scheduler.running:
            if request.num_tokens - request.num_computed_tokens == 1 and rng.random() < 0.3:
                request.spec_token_ids = [rng.randrange(1, 400) for _ in range(rng.randrange(1, 4))]
        plan = scheduler.schedule()

        assert plan.num_scheduled_tokens <= config.limits.max_num_batched_tokens
        assert len(scheduler.running) <= config.limits.max_num_seqs
        for seq_id in plan.finished_seq_ids:
            assert executor_known.pop(seq_id, None) is not None
        by_seq_id = {r.seq_id: r for r in scheduler.requests.values()}
        outputs = []
        for seq in plan.new:
            assert seq.seq_id not in executor_known
            request = by_seq_id[seq.seq_id]
            assert seq.token_ids == request.all_token_ids and seq.prompt_len == request.num_prompt_tokens
            assert len(seq.block_ids) * config.block_size >= seq.num_computed_tokens + seq.num_scheduled_tokens
            executor_known[seq.seq_id] = seq.num_computed_tokens + seq.num_scheduled_tokens
            done = executor_known[seq.seq_id] >= len(seq.token_ids)
            outputs.append(SequenceOutput(seq.seq_id, [rng.randrange(1, 400)] if done else []))
        for seq in plan.running:
            request = by_seq_id[seq.seq_id]
            assert executor_known[seq.seq_id] == request.num_computed_tokens
            assert len(request.block_ids) * config.block_size >= request.num_computed_tokens + seq.num_scheduled_tokens
            done = request.num_computed_tokens + seq.num_scheduled_tokens >= request.num_tokens
            accepted = seq.draft_token_ids[: rng.randrange(0, len(seq.draft_token_ids) + 1)]
            outputs.append(SequenceOutput(seq.seq_id, accepted + [rng.randrange(1, 400)] if done else []))
        scheduler.update(plan, StepResult(plan.step_id, outputs))
        for request in scheduler.running:
            executor_known[request.seq_id] = request.num_computed_tokens
        # Ref counts equal the number of block tables holding each block.
        holders = [0] * config.num_blocks
        for request in scheduler.running:
            for block_id in request.block_ids:
                holders[block_id] += 1
        assert holders == [block.ref_count for block in scheduler.block_manager.pool.blocks]
        assert scheduler.block_manager.pool.num_free == holders.count(0)
    else:
        raise AssertionError("workload did not finish")

    assert_all_blocks_free(scheduler)
    assert scheduler.num_preemptions > 0  # the cache is small enough to force some
    assert scheduler.block_manager.prefixes.hits > 0
    for request in requests:
        if request.finish_reason is not FinishReason.ABORT:
            assert request.finish_reason is FinishReason.LENGTH
            assert request.num_output_tokens == request.stop.max_tokens
