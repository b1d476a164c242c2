"""Expert parallelism's all-to-all between real processes, through the shared-memory segment
(services/runtime/kernels/cpu/shm_all_reduce.cpp) and through gloo, at 2 and 3 ranks, against
the exchange computed in one process: nothing sent, everything to one rank, awkward counts,
int64 and bf16 rows of several dimensions, and rows that span several of the segment's chunks
with unequal stream lengths per rank.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
from datetime import timedelta

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.runtime.parallel.shared_memory import CAPACITY

CASES = {  # name -> (counts[src][dst] for world 3, the row shape, dtype); world 2 uses the top-left 2x2
    "nothing": ([[0, 0, 0], [0, 0, 0], [0, 0, 0]], (4,), torch.float32),
    "all_to_rank0": ([[5, 0, 0], [7, 0, 0], [1, 0, 0]], (3,), torch.float32),
    "awkward": ([[1, 0, 3], [2, 9, 0], [0, 4, 1]], (2, 3), torch.bfloat16),
    "ids": ([[3, 1, 2], [0, 2, 5], [4, 4, 0]], (), torch.int64),
    # ~1.5 and ~2.5 chunks of the segment from ranks 0 and 1, a few rows from rank 2
    "chunks": ([[200, 184, 0], [300, 0, 340], [1, 0, 2]], (CAPACITY // 256,), torch.float32),
}


def rows(src: int, dst: int, n: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * src + dst + 7 * n)
    if dtype == torch.int64:
        return torch.randint(-2**40, 2**40, (n, *shape), generator=g)
    return torch.randn((n, *shape), generator=g).to(dtype)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    from services.runtime.parallel.collectives import RankGroups

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=120))
    results = {}
    for backend in ("shm", "gloo"):
        groups = RankGroups.join(dist.PrefixStore(backend, store), rank, world, torch.device("cpu"), backend)
        assert (groups.shm is not None) == (backend == "shm")
        for name, (matrix, shape, dtype) in CASES.items():
            counts = matrix[rank][:world]
            send = torch.cat([rows(rank, dst, n, shape, dtype) for dst, n in enumerate(counts)])
            received, recv_counts = groups.all_to_all(send, torch.tensor(counts))
            results[f"{backend}/{name}"] = received
            results[f"{backend}/{name}/counts"] = recv_counts
    save_file(results, os.path.join(out_dir, f"rank{rank}.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_all_to_all_delivers_every_rows_run_to_its_rank(world, tmp_path):
    ctx = multiprocessing.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, str(tmp_path))) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    assert [p.exitcode for p in procs] == [0] * world
    for dst in range(world):
        got = load_file(tmp_path / f"rank{dst}.safetensors")
        for name, (matrix, shape, dtype) in CASES.items():
            want = torch.cat([rows(src, dst, matrix[src][dst], shape, dtype) for src in range(world)])
            for backend in ("shm", "gloo"):
                assert torch.equal(got[f"{backend}/{name}"], want), (backend, name, dst)
                assert got[f"{backend}/{name}/counts"].tolist() == [matrix[src][dst] for src in range(world)]
