"""Fair admission between tenants (core/fairness.py) and priority preemption in the core.

- One tenant: the fair queue orders exactly as the plain (priority, arrival) queue.
- The virtual token counter: the least-served tenant's request goes first; a tenant back
  from idle starts level with the active ones, not with banked credit.
- Through the scheduler: a tenant flooding at many times its share does not hold back another
  tenant's request behind its backlog.
- A more urgent request preempts a less urgent running one (recompute) when there is no room,
  and, through the in-process engine and the real model, every output is unchanged.
"""

from __future__ import annotations

import random

import pytest
import torch

from services.common.sampling_params import SamplingParams
from services.scheduler.request.stop import StopConditions
from services.executor.config import ExecutorConfig
from services.inprocess.engine import Engine, EngineConfig
from services.scheduler.core.config import SchedulerLimits
from services.scheduler.request.finish_reason import FinishReason
from services.scheduler.request.request import Request
from services.scheduler.core.waiting_queue import WaitingQueue
from tests.helpers.service_harness import STORIES_DIR
from tests.scheduler.test_scheduler import add, make_request, make_scheduler, step
from tests.helpers.engine_runs import generate_all


def tenant_request(request_id: str, tenant: str, *, priority: int = 0, arrival_time: float = 0.0,
                   prompt_len: int = 4, **stop) -> Request:
    request = make_request(request_id, prompt_len, priority=priority, arrival_time=arrival_time, **stop)
    request.tenant = tenant
    return request


def test_one_tenant_orders_by_priority_then_arrival_then_admission() -> None:
    rng = random.Random(3)
    queue = WaitingQueue()
    live: list[Request] = []

    def expected_next() -> Request:
        return min(live, key=lambda r: (r.priority, r.arrival_time, r.seq_id))

    for seq_id in range(300):
        if live and rng.random() < 0.3:
            victim = live.pop(rng.randrange(len(live)))
            queue.remove(victim)
            continue
        request = make_request(f"r{seq_id}", priority=rng.randint(-2, 2), arrival_time=float(rng.randint(0, 50)))
        request.seq_id = seq_id
        queue.push(request)
        live.append(request)
        if rng.random() < 0.2:
            head = expected_next()
            assert queue.pop() is head
            live.remove(head)
    assert list(queue) == sorted(live, key=lambda r: (r.priority, r.arrival_time, r.seq_id))
    while live:
        head = expected_next()
        assert queue.pop() is head
        live.remove(head)
    assert not queue and queue.peek() is None


def test_the_least_served_tenant_goes_first_within_a_priority() -> None:
    queue = WaitingQueue()
    for i in range(5):
        request = tenant_request(f"a{i}", "a", arrival_time=float(i))
        request.seq_id = i
        queue.push(request)
    late_b = tenant_request("b0", "b", arrival_time=10.0)
    late_b.seq_id = 10
    urgent_a = tenant_request("a-urgent", "a", priority=-1, arrival_time=20.0)
    urgent_a.seq_id = 11
    queue.push(late_b)
    assert queue.pop().request_id == "a0"  # equal counters: arrival decides
    queue.charge("a", 100)
    assert queue.peek().request_id == "b0"  # a was served more: b's later request first
    queue.push(urgent_a)
    assert queue.peek().request_id == "a-urgent"  # priority before fairness
    assert [queue.pop().request_id for _ in range(len(queue))] == ["a-urgent", "b0", "a1", "a2", "a3", "a4"]


def test_a_tenant_back_from_idle_starts_level_and_keeps_its_debt() -> None:
    credited = WaitingQueue(idle_credit=100)
    credited.charge("a", 1000)
    credited.set_running({"a"})
    back = tenant_request("b0", "b")
    back.seq_id = 1
    credited.push(back)
    assert credited.served["b"] == 900  # one request's worth of credit, no more
    queue = WaitingQueue()
    queue.charge("a", 1000)
    queue.set_running({"a"})
    idle = tenant_request("b0", "b")
    idle.seq_id = 1
    queue.push(idle)
    assert queue.served["b"] == 1000  # lifted to the active minimum: no banked credit
    queue.charge("c", 5000)
    queue.set_running(set())
    back = tenant_request("c0", "c")
    back.seq_id = 2
    queue.push(back)
    assert queue.served["c"] == 5000  # never lowered either


def test_the_counters_stay_bounded_however_many_tenants_come_and_go() -> None:
    queue = WaitingQueue(idle_credit=10, max_idle_tenants=8)
    queue.charge("heavy", 1_000_000)  # went idle far ahead: its debt must outlive the churn
    queue.set_running({"steady"})
    queue.charge("steady", 0)
    for seq_id in range(5000):
        tenant = f"key-{seq_id}"
        request = tenant_request(f"r{seq_id}", tenant)
        request.seq_id = seq_id
        queue.push(request)
        assert queue.pop() is request
        queue.charge(tenant, 4 + seq_id % 7)  # it ran, then went idle
        queue.charge("steady", 5)
        assert len(queue.served) <= 2 * 8 + 2, len(queue.served)
    assert queue.served["heavy"] == 1_000_000  # ahead of the floor and the highest: kept
    back = tenant_request("heavy-again", "heavy")
    back.seq_id = 10_000
    queue.push(back)
    assert queue.served["heavy"] == 1_000_000  # no credit for the churn it sat out
    with pytest.raises(ValueError, match="max_idle_tenants must be >= 1"):
        WaitingQueue(max_idle_tenants=0)


def test_a_flooding_tenant_does_not_hold_back_another_tenants_request() -> None:
    scheduler = make_scheduler(max_num_seqs=2, num_blocks=64)
    flood = [tenant_request(f"flood{i}", "flood", arrival_time=float(i), max_tokens=4) for i in range(20)]
    add(scheduler, *flood)
    step(scheduler)  # two flood requests start
    add(scheduler, tenant_request("quiet", "quiet", arrival_time=100.0, max_tokens=4))
    started_at = None
    for n in range(1, 60):
        step(scheduler)
        quiet = scheduler.requests.get("quiet")
        if quiet is None or quiet.first_scheduled_time is not None or quiet in scheduler.running:
            started_at = n
            break
    # It starts as soon as a slot frees (the running flood requests need 4 steps), not after
    # the 18 flood requests that arrived before it.
    assert started_at is not None and started_at <= 5, started_at
    assert scheduler.waiting.served["flood"] > scheduler.waiting.served["quiet"]


def test_a_more_urgent_request_preempts_a_less_urgent_one_when_there_is_no_room() -> None:
    scheduler = make_scheduler(max_num_seqs=2, num_blocks=64)
    low = [tenant_request(f"low{i}", "", priority=5, max_tokens=30) for i in range(2)]
    add(scheduler, *low)
    step(scheduler)
    step(scheduler)
    add(scheduler, tenant_request("high", "", priority=0, max_tokens=3))
    plan, _ = step(scheduler)
    victim = low[1]  # least urgent: the later of two equal priorities
    assert plan.finished_seq_ids == [victim.seq_id] and scheduler.num_preemptions == 1
    assert victim in scheduler.waiting and low[0] in scheduler.running
    # The urgent request starts in the same step, in the room the preemption made; the victim
    # is not started again in the plan that tells the executor to forget it.
    assert [seq.seq_id for seq in plan.new] == [scheduler.requests.get("high").seq_id]
    plan, _ = step(scheduler)
    assert plan.new == [] and victim in scheduler.waiting
    # Equal priority never preempts.
    scheduler = make_scheduler(max_num_seqs=1, num_blocks=64)
    add(scheduler, tenant_request("a", "", max_tokens=30))
    step(scheduler)
    add(scheduler, tenant_request("b", "", max_tokens=3))
    plan, _ = step(scheduler)
    assert plan.finished_seq_ids == [] and scheduler.num_preemptions == 0


def test_a_flooding_tenant_yields_a_running_slot_to_a_tenant_far_behind() -> None:
    # max_model_len 64: the flood must be more than 64 tokens ahead to give up a slot.
    scheduler = make_scheduler(max_num_seqs=2, num_blocks=64)
    flood = [tenant_request(f"flood{i}", "flood", arrival_time=float(i), max_tokens=40) for i in range(6)]
    add(scheduler, *flood)
    for _ in range(3):
        step(scheduler)
    add(scheduler, tenant_request("even", "even", arrival_time=50.0, max_tokens=4))
    # even starts at 0 (14 - 64, floored at its own 0); flood is 14 ahead, not the 32 a
    # preemption needs.
    plan, _ = step(scheduler)
    assert plan.finished_seq_ids == [] and scheduler.num_preemptions == 0
    scheduler.finish_request("even", FinishReason.ABORT)
    for _ in range(40):
        step(scheduler)
    add(scheduler, tenant_request("quiet", "quiet", arrival_time=100.0, max_tokens=4))
    running_flood = [r.request_id for r in scheduler.running]
    plan, _ = step(scheduler)
    quiet = scheduler.requests.get("quiet")
    assert scheduler.waiting.served["flood"] - scheduler.waiting.served["quiet"] >= 64 - 6  # credit, less its prompt
    assert len(plan.finished_seq_ids) == 1 and scheduler.num_preemptions == 1
    victim = next(r for r in flood if r.seq_id == plan.finished_seq_ids[0])
    assert victim.request_id in running_flood and victim in scheduler.waiting
    assert [seq.seq_id for seq in plan.new] == [quiet.seq_id]  # in the same step


@pytest.fixture(scope="module")
def engine_factory():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield lambda max_num_seqs: Engine(EngineConfig(
        ExecutorConfig(model=str(STORIES_DIR), dtype="fp32", device="cpu", attention_backend="torch", block_size=16,
                       num_blocks=64),
        SchedulerLimits(max_num_seqs=max_num_seqs)))
    torch.set_num_threads(previous)


def test_priority_preemption_leaves_every_output_unchanged(engine_factory) -> None:
    # Room for two running sequences: two long low-priority streams take it; an urgent
    # request arrives and preempts one; all three finish with their solo outputs.
    greedy, stop = SamplingParams(temperature=0.0), StopConditions(max_tokens=80, ignore_eos=True)
    prompts = ["Once upon a time", "The cat sat on the mat and"]
    solo = engine_factory(8)
    want = {p: generate_all(solo, [p], greedy, stop)[0].token_ids for p in prompts}
    urgent_want = generate_all(solo, ["Lily wanted"], greedy, StopConditions(max_tokens=20, ignore_eos=True))[0]
    engine = engine_factory(2)
    ids = [engine.add_request(p, greedy, stop, priority=5) for p in prompts]
    got: dict[str, list[int]] = {i: [] for i in ids}
    while min(len(tokens) for tokens in got.values()) < 20:  # well short of 80, bursts or not
        for delta in engine.step():
            got[delta.request_id] += delta.token_ids
    urgent = engine.add_request("Lily wanted", greedy, StopConditions(max_tokens=20, ignore_eos=True), priority=0)
    got[urgent] = []
    finished_order = []
    while engine.has_unfinished():
        for delta in engine.step():
            got[delta.request_id] += delta.token_ids
            if delta.finished:
                finished_order.append(delta.request_id)
    assert engine.scheduler.num_preemptions >= 1
    assert finished_order[0] == urgent
    assert got[urgent] == urgent_want.token_ids
    assert [got[i] for i in ids] == [want[p] for p in prompts]
