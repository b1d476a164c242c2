"""What one step costs through the codec and the wire format, both directions.

One round trip = plan_to_proto + SerializeToString + FromString + plan_from_proto, then the
same for the result: the Python the scheduler and the executor pay per step on top of the
gRPC hop itself. The serving benchmark puts it beside the services' gap to the in-process
engine; ``python -m benchmarks step-codec`` prints it by part.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from services.common.codec.step_codec import plan_from_proto, plan_to_proto, result_from_proto, result_to_proto
from services.common.pb.tokenmill.v1 import executor_pb2
from services.common.step import RunningSequence, SequenceOutput, StepPlan, StepResult


def decode_step(num_seqs: int, block_size: int = 16) -> tuple[StepPlan, StepResult]:
    """A steady-state decode step: one token each, a new block for 1 in block_size sequences."""
    plan = StepPlan(
        step_id=1,
        running=[
            RunningSequence(seq_id=10_000 + i, num_scheduled_tokens=1, new_block_ids=[i] if i % block_size == 0 else [])
            for i in range(num_seqs)
        ],
        finished_seq_ids=[1, 2],
    )
    result = StepResult(step_id=1, outputs=[SequenceOutput(10_000 + i, [(i * 7919) % 32_000]) for i in range(num_seqs)])
    return plan, result


def time_us(fn: Callable[[], object], iters: int) -> float:
    """Mean microseconds of ``fn()`` over ``iters`` calls after one untimed call."""
    fn()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters * 1e6


def codec_parts(num_seqs: int) -> tuple[dict[str, Callable[[], object]], int, int]:
    """The four parts of a step's round trip as calls, and the plan's and the result's size in bytes."""
    plan, result = decode_step(num_seqs)
    plan_bytes = plan_to_proto(plan).SerializeToString()
    result_bytes = result_to_proto(result).SerializeToString()
    parts = {
        "plan encode (to_proto + serialize)": lambda: plan_to_proto(plan).SerializeToString(),
        "plan decode (parse + from_proto)": lambda: plan_from_proto(executor_pb2.StepRequest.FromString(plan_bytes)),
        "result encode (to_proto + serialize)": lambda: result_to_proto(result).SerializeToString(),
        "result decode (parse + from_proto)":
            lambda: result_from_proto(executor_pb2.StepResponse.FromString(result_bytes)),
    }
    return parts, len(plan_bytes), len(result_bytes)


def codec_ms_per_step(batch_size: float, iters: int = 200) -> float:
    """Python cost of one step through the codec and wire format, both directions, at this batch size."""
    parts, _, _ = codec_parts(max(1, round(batch_size)))
    return sum(time_us(fn, iters) for fn in parts.values()) / 1000.0
