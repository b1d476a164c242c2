"""The mixture-of-experts MLP: a router picks ``top_k`` of ``num_experts`` SwiGLU experts per token.

    probs = softmax(x W_r^T)                [T, E]   (W_r: the router, "gate")
    w, ids = topk(probs, k)                 [T, k]   (w /= sum(w) where the family renormalizes)
    y_t = sum_j w_tj * down_e(silu(gate_e(x_t)) * up_e(x_t)),  e = ids_tj
          (+ sigmoid(x_t . w_s) * shared(x_t): Qwen2-MoE's shared expert)

The experts run grouped: the T*k (token, expert) pairs are sorted by expert, each expert with
at least one token multiplies all its tokens' rows in one product per projection (its weights
read once per step), and the weighted rows are summed back per token. There is no loop over
tokens, and an expert no token chose costs nothing. Experts are stacked as
``w_gate_up`` [E, 2I, H] (gate rows first) and ``w_down`` [E, H, I], transformers' layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.runtime.kernels.fused_moe import fused_moe
from services.runtime.model.config import ModelConfig
from services.runtime.model.moe_config import MoeConfig
from services.runtime.model.quant.linear import build_linear


def route(logits: torch.Tensor, top_k: int, renormalize: bool,
          order: str = "softmax_topk") -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] fp32, expert ids [T, k] int64), as transformers computes them.

    ``softmax_topk``: a softmax over all experts, the k largest kept (and renormalized if asked);
    ``topk_softmax``: the k largest logits, softmaxed among themselves (renormalized by construction).
    """
    if order == "topk_softmax":
        top, ids = torch.topk(logits.float(), top_k, dim=-1)
        return torch.softmax(top, dim=-1), ids
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def expert_counts(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens routed to each expert this step, [E] int64 (what the load metric counts)."""
    return torch.bincount(topk_ids.reshape(-1), minlength=num_experts)


def grouped_experts(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, activation: str = "silu",
                    counts: list[int] | None = None) -> torch.Tensor:
    """The routed experts' weighted sum, grouped by expert: one product per projection per expert with tokens.

    x [T, H], w_gate_up [E, 2I, H], w_down [E, H, I], topk_weights [T, k], topk_ids [T, k] int64 -> [T, H].
    ``counts``: ``expert_counts`` as a list when the caller has it (one device sync fewer).
    """
    if activation != "silu":
        raise ValueError(f"expert activation {activation!r} is not supported (only silu)")
    t, k = topk_ids.shape
    num_experts = w_gate_up.shape[0]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # [T*k]: pairs grouped by expert, tokens in order within one
    rows = order // k  # each sorted pair's token
    if counts is None:
        counts = expert_counts(flat, num_experts).tolist()
    xs = x.index_select(0, rows)  # [T*k, H]
    out = torch.empty_like(xs)
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        gate, up = F.linear(xs[start:start + n], w_gate_up[expert]).chunk(2, dim=-1)  # [n, I] each
        out[start:start + n] = F.linear(F.silu(gate) * up, w_down[expert])
        start += n
    weighted = out * topk_weights.reshape(-1)[order].unsqueeze(1)  # fp32 weights: the product in fp32
    return torch.zeros_like(x).index_add_(0, rows, weighted.to(x.dtype))


_EXPERT_NAMES = {  # family -> (module prefix, router, gate, up, down)
    "mixtral": ("block_sparse_moe.", "gate", "w1", "w3", "w2"),
}
_DEFAULT_NAMES = ("mlp.", "gate", "gate_proj", "up_proj", "down_proj")


def expert_weight_names(config: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape of one sparse layer's router, experts and shared expert (transformers' names)."""
    moe: MoeConfig = config.moe
    d, f = config.hidden_size, moe.intermediate_size
    block, router, gate, up, down = _EXPERT_NAMES.get(config.family, _DEFAULT_NAMES)
    p = prefix + block
    shapes = {f"{p}{router}.weight": (moe.num_experts, d)}
    for e in range(moe.num_experts):
        shapes |= {f"{p}experts.{e}.{gate}.weight": (f, d), f"{p}experts.{e}.{up}.weight": (f, d),
                   f"{p}experts.{e}.{down}.weight": (d, f)}
    if moe.shared_expert_size:
        s = moe.shared_expert_size
        shapes |= {f"{p}shared_expert.gate_proj.weight": (s, d), f"{p}shared_expert.up_proj.weight": (s, d),
                   f"{p}shared_expert.down_proj.weight": (d, s), f"{p}shared_expert_gate.weight": (1, d)}
    return shapes


def expert_loads(model: nn.Module) -> list[tuple[int, list[int]]]:
    """[(layer index, tokens routed to each expert since the last reset)] of a model's sparse layers."""
    out = []
    for i, layer in enumerate(model.layers):
        moe = getattr(layer, "moe", None)
        if moe is not None:
            out.append((i, moe.load.tolist() if moe.load is not None else [0] * moe.num_experts))
    return out


def reset_expert_loads(model: nn.Module) -> None:
    for layer in model.layers:
        if getattr(layer, "moe", None) is not None:
            layer.moe.load = None


class SparseMoe(nn.Module):
    """One layer's routed MLP (and shared expert), built from its checkpoint tensors."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], prefix: str):
        super().__init__()
        moe: MoeConfig = config.moe
        self.num_experts, self.top_k = moe.num_experts, moe.top_k
        self.renormalize, self.router_order = moe.renormalize, moe.router_order
        block, router, gate, up, down = _EXPERT_NAMES.get(config.family, _DEFAULT_NAMES)
        p = prefix + block
        w = lambda name: weights.pop(p + name)  # noqa: E731 - local shorthand
        self.router = nn.Parameter(w(f"{router}.weight"), requires_grad=False)  # [E, H]
        experts = range(moe.num_experts)
        self.w_gate_up = nn.Parameter(torch.stack([
            torch.cat([w(f"experts.{e}.{gate}.weight"), w(f"experts.{e}.{up}.weight")]) for e in experts]),
            requires_grad=False)  # [E, 2I, H]
        self.w_down = nn.Parameter(torch.stack([w(f"experts.{e}.{down}.weight") for e in experts]),
                                   requires_grad=False)  # [E, H, I]
        self.shared_gate_up = self.shared_down = self.shared_gate = None
        if moe.shared_expert_size:
            self.shared_gate_up = build_linear([w("shared_expert.gate_proj.weight"), w("shared_expert.up_proj.weight")])
            self.shared_down = build_linear([w("shared_expert.down_proj.weight")])
            self.shared_gate = nn.Parameter(w("shared_expert_gate.weight"), requires_grad=False)  # [1, H]
        self.expert_parallel = None
        """Under tensor parallelism with split experts: the ExpertParallelMoe holding this rank's
        run of them (services/runtime/parallel/expert_parallel.py); w_gate_up and w_down are None then."""
        self.load: torch.Tensor | None = None
        """Tokens routed to each expert since the model was loaded, [E] int64 (the load metric's source)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] (the post-attention normed hidden) -> [T, H]
        weights, ids = route(F.linear(x, self.router), self.top_k, self.renormalize, self.router_order)
        counts = expert_counts(ids, self.num_experts)
        self.load = counts if self.load is None else self.load + counts
        if self.expert_parallel is not None:  # tensor parallelism: this rank's run of experts, the tokens exchanged
            out = self.expert_parallel(x, weights, ids)
        elif x.is_cuda:
            out = fused_moe(x, self.w_gate_up, self.w_down, weights, ids)  # the fused Triton kernel
        else:
            out = grouped_experts(x, self.w_gate_up, self.w_down, weights, ids, counts=counts.tolist())
        if self.shared_gate_up is not None:
            gate, up = self.shared_gate_up(x).chunk(2, dim=-1)
            out = out + torch.sigmoid(F.linear(x, self.shared_gate)) * self.shared_down(F.silu(gate) * up)
        return out
