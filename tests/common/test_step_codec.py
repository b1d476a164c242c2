"""Round trips of the step contract through executor.proto, including the wire bytes."""

from __future__ import annotations

import math

import pytest

from services.common.codec.step_codec import (
    plan_from_proto,
    plan_to_proto,
    result_from_proto,
    result_to_proto,
    sampling_from_proto,
    sampling_to_proto,
)
from services.common.errors import InvalidArgumentError
from services.common.pb.tokenmill.v1 import common_pb2, executor_pb2
from services.common.sampling_params import SamplingParams
from services.common.step import MinTokensBan
from services.common.step import (
    NewSequence,
    RunningSequence,
    SequenceOutput,
    StepPlan,
    StepResult,
    TokenLogprobs,
)


def wire_plan(plan: StepPlan) -> StepPlan:
    data = plan_to_proto(plan).SerializeToString()
    return plan_from_proto(executor_pb2.StepRequest.FromString(data))


def wire_result(result: StepResult) -> StepResult:
    data = result_to_proto(result).SerializeToString()
    return result_from_proto(executor_pb2.StepResponse.FromString(data))


# Values exactly representable in float32, so logprobs compare with ==.
FULL_SAMPLING = SamplingParams(
    temperature=0.7,
    top_k=40,
    top_p=0.9,
    min_p=0.05,
    repetition_penalty=1.1,
    presence_penalty=-0.5,
    frequency_penalty=0.25,
    logit_bias={5: -100.0, 17: 2.5},
    seed=2**63 + 11,
    logprobs=3,
)
FULL_BAN = MinTokensBan(min_tokens=4, token_ids=(2, 32000))


# --- sampling ---


@pytest.mark.parametrize("params", [SamplingParams(), FULL_SAMPLING, SamplingParams(temperature=0.0, logprobs=0, seed=0)])
def test_sampling_round_trip_is_exact(params: SamplingParams) -> None:
    msg = sampling_to_proto(params)
    back = sampling_from_proto(common_pb2.SamplingParams.FromString(msg.SerializeToString()))
    assert back == params


def test_sampling_absent_optionals_take_dataclass_defaults() -> None:
    # An empty message must not mean greedy/top_p=0/penalty=0: those are proto zero values.
    assert sampling_from_proto(common_pb2.SamplingParams()) == SamplingParams()


def test_sampling_zero_temperature_and_zero_logprobs_survive_presence() -> None:
    msg = sampling_to_proto(SamplingParams(temperature=0.0, logprobs=0, seed=0))
    assert msg.HasField("temperature") and msg.temperature == 0.0
    assert msg.HasField("logprobs") and msg.logprobs == 0
    assert msg.HasField("seed") and msg.seed == 0
    no_extras = sampling_to_proto(SamplingParams())
    assert not no_extras.HasField("seed") and not no_extras.HasField("logprobs")


# --- plans ---


def test_empty_plan_round_trip() -> None:
    plan = StepPlan(step_id=0)
    assert wire_plan(plan) == plan
    assert plan_to_proto(plan).SerializeToString() == b""


def test_plan_with_only_finished_ids_round_trip() -> None:
    plan = StepPlan(step_id=9, finished_seq_ids=[4, 2**40])
    assert wire_plan(plan) == plan


def test_mixed_plan_round_trip() -> None:
    plan = StepPlan(
        step_id=123,
        new=[
            NewSequence(
                seq_id=1,
                token_ids=[1, 15043, 3186, 29991],
                prompt_len=4,
                num_computed_tokens=0,
                num_scheduled_tokens=4,
                block_ids=[7],
                sampling=FULL_SAMPLING,
                min_tokens_ban=FULL_BAN,
            ),
            # A preempted sequence coming back: output tokens past prompt_len, prefix hit.
            NewSequence(
                seq_id=2,
                token_ids=list(range(100, 140)),
                prompt_len=33,
                num_computed_tokens=32,
                num_scheduled_tokens=8,
                block_ids=[3, 4, 9],
                sampling=SamplingParams(),
                adapter="tenant-a/support",
            ),
        ],
        running=[
            RunningSequence(seq_id=10, num_scheduled_tokens=1),
            RunningSequence(seq_id=11, num_scheduled_tokens=1, new_block_ids=[42]),
            RunningSequence(seq_id=12, num_scheduled_tokens=4, draft_token_ids=[5, 6, 7]),
            RunningSequence(seq_id=13, num_scheduled_tokens=3, new_block_ids=[8, 9], draft_token_ids=[1, 2]),
        ],
        finished_seq_ids=[5, 6],
    )
    back = wire_plan(plan)
    assert back == plan
    assert back.num_scheduled_tokens == 4 + 8 + 1 + 1 + 4 + 3


def test_plan_packs_running_sequences_as_parallel_arrays() -> None:
    msg = plan_to_proto(
        StepPlan(
            step_id=1,
            running=[
                RunningSequence(seq_id=10, num_scheduled_tokens=3, new_block_ids=[8, 9], draft_token_ids=[1, 2]),
                RunningSequence(seq_id=11, num_scheduled_tokens=1),
                RunningSequence(seq_id=12, num_scheduled_tokens=2, new_block_ids=[4], draft_token_ids=[7]),
            ],
        )
    )
    assert list(msg.running_seq_ids) == [10, 11, 12]
    assert list(msg.running_num_scheduled_tokens) == [3, 1, 2]
    assert list(msg.running_new_block_counts) == [2, 0, 1]
    assert list(msg.running_new_block_ids) == [8, 9, 4]
    assert list(msg.running_draft_counts) == [2, 0, 1]
    assert list(msg.running_draft_token_ids) == [1, 2, 7]


def test_new_sequence_carries_min_tokens_and_stop_ids_beside_sampling() -> None:
    seq = NewSequence(1, [1, 2], 2, 0, 2, [0], FULL_SAMPLING, FULL_BAN)
    msg = plan_to_proto(StepPlan(step_id=1, new=[seq])).new_sequences[0]
    assert msg.min_tokens == 4
    assert list(msg.stop_token_ids) == [2, 32000]
    no_ban = plan_to_proto(StepPlan(step_id=1, new=[NewSequence(1, [1, 2], 2, 0, 2, [0], FULL_SAMPLING)]))
    assert (no_ban.new_sequences[0].min_tokens, list(no_ban.new_sequences[0].stop_token_ids)) == (0, [])
    assert wire_plan(StepPlan(step_id=1, new=[seq])).new[0].min_tokens_ban == FULL_BAN


def test_decoded_running_lists_are_independent_objects() -> None:
    # The executor may keep these lists; a shared empty list would alias every sequence.
    back = wire_plan(StepPlan(step_id=1, running=[RunningSequence(1, 1), RunningSequence(2, 1)]))
    back.running[0].new_block_ids.append(99)
    assert back.running[1].new_block_ids == []


def test_large_decode_plan_round_trip() -> None:
    plan = StepPlan(
        step_id=2**33,
        running=[
            RunningSequence(seq_id=i, num_scheduled_tokens=1, new_block_ids=[i] if i % 16 == 0 else [])
            for i in range(256)
        ],
    )
    assert wire_plan(plan) == plan


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda m: m.running_num_scheduled_tokens.append(1), "running_num_scheduled_tokens has 3 entries; expected 2"),
        (lambda m: m.running_new_block_counts.pop(), "running_new_block_counts has 1 entries; expected 2"),
        (lambda m: m.running_new_block_ids.append(5), "running_new_block_ids has 2 entries but running_new_block_counts sums to 1"),
        (lambda m: m.running_draft_token_ids.pop(), "running_draft_token_ids has 1 entries but running_draft_counts sums to 2"),
    ],
)
def test_inconsistent_plan_arrays_are_rejected(mutate, message: str) -> None:
    msg = plan_to_proto(
        StepPlan(
            step_id=1,
            running=[
                RunningSequence(1, 3, new_block_ids=[4], draft_token_ids=[5, 6]),
                RunningSequence(2, 1),
            ],
        )
    )
    mutate(msg)
    with pytest.raises(InvalidArgumentError, match=message):
        plan_from_proto(msg)


# --- results ---


def test_empty_result_round_trip() -> None:
    result = StepResult(step_id=5)
    assert wire_result(result) == result


def test_result_without_logprobs_round_trip() -> None:
    result = StepResult(
        step_id=8,
        outputs=[
            SequenceOutput(1, []),  # prefill chunk that did not reach the end
            SequenceOutput(2, [17]),
            SequenceOutput(3, [4, 5, 6]),  # two accepted drafts + one sampled
        ],
    )
    assert wire_result(result) == result


def test_a_sequence_error_travels_with_its_output_alone() -> None:
    result = StepResult(step_id=9, outputs=[
        SequenceOutput(1, [17]),
        SequenceOutput(2, [3], error="structured output failed: lexer error: too many expressions constructed"),
    ])
    assert wire_result(result) == result


def test_result_with_logprobs_for_some_rows_only() -> None:
    result = StepResult(
        step_id=9,
        outputs=[
            SequenceOutput(1, [10], None),
            SequenceOutput(
                2,
                [11, 12],
                [
                    TokenLogprobs(-0.5, [11, 3], [-0.5, -1.25]),
                    TokenLogprobs(-2.0, [7, 12], [-0.75, -2.0]),
                ],
            ),
            SequenceOutput(3, [], None),
            SequenceOutput(4, [13], [TokenLogprobs(-0.125)]),  # logprobs=0: no alternatives
            SequenceOutput(5, [14], None),
        ],
    )
    msg = result_to_proto(result)
    assert list(msg.logprob_counts) == [0, 2, 0, 1, 0]
    assert list(msg.sampled_logprobs) == [-0.5, -2.0, -0.125]
    assert list(msg.top_counts) == [2, 2, 0]
    assert list(msg.top_token_ids) == [11, 3, 7, 12]
    assert wire_result(result) == result


def test_prompt_logprobs_travel_beside_the_sampled_ones_and_are_checked() -> None:
    result = StepResult(step_id=4, outputs=[
        SequenceOutput(1, [], None, prompt_logprobs=[TokenLogprobs(-1.5, [3, 9], [-0.25, -1.5]),
                                                     TokenLogprobs(-0.5, [5, 2], [-0.5, -3.0])]),
        SequenceOutput(2, [7], [TokenLogprobs(-0.25)]),
        SequenceOutput(3, [8], None, prompt_logprobs=[TokenLogprobs(-2.0)]),  # prompt_logprobs=0: no alternatives
    ])
    msg = result_to_proto(result)
    assert list(msg.prompt_logprob_counts) == [2, 0, 1] and list(msg.prompt_top_counts) == [2, 2, 0]
    assert wire_result(result) == result
    assert not result_to_proto(StepResult(5, [SequenceOutput(1, [2])])).prompt_logprob_counts  # none: no arrays
    msg.prompt_top_token_ids.pop()
    with pytest.raises(InvalidArgumentError, match="prompt_top_token_ids has 3 entries but prompt_top_counts sums to 4"):
        result_from_proto(msg)


def test_empty_logprob_list_comes_back_as_none() -> None:
    back = wire_result(StepResult(step_id=1, outputs=[SequenceOutput(1, [], [])]))
    assert back.outputs == [SequenceOutput(1, [], None)]


def test_logprobs_travel_as_float32() -> None:
    back = wire_result(StepResult(step_id=1, outputs=[SequenceOutput(1, [2], [TokenLogprobs(-0.1)])]))
    assert back.outputs[0].logprobs[0].logprob == pytest.approx(-0.1, rel=1e-7)
    assert back.outputs[0].logprobs[0].logprob != -0.1


def test_result_rejects_mismatched_top_lists() -> None:
    bad = StepResult(step_id=1, outputs=[SequenceOutput(7, [1], [TokenLogprobs(-1.0, [1, 2], [-1.0])])])
    with pytest.raises(InvalidArgumentError, match="seq 7: top_token_ids has 2 entries but top_logprobs has 1"):
        result_to_proto(bad)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda m: m.token_ids.append(3), "token_ids has 3 entries but token_counts sums to 2"),
        (lambda m: m.logprob_counts.append(0), "logprob_counts has 3 entries; expected 2"),
        (lambda m: m.top_counts.append(0), "top_counts has 2 entries; expected 1"),
        (lambda m: m.top_logprobs.pop(), "top_logprobs has 0 entries; expected 1"),
    ],
)
def test_inconsistent_result_arrays_are_rejected(mutate, message: str) -> None:
    msg = result_to_proto(
        StepResult(step_id=1, outputs=[SequenceOutput(1, [4], [TokenLogprobs(-1.0, [4], [-1.0])]), SequenceOutput(2, [5])])
    )
    mutate(msg)
    with pytest.raises(InvalidArgumentError, match=message):
        result_from_proto(msg)


def test_the_executors_step_time_travels_and_must_be_finite_and_not_negative() -> None:
    back = wire_result(StepResult(step_id=2, outputs=[SequenceOutput(1, [4])], execute_seconds=0.00125))
    assert back.execute_seconds == 0.00125
    for bad in (-0.5, math.inf, math.nan):
        msg = executor_pb2.StepResponse(step_id=3, execute_seconds=bad)
        with pytest.raises(InvalidArgumentError, match="execute_seconds = .*: must be a finite number >= 0"):
            result_from_proto(msg)


def test_missing_logprob_counts_means_no_logprobs() -> None:
    msg = executor_pb2.StepResponse(step_id=3, seq_ids=[1, 2], token_counts=[1, 1], token_ids=[8, 9])
    assert result_from_proto(msg) == StepResult(3, [SequenceOutput(1, [8]), SequenceOutput(2, [9])])


def test_multi_step_counts_travel_only_when_some_sequence_runs_more_than_one() -> None:
    plain = StepPlan(step_id=3, running=[RunningSequence(1, 1), RunningSequence(2, 1)])
    assert list(plan_to_proto(plain).running_num_steps) == []
    assert wire_plan(plain) == plain
    multi = StepPlan(step_id=4, running=[RunningSequence(1, 1, [5], [], 8), RunningSequence(2, 1),
                                         RunningSequence(3, 2, [], [])])
    assert list(plan_to_proto(multi).running_num_steps) == [8, 1, 1]
    assert wire_plan(multi) == multi


@pytest.mark.parametrize(
    ("num_steps", "message"),
    [
        ([2], "running_num_steps has 1 entries; expected 2"),
        ([0, 1], r"running_num_steps\[0\] = 0: must be >= 1"),
        ([1, 3], r"running_num_steps\[1\] = 3: must be >= 1, and above 1 only for a sequence that schedules 1 "
                 r"token and no drafts \(it has 2 and 1\)"),
    ],
)
def test_bad_multi_step_counts_are_invalid_arguments(num_steps, message) -> None:
    msg = plan_to_proto(StepPlan(step_id=1, running=[RunningSequence(1, 1), RunningSequence(2, 2, [], [9])]))
    msg.running_num_steps.extend(num_steps)
    with pytest.raises(InvalidArgumentError, match=message):
        plan_from_proto(msg)


def test_executor_info_carries_its_adapters_and_slots() -> None:
    from services.common.adapters import AdapterInfo
    from services.common.codec.step_codec import executor_info_from_proto, executor_info_to_proto
    from services.common.step import ExecutorInfo

    adapters = (AdapterInfo("support", "/srv/lora/support", 8, 16.0, ("q_proj", "v_proj"), "ab" * 16),
                AdapterInfo("sql", "/srv/lora/sql", 64, 32.0, ("down_proj",), "cd" * 16))
    info = ExecutorInfo(num_blocks=64, block_size=16, max_model_len=256, vocab_size=512, dtype="float32",
                        device="cpu", attention_backend="torch", model="m", architecture="LlamaForCausalLM",
                        bos_token_id=1, eos_token_ids=(2,), max_loras=4, adapters=adapters)
    back = executor_info_from_proto(executor_pb2.ExecutorInfo.FromString(
        executor_info_to_proto(info).SerializeToString()))
    assert (back.max_loras, back.adapters) == (4, adapters)
