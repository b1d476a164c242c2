"""Time a 256-sequence decode step through the codec and the wire format, both directions.

    python -m benchmarks.step_codec_bench [--num-seqs 256] [--iters 2000]

One round trip = plan_to_proto + SerializeToString + FromString + plan_from_proto, then
the same for the result; that is the Python cost the scheduler and executor pay per step
on top of the gRPC hop itself.
"""

from __future__ import annotations

import argparse
import time

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


def time_us(fn, iters: int) -> float:
    fn()  # warm up
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--iters", type=int, default=2000)
    args = parser.parse_args()
    plan, result = decode_step(args.num_seqs)
    plan_bytes = plan_to_proto(plan).SerializeToString()
    result_bytes = result_to_proto(result).SerializeToString()
    rows = {
        "plan encode (to_proto + serialize)": lambda: plan_to_proto(plan).SerializeToString(),
        "plan decode (parse + from_proto)": lambda: plan_from_proto(executor_pb2.StepRequest.FromString(plan_bytes)),
        "result encode (to_proto + serialize)": lambda: result_to_proto(result).SerializeToString(),
        "result decode (parse + from_proto)": lambda: result_from_proto(executor_pb2.StepResponse.FromString(result_bytes)),
    }
    total = 0.0
    for name, fn in rows.items():
        us = time_us(fn, args.iters)
        total += us
        print(f"{name:40s} {us:8.1f} us")
    print(f"{'step round trip':40s} {total:8.1f} us  ({args.num_seqs} seqs; {len(plan_bytes)} B plan, {len(result_bytes)} B result)")


if __name__ == "__main__":
    main()
