"""Overlapped scheduling in the core: step N+1 is planned before step N's result is applied.

Driven by hand (schedule → schedule → update(N) → update(N+1)) with exact plans and counts,
then by a fake executor that runs plans in order the way ModelRunner does (keeps each
sequence's tokens, appends what it samples) and checks every K/V slot an attention read
would touch, over random workloads with overlap on and off.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

import pytest

from services.common.settings import parse_config
from services.common.step import RunningSequence, SequenceOutput, StepPlan, StepResult
from services.scheduler.config import SchedulerServiceConfig
from services.scheduler.core import Scheduler
from services.scheduler.request.finish_reason import FinishReason
from services.scheduler.request.request import Request, RequestStatus
from services.scheduler.request.update import RequestUpdate
from tests.scheduler.test_scheduler import add, assert_all_blocks_free, make_request, make_scheduler, prompt_for

EOS = 3


def overlapped(**overrides) -> Scheduler:
    return make_scheduler(overlap_scheduling=True, **overrides)


def out(plan: StepPlan, tokens: dict[int, list[int]]) -> StepResult:
    """The executor's result: tokens per seq_id (a seq_id absent here produced none)."""
    seq_ids = [s.seq_id for s in plan.new] + [s.seq_id for s in plan.running]
    return StepResult(plan.step_id, [SequenceOutput(seq_id, tokens.get(seq_id, [])) for seq_id in seq_ids])


def in_flight(request: Request) -> tuple[int, int, int, int]:
    """(computed, known, in flight, placeholders)"""
    return (request.num_computed_tokens, request.num_tokens, request.num_in_flight_tokens,
            request.num_output_placeholders)


# ---- decode ahead of the result ---------------------------------------------------------


def test_decode_is_planned_for_the_token_the_scheduler_has_not_seen():
    scheduler = overlapped()
    request = make_request("a", 7, max_tokens=5)
    add(scheduler, request)

    plan0 = scheduler.schedule()
    assert [(s.num_computed_tokens, s.num_scheduled_tokens, s.block_ids) for s in plan0.new] == [(0, 7, [0, 1])]
    assert in_flight(request) == (0, 7, 7, 1)
    # Step 0 still runs: step 1 computes the token step 0 samples (position 7, still block 1).
    plan1 = scheduler.schedule()
    assert plan1.new == [] and plan1.running == [RunningSequence(0, 1, [], [])]
    assert in_flight(request) == (0, 7, 8, 2)
    assert scheduler.num_steps_in_flight == 2
    with pytest.raises(RuntimeError, match="step 1 was scheduled but update\\(\\) was not called"):
        scheduler.schedule()

    assert scheduler.update(plan0, out(plan0, {0: [11]})) == [RequestUpdate("a", 0, [11], None, None, None)]
    assert in_flight(request) == (7, 8, 1, 1)
    # Step 2 computes position 8, the token step 1 samples: a new block for it.
    plan2 = scheduler.schedule()
    assert plan2.running == [RunningSequence(0, 1, [2], [])]
    assert request.block_ids == [0, 1, 2]
    assert scheduler.update(plan1, out(plan1, {0: [12]})) == [RequestUpdate("a", 0, [12], None, None, None)]
    assert in_flight(request) == (8, 9, 1, 1)

    plan3 = scheduler.schedule()
    assert plan3.running == [RunningSequence(0, 1, [], [])]
    scheduler.update(plan2, out(plan2, {0: [13]}))
    plan4 = scheduler.schedule()  # samples the 5th and last token
    assert plan4.running == [RunningSequence(0, 1, [], [])]
    scheduler.update(plan3, out(plan3, {0: [14]}))
    assert in_flight(request) == (10, 11, 1, 1)
    # The token in flight is the last max_tokens allows: no surplus step is planned.
    plan5 = scheduler.schedule()
    assert plan5.is_empty and plan5.finished_seq_ids == []
    assert scheduler.num_steps_in_flight == 1
    assert scheduler.update(plan5, out(plan5, {})) == []
    assert scheduler.update(plan4, out(plan4, {0: [15]})) == [
        RequestUpdate("a", 0, [15], None, FinishReason.LENGTH, None)]
    assert request.output_token_ids == [11, 12, 13, 14, 15]
    assert_all_blocks_free(scheduler)
    assert scheduler.schedule().finished_seq_ids == [0]


def test_max_model_len_leaves_no_surplus_step_either():
    scheduler = overlapped(max_model_len=10, num_blocks=8)
    request = make_request("a", 8)
    add(scheduler, request)
    plan0 = scheduler.schedule()
    plan1 = scheduler.schedule()  # position 8 -> samples token 10, the last max_model_len allows
    assert plan1.running == [RunningSequence(0, 1, [2], [])]
    scheduler.update(plan0, out(plan0, {0: [11]}))
    assert scheduler.schedule().is_empty
    assert scheduler.update(plan1, out(plan1, {0: [12]}))[0].finish_reason is FinishReason.LENGTH
    assert request.num_tokens == 10
    assert_all_blocks_free(scheduler)


def test_chunks_of_a_long_prompt_go_back_to_back():
    scheduler = overlapped(max_num_batched_tokens=8)
    request = make_request("a", 20)
    add(scheduler, request)
    plan0 = scheduler.schedule()
    plan1 = scheduler.schedule()
    assert [(s.num_scheduled_tokens, s.block_ids) for s in plan0.new] == [(8, [0, 1])]
    assert plan1.running == [RunningSequence(0, 8, [2, 3], [])]
    assert scheduler.update(plan0, out(plan0, {})) == []
    plan2 = scheduler.schedule()
    assert plan2.running == [RunningSequence(0, 4, [4], [])]
    assert in_flight(request) == (8, 20, 12, 1)
    assert scheduler.update(plan1, out(plan1, {})) == []
    plan3 = scheduler.schedule()  # the token the last chunk samples
    assert plan3.running == [RunningSequence(0, 1, [5], [])]
    assert [u.new_token_ids for u in scheduler.update(plan2, out(plan2, {0: [30]}))] == [[30]]
    assert in_flight(request) == (20, 21, 1, 1)


# ---- stops seen one step late -----------------------------------------------------------


def test_eos_is_seen_a_step_late_and_the_surplus_token_is_dropped():
    scheduler = overlapped()
    request = make_request("a", 7, eos_token_ids=(EOS,))
    other = make_request("b", 3, max_tokens=4)
    add(scheduler, request, other)
    plan0 = scheduler.schedule()
    plan1 = scheduler.schedule()
    assert [s.seq_id for s in plan1.running] == [0, 1]

    updates = scheduler.update(plan0, out(plan0, {0: [EOS], 1: [21]}))
    assert updates == [RequestUpdate("a", 0, [EOS], None, FinishReason.EOS, None),
                       RequestUpdate("b", 1, [21], None, None, None)]
    assert request.status is RequestStatus.FINISHED_STOPPED
    assert scheduler.block_manager.pool.num_free == 63  # a's two blocks are free at once
    # Step 2 tells the executor to forget a, whose surplus step 1 is still running.
    plan2 = scheduler.schedule()
    assert plan2.finished_seq_ids == [0] and [s.seq_id for s in plan2.running] == [1]
    # a's surplus token (99) is dropped: no update, not in its outputs.
    assert scheduler.update(plan1, out(plan1, {0: [99], 1: [22]})) == [RequestUpdate("b", 1, [22], None, None, None)]
    assert request.output_token_ids == [EOS]
    assert scheduler.update(plan2, out(plan2, {1: [23]}))[0].new_token_ids == [23]


def test_stop_token_respects_min_tokens_with_steps_in_flight():
    scheduler = overlapped()
    request = make_request("a", 3, stop_token_ids=[9], min_tokens=2)
    add(scheduler, request)
    plans = [scheduler.schedule(), scheduler.schedule()]
    reasons = []
    for index, token in enumerate((9, 9, 9, 4)):  # the first two come before min_tokens; the third stops
        plan = plans[index]
        reasons += [(u.new_token_ids, u.finish_reason) for u in scheduler.update(plan, out(plan, {0: [token]}))]
        plans.append(scheduler.schedule())
    assert reasons == [([9], None), ([9], None), ([9], FinishReason.STOP)]
    assert request.output_token_ids == [9, 9, 9] and request.stop_reason == 9
    # Step 3 computed the surplus token 4; step 4, planned after the stop, forgets the sequence.
    assert [len(p.running) for p in plans] == [0, 1, 1, 1, 0, 0]
    assert [p.finished_seq_ids for p in plans] == [[], [], [], [], [0], []]
    assert_all_blocks_free(scheduler)


def test_a_stop_string_finish_with_two_steps_in_flight():
    scheduler = overlapped()
    request = make_request("a", 4)
    add(scheduler, request)
    plan0, plan1 = scheduler.schedule(), scheduler.schedule()
    scheduler.update(plan0, out(plan0, {0: [5]}))
    plan2 = scheduler.schedule()
    # The publisher finds a stop string in token 5's text while steps 1 and 2 run.
    assert scheduler.finish_request("a", FinishReason.STOP, "###")
    assert_all_blocks_free(scheduler)
    assert scheduler.update(plan1, out(plan1, {0: [6]})) == []
    assert scheduler.update(plan2, StepResult(plan2.step_id)) == []  # its output may be missing
    assert request.output_token_ids == [5]
    assert scheduler.schedule().finished_seq_ids == [0]


# ---- abort and preemption while a step is in flight -------------------------------------


def test_abort_with_two_steps_in_flight_frees_blocks_that_only_later_steps_reuse():
    scheduler = overlapped(num_blocks=4, max_model_len=16)
    doomed, kept = make_request("a", 7), make_request("b", 3)
    add(scheduler, doomed, kept)
    plan0, plan1 = scheduler.schedule(), scheduler.schedule()
    assert doomed.block_ids == [0, 1] and kept.block_ids == [2]
    assert scheduler.finish_request("a", FinishReason.ABORT)
    assert scheduler.block_manager.pool.free_block_ids() == [3, 1, 0]
    assert scheduler.update(plan0, out(plan0, {0: [5], 1: [6]})) == [RequestUpdate("b", 1, [6], None, None, None)]
    # Blocks 0 and 1 may still be written by steps 0 and 1 (a's tokens); the first plan that
    # can hand them out is step 2, which the executor runs after both.
    late = make_request("c", 8)
    add(scheduler, late)
    plan2 = scheduler.schedule()
    assert plan2.finished_seq_ids == [0]
    assert plan2.running == [RunningSequence(1, 1, [3], [])]  # b's position 4
    assert [(s.seq_id, s.block_ids) for s in plan2.new] == [(2, [1, 0])]
    assert plan2.step_id > max(plan0.step_id, plan1.step_id)
    assert [u.request_id for u in scheduler.update(plan1, out(plan1, {0: [7], 1: [8]}))] == ["b"]
    assert doomed.output_token_ids == []
    for request_id in ("b", "c"):
        scheduler.finish_request(request_id, FinishReason.ABORT)
    scheduler.update(plan2, StepResult(plan2.step_id))
    assert_all_blocks_free(scheduler)


def test_a_victim_preempted_while_its_step_runs_restarts_from_its_known_tokens():
    scheduler = overlapped(num_blocks=4, max_model_len=16)
    first, victim = make_request("a", 7, arrival_time=0.0), make_request("b", 7, arrival_time=1.0)
    add(scheduler, first, victim)
    plan0, plan1 = scheduler.schedule(), scheduler.schedule()
    assert (first.block_ids, victim.block_ids) == ([0, 1], [2, 3])
    scheduler.update(plan0, out(plan0, {0: [11], 1: [21]}))
    # a's step 2 needs a block for position 8: b, the later arrival, is preempted while its
    # step 1 still runs; its blocks go to a in the very plan that tells the executor to forget b.
    plan2 = scheduler.schedule()
    assert plan2.running == [RunningSequence(0, 1, [3], [])]
    assert plan2.finished_seq_ids == [1] and plan2.new == []
    assert victim.status is RequestStatus.PREEMPTED
    assert in_flight(victim) == (0, 8, 0, 0)
    # b's token from step 1 is ignored: it is sampled again after the restart.
    assert [u.request_id for u in scheduler.update(plan1, out(plan1, {0: [12], 1: [22]}))] == ["a"]
    assert victim.output_token_ids == [21]
    scheduler.finish_request("a", FinishReason.STOP, "###")
    plan3 = scheduler.schedule()
    # b's first block (4 prompt tokens, computed and confirmed in step 0) is still cached.
    assert [(s.token_ids, s.num_computed_tokens, s.num_scheduled_tokens) for s in plan3.new] == [
        (prompt_for("b", 7) + [21], 4, 4)]
    assert plan3.finished_seq_ids == [0]
    scheduler.update(plan2, out(plan2, {0: [13]}))  # a's surplus, dropped
    assert [u.new_token_ids for u in scheduler.update(plan3, out(plan3, {1: [22]}))] == [[22]]
    assert victim.output_token_ids == [21, 22]


# ---- prefix caching waits for known, confirmed tokens -----------------------------------


def test_a_block_is_cached_only_once_its_tokens_are_known_and_computed():
    scheduler = overlapped()
    request = make_request("a", 6)
    add(scheduler, request)
    manager = scheduler.block_manager
    plan0, plan1 = scheduler.schedule(), scheduler.schedule()
    scheduler.update(plan0, out(plan0, {0: [11]}))
    assert len(manager.prefixes.index) == 1  # block 0: positions 0-3
    plan2 = scheduler.schedule()  # computes position 7, whose token only the executor knows
    scheduler.update(plan1, out(plan1, {0: [12]}))
    # Block 1 (positions 4-7) holds four known tokens now, but step 2, still running, writes
    # position 7's K/V: not cached yet.
    assert request.all_token_ids[4:8] == prompt_for("a", 6)[4:] + [11, 12]
    assert len(manager.prefixes.index) == 1
    plan3 = scheduler.schedule()
    scheduler.update(plan2, out(plan2, {0: [13]}))
    assert len(manager.prefixes.index) == 2
    scheduler.update(plan3, out(plan3, {0: [14]}))
    # A later prompt with the same 8 tokens starts from both blocks.
    add(scheduler, make_request("b", token_ids=request.all_token_ids[:8] + [5]))
    plan4 = scheduler.schedule()
    assert [(s.num_computed_tokens, s.block_ids[:2]) for s in plan4.new] == [(8, [0, 1])]


# ---- drafts -----------------------------------------------------------------------------


def test_drafts_go_only_to_a_request_with_nothing_in_flight():
    scheduler = overlapped()
    request = make_request("a", 3)
    add(scheduler, request)
    plan0 = scheduler.schedule()
    scheduler.update(plan0, out(plan0, {0: [5]}))
    request.spec_token_ids = [6, 7]
    plan1 = scheduler.schedule()
    assert plan1.running == [RunningSequence(0, 3, [1], [6, 7])]
    # Where step 2 would start depends on how many drafts step 1 accepts: a waits.
    assert scheduler.schedule().is_empty
    scheduler.update(plan1, out(plan1, {0: [6, 9]}))
    assert request.output_token_ids == [5, 6, 9]
    plan2 = scheduler.schedule()
    request.spec_token_ids = [10]  # drafted while step 2 runs: the last token is not known
    plan3 = scheduler.schedule()
    assert plan3.running == [RunningSequence(0, 1, [], [])] and request.spec_token_ids == []
    scheduler.update(plan2, out(plan2, {0: [11]}))
    scheduler.update(plan3, out(plan3, {0: [12]}))
    assert request.output_token_ids == [5, 6, 9, 11, 12]


# ---- protocol ---------------------------------------------------------------------------


def test_updates_must_come_in_step_order():
    scheduler = overlapped()
    add(scheduler, make_request("a"))
    plan0, plan1 = scheduler.schedule(), scheduler.schedule()
    with pytest.raises(ValueError, match="plan.step_id=1 is not the oldest step in flight \\(0\\)"):
        scheduler.update(plan1, out(plan1, {0: [5]}))
    scheduler.update(plan0, out(plan0, {0: [5]}))
    scheduler.update(plan1, out(plan1, {0: [6]}))
    with pytest.raises(ValueError, match="plan.step_id=1 is not the oldest step in flight \\(None\\)"):
        scheduler.update(plan1, out(plan1, {0: [6]}))


def test_without_overlap_a_second_plan_waits_for_the_update():
    scheduler = make_scheduler()
    add(scheduler, make_request("a"))
    scheduler.schedule()
    with pytest.raises(RuntimeError, match="overlap_scheduling=False"):
        scheduler.schedule()


# ---- random workloads through an in-order executor --------------------------------------


@dataclass
class _Sequence:
    tokens: list[int]
    num_computed: int
    block_ids: list[int]


@dataclass
class InOrderExecutor:
    """Runs plans in the order it receives them, as ModelRunner does: it keeps each sequence's
    tokens and appends what it samples. Sampling is a function of the sequence's tokens, so a
    recomputed sequence samples the same tokens again. The KV pool is modelled slot by slot:
    a write stores the prefix the K/V was computed from, and every position a step attends
    to must hold its own sequence's prefix (a slot clobbered by another sequence, or never
    written, fails the step)."""

    block_size: int
    sequences: dict[int, _Sequence] = field(default_factory=dict)
    kv: dict[int, tuple[int, ...]] = field(default_factory=dict)

    def sample(self, tokens: list[int]) -> int:
        return hash(tuple(tokens)) % 40 + 1  # EOS (3) about one token in 40

    def slot(self, sequence: _Sequence, position: int) -> int:
        return sequence.block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def execute(self, plan: StepPlan) -> StepResult:
        for seq_id in plan.finished_seq_ids:
            del self.sequences[seq_id]
        scheduled: list[tuple[int, _Sequence, int]] = []
        for new in plan.new:
            assert new.seq_id not in self.sequences
            sequence = _Sequence(list(new.token_ids), new.num_computed_tokens, list(new.block_ids))
            self.sequences[new.seq_id] = sequence
            scheduled.append((new.seq_id, sequence, new.num_scheduled_tokens))
        more_steps: dict[int, int] = {}
        for running in plan.running:
            assert not running.draft_token_ids
            sequence = self.sequences[running.seq_id]
            sequence.block_ids += running.new_block_ids
            scheduled.append((running.seq_id, sequence, running.num_scheduled_tokens))
            if running.num_steps > 1:
                assert running.num_scheduled_tokens == 1
                more_steps[running.seq_id] = running.num_steps - 1
        for _, sequence, n in scheduled:  # every layer writes the step's K/V, then attends
            end = sequence.num_computed + n
            assert end <= len(sequence.tokens) and end <= len(sequence.block_ids) * self.block_size
            for position in range(sequence.num_computed, end):
                self.kv[self.slot(sequence, position)] = tuple(sequence.tokens[: position + 1])
        outputs = []
        for seq_id, sequence, n in scheduled:
            end = sequence.num_computed + n
            for position in range(end):
                assert self.kv.get(self.slot(sequence, position)) == tuple(sequence.tokens[: position + 1]), (
                    f"seq {seq_id} reads a slot at position {position} it does not own")
            sequence.num_computed = end
            output = SequenceOutput(seq_id)
            if end == len(sequence.tokens):
                output.token_ids = [self.sample(sequence.tokens)]
                sequence.tokens.append(output.token_ids[0])
            outputs.append(output)
        # Multi-step: each sampled token is fed back in, one decode step at a time.
        for step in range(1, max(more_steps.values(), default=0) + 1):
            for seq_id, sequence, output in [(i, q, o) for (i, q, _), o in zip(scheduled, outputs)
                                             if more_steps.get(i, 0) >= step]:
                position = sequence.num_computed
                assert position + 1 == len(sequence.tokens) and position < len(sequence.block_ids) * self.block_size
                self.kv[self.slot(sequence, position)] = tuple(sequence.tokens)
                for p in range(position + 1):
                    assert self.kv.get(self.slot(sequence, p)) == tuple(sequence.tokens[: p + 1]), (
                        f"seq {seq_id} reads a slot at position {p} it does not own")
                sequence.num_computed += 1
                output.token_ids.append(self.sample(sequence.tokens))
                sequence.tokens.append(output.token_ids[-1])
        return StepResult(plan.step_id, outputs)


def random_requests(rng: random.Random, count: int) -> list[Request]:
    shared_prefix = list(range(500, 516))
    requests = []
    for index in range(count):
        prompt = shared_prefix[: rng.randrange(0, 16)] + [rng.randrange(1, 400) for _ in range(rng.randrange(1, 30))]
        stop_fields = dict(max_tokens=rng.randrange(1, min(20, 64 - len(prompt)) + 1))
        if rng.random() < 0.3:
            stop_fields["stop_token_ids"] = [rng.randrange(1, 41) for _ in range(3)]
        if rng.random() < 0.3:
            stop_fields["min_tokens"] = rng.randrange(0, stop_fields["max_tokens"] + 1)
        if rng.random() < 0.2:
            del stop_fields["max_tokens"]  # until EOS, a stop id or max_model_len
        requests.append(make_request(f"r{index}", token_ids=prompt, priority=rng.randrange(0, 3),
                                     arrival_time=float(index), eos_token_ids=(EOS,), **stop_fields))
    return requests


def run_workload(overlap: bool, seed: int, abort_rate: float = 0.0, num_scheduler_steps: int = 1,
                 plans: list[StepPlan] | None = None) -> tuple[Scheduler, dict[str, tuple]]:
    """Requests arrive at random steps; the caller keeps up to two plans in flight (overlap)
    or one, the executor runs each plan when it is sent, and the result is applied later.
    ``plans`` receives every plan sent."""
    rng = random.Random(seed)
    scheduler = make_scheduler(num_blocks=16, max_model_len=64, max_num_batched_tokens=24, max_num_seqs=6,
                               overlap_scheduling=overlap, num_scheduler_steps=num_scheduler_steps,
                               multi_step_max_delay_ms=0)
    executor = InOrderExecutor(scheduler.config.block_size)
    requests = random_requests(rng, 40)
    pending, sent = list(requests), deque()
    outputs: dict[str, list[int]] = {r.request_id: [] for r in requests}
    depth = 2 if overlap else 1
    for _ in range(5000):
        while pending and rng.random() < 0.5:
            scheduler.add_request(pending.pop(0))
        if not pending and not scheduler.has_unfinished_requests() and not sent:
            break
        if abort_rate and rng.random() < abort_rate and scheduler.requests:
            scheduler.finish_request(rng.choice(sorted(scheduler.requests)), FinishReason.ABORT)
        while len(sent) < depth:
            plan = scheduler.schedule()
            if plan.is_empty and not plan.finished_seq_ids:
                break
            assert plan.num_scheduled_tokens <= scheduler.config.limits.max_num_batched_tokens
            if plans is not None:
                plans.append(plan)
            sent.append((plan, executor.execute(plan)))
        if sent:
            for update in scheduler.update(*sent.popleft()):
                outputs[update.request_id] += update.new_token_ids
        holders = [0] * scheduler.config.num_blocks
        for request in scheduler.running:
            assert len(request.block_ids) * scheduler.config.block_size >= request.num_planned_tokens
            for block_id in request.block_ids:
                holders[block_id] += 1
        assert holders == [block.ref_count for block in scheduler.block_manager.pool.blocks]
    else:
        raise AssertionError("workload did not finish")
    final = scheduler.schedule()  # tell the executor to forget the last finished sequences
    assert final.is_empty
    executor.execute(final)
    assert executor.sequences == {}
    assert_all_blocks_free(scheduler)
    return scheduler, {r.request_id: (outputs[r.request_id], r.finish_reason, r.stop_reason) for r in requests}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_workload_outputs_are_the_same_with_overlap_on_and_off(seed):
    scheduler_off, off = run_workload(overlap=False, seed=seed)
    scheduler_on, on = run_workload(overlap=True, seed=seed)
    assert on == off
    for request_id, (tokens, reason, _) in on.items():
        assert reason in (FinishReason.LENGTH, FinishReason.EOS, FinishReason.STOP), request_id
        assert tokens, request_id
    assert {reason for _, reason, _ in on.values()} == {FinishReason.LENGTH, FinishReason.EOS, FinishReason.STOP}
    assert scheduler_on.num_preemptions > 0  # 16 blocks of 4 tokens force some
    assert scheduler_on.block_manager.prefixes.hits > 0


@pytest.mark.parametrize("seed", [4, 5])
def test_random_workload_with_aborts_keeps_every_slot_its_owner_wrote(seed):
    scheduler, results = run_workload(overlap=True, seed=seed, abort_rate=0.05)
    assert any(reason is FinishReason.ABORT for _, reason, _ in results.values())


def test_overlap_is_on_by_default_and_a_flag_or_variable_turns_it_off():
    assert SchedulerServiceConfig().limits.overlap_scheduling is True
    assert parse_config(SchedulerServiceConfig, ["--no-overlap-scheduling"], env={}).limits.overlap_scheduling is False
    env = {"TOKENMILL_OVERLAP_SCHEDULING": "false"}
    assert parse_config(SchedulerServiceConfig, [], env=env).limits.overlap_scheduling is False
