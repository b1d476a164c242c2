"""The one request path (services/scheduler/requests.py): admit, then each update to a delta.

Driven against a real scheduler core with hand-made executor results and a hand-set clock,
so every delta, stop string, usage and timing is exact.
"""

from __future__ import annotations

import pytest

from services.common.generation import GenerationDelta, Timings, Usage
from services.common.sampling_params import SamplingParams
from services.common.step import ExecutorInfo, SequenceOutput, StepResult
from services.common.stop import MinTokensBan, StopConditions
from services.scheduler.core import (
    FinishReason,
    QueueFullError,
    RequestStatus,
    RequestUpdate,
    Scheduler,
    SchedulerConfig,
    SchedulerLimits,
)
from services.scheduler.requests import RequestState, admit, model_eos_token_ids

EOS = 2


def make_core(**limits) -> Scheduler:
    return Scheduler(SchedulerConfig(SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=64, **limits),
                                     max_model_len=32, num_blocks=16, block_size=4, vocab_size=100))


def admit_one(core: Scheduler, stop: StopConditions, request_id: str = "a", now: float = 1.0) -> RequestState:
    return admit(core, request_id, [1, 2, 3], SamplingParams(temperature=0.0), stop, (EOS,), 0, now)


def step(core: Scheduler, token: int, now: float) -> list[RequestUpdate]:
    """One step in which every scheduled sequence samples ``token``."""
    plan = core.schedule(now)
    seq_ids = [seq.seq_id for seq in plan.new] + [seq.seq_id for seq in plan.running]
    return core.update(plan, StepResult(plan.step_id, [SequenceOutput(seq_id, [token]) for seq_id in seq_ids]))


# ---- intake ---------------------------------------------------------------------------


def test_admit_queues_a_core_request_with_the_stop_rules_and_the_eos_ids():
    core = make_core()
    stop = StopConditions(max_tokens=5, stop=("end", "end"), stop_token_ids=(7,), min_tokens=2)
    sampling = SamplingParams(temperature=0.0)
    state = admit(core, "a", [1, 2, 3], sampling, stop, (EOS,), priority=1, now=10.0)
    request = state.request
    assert core.get_request("a") is request and request.status is RequestStatus.WAITING
    assert (request.prompt_token_ids, request.sampling, request.stop, request.eos_token_ids) == (
        [1, 2, 3], sampling, stop, (EOS,))
    assert (request.priority, request.arrival_time, request.seq_id) == (1, 10.0, 0)
    assert request.min_tokens_ban == MinTokensBan(2, (7, EOS))
    assert (state.output.request_id, state.output.prompt_tokens, state.output.arrival_time) == ("a", 3, 10.0)
    assert state.output.matcher.stops == ("end",)


@pytest.mark.parametrize(
    ("prompt", "sampling", "stop", "message"),
    [
        ([1], SamplingParams(top_p=0.0), StopConditions(), r"top_p must be in \(0, 1\], got 0.0"),
        ([1], SamplingParams(), StopConditions(max_tokens=0), r"max_tokens must be >= 1 \(or None for no limit\), got 0"),
        ([1], SamplingParams(), StopConditions(max_tokens=32), r"max_tokens 32 must be below the context limit 32"),
        ([1], SamplingParams(), StopConditions(max_tokens=2, min_tokens=3), r"min_tokens=3 must not exceed max_tokens=2"),
        ([1], SamplingParams(), StopConditions(stop_token_ids=(100,)), r"stop_token_ids entry 100 is outside \[0, 100\)"),
        ([1], SamplingParams(), StopConditions(stop=("",)), r"stop\[0\] is empty"),
        ([1] * 32, SamplingParams(), StopConditions(), r"prompt length 32 \(prompt_token_ids\) must be below max_model_len=32"),
        ([1, 100], SamplingParams(), StopConditions(), r"prompt_token_ids\[1\] = 100 is outside \[0, 100\)"),
    ],
)
def test_admit_refuses_a_request_naming_the_field_and_keeps_nothing(prompt, sampling, stop, message):
    core = make_core()
    with pytest.raises(ValueError, match=message):
        admit(core, "bad", prompt, sampling, stop, (EOS,), 0, 0.0)
    assert not core.has_unfinished_requests()
    assert admit_one(core, StopConditions(), "good").request.seq_id == 0  # no seq id consumed


def test_admit_refuses_beyond_max_waiting_requests():
    core = make_core(max_waiting_requests=1)
    admit_one(core, StopConditions(), "a")
    with pytest.raises(QueueFullError, match="max_waiting_requests=1"):
        admit_one(core, StopConditions(), "b")
    assert core.get_request("b") is None


def test_the_tokenizer_eos_ids_win_over_the_model_config():
    info = ExecutorInfo(num_blocks=16, block_size=4, max_model_len=32, vocab_size=100, dtype="fp32", device="cpu",
                        attention_backend="torch", model="m", architecture="LlamaForCausalLM", bos_token_id=1,
                        eos_token_ids=(2,))
    assert model_eos_token_ids([3, 4], info) == (3, 4)
    assert model_eos_token_ids([], info) == (2,)


# ---- output ---------------------------------------------------------------------------


def test_a_stop_string_across_two_deltas_ends_the_request_and_names_itself_to_the_caller():
    core = make_core()
    state = admit_one(core, StopConditions(stop=("The end",)), now=1.0)
    (update,) = step(core, 11, now=1.5)
    delta, stop_string = state.on_update(update, "Once. The", now=2.0)
    # "The" may begin the stop string: held back until the next text decides.
    assert (delta, stop_string) == (GenerationDelta("a", "Once. ", [11]), None)

    (update,) = step(core, 12, now=2.5)
    delta, stop_string = state.on_update(update, " end!", now=3.0)
    assert stop_string == "The end"
    assert delta == GenerationDelta(
        "a", "", [12], finish_reason="stop", stop_reason="The end", usage=Usage(3, 2, 0),
        timings=Timings(queue_time_ms=500.0, time_to_first_token_ms=1000.0, decode_time_ms=1000.0, e2e_ms=2000.0))
    # The core still runs the request until the caller tells it.
    assert core.get_request("a") is state.request
    assert core.finish_request("a", FinishReason.STOP, stop_string)
    assert state.request.status is RequestStatus.FINISHED_STOPPED and state.request.stop_reason == "The end"


def test_a_stop_string_in_the_step_the_core_finished_needs_no_finish_request():
    core = make_core()
    state = admit_one(core, StopConditions(stop=("end",), include_stop_str_in_output=True))
    (update,) = step(core, EOS, now=1.0)
    assert update.finish_reason is FinishReason.EOS and core.get_request("a") is None
    delta, stop_string = state.on_update(update, "the end.", now=1.0)
    assert stop_string is None
    assert (delta.text, delta.finish_reason, delta.stop_reason) == ("the end", "stop", "end")


def test_text_held_for_a_stop_string_is_released_when_the_core_ends_the_request():
    core = make_core()
    state = admit_one(core, StopConditions(stop=("xyz",), max_tokens=1))
    (update,) = step(core, 11, now=1.0)
    assert update.finish_reason is FinishReason.LENGTH
    delta, stop_string = state.on_update(update, "abx", now=1.0)
    assert (delta.text, delta.finish_reason, delta.stop_reason, stop_string) == ("abx", "length", None, None)


def test_an_eos_token_finishes_with_eos_and_the_usage_counts_it():
    core = make_core()
    state = admit_one(core, StopConditions(), now=0.0)
    (update,) = step(core, 11, now=0.0)
    state.on_update(update, "Hi", now=0.25)
    (update,) = step(core, EOS, now=0.5)
    delta, stop_string = state.on_update(update, "", now=0.5)
    assert (delta.token_ids, delta.finish_reason, delta.usage, stop_string) == ([EOS], "eos", Usage(3, 2, 0), None)
    assert delta.timings == Timings(0.0, 250.0, 250.0, 500.0)
    assert state.output.token_times == [0.25, 0.5]


def test_abort_gives_the_final_delta_with_the_tokens_so_far():
    core = make_core()
    state = admit_one(core, StopConditions(), now=1.0)
    (update,) = step(core, 11, now=2.0)
    state.on_update(update, "Hi", now=3.0)
    assert core.abort_request("a")
    assert state.abort(now=5.0) == GenerationDelta(
        "a", finish_reason="abort", usage=Usage(3, 1, 0),
        timings=Timings(queue_time_ms=1000.0, time_to_first_token_ms=2000.0, decode_time_ms=2000.0, e2e_ms=4000.0))


def test_abort_before_the_first_schedule_counts_queue_time_until_now():
    core = make_core()
    state = admit_one(core, StopConditions(), now=1.0)
    core.abort_request("a")
    delta = state.abort(now=1.5, reason=FinishReason.ERROR)
    assert (delta.finish_reason, delta.usage) == ("error", Usage(3, 0, 0))
    assert delta.timings == Timings(500.0, 500.0, 0.0, 500.0)
