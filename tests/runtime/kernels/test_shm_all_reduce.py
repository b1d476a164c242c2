"""The shared-memory all-reduce (services/runtime/kernels/cpu/shm_all_reduce.cpp) against torch's
sum, between real processes: 2 and 3 ranks, awkward sizes (1, 17, 769, one float past a
buffer's capacity, several buffers), every rank's result bit-identical to the others and to the
fixed-order sum t0 + t1 + t2; the gather onto rank 0; rank 0's broadcast (the step channel)
of awkward byte counts between the sums; a dead peer and a silent one fail the wait with their
reasons instead of hanging, while an idle wait for rank 0's next broadcast outlasts the timeout
and still ends when rank 0 dies.
"""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.runtime.parallel.shared_memory import CAPACITY
from tests.helpers.rank_processes import rank_context

SIZES = [1, 17, 769, 32 * 768, CAPACITY, CAPACITY + 1, 3 * CAPACITY + 5]
BROADCAST_INTS = [1, 5, CAPACITY // 2, CAPACITY // 2 + 1, 3 * CAPACITY + 7]
"""int64 counts: a chunk is CAPACITY floats' bytes, CAPACITY / 2 int64s."""


def blob(n: int) -> torch.Tensor:
    return torch.randint(-2**62, 2**62, (n,), generator=torch.Generator().manual_seed(n), dtype=torch.int64)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def values(rank: int, n: int) -> torch.Tensor:
    # Magnitudes over several orders, so the order of the adds shows in the last bits.
    g = torch.Generator().manual_seed(1000 * rank + n)
    return torch.randn(n, generator=g) * torch.logspace(-3, 3, n) if n > 1 else torch.randn(n, generator=g)


def _rank_main(rank: int, world: int, port: int, out_dir: str, mode: str, timeout_s: float) -> None:
    import torch.distributed as dist

    from services.runtime.parallel.collectives import RankGroups
    from services.runtime.parallel.shared_memory import SharedMemoryReducer

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=120))
    groups = RankGroups.join(store, rank, world, torch.device("cpu"), all_reduce="gloo", secret=bytes(32))
    shm = SharedMemoryReducer.join(store, rank, world, groups.min_int, timeout_s, required=True)
    results: dict[str, torch.Tensor] = {}
    if mode == "sums":
        for n, ints in zip(SIZES, BROADCAST_INTS + BROADCAST_INTS):
            t = values(rank, n)
            shm.all_reduce(t)
            results[f"sum{n}"] = t
            sent = blob(ints) if rank == 0 else torch.zeros(ints, dtype=torch.int64)
            shm.broadcast(sent, idle=n == 1)
            results[f"broadcast{ints}/{n}"] = sent
        for n in (1, 5, CAPACITY + 3):  # gather: [world, n] on rank 0
            local = values(rank, n)
            out = torch.full((world, n), float("nan")) if rank == 0 else None
            shm.gather(local, out)
            if rank == 0:
                results[f"gather{n}"] = out
        save_file(results, os.path.join(out_dir, f"rank{rank}.safetensors"))
        return
    if mode in ("idle", "idle-dead"):  # rank 1 waits for rank 0's broadcast, longer than timeout_s
        if rank == 0:
            time.sleep(3 * timeout_s)
            if mode == "idle-dead":
                os._exit(0)
            shm.broadcast(blob(3))
            return
        got = torch.zeros(3, dtype=torch.int64)
        start = time.monotonic()
        try:
            shm.broadcast(got, idle=True)
            message = "received" if torch.equal(got, blob(3)) else f"wrong values {got.tolist()}"
        except RuntimeError as exc:
            message = str(exc)
        Path(out_dir, "error.txt").write_text(f"{time.monotonic() - start:.3f}\n{message}")
        return
    # mode "dead" / "silent": rank 1 leaves (or sleeps) where rank 0 all-reduces.
    if rank == 1:
        if mode == "dead":
            os._exit(0)
        time.sleep(60)
        return
    t = torch.ones(8)
    start = time.monotonic()
    try:
        shm.all_reduce(t)
        message = "no error"
    except RuntimeError as exc:
        message = str(exc)
    Path(out_dir, "error.txt").write_text(f"{time.monotonic() - start:.3f}\n{message}")


def run_ranks(world: int, tmp_path: Path, mode: str = "sums", timeout_s: float = 60.0) -> list:
    ctx = rank_context(__name__, "services.runtime.parallel.collectives")
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, str(tmp_path), mode, timeout_s))
             for r in range(world)]
    for p in procs:
        p.start()
    procs[0].join(timeout=300)
    for p in procs[1:]:
        if mode == "silent":
            p.kill()
        p.join(timeout=60)
    assert procs[0].exitcode == 0, f"rank 0 exited with {procs[0].exitcode}"
    assert mode == "silent" or all(p.exitcode == 0 for p in procs[1:]), [p.exitcode for p in procs]
    return procs


@pytest.mark.parametrize("world", [2, 3])
def test_sums_match_torch_bit_for_bit_on_every_rank(world, tmp_path):
    procs = run_ranks(world, tmp_path)
    assert all(p.exitcode == 0 for p in procs)
    got = [load_file(tmp_path / f"rank{r}.safetensors") for r in range(world)]
    for n in SIZES:
        parts = [values(r, n) for r in range(world)]
        want = parts[0]
        for part in parts[1:]:
            want = want + part  # rank order, one add at a time
        for r in range(world):
            assert torch.equal(got[r][f"sum{n}"], want), (n, r)
    for n in (1, 5, CAPACITY + 3):
        assert torch.equal(got[0][f"gather{n}"], torch.stack([values(r, n) for r in range(world)])), n
    for n, ints in zip(SIZES, BROADCAST_INTS + BROADCAST_INTS):
        for r in range(world):
            assert torch.equal(got[r][f"broadcast{ints}/{n}"], blob(ints)), (ints, r)


def test_a_dead_peer_fails_the_wait_with_its_rank(tmp_path):
    run_ranks(2, tmp_path, mode="dead")
    seconds, message = (tmp_path / "error.txt").read_text().split("\n", 1)
    assert "tensor-parallel rank 1 (pid" in message and "ended while rank 0 waited" in message
    assert float(seconds) < 30


def test_a_silent_peer_fails_the_wait_at_the_timeout(tmp_path):
    run_ranks(2, tmp_path, mode="silent", timeout_s=1.0)
    seconds, message = (tmp_path / "error.txt").read_text().split("\n", 1)
    assert "tensor-parallel rank 1 did not reach the all-reduce within 1.0 s" in message
    assert 1.0 <= float(seconds) < 30


def test_an_idle_wait_for_the_next_broadcast_has_no_deadline(tmp_path):
    run_ranks(2, tmp_path, mode="idle", timeout_s=0.5)
    seconds, message = (tmp_path / "error.txt").read_text().split("\n", 1)
    assert message == "received" and float(seconds) >= 1.0, (seconds, message)


def test_an_idle_wait_ends_when_rank_0_dies(tmp_path):
    run_ranks(2, tmp_path, mode="idle-dead", timeout_s=0.5)
    seconds, message = (tmp_path / "error.txt").read_text().split("\n", 1)
    assert "tensor-parallel rank 0 (pid" in message and "ended while rank 1 waited" in message, message
    assert float(seconds) < 30
