"""Time a 256-sequence decode step through the codec and the wire format, both directions.

    python -m benchmarks step-codec [--num-seqs 256] [--iters 2000]

One round trip = plan_to_proto + SerializeToString + FromString + plan_from_proto, then
the same for the result; that is the Python cost the scheduler and executor pay per step
on top of the gRPC hop itself (benchmarks/harness/step_codec.py, which the serving
benchmark's services gap also uses).
"""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.harness import flags
from benchmarks.harness.flags import setting
from benchmarks.harness.step_codec import codec_parts, time_us

PROG = "python -m benchmarks step-codec"


@dataclass(frozen=True, slots=True)
class StepCodecSettings:
    num_seqs: int = setting(256)
    """Sequences in the decode step."""
    iters: int = setting(2000)
    """Timed calls of each part."""

    def validate(self) -> None:
        flags.check_at_least(self, 1, "num_seqs", "iters")


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    args = flags.parse(StepCodecSettings, argv, prog=prog, description=__doc__)
    parts, plan_bytes, result_bytes = codec_parts(args.num_seqs)
    total = 0.0
    for name, fn in parts.items():
        us = time_us(fn, args.iters)
        total += us
        print(f"{name:40s} {us:8.1f} us")
    print(f"{'step round trip':40s} {total:8.1f} us  ({args.num_seqs} seqs; {plan_bytes} B plan, {result_bytes} B result)")
    return 0
