"""Mixture-of-experts FFN over routed tokens: each token's top-k experts, weighted and summed.

  out[t] = sum_j topk_weights[t, j] * down_e(act(gate_e x[t]) * up_e x[t]),  e = topk_ids[t, j]

Shapes (the layout of Hugging Face's ``MixtralExperts``): x [T, H], w_gate_up [E, 2I, H] (the
I gate rows first, then the I up rows), w_down [E, H, I], topk_weights [T, k] float,
topk_ids [T, k] int64. A negative id is a slot with no expert here (an expert another rank
holds under expert parallelism): it contributes nothing.

``fused_moe_reference`` is the PyTorch reference: the (token, slot) pairs are sorted by expert,
so each expert's weights are read once for all its tokens, and rounded where Hugging Face's
expert loop rounds (the expert's output times its weight cast to x's dtype, then summed per
token in x's dtype in ascending expert order).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = ("silu", "gelu_tanh")


def _check_inputs(x, w_gate_up, w_down, topk_weights, topk_ids, activation) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if x.dim() != 2:
        raise ValueError(f"x must be [tokens, hidden], got {tuple(x.shape)}")
    num_tokens, hidden = x.shape
    if w_gate_up.dim() != 3 or w_gate_up.shape[2] != hidden or w_gate_up.shape[1] % 2:
        raise ValueError(f"w_gate_up must be [experts, 2 * intermediate, {hidden}], got {tuple(w_gate_up.shape)}")
    num_experts, intermediate = w_gate_up.shape[0], w_gate_up.shape[1] // 2
    if tuple(w_down.shape) != (num_experts, hidden, intermediate):
        raise ValueError(f"w_down must be [{num_experts}, {hidden}, {intermediate}], got {tuple(w_down.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != num_tokens or topk_ids.dtype != torch.int64:
        raise ValueError(f"topk_ids must be int64 [{num_tokens}, k], got {topk_ids.dtype} {tuple(topk_ids.shape)}")
    if topk_weights.shape != topk_ids.shape or not topk_weights.is_floating_point():
        raise ValueError(f"topk_weights must be float {tuple(topk_ids.shape)}, got {topk_weights.dtype} "
                         f"{tuple(topk_weights.shape)}")
    for name, tensor in (("w_gate_up", w_gate_up), ("w_down", w_down), ("topk_weights", topk_weights),
                         ("topk_ids", topk_ids)):
        if tensor.device != x.device:
            raise ValueError(f"{name} must be on {x.device}, got {tensor.device}")


def _activate(gate: torch.Tensor, activation: str) -> torch.Tensor:
    return F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")


def fused_moe_reference(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
) -> torch.Tensor:
    """[T, H]: the routed experts' outputs, weighted and summed per token (see the module docstring)."""
    _check_inputs(x, w_gate_up, w_down, topk_weights, topk_ids, activation)
    num_experts, top_k = w_gate_up.shape[0], topk_ids.shape[1]
    out = torch.zeros_like(x)
    flat_ids = topk_ids.reshape(-1)
    # Stable: a token's slots stay in slot order within one expert, and experts come in
    # ascending order, so each token's sum runs in the order Hugging Face's loop adds.
    order = torch.argsort(flat_ids, stable=True)
    sorted_ids = flat_ids[order]
    counts = torch.bincount(sorted_ids[sorted_ids >= 0], minlength=num_experts).tolist()
    start = int((sorted_ids < 0).sum())  # skipped slots sort first
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start:start + count]  # flat (token, slot) indices routed to this expert
        start += count
        tokens = pairs // top_k
        gate, up = F.linear(x[tokens], w_gate_up[expert]).chunk(2, dim=-1)
        expert_out = F.linear(_activate(gate, activation) * up, w_down[expert])
        weighted = (expert_out * topk_weights.reshape(-1)[pairs, None]).to(x.dtype)
        out.index_add_(0, tokens, weighted)
    return out


def fused_moe(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
) -> torch.Tensor:
    """The layer's one entry point: [T, H] as ``fused_moe_reference`` defines it, computed by the
    best kernel for x's device."""
    return fused_moe_reference(x, w_gate_up, w_down, topk_weights, topk_ids, activation)
