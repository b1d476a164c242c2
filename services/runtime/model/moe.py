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

One reference, one fast path per kind of weight: float experts run kernels/fused_moe.py's
``fused_moe`` (its PyTorch reference ``fused_moe_reference`` on a CPU, the Triton kernel on
CUDA); experts a GGUF checkpoint keeps quantized run the grouped C++ kernel of
kernels/moe_experts.py on a CPU (its reference beside it), or are dequantized at load elsewhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.runtime.kernels.fused_moe import fused_moe
from services.runtime.kernels.moe_experts import experts_fit, gate_up, moe_experts_int8, pack_experts
from services.runtime.model.config import ModelConfig
from services.runtime.model.moe_config import MoeConfig
from services.runtime.model.quant.formats import QuantizedWeight, dequantize
from services.runtime.model.quant.linear import cpu_kernels_ready
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
            out.append((i, moe.load.tolist()))
    return out


def reset_expert_loads(model: nn.Module) -> None:
    for layer in model.layers:
        if getattr(layer, "moe", None) is not None:
            layer.moe.load.zero_()  # in place: the fused CPU step adds to this tensor too


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
        gates = [w(f"experts.{e}.{gate}.weight") for e in experts]
        ups = [w(f"experts.{e}.{up}.weight") for e in experts]
        downs = [w(f"experts.{e}.{down}.weight") for e in experts]
        self.quantized: tuple[list[QuantizedWeight], list[QuantizedWeight]] | None = None
        """Experts a checkpoint keeps quantized (GGUF types), as read: (gate|up per expert, down per
        expert) until ``prepare`` packs them for the CPU kernel or dequantizes them."""
        self.w13 = self.w2 = None
        """The quantized experts packed for kernels/moe_experts.py, [E, bytes] uint8 each (path cpu_int8)."""
        self.path = "dense"
        kept = [isinstance(t, QuantizedWeight) for t in gates + ups + downs]
        if all(kept) and all(g.fmt == u.fmt for g, u in zip(gates, ups)):
            self.quantized = ([gate_up(g, u) for g, u in zip(gates, ups)], downs)
            self.w_gate_up = self.w_down = None
            self.path = "unprepared"
        else:
            if any(kept):  # some experts in float, or gate and up apart: all in float, as build_linear does
                dtype = self.router.dtype
                gates, ups, downs = ([dequantize(t, dtype) if isinstance(t, QuantizedWeight) else t for t in ts]
                                     for ts in (gates, ups, downs))
            self.w_gate_up = nn.Parameter(torch.stack([torch.cat([g, u]) for g, u in zip(gates, ups)]),
                                          requires_grad=False)  # [E, 2I, H]
            self.w_down = nn.Parameter(torch.stack(downs), requires_grad=False)  # [E, H, I]
        self.inter = moe.intermediate_size
        self.shared_gate_up = self.shared_down = self.shared_gate = None
        if moe.shared_expert_size:
            self.shared_gate_up = build_linear([w("shared_expert.gate_proj.weight"), w("shared_expert.up_proj.weight")])
            self.shared_down = build_linear([w("shared_expert.down_proj.weight")])
            self.shared_gate = nn.Parameter(w("shared_expert_gate.weight"), requires_grad=False)  # [1, H]
        self.expert_parallel = None
        """Under tensor parallelism with split experts: the ExpertParallelMoe holding this rank's
        run of them (services/runtime/parallel/expert_parallel.py); w_gate_up and w_down are None then."""
        with torch.inference_mode(False):  # a normal tensor, which steps in inference mode may add to
            self.register_buffer("load", torch.zeros(moe.num_experts, dtype=torch.int64), persistent=False)
        """Tokens routed to each expert since the model was loaded or reset, [E] int64 (the load metric's
        source), on the router's device; added to in place, by the fused CPU step (fused_decode.py) too."""

    def int8_under_auto(self) -> bool:
        """Whether ``prepare("auto")`` runs these experts on the grouped int8-activation kernel."""
        return (self.quantized is not None and self.router.device.type == "cpu" and experts_fit(self.quantized[0])
                and experts_fit(self.quantized[1]) and cpu_kernels_ready())

    def prepare(self, activations: str = "auto") -> str:
        """Ready quantized experts for the router's device (after the move); returns the path.

        On a CPU with ``activations`` int8 or auto, experts in a format of kernels/moe_experts.py
        are packed for its grouped int8-activation kernel (there is no exact grouped kernel, so auto
        takes int8 as it does for K-quant linears); otherwise (none, CUDA, another format) they are
        dequantized once to the router's dtype and run as dense experts."""
        if self.quantized is None:
            return self.path
        w13, w2 = self.quantized
        device = self.router.device
        if activations in ("int8", "auto") and self.int8_under_auto():
            self.w13, self.w2 = pack_experts(w13), pack_experts(w2)
            self.formats = (w13[0].fmt, w2[0].fmt)
            self.path = "cpu_int8"
        else:
            dtype = self.router.dtype
            self.w_gate_up = nn.Parameter(torch.stack([dequantize(w, dtype) for w in w13]).to(device),
                                          requires_grad=False)
            self.w_down = nn.Parameter(torch.stack([dequantize(w, dtype) for w in w2]).to(device),
                                       requires_grad=False)
            self.path = "dequantized"
        self.quantized = None  # the packed tiles or the dense copy hold every byte the products read
        return self.path

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] (the post-attention normed hidden) -> [T, H]
        if self.path == "unprepared":
            self.prepare()
        weights, ids = route(F.linear(x, self.router), self.top_k, self.renormalize, self.router_order)
        counts = expert_counts(ids, self.num_experts)
        self.load += counts
        if self.expert_parallel is not None:  # tensor parallelism: this rank's run of experts, the tokens exchanged
            out = self.expert_parallel(x, weights, ids)
        elif self.path == "cpu_int8":  # quantized experts, grouped, in C++
            out = moe_experts_int8(x, self.w13, self.formats[0], self.w2, self.formats[1], weights, ids, self.inter)
        else:  # the fused Triton kernel on CUDA, its grouped PyTorch reference elsewhere
            out = fused_moe(x, self.w_gate_up, self.w_down, weights, ids)
        if self.shared_gate_up is not None:
            gate, up = self.shared_gate_up(x).chunk(2, dim=-1)
            out = out + torch.sigmoid(F.linear(x, self.shared_gate)) * self.shared_down(F.silu(gate) * up)
        return out
