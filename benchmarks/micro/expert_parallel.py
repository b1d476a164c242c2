"""Micro-benchmark of expert parallelism on a CPU: a stack of sparse layers' experts over two
(or more) ranks, against the same stack on one rank, and where the ranks' time goes.

    python -m benchmarks expert-parallel [--world 2] [--all-reduce shm|gloo] [--exchange all_to_all|all_reduce]
                                         [--batches 1,32]

Random fp32 weights (each expert seeded by its layer and index, so every rank makes its own
run of them and the one-rank baseline all of them); each layer routes its input (softmax, top
k, renormalized) and the experts' output is added back to it. Every rank and the baseline run
one intra-op thread. A step is the whole stack for a batch of ``batch`` tokens; tokens/s is
``batch`` over the median step. The split is each rank's own count: the exchange (three
all-to-alls a layer, or one all-reduce; waiting for the other ranks included) against the rest
(routing bookkeeping, experts).
Only the sparse layers run: no attention, no LM head.
"""

from __future__ import annotations

import multiprocessing
import socket
import statistics
import time
from dataclasses import dataclass
from datetime import timedelta

import torch

from benchmarks.harness import flags
from benchmarks.harness.flags import setting

PROG = "python -m benchmarks expert-parallel"


@dataclass(frozen=True, slots=True)
class ExpertParallelSettings:
    world: int = setting(2)
    """Ranks the experts are split over."""
    all_reduce: str = setting("shm")
    """Shm (the shared-memory segment) or gloo: the ranks' channel."""
    exchange: str = setting("all_to_all")
    """all_to_all (tokens to their experts' ranks and back) or all_reduce (each rank's experts over all tokens, the
    outputs summed)."""
    layers: int = setting(4)
    """Sparse layers in the stack."""
    experts: int = setting(16)
    """Experts per layer."""
    top_k: int = setting(2)
    """Experts per token."""
    hidden: int = setting(1024)
    """Hidden size."""
    intermediate: int = setting(512)
    """Each expert's intermediate size."""
    batches: str = setting("1,32")
    """comma-separated batch sizes (tokens per step)."""
    repeats: int = setting(20)
    """Timed steps per batch size (the median is printed)."""

    def validate(self) -> None:
        flags.check_at_least(self, 2, "world")
        flags.check_at_least(self, 1, "repeats")
        if self.all_reduce not in ("shm", "gloo"):
            raise ValueError(f"all_reduce must be shm or gloo, got {self.all_reduce!r}")
        if self.exchange not in ("all_to_all", "all_reduce"):
            raise ValueError(f"exchange must be all_to_all or all_reduce, got {self.exchange!r}")
        if self.world > self.experts:
            raise ValueError(f"world {self.world} exceeds experts {self.experts}")

    @property
    def batch_sizes(self) -> list[int]:
        return [int(b) for b in self.batches.split(",")]


def _layer(s: ExpertParallelSettings, layer: int, experts: range):
    """The router [E, H] and experts ``experts``' w_gate_up [e, 2I, H], w_down [e, H, I] of ``layer``."""
    router = torch.randn(s.experts, s.hidden, generator=torch.Generator().manual_seed(layer)) / s.hidden ** 0.5
    gate_up, down = [], []
    for e in experts:
        g = torch.Generator().manual_seed(1000 * (layer + 1) + e)
        gate_up.append(torch.randn(2 * s.intermediate, s.hidden, generator=g) / s.hidden ** 0.5)
        down.append(torch.randn(s.hidden, s.intermediate, generator=g) / s.intermediate ** 0.5)
    return router, torch.stack(gate_up), torch.stack(down)


def _route(x: torch.Tensor, router: torch.Tensor, top_k: int):
    weights, ids = torch.topk(torch.softmax(x @ router.T, dim=-1), top_k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids


def _steps(step, s: ExpertParallelSettings, batch: int, after=None) -> list[float]:
    x = torch.randn(batch, s.hidden, generator=torch.Generator().manual_seed(batch))
    step(x)  # warm-up
    if after is not None:
        after()
    times = []
    for _ in range(s.repeats):
        start = time.perf_counter()
        step(x)
        times.append(time.perf_counter() - start)
        if after is not None:
            after()
    return times


def _rank_main(rank: int, s: ExpertParallelSettings, port: int, results) -> None:
    import torch.distributed as dist

    from services.runtime.parallel.collectives import RankGroups
    from services.runtime.parallel.expert_parallel import ExpertParallelMoe, expert_runs

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, s.world, rank == 0, timeout=timedelta(seconds=300))
    groups = RankGroups.join(store, rank, s.world, torch.device("cpu"), s.all_reduce, secret=bytes(32))
    mine = expert_runs(s.experts, s.world)[rank]
    stack = []
    for layer in range(s.layers):
        router, w_gate_up, w_down = _layer(s, layer, mine)
        stack.append((router, ExpertParallelMoe(rank, s.world, s.experts, w_gate_up, w_down, exchange=s.exchange,
                                                     groups=groups)))

    def step(x: torch.Tensor) -> None:
        for router, moe in stack:
            weights, ids = _route(x, router, s.top_k)
            x = x + moe(x, weights, ids)

    with torch.inference_mode():
        for batch in s.batch_sizes:
            splits: list[tuple[float, float]] = []

            def after() -> None:  # this step's split, then the counters from zero
                splits.append((sum(m.exchange_seconds for _, m in stack), sum(m.compute_seconds for _, m in stack)))
                for _, moe in stack:
                    moe.exchange_seconds = moe.compute_seconds = 0.0

            times = _steps(step, s, batch, after)
            splits = splits[1:]  # the warm-up's
            results.put((rank, batch, statistics.median(times), statistics.median(e for e, _ in splits),
                         statistics.median(c for _, c in splits)))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_benchmark(s: ExpertParallelSettings) -> None:
    from services.runtime.kernels.fused_moe import fused_moe

    torch.set_num_threads(1)
    print(f"exchange={s.exchange} over {s.all_reduce} layers={s.layers} experts={s.experts} top_k={s.top_k} hidden={s.hidden} intermediate={s.intermediate} "
          f"fp32, one thread a rank, median of {s.repeats} steps")
    single = {}
    stack = [_layer(s, layer, range(s.experts)) for layer in range(s.layers)]

    def step(x: torch.Tensor) -> None:
        for router, w_gate_up, w_down in stack:
            weights, ids = _route(x, router, s.top_k)
            x = x + fused_moe(x, w_gate_up, w_down, weights, ids)

    with torch.inference_mode():
        for batch in s.batch_sizes:
            single[batch] = statistics.median(_steps(step, s, batch))
    del stack
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, s, port, results)) for r in range(s.world)]
    for p in procs:
        p.start()
    rows = [results.get(timeout=1800) for _ in range(s.world * len(s.batch_sizes))]
    for p in procs:
        p.join(timeout=60)
    print(f"{'batch':>5} {'1 rank tok/s':>13} {f'{s.world} ranks tok/s':>13} {'speed-up':>9} "
          f"{'exchange ms':>12} {'compute ms':>11}  (per step, by rank)")
    for batch in s.batch_sizes:
        mine = sorted((r for r in rows if r[1] == batch), key=lambda r: r[0])
        step_s = max(r[2] for r in mine)
        exchange = "/".join(f"{r[3] * 1e3:.2f}" for r in mine)
        compute = "/".join(f"{r[4] * 1e3:.2f}" for r in mine)
        print(f"{batch:>5} {batch / single[batch]:>13.1f} {batch / step_s:>13.1f} {single[batch] / step_s:>8.2f}x "
              f"{exchange:>12} {compute:>11}")


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    args = flags.parse(ExpertParallelSettings, argv, prog=prog, description=__doc__)
    run_benchmark(args)
    return 0
