"""Multi-step scheduling in the core (SchedulerLimits.num_scheduler_steps): while nobody waits, a
plain decode is planned as n decode steps the executor runs back to back.

Fixed bursts (multi_step_max_delay_ms = 0) for exact plans and counts by hand; bursts sized
from the executor's measured step time; then then the in-order fake executor of test_overlap (which models
every K/V slot a step writes and reads) over random workloads: outputs equal one step at a
time, with overlap on and off, with and without aborts.
"""

from __future__ import annotations

import pytest

from services.common.step import RunningSequence, StepPlan
from services.scheduler.request.finish_reason import FinishReason
from services.scheduler.request.update import RequestUpdate
from services.scheduler.core.speculation import DraftLength, SpeculationConfig
from tests.scheduler.test_overlap import EOS, in_flight, out, run_workload
from tests.scheduler.test_scheduler import add, assert_all_blocks_free, make_request, make_scheduler


def started(scheduler, request, first_token: int):
    """Schedule and update the request's prefill; it then holds one sampled token."""
    plan = scheduler.schedule()
    assert [s.seq_id for s in plan.new] == [request.seq_id]
    scheduler.update(plan, out(plan, {request.seq_id: [first_token]}))
    return plan


def decoding(request, num_scheduler_steps: int = 4, **limits):
    """A scheduler (one step in flight) whose only request has finished its prefill with token 11."""
    scheduler = make_scheduler(num_scheduler_steps=num_scheduler_steps, multi_step_max_delay_ms=0,
                               overlap_scheduling=False, **limits)
    add(scheduler, request)
    started(scheduler, request, 11)
    return scheduler


def test_a_decode_is_planned_as_n_steps_with_blocks_for_every_position():
    request = make_request("a", 7, max_tokens=20)
    scheduler = decoding(request)
    assert in_flight(request) == (7, 8, 0, 0) and request.block_ids == [0, 1]
    plan = scheduler.schedule()
    # Positions 7..10: block 1 holds 4..7, block 2 is new for 8..10.
    assert plan.running == [RunningSequence(0, 1, [2], [], 4)]
    assert in_flight(request) == (7, 8, 4, 4)
    updates = scheduler.update(plan, out(plan, {0: [12, 13, 14, 15]}))
    assert updates == [RequestUpdate("a", 0, [12, 13, 14, 15], None, None, None)]
    assert in_flight(request) == (11, 12, 0, 0)


def test_a_burst_stops_at_max_tokens_and_max_model_len():
    request = make_request("a", 5, max_tokens=4)
    scheduler = decoding(request, 8)
    plan = scheduler.schedule()
    assert plan.running[0].num_steps == 3  # 1 token out, 3 to go
    updates = scheduler.update(plan, out(plan, {0: [12, 13, 14]}))
    assert updates[0].finish_reason is FinishReason.LENGTH
    assert_all_blocks_free(scheduler)

    scheduler = decoding(make_request("b", 5), 8, max_model_len=10)  # 6 tokens known: room for 4 more
    plan = scheduler.schedule()
    assert plan.running[0].num_steps == 4


def test_eos_inside_a_burst_cuts_the_tokens_after_it():
    request = make_request("a", 4, max_tokens=50, eos_token_ids=(EOS,))
    scheduler = decoding(request)
    plan = scheduler.schedule()
    updates = scheduler.update(plan, out(plan, {0: [12, EOS, 14, 15]}))
    assert updates == [RequestUpdate("a", 0, [12, EOS], None, FinishReason.EOS, None)]
    assert request.output_token_ids == [11, 12, EOS]
    assert_all_blocks_free(scheduler)
    assert scheduler.schedule().finished_seq_ids == [0]


def test_a_waiting_request_turns_bursts_off_until_it_has_started():
    scheduler = make_scheduler(num_scheduler_steps=4, multi_step_max_delay_ms=0, overlap_scheduling=False, max_num_seqs=1)
    first, second = make_request("a", 4, max_tokens=50), make_request("b", 4, max_tokens=50)
    add(scheduler, first)
    started(scheduler, first, 11)
    add(scheduler, second)  # no room (max_num_seqs 1): it waits
    plan = scheduler.schedule()
    assert plan.running == [RunningSequence(0, 1, [1], [], 1)] and plan.new == []  # blocks of 4


def test_requests_with_stop_strings_or_speculation_run_one_step_at_a_time():
    scheduler = decoding(make_request("a", 4, max_tokens=50, stop=("the end",)))
    assert scheduler.schedule().running[0].num_steps == 1
    speculating = make_request("b", 4, max_tokens=50)
    speculating.draft_length = DraftLength(SpeculationConfig(), 4)
    assert decoding(speculating).schedule().running[0].num_steps == 1


def test_the_executor_must_return_every_token_of_a_burst():
    scheduler = decoding(make_request("a", 4, max_tokens=50))
    plan = scheduler.schedule()
    with pytest.raises(ValueError, match="seq id 0: 2 output tokens, expected 4 \\(4 decode steps\\)"):
        scheduler.update(plan, out(plan, {0: [12, 13]}))


def test_with_overlap_the_next_plan_continues_from_the_bursts_last_token():
    scheduler = make_scheduler(num_scheduler_steps=4, multi_step_max_delay_ms=0, overlap_scheduling=True)
    request = make_request("a", 7, max_tokens=20)
    add(scheduler, request)
    plan0 = scheduler.schedule()
    # Step 0 still runs and its token (the first) is on its way: one step, position 7, so the
    # executor is not kept busy by a burst while that token travels to the client.
    plan1 = scheduler.schedule()
    assert plan1.running == [RunningSequence(0, 1, [], [], 1)]
    scheduler.update(plan0, out(plan0, {0: [11]}))
    plan2 = scheduler.schedule()  # a burst from position 8 (step 1's token) to 11
    assert plan2.running == [RunningSequence(0, 1, [2], [], 4)]
    assert in_flight(request) == (7, 8, 5, 5)
    scheduler.update(plan1, out(plan1, {0: [12]}))
    plan3 = scheduler.schedule()  # from position 12, the burst's last token, to 15
    assert plan3.running == [RunningSequence(0, 1, [3], [], 4)]
    scheduler.update(plan2, out(plan2, {0: [13, 14, 15, 16]}))
    assert in_flight(request) == (12, 13, 4, 4)
    scheduler.update(plan3, out(plan3, {0: [17, 18, 19, 20]}))
    assert request.output_token_ids == list(range(11, 21))


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_workload_outputs_are_the_same_with_multi_step(seed, overlap):
    _, one_step = run_workload(overlap=False, seed=seed)
    plans: list[StepPlan] = []
    scheduler, multi = run_workload(overlap=overlap, seed=seed, num_scheduler_steps=4, plans=plans)
    assert multi == one_step
    assert any(s.num_steps > 1 for plan in plans for s in plan.running)
    assert scheduler.num_preemptions > 0


@pytest.mark.parametrize("seed", [4, 5])
def test_random_workload_with_aborts_and_multi_step_keeps_every_slot_its_owner_wrote(seed):
    _, results = run_workload(overlap=True, seed=seed, abort_rate=0.05, num_scheduler_steps=3)
    assert any(reason is FinishReason.ABORT for _, reason, _ in results.values())


# ---- bursts sized from the executor's measured step time ---------------------------------


def timed(plan: StepPlan, tokens: dict[int, list[int]], seconds: float):
    result = out(plan, tokens)
    result.execute_seconds = seconds
    return result


def test_bursts_follow_the_measured_decode_step_time():
    # Cap 16, 4 ms delay budget: one step until a decode-only plan was timed, then
    # 1 + floor(4 ms / step time) steps.
    scheduler = make_scheduler(num_scheduler_steps=16, multi_step_max_delay_ms=4.0, overlap_scheduling=False)
    request = make_request("a", 4, max_tokens=50)
    add(scheduler, request)
    plan = scheduler.schedule()
    scheduler.update(plan, timed(plan, {0: [11]}, 0.050))  # a prefill's time says nothing of a decode
    plan = scheduler.schedule()
    assert plan.running[0].num_steps == 1
    scheduler.update(plan, timed(plan, {0: [12]}, 0.001))  # 1 ms a step: 1 + 4 steps
    plan = scheduler.schedule()
    assert plan.running[0].num_steps == 5
    scheduler.update(plan, timed(plan, {0: [13, 14, 15, 16, 17]}, 5 * 0.0002))  # estimate 1 -> 0.8 ms
    assert scheduler.burst.decode_step_s == pytest.approx(0.0008)
    plan = scheduler.schedule()
    assert plan.running[0].num_steps == 6
    scheduler.update(plan, timed(plan, {0: list(range(18, 24))}, 6 * 0.030))  # slow steps: bursts shrink
    assert scheduler.schedule().running[0].num_steps == 1


def test_cheap_steps_burst_up_to_the_cap_and_zero_delay_means_always_the_cap():
    scheduler = make_scheduler(num_scheduler_steps=8, multi_step_max_delay_ms=4.0, overlap_scheduling=False)
    request = make_request("a", 4, max_tokens=50)
    add(scheduler, request)
    started(scheduler, request, 11)
    plan = scheduler.schedule()
    scheduler.update(plan, timed(plan, {0: [12]}, 0.00001))
    assert scheduler.schedule().running[0].num_steps == 8
    assert decoding(make_request("b", 4, max_tokens=50), 8).schedule().running[0].num_steps == 8  # delay 0


def test_an_unmeasured_result_leaves_bursts_at_one_step():
    scheduler = make_scheduler(num_scheduler_steps=16, multi_step_max_delay_ms=4.0, overlap_scheduling=False)
    request = make_request("a", 4, max_tokens=50)
    add(scheduler, request)
    started(scheduler, request, 11)
    for token in (12, 13, 14):
        plan = scheduler.schedule()
        assert plan.running[0].num_steps == 1
        scheduler.update(plan, out(plan, {0: [token]}))  # execute_seconds 0: not measured
