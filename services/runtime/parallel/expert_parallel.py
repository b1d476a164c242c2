"""Expert parallelism: a sparse layer's experts split over the tensor-parallel ranks, the routed
tokens exchanged with all-to-alls.

Every rank holds the layer's input for all T tokens (attention ends in an all-reduce) and the
routing (the router is replicated: [T, E] is cheap next to the experts). Rank r of w:
  1. takes its slice of the tokens, [T r / w, T (r + 1) / w), and sends each (token, slot)
     pair to the rank holding its expert: the token's row, the expert's local index and the
     routing weight, packed into one byte row (one exchange, whatever x's dtype);
  2. runs its own experts over the pairs it received (``fused_moe`` with k = 1: each pair's
     weighted output; Triton on CUDA), and sends each result back where the pair came from;
  3. adds each of its tokens' k results in ascending expert order, rounding in x's dtype after
     each add, as ``fused_moe_reference`` does on one rank;
  4. gathers every rank's slice (an all-to-all of the slice to every rank), so each rank holds
     [T, H] again for the next layer's attention.
``exchange="all_reduce"`` is the other way to the same sum: every rank runs its own experts
over all T tokens (the slots of other ranks' experts skipped) and one all-reduce adds the
ranks' partial outputs. It moves one [T, H] sum a layer where the all-to-alls move the pairs
twice and the slices once, and needs the tokens replicated, which they are here; the order of
each token's adds then follows the ranks (the same numbers as one rank's for k <= 2).

Experts go to ranks in contiguous runs as even as they go (shard.py's split), each rank's
weights cut to its run, so a rank reads 1/w of the layer's expert bytes per step.

``seconds`` splits the time spent here into the exchanges (waiting for the other ranks
included) and the rest (routing bookkeeping, the experts), for the benchmark.
"""

from __future__ import annotations

import time

import torch

from services.runtime.kernels.fused_moe import fused_moe
from services.runtime.model.quant.formats import dequantize
from services.runtime.parallel.collectives import RankGroups


EXCHANGES = ("all_to_all", "all_reduce")
"""all_to_all: each rank's slice of the tokens goes to its experts' ranks and back; all_reduce:
every rank's experts over all tokens, the partial outputs summed."""


def expert_runs(num_experts: int, world: int) -> list[range]:
    """Each rank's experts: contiguous runs as even as they go, the longer first."""
    if not 1 <= world <= num_experts:
        raise ValueError(f"expert parallelism over {world} ranks needs at least as many experts, got {num_experts}")
    base, extra = divmod(num_experts, world)
    bounds = [0]
    for rank in range(world):
        bounds.append(bounds[-1] + base + (rank < extra))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """[N, C] of any dtype -> [N, C * itemsize] uint8 (N may be 0: a rank with no tokens)."""
    return t.contiguous().view(torch.uint8).reshape(t.shape[0], t.shape[1] * t.element_size())


def split_experts(model, world: int, rank: int, exchange: str) -> list["ExpertParallelMoe"]:
    """Cut every sparse layer of ``model`` (a ``moe`` attribute with stacked dense ``w_gate_up``
    and ``w_down``, or experts a checkpoint keeps quantized) to ``rank``'s run of experts and give
    it the ExpertParallelMoe that runs them (``moe.expert_parallel``); the groups are set on them
    once the ranks have joined. Quantized experts are dequantized here, only the rank's run: ranks
    run float activations (the runner resolves quant_activations to none under tensor parallelism,
    where one rank dequantizes its kept experts at load too)."""
    split = []
    for index, layer in enumerate(model.layers):
        moe = getattr(layer, "moe", None)
        if moe is None:
            continue
        quantized = getattr(moe, "quantized", None)
        if quantized is not None:
            w13, w2 = quantized
            run = expert_runs(len(w13), world)[rank]
            dtype = moe.router.dtype
            w_gate_up = torch.stack([dequantize(w, dtype) for w in w13[run.start:run.stop]])
            w_down = torch.stack([dequantize(w, dtype) for w in w2[run.start:run.stop]])
            moe.quantized, moe.path = None, "dequantized"
        elif all(isinstance(w, torch.Tensor) for w in (moe.w_gate_up, moe.w_down)):
            run = expert_runs(moe.w_gate_up.shape[0], world)[rank]
            w_gate_up = moe.w_gate_up.data[run.start:run.stop].clone()
            w_down = moe.w_down.data[run.start:run.stop].clone()
        else:
            raise ValueError(f"layer {index}: expert parallelism splits dense or kept experts; this layer's are "
                             f"{type(moe.w_gate_up).__name__} (tensor_parallel_experts 'replicated' runs them)")
        experts = ExpertParallelMoe(rank, world, moe.num_experts, w_gate_up, w_down,
                                    getattr(moe, "activation", "silu"), exchange)
        moe.w_gate_up = moe.w_down = None  # the rank's run lives in ``experts``, the rest is freed
        moe.expert_parallel = experts
        split.append(experts)
    return split


class ExpertParallelMoe:
    """Rank ``rank``'s experts of one sparse layer (its run of ``expert_runs``)."""

    def __init__(self, rank: int, world: int, num_experts: int, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                 activation: str = "silu", exchange: str = "all_to_all", groups: RankGroups | None = None) -> None:
        """``w_gate_up`` [E_local, 2I, H], ``w_down`` [E_local, H, I]: this rank's run of experts;
        ``exchange``: one of EXCHANGES; ``groups``: the ranks' (set later when not given)."""
        if exchange not in EXCHANGES:
            raise ValueError(f"exchange must be one of {', '.join(EXCHANGES)}, got {exchange!r}")
        self.groups, self.exchange, self.rank, self.world = groups, exchange, rank, world
        runs = expert_runs(num_experts, world)
        self.local = runs[rank]
        if w_gate_up.shape[0] != len(self.local) or w_down.shape[0] != len(self.local):
            raise ValueError(f"rank {rank} holds experts {self.local.start}..{self.local.stop - 1}, got "
                             f"{w_gate_up.shape[0]} and {w_down.shape[0]} experts' weights")
        self.w_gate_up, self.w_down, self.activation = w_gate_up, w_down, activation
        self.run_starts = torch.tensor([r.start for r in runs[1:]], dtype=torch.int64, device=w_gate_up.device)
        self.exchange_seconds = 0.0
        self.compute_seconds = 0.0

    def _exchange(self, send: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        start = time.perf_counter()
        out = self.groups.all_to_all(send, counts)
        self.exchange_seconds += time.perf_counter() - start
        return out

    def __call__(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H] and the routing of every token (the same on every rank) -> [T, H] on every rank."""
        if self.exchange == "all_reduce":
            return self._all_reduce(x, topk_weights, topk_ids)
        start = time.perf_counter()
        rank, world = self.rank, self.world
        num_tokens, hidden = x.shape
        top_k = topk_ids.shape[1]
        lo, hi = num_tokens * rank // world, num_tokens * (rank + 1) // world
        ids = topk_ids[lo:hi].reshape(-1)  # [P] this rank's pairs, P = (hi - lo) * k
        owner = torch.bucketize(ids, self.run_starts, right=True)
        order = torch.argsort(owner, stable=True)  # pairs grouped by the rank that owns their expert
        send_counts = torch.bincount(owner, minlength=world).cpu()
        starts = torch.cat([torch.zeros(1, dtype=torch.int64, device=x.device), self.run_starts])
        local_ids = (ids - starts[owner]).to(torch.int32)
        pair_rows = x[lo:hi].index_select(0, order // top_k)
        send = torch.cat([_as_bytes(pair_rows), _as_bytes(topk_weights[lo:hi].reshape(-1)[order].float()[:, None]),
                          _as_bytes(local_ids[order][:, None])], dim=1)
        self.compute_seconds += time.perf_counter() - start

        received, recv_counts = self._exchange(send, send_counts)

        start = time.perf_counter()
        row_bytes = hidden * x.element_size()
        rows = received[:, :row_bytes].contiguous().view(x.dtype)  # [n, H]
        weights = received[:, row_bytes:row_bytes + 4].contiguous().view(torch.float32)  # [n, 1]
        experts = received[:, row_bytes + 4:].contiguous().view(torch.int32).long()  # [n, 1]
        results = fused_moe(rows, self.w_gate_up, self.w_down, weights, experts, self.activation)
        self.compute_seconds += time.perf_counter() - start

        returned, _ = self._exchange(results, recv_counts)  # in the order this rank sent its pairs

        start = time.perf_counter()
        per_pair = torch.empty_like(returned)
        per_pair[order] = returned
        per_pair = per_pair.view(hi - lo, top_k, hidden)
        by_expert = torch.argsort(topk_ids[lo:hi], dim=1, stable=True)
        mine = torch.zeros((hi - lo, hidden), dtype=x.dtype, device=x.device)
        for j in range(top_k):  # k adds (not a loop over tokens), in ascending expert order
            mine += per_pair.gather(1, by_expert[:, j, None, None].expand(-1, 1, hidden))[:, 0]
        self.compute_seconds += time.perf_counter() - start

        everyone, _ = self._exchange(mine.repeat(world, 1), torch.full((world,), hi - lo, dtype=torch.int64))
        return everyone

    def _all_reduce(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        here = (topk_ids >= self.local.start) & (topk_ids < self.local.stop)
        local_ids = torch.where(here, topk_ids - self.local.start, -1)  # -1: another rank's expert
        out = fused_moe(x, self.w_gate_up, self.w_down, topk_weights, local_ids, self.activation)
        self.compute_seconds += time.perf_counter() - start
        start = time.perf_counter()
        self.groups.all_reduce(out)
        self.exchange_seconds += time.perf_counter() - start
        return out
