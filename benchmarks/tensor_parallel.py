"""Decode steps: tensor-parallel ranks against one rank, one run side by side.

    python -m benchmarks tensor-parallel [--model random:llama-100m] [--batches 1,32] [--rounds 5]
        [--cpu-decode eager|fused] [--device cuda --dtype bf16 --tp 4]

The systems on the same model, one forward path for all (``--cpu-decode``: eager, or the fused
CPU step for a model it takes): one rank on one thread, one rank on two threads, and ``--tp``
ranks (this process and the rank processes) on one thread each: on a CPU summing over gloo on
loopback (eager only) with the LM head replicated on rank 0, then over the shared memory
segment with the head replicated and vocab-parallel; on CUDA over NCCL, vocab-parallel. Each round runs
every system in turn: a batch of fresh prompts prefilled in one step, then ``--steps`` timed
decode steps of the whole batch; the table has the median milliseconds per decode step over
the rounds, the ratio against one rank on one thread, and for the ranks the share of rank 0's
step spent in its all-reduces (which includes waiting for the other ranks to reach them). On a
CPU it then times the all-reduce alone between two processes doing nothing else, over gloo and
over shared memory.
"""

from __future__ import annotations

import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch

from benchmarks.harness import flags
from benchmarks.harness.flags import setting
from benchmarks.harness.models import resolve_model
from benchmarks.harness.report import LoadWatch, command_line, cpu_model_name, provenance, result_path, write_result
from services.common.sampling_params import SamplingParams
from services.common.step import NewSequence, RunningSequence, StepPlan
from services.executor.config import ExecutorConfig
from services.executor.forward_paths.decode_graphs import DecodeGraphSettings
from services.executor.forward_paths.fused_decode import FusedDecodeSettings
from services.executor.model_runner import ModelRunner

PROG = "python -m benchmarks tensor-parallel"
BLOCK_SIZE = 16
PROMPT_LEN = 32


@dataclass(frozen=True)
class TensorParallelSettings:
    model: str = setting("random:llama-100m")
    """Model (a directory or random:PRESET)."""
    batches: tuple[int, ...] = setting((1, 32))
    """Decode batch sizes, comma-separated."""
    steps: int = setting(16)
    """Timed decode steps a round."""
    rounds: int = setting(5)
    """Rounds, every system in turn."""
    device: str = setting("cpu")
    """cpu, or cuda (rank r on the r-th GPU)."""
    dtype: str = setting("fp32")
    """fp32, bf16 or fp16."""
    tp: int = setting(2)
    """Ranks of the tensor-parallel system."""
    cpu_decode: str = setting("eager")
    """Forward path of every system on a CPU: eager, or fused (the fused CPU step)."""
    all_reduce_calls: int = setting(500)
    """CPU: timed all-reduces of the collective alone (0: skip it)."""
    out: str = setting("")
    """Result JSON path (default benchmarks/results/tensor-parallel-DATE.json)."""

    def validate(self) -> None:
        flags.check_at_least(self, 1, "steps", "rounds")
        flags.check_at_least(self, 2, "tp")
        flags.check_at_least(self, 0, "all_reduce_calls")
        if not self.batches or min(self.batches) < 1:
            raise ValueError(f"--batches must be sizes >= 1, got {self.batches}")
        if self.cpu_decode not in ("eager", "fused"):
            raise ValueError(f"--cpu-decode must be eager or fused, got {self.cpu_decode!r}")


class System:
    def __init__(self, name: str, runner: ModelRunner, threads: int) -> None:
        self.name, self.runner, self.threads = name, runner, threads
        self.step_ms: dict[int, list[float]] = {}
        self.reduce_share: dict[int, list[float]] = {}
        self._next_id = 0
        self._step = 0

    def round(self, batch: int, steps: int, vocab: int) -> None:
        torch.set_num_threads(self.threads)
        width = -(-(PROMPT_LEN + steps + 1) // BLOCK_SIZE)
        generator = torch.Generator().manual_seed(self._next_id)
        ids = list(range(self._next_id, self._next_id + batch))
        self._next_id += batch
        new = [NewSequence(seq, torch.randint(3, vocab, (PROMPT_LEN,), generator=generator).tolist(), PROMPT_LEN, 0,
                           PROMPT_LEN, list(range(i * width, (i + 1) * width)), SamplingParams(temperature=0.0))
               for i, seq in enumerate(ids)]
        self._execute(StepPlan(self._step, new=new))
        hooks = self.runner.all_reduces
        if hooks is not None:
            hooks.start_timing()
        start = time.perf_counter()
        for _ in range(steps):
            self._execute(StepPlan(self._step, running=[RunningSequence(seq, 1) for seq in ids]))
        elapsed = time.perf_counter() - start
        self.step_ms.setdefault(batch, []).append(1000 * elapsed / steps)
        if hooks is not None:
            hooks.timed = False
            self.reduce_share.setdefault(batch, []).append(hooks.seconds / elapsed)
        self._execute(StepPlan(self._step, finished_seq_ids=ids))

    def _execute(self, plan: StepPlan) -> None:
        self.runner.execute(plan)
        self._step += 1


STEP_BLOCKS = 16
"""Block-table width of the measured step hand-off."""


def all_reduce_alone(rank: int, port: int, shapes: list[tuple[int, int]], calls: int) -> dict[str, dict[str, float]]:
    """Microseconds per all-reduce of each shape between two processes, over gloo on loopback
    and over the shared memory segment, nothing else running in them: the collective's own
    cost, without the wait for a slower rank that a step's all-reduce also holds. Then ("step
    gloo", "step shm") a decode step's hand-off from rank 0 (header and inputs of that many
    sequences, through gloo's step group or the segment) and the step's first sum (the
    segment's), which rank 0 leaves only once the other rank has the step."""
    import torch.distributed as dist

    from services.runtime.parallel.collectives import RankGroups

    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=120))
    groups = RankGroups.join(store, rank, 2, torch.device("cpu"), all_reduce="shm", secret=bytes(32))
    out: dict[str, dict[str, float]] = {"gloo": {}, "shm": {}}
    for name in out:
        reduce = (lambda t: groups.reduce.allreduce([t]).wait()) if name == "gloo" else groups.shm.all_reduce
        for rows, cols in shapes:
            t = torch.ones(rows, cols)
            for _ in range(20):
                reduce(t)
            groups.min_int(0)  # both start the timed calls together
            start = time.perf_counter()
            for _ in range(calls):
                reduce(t)
            out[name][f"{rows}x{cols}"] = 1e6 * (time.perf_counter() - start) / calls
    segment = groups.step_segment
    for name in ("step gloo", "step shm"):  # a decode step's inputs handed over, then its first sum
        out[name] = {}
        groups.step_segment = segment if name == "step shm" else None
        for rows, cols in shapes:
            header = torch.tensor([1, rows, rows, STEP_BLOCKS, rows], dtype=torch.int64)
            blob = torch.zeros(3 * rows + 2 * rows + 1 + rows * STEP_BLOCKS + rows, dtype=torch.int64)
            t = torch.ones(rows, cols)
            groups.min_int(0)
            start = time.perf_counter()
            for _ in range(calls):
                groups.broadcast_from_first(header, idle=rank != 0)
                groups.broadcast_from_first(blob)
                groups.shm.all_reduce(t)
            out[name][f"{rows}x{cols}"] = 1e6 * (time.perf_counter() - start) / calls
    groups.step_segment = segment
    return out


def _all_reduce_peer() -> None:
    """Rank 1 of ``measure_all_reduce``: argv PORT SHAPES CALLS."""
    port, shapes, calls = sys.argv[1:4]
    all_reduce_alone(1, int(port), [tuple(map(int, s.split("x"))) for s in shapes.split(",")], int(calls))


def measure_all_reduce(hidden: int, batches: tuple[int, ...], calls: int) -> dict[str, dict[str, float]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    shapes = ",".join(f"{b}x{hidden}" for b in batches)
    peer = subprocess.Popen([sys.executable, "-c", "from benchmarks.tensor_parallel import _all_reduce_peer; "
                             "_all_reduce_peer()", str(port), shapes, str(calls)])
    try:
        return all_reduce_alone(0, port, [(b, hidden) for b in batches], calls)
    finally:
        peer.wait(timeout=60)


def make_runner(args: TensorParallelSettings, model: str, tp: int, blocks: int, threads: int,
                all_reduce: str = "auto", lm_head: str = "vocab") -> ModelRunner:
    torch.set_num_threads(threads)  # the other ranks take rank 0's count at their start
    cpu = args.device == "cpu"
    # The fused step where asked, and then on every system or none (its own error if it cannot).
    decode = args.cpu_decode if cpu else "eager"
    return ModelRunner(ExecutorConfig(model=model, dtype=args.dtype, device=args.device,
                                      attention_backend="cpu" if cpu else "auto", block_size=BLOCK_SIZE,
                                      num_blocks=blocks, tensor_parallel_size=tp, tensor_parallel_all_reduce=all_reduce,
                                      tensor_parallel_lm_head=lm_head,
                                      quant_activations="none",
                                      fused_decode=FusedDecodeSettings(cpu_decode=decode),
                                      decode_graphs=DecodeGraphSettings(enforce_eager=True)))


def build_systems(args: TensorParallelSettings, model, blocks: int) -> list[System]:
    """One rank with one and with two threads, then --tp ranks over each all-reduce this device has."""
    one = make_runner(args, model, 1, blocks, 1)
    systems = [System("TP=1, 1 thread", one, 1), System("TP=1, 2 threads", one, 2)]
    if args.device != "cpu":
        return [*systems, System(f"TP={args.tp}, 1 thread a rank", make_runner(args, model, args.tp, blocks, 1), 1)]
    if args.cpu_decode == "eager":  # the fused step sums through shared memory only
        systems.append(System(f"TP={args.tp} gloo, 1 thread",
                              make_runner(args, model, args.tp, blocks, 1, "gloo", "replicated"), 1))
    return systems + [
        System(f"TP={args.tp} shm, 1 thread", make_runner(args, model, args.tp, blocks, 1, "shm", "replicated"), 1),
        System(f"TP={args.tp} shm vocab, 1 thread", make_runner(args, model, args.tp, blocks, 1, "shm", "vocab"), 1)]


def measure(systems: list[System], args: TensorParallelSettings, vocab: int) -> None:
    """A warm-up round (first-call allocations and oneDNN's caches), then --rounds of every
    batch, the systems interleaved within each."""
    for system in systems:
        for batch in args.batches:
            system.round(batch, 2, vocab)
        system.step_ms.clear()
        system.reduce_share.clear()
    for _ in range(args.rounds):
        for batch in args.batches:
            for system in systems:
                system.round(batch, args.steps, vocab)


def report_systems(systems: list[System], args: TensorParallelSettings) -> dict:
    """The table of median step times; the same as the result's ``systems``."""
    print(f"{'system':<26}" + "".join(f"{f'batch {b}':>14}{'vs TP=1/1t':>12}" for b in args.batches)
          + "".join(f"{f'all-reduce b{b}':>16}" for b in args.batches))
    base = {b: statistics.median(systems[0].step_ms[b]) for b in args.batches}
    reported = {}
    for system in systems:
        ms = {b: statistics.median(system.step_ms[b]) for b in args.batches}
        share = {b: statistics.median(system.reduce_share[b]) for b in system.reduce_share}
        line = f"{system.name:<26}" + "".join(f"{ms[b]:>14.2f}{base[b] / ms[b]:>11.2f}x" for b in args.batches)
        print(line + "".join(f"{share[b]:>15.0%} " for b in share))
        reported[system.name] = {"ms_per_step": ms, "vs_one_rank_one_thread": {b: base[b] / ms[b] for b in ms},
                                 "all_reduce_share": share}
    return reported


def report_all_reduce(config, args: TensorParallelSettings) -> dict:
    """The all-reduce (and the fused step's hand-off) timed alone between two processes."""
    alone = measure_all_reduce(config.hidden_size, args.batches, args.all_reduce_calls)
    per_step = 2 * config.num_layers
    for name, times in alone.items():
        if name.startswith("step"):
            print(f"step hand-off and first sum, two processes, {name.removeprefix('step ')}: "
                  + ", ".join(f"batch {shape.split('x')[0]} {us:.1f} us" for shape, us in times.items()))
            continue
        print(f"all-reduce alone, two processes, {name}: "
              + ", ".join(f"[{shape}] {us:.1f} us ({per_step} a step: {per_step * us / 1000:.2f} ms)"
                          for shape, us in times.items()))
    return alone


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    args = flags.parse(TensorParallelSettings, argv, prog=prog, description=__doc__)
    model = resolve_model(args.model)
    load = LoadWatch()
    width = -(-(PROMPT_LEN + args.steps + 1) // BLOCK_SIZE)
    systems = build_systems(args, model, max(args.batches) * width + 1)
    config = systems[0].runner.model_config
    try:
        measure(systems, args, config.vocab_size)
    finally:
        for system in systems[2:]:
            system.runner.close()
    path = args.cpu_decode if args.device == "cpu" else "eager"
    result: dict = {"model": args.model, "dtype": args.dtype, "device": args.device, "batches": list(args.batches),
                    "steps": args.steps, "rounds": args.rounds, "systems": {}, "cpu_decode": path}
    print(f"{args.model}, {args.dtype} on {args.device}, {path}, prompts of {PROMPT_LEN}, {args.steps} decode steps "
          f"x {args.rounds} rounds (median ms per decode step); {cpu_model_name()}")
    result["systems"] = report_systems(systems, args)
    if args.device == "cpu" and args.all_reduce_calls:
        result["all_reduce_alone_us"] = report_all_reduce(config, args)
    result |= provenance(command_line(prog, argv or []), load)
    load.stop()
    path = write_result(result, result_path("tensor-parallel", args.out or None))
    print(f"wrote {path}")
    return 0
