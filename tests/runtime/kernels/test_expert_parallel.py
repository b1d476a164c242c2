"""Expert parallelism between real processes at 2 and 3 ranks, through the shared-memory segment
(services/runtime/kernels/cpu/shm_all_reduce.cpp) and through gloo.

The all-to-all against the exchange computed in one process: nothing sent, everything to one
rank, awkward counts, int64 and bf16 rows of several dimensions, rows that span several of the
segment's chunks with unequal stream lengths per rank. The expert-parallel layer
(services/runtime/parallel/expert_parallel.py) against ``fused_moe_reference`` on one rank:
fp32 and bf16, one token (ranks with no tokens), tokens not a multiple of the ranks, every
token routed to one rank's experts, k = 1 and 8; both exchanges (all-to-all, all-reduce).
"""

from __future__ import annotations

import itertools
import os
import socket
from datetime import timedelta

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.runtime.kernels.fused_moe import fused_moe_reference
from services.runtime.parallel.shared_memory import CAPACITY
from tests.helpers.rank_processes import rank_context

CASES = {  # name -> (counts[src][dst] for world 3, the row shape, dtype); world 2 uses the top-left 2x2
    "nothing": ([[0, 0, 0], [0, 0, 0], [0, 0, 0]], (4,), torch.float32),
    "all_to_rank0": ([[5, 0, 0], [7, 0, 0], [1, 0, 0]], (3,), torch.float32),
    "awkward": ([[1, 0, 3], [2, 9, 0], [0, 4, 1]], (2, 3), torch.bfloat16),
    "ids": ([[3, 1, 2], [0, 2, 5], [4, 4, 0]], (), torch.int64),
    # ~1.5 and ~2.5 chunks of the segment from ranks 0 and 1, a few rows from rank 2
    "chunks": ([[200, 184, 0], [300, 0, 340], [1, 0, 2]], (CAPACITY // 256,), torch.float32),
}


LAYER_CASES = {  # name -> (tokens, experts, k, dtype, routing)
    "fp32": (7, 8, 2, torch.float32, "random"),
    "bf16_k8": (5, 12, 8, torch.bfloat16, "random"),
    "one_token": (1, 6, 2, torch.float32, "random"),
    "to_rank0": (9, 8, 1, torch.float32, "first_expert"),
}
HIDDEN, INTERMEDIATE = 24, 40


def layer_inputs(name: str):
    """The same on every rank and in the test process: x, weights, routing."""
    tokens, experts, top_k, dtype, routing = LAYER_CASES[name]
    g = torch.Generator().manual_seed(len(name))
    x = torch.randn(tokens, HIDDEN, generator=g).to(dtype)
    w_gate_up = (torch.randn(experts, 2 * INTERMEDIATE, HIDDEN, generator=g) / HIDDEN ** 0.5).to(dtype)
    w_down = (torch.randn(experts, HIDDEN, INTERMEDIATE, generator=g) / INTERMEDIATE ** 0.5).to(dtype)
    weights, ids = torch.topk(torch.randn(tokens, experts, generator=g).softmax(-1), top_k, dim=-1)
    if routing == "first_expert":
        ids.zero_()
    return x, w_gate_up, w_down, weights, ids


def rows(src: int, dst: int, n: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * src + dst + 7 * n)
    if dtype == torch.int64:
        return torch.randint(-2**40, 2**40, (n, *shape), generator=g)
    return torch.randn((n, *shape), generator=g).to(dtype)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, out_dir: str, device: str = "cpu") -> None:
    import torch.distributed as dist

    from services.runtime.parallel.collectives import RankGroups
    from services.runtime.parallel.expert_parallel import EXCHANGES, ExpertParallelMoe, expert_runs

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=120))
    results = {}
    on = torch.device(device if device == "cpu" else f"cuda:{rank}")
    if on.type == "cuda":
        torch.cuda.set_device(on)
    for backend in ("shm", "gloo") if on.type == "cpu" else ("nccl",):
        groups = RankGroups.join(dist.PrefixStore(backend, store), rank, world, on,
                                 "auto" if backend == "nccl" else backend, secret=bytes(32))
        assert (groups.shm is not None) == (backend == "shm")
        for name, (matrix, shape, dtype) in CASES.items():
            counts = matrix[rank][:world]
            send = torch.cat([rows(rank, dst, n, shape, dtype) for dst, n in enumerate(counts)])
            received, recv_counts = groups.all_to_all(send.to(on), torch.tensor(counts))
            results[f"{backend}/{name}"] = received.cpu()
            results[f"{backend}/{name}/counts"] = recv_counts
        for name, exchange in itertools.product(LAYER_CASES, EXCHANGES):
            x, w_gate_up, w_down, weights, ids = (t.to(on) for t in layer_inputs(name))
            mine = expert_runs(w_gate_up.shape[0], world)[rank]
            layer = ExpertParallelMoe(rank, world, w_gate_up.shape[0], w_gate_up[mine.start:mine.stop],
                                      w_down[mine.start:mine.stop], exchange=exchange, groups=groups)
            results[f"{backend}/{exchange}/{name}"] = layer(x, weights, ids).cpu()
    save_file(results, os.path.join(out_dir, f"rank{rank}.safetensors"))


def run_ranks(world: int, tmp_path, device: str) -> None:
    ctx = rank_context(__name__, "services.runtime.parallel.collectives")
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, str(tmp_path), device)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    assert [p.exitcode for p in procs] == [0] * world


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_all_to_all_and_the_expert_parallel_layer(world, tmp_path):
    run_ranks(world, tmp_path, "cpu")
    for dst in range(world):
        got = load_file(tmp_path / f"rank{dst}.safetensors")
        for name, (matrix, shape, dtype) in CASES.items():
            want = torch.cat([rows(src, dst, matrix[src][dst], shape, dtype) for src in range(world)])
            for backend in ("shm", "gloo"):
                assert torch.equal(got[f"{backend}/{name}"], want), (backend, name, dst)
                assert got[f"{backend}/{name}/counts"].tolist() == [matrix[src][dst] for src in range(world)]
        for name in LAYER_CASES:
            want = fused_moe_reference(*layer_inputs(name))
            for backend in ("shm", "gloo"):
                # The same products in the same order of adds; only the row blocking of the
                # experts' matmuls (a rank multiplies a subset of an expert's rows) may differ.
                exact = 0 if want.dtype == torch.bfloat16 else 1e-6
                torch.testing.assert_close(got[f"{backend}/all_to_all/{name}"], want, rtol=exact, atol=exact)
                # Each token's adds in rank order (k = 8 spans ranks): bf16's rounding of a sum.
                close = 1e-6 if want.dtype == torch.float32 else 2e-2
                torch.testing.assert_close(got[f"{backend}/all_reduce/{name}"], want, rtol=close, atol=close)


@pytest.mark.gpu
@pytest.mark.slow
def test_nccl_all_to_all_and_the_expert_parallel_layer_on_two_gpus(tmp_path):
    """The NCCL path (the counts first, then the rows) and the layer's experts in the Triton kernel."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs two CUDA devices (this machine has {torch.cuda.device_count()})")
    run_ranks(2, tmp_path, "cuda")
    for dst in range(2):
        got = load_file(tmp_path / f"rank{dst}.safetensors")
        for name, (matrix, shape, dtype) in CASES.items():
            want = torch.cat([rows(src, dst, matrix[src][dst], shape, dtype) for src in range(2)])
            assert torch.equal(got[f"nccl/{name}"], want), (name, dst)
        for name, exchange in itertools.product(LAYER_CASES, ("all_to_all", "all_reduce")):
            want = fused_moe_reference(*layer_inputs(name))
            # tf32-free fp32 dots and bf16 tiles summed in another order than the CPU's
            tolerance = 1e-4 if want.dtype == torch.float32 else 2e-2
            torch.testing.assert_close(got[f"nccl/{exchange}/{name}"], want, rtol=tolerance, atol=tolerance)
