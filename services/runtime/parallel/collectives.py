"""The process groups of one tensor-parallel executor, and the step inputs rank 0 hands the others.

Two groups over one store rank 0 makes (a FileStore in a private directory, leader.py): the
step channel (host tensors, every backend) and the reduce group (gloo on a CPU, NCCL on CUDA) that sums the
row-parallel layers' partial outputs. On a CPU the sums go through a shared memory segment
instead (shared_memory.py: a few microseconds where gloo's loopback round trips take hundreds),
gloo's reduce group staying the fallback where the segment cannot be made
(``--tensor-parallel-all-reduce``). The step channel goes through such a segment too, on CUDA
as well (the ranks are always processes of one host): gloo's broadcast took a millisecond or
more a step on loopback, the segment microseconds; gloo's step group remains for the set-up's
votes and where no segment could be made. Separate because they wait differently: a rank idles in
the step channel's broadcast until the next step comes, for as long as the executor has no
work (a long timeout; a rank that dies closes its sockets, which ends the wait at once), while
an all-reduce that stalls means a rank is stuck. The groups are objects, not torch.distributed's
process-global default group, so a process can hold more than one (the tests do).

A step is two broadcasts from rank 0: a header (kind: which forward runs it, tokens, sequences, block-table width,
logit rows) and one int64 blob: input ids, positions and slots [3T], then context lengths [B],
query starts [B + 1], the block table [B, W] and the rows of the final hidden states that need
logits [R], from which every rank builds the same AttentionMetadata (its host lists too) on its
own device, and, with a vocab-parallel LM head, computes its vocabulary's logits of those rows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from services.runtime.model.attention.base import AttentionMetadata
from services.runtime.parallel.pair_auth import authenticate
from services.runtime.parallel.shared_memory import SharedMemoryReducer
from services.runtime.step_inputs import unpack_step_inputs

STEP = 1
"""A step header: the step runs eagerly (the model's forward)."""
STEP_FUSED = 2
"""A step header: the step runs through the fused CPU step (one C++ call)."""
STEP_GRAPHS = 3
"""A step header: a decode step through the decode graphs' padded buffers (replayed graphs on
CUDA), each rank's over its own shard, so every rank's graph holds the same all-reduces."""
CAPTURE = 4
"""A header alone: every rank captures its decode graphs now, together (their all-reduces meet)."""
STOP = 0
STEP_KINDS = {"eager": STEP, "fused_decode": STEP_FUSED, "decode_graphs": STEP_GRAPHS}
"""The step kind of each forward path that runs under tensor parallelism, by path name."""

ALL_REDUCE_BACKENDS = ("auto", "shm", "gloo")
"""auto: the shared memory segment on a CPU (gloo where it cannot be made), NCCL on CUDA; shm:
the segment or an error; gloo: gloo's all-reduce over loopback (the measurement's baseline)."""

IDLE_TIMEOUT = timedelta(days=30)
"""How long a rank waits for the next step: an executor may sit idle for any time."""
REDUCE_TIMEOUT = timedelta(minutes=10)
"""An all-reduce waits at most this long for a rank that stopped answering (not one that
died: its closed sockets fail the collective at once)."""


def _gloo(store: dist.Store, prefix: str, rank: int, world: int, timeout: timedelta) -> dist.ProcessGroup:
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    # Loopback explicitly: the ranks are processes of one host, whatever its hostname resolves to.
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, world, options)


@dataclass(slots=True)
class RankGroups:
    rank: int
    world: int
    step: dist.ProcessGroup
    reduce: dist.ProcessGroup
    shm: SharedMemoryReducer | None = None
    """The CPU all-reduce through shared memory; None: the reduce group's (gloo's or NCCL's)."""
    step_segment: SharedMemoryReducer | None = None
    """The segment the step inputs go through (``shm`` itself on a CPU); None: the step group's
    gloo broadcasts."""

    @classmethod
    def join(cls, store: dist.Store, rank: int, world: int, device: torch.device,
             all_reduce: str = "auto", *, secret: bytes) -> "RankGroups":
        """Blocks until every rank has joined (each construction is a rendezvous over the store);
        every gloo connection then proves ``secret``, the launch's (pair_auth.py)."""
        if all_reduce not in ALL_REDUCE_BACKENDS:
            raise ValueError(f"tensor_parallel_all_reduce must be one of {', '.join(ALL_REDUCE_BACKENDS)}, "
                             f"got {all_reduce!r}")
        step = _gloo(store, "step", rank, world, IDLE_TIMEOUT)
        authenticate(step, "step", rank, world, secret)
        if device.type == "cuda":
            if all_reduce != "auto":
                raise ValueError(f"tensor_parallel_all_reduce {all_reduce!r} sums CPU tensors; on {device} the "
                                 "ranks sum over NCCL (auto)")
            if not dist.is_nccl_available():
                raise RuntimeError("tensor parallelism on CUDA sums over NCCL, which this torch build lacks")
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = REDUCE_TIMEOUT
            reduce = dist.ProcessGroupNCCL(dist.PrefixStore("reduce", store), rank, world, options)
        else:
            reduce = _gloo(store, "reduce", rank, world, REDUCE_TIMEOUT)
            authenticate(reduce, "reduce", rank, world, secret)
        groups = cls(rank, world, step, reduce)
        if all_reduce != "gloo":
            segment = SharedMemoryReducer.join(store, rank, world, groups.min_int, REDUCE_TIMEOUT.total_seconds(),
                                               required=all_reduce == "shm")
            groups.step_segment = segment
            groups.shm = segment if device.type == "cpu" else None
        return groups

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum in place over the ranks."""
        if self.shm is not None and tensor.device.type == "cpu" and tensor.dtype == torch.float32:
            self.shm.all_reduce(tensor if tensor.is_contiguous() else tensor.contiguous())
            return
        self.reduce.allreduce([tensor]).wait()

    def all_to_all(self, send: torch.Tensor, send_counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert parallelism's exchange: ``send`` [N, ...] goes in runs of ``send_counts[r]``
        rows (int64 [world], on the CPU) to rank r, in rank order -> (the rows received,
        concatenated by source rank, on send's device; int64 [world] on the CPU, how many from
        each). Through the segment on a CPU, else the reduce group (gloo; NCCL on CUDA), which
        needs the counts first: one all-to-all of the counts, then one of the rows."""
        if self.shm is not None and send.device.type == "cpu":
            return self.shm.all_to_all(send.contiguous(), send_counts.contiguous())
        device = send.device
        recv_counts = torch.empty(self.world, dtype=torch.int64, device=device)
        self.reduce.alltoall_base(recv_counts, send_counts.to(device), [1] * self.world, [1] * self.world,
                                  dist.AllToAllOptions()).wait()
        recv_counts = recv_counts.cpu()
        received = torch.empty((int(recv_counts.sum()), *send.shape[1:]), dtype=send.dtype, device=device)
        self.reduce.alltoall_base(received, send.contiguous(), recv_counts.tolist(), send_counts.tolist(),
                                  dist.AllToAllOptions()).wait()
        return received, recv_counts

    def min_int(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.step.allreduce([t], opts).wait()
        return int(t.item())

    def gather_to_first(self, local: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: [world, *local.shape], every rank's ``local`` by rank; the others: None."""
        if self.shm is not None and local.device.type == "cpu" and local.dtype == torch.float32:
            local = local.contiguous()
            out = torch.empty((self.world, *local.shape)) if self.rank == 0 else None
            self.shm.gather(local, out)
            return out
        parts = [torch.empty_like(local) for _ in range(self.world)]
        self.reduce.allgather([parts], [local.contiguous()]).wait()
        return torch.stack(parts) if self.rank == 0 else None

    def gather_ints(self, value: int) -> list[int]:
        """Every rank's ``value``, by rank (a sum of one-hot rows: gloo's all-gather needs lists)."""
        t = torch.zeros(self.world, dtype=torch.int64)
        t[self.rank] = value
        self.step.allreduce([t]).wait()
        return t.tolist()

    # --- the step channel ------------------------------------------------------------------
    def broadcast_from_first(self, tensor: torch.Tensor, idle: bool = False) -> None:
        """``idle``: the others wait for it without a deadline (the header of the next step)."""
        if self.step_segment is not None:
            self.step_segment.broadcast(tensor, idle)
            return
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.step.broadcast([tensor], opts).wait()

    def send_step(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                  kind: int = STEP, logit_rows: list[int] = ()) -> None:
        """Rank 0: the step's inputs to the other ranks, which forward runs it (``kind``, of
        STEP_KINDS) and which hidden rows need logits."""
        t, b = input_ids.numel(), meta.num_seqs
        blob = torch.cat([input_ids, positions, meta.slot_mapping, meta.context_lens.long(),
                          meta.query_start_loc.long(), meta.block_tables.reshape(-1).long(),
                          torch.tensor(logit_rows, dtype=torch.int64, device=input_ids.device)]).cpu()
        self.broadcast_from_first(torch.tensor([kind, t, b, meta.block_tables.shape[1], len(logit_rows)], dtype=torch.int64))
        self.broadcast_from_first(blob)

    def send_capture(self) -> None:
        self.broadcast_from_first(torch.tensor([CAPTURE, 0, 0, 0, 0], dtype=torch.int64))

    def send_stop(self) -> None:
        self.broadcast_from_first(torch.tensor([STOP, 0, 0, 0, 0], dtype=torch.int64))

    def receive_step(self, block_size: int, device: torch.device) -> ReceivedStep | None:
        """The other ranks: the next step (of kind CAPTURE: no inputs), or None to stop."""
        header = torch.empty(5, dtype=torch.int64)
        self.broadcast_from_first(header, idle=True)
        kind, t, b, width, r = header.tolist()
        if kind == STOP:
            return None
        if kind == CAPTURE:
            return ReceivedStep(CAPTURE, None, None, None, None)
        blob = torch.empty(3 * t + 2 * b + 1 + b * width + r, dtype=torch.int64)
        self.broadcast_from_first(blob)
        ints = blob[3 * t:blob.numel() - r]
        context_lens, query_starts = ints[:b].tolist(), ints[b:2 * b + 1].tolist()
        query_lens = [query_starts[i + 1] - query_starts[i] for i in range(b)]
        input_ids, positions, meta = unpack_step_inputs(blob[:3 * t].to(device), ints.to(torch.int32).to(device),
                                                        query_lens, context_lens, width, block_size)
        host_rows = None
        if kind == STEP_GRAPHS:  # read from the host blob: no copy back from the device
            ids, positions_cpu = blob[:t].tolist(), blob[t:2 * t].tolist()
            table = ints[2 * b + 1:2 * b + 1 + b * width].view(b, width).tolist()
            host_rows = [(token, pos, table[i][:pos // block_size + 1])
                         for i, (token, pos) in enumerate(zip(ids, positions_cpu))]
        return ReceivedStep(kind, input_ids, positions, meta, blob[blob.numel() - r:].to(device), host_rows)


@dataclass(slots=True)
class ReceivedStep:
    kind: int
    """STEP, STEP_FUSED, STEP_GRAPHS: which forward runs it; CAPTURE: capture the graphs (no inputs)."""
    input_ids: torch.Tensor | None
    positions: torch.Tensor | None
    meta: AttentionMetadata | None
    logit_rows: torch.Tensor | None
    """[R] int64: the final hidden states' rows whose logits rank 0 samples from."""

    decode_rows: list[tuple[int, int, list[int]]] | None = None
    """STEP_GRAPHS: (token id, position, the blocks up to the position's) per row, what the
    decode graphs load (rank 0 loads its rows' whole block lists; the blocks past a row's
    position are never read)."""


class AllReduceHooks:
    """Sums the row-parallel projections' outputs over the ranks (gpt-fast's forward hook): the
    model code stays the single-device code. ``groups`` is set once the ranks have joined."""

    def __init__(self, model: nn.Module) -> None:
        self._groups: RankGroups | None = None
        self.expert_layers: list = []
        """The sparse layers' ExpertParallelMoe (expert_parallel.py), which exchange tokens
        themselves; they get the groups with the hooks."""
        self.timed = False
        self._seconds = 0.0
        self._shm_start = 0.0
        for layer in model.layers:
            # A sparse layer has no row-parallel down projection: its experts are replicated
            # (nothing to sum) or split (their exchange sums them).
            for module in (layer.o_proj, getattr(layer, "down", None)):
                if module is not None:
                    module.register_forward_hook(self._hook)

    @property
    def groups(self) -> RankGroups | None:
        return self._groups

    @groups.setter
    def groups(self, groups: RankGroups) -> None:
        self._groups = groups
        for experts in self.expert_layers:
            experts.groups = groups

    def start_timing(self) -> None:
        """Count the time spent in collectives from now (the benchmark's share of a step)."""
        self.timed, self._seconds = True, 0.0
        self._shm_start = self.groups.shm.seconds if self.groups.shm is not None else 0.0

    @property
    def seconds(self) -> float:
        """Time spent in the collectives since ``start_timing``, the other ranks' lateness
        included: the segment's own count (which sees the fused step's all-reduces, made from
        C++, and the logits' gather too), else the hooks' timing of gloo's."""
        if self.groups.shm is not None:
            return self.groups.shm.seconds - self._shm_start
        return self._seconds

    def _hook(self, module: nn.Module, inputs, output: torch.Tensor) -> None:
        if not self.timed:
            self.groups.all_reduce(output)
            return
        start = time.perf_counter()
        self.groups.all_reduce(output)
        self._seconds += time.perf_counter() - start
