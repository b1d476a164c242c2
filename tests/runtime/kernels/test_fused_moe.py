"""The fused-MoE reference against Hugging Face's expert loop and a per-token float64 sum."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.runtime.kernels.fused_moe import fused_moe, fused_moe_reference


def _routing(num_tokens: int, num_experts: int, top_k: int, skew: bool = False):
    logits = torch.randn(num_tokens, num_experts)
    if skew:
        logits[:, 0] += 4.0  # most tokens pick expert 0
    weights, ids = torch.topk(logits.softmax(-1), top_k, dim=-1)
    return weights, ids


def _per_token(x, w_gate_up, w_down, topk_weights, topk_ids, activation):
    """Each token, each slot, one at a time, in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            if e < 0:
                continue
            gate, up = (w_gate_up[e].double() @ x[t].double()).chunk(2)
            act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
            out[t] += float(topk_weights[t, j]) * (w_down[e].double() @ (act * up))
    return out


@pytest.mark.parametrize("num_tokens,num_experts,top_k,activation,skew", [
    (1, 4, 1, "silu", False),
    (7, 8, 2, "gelu_tanh", False),
    (13, 16, 8, "silu", True),
])
def test_reference_matches_per_token_sum(num_tokens, num_experts, top_k, activation, skew):
    hidden, intermediate = 24, 40
    x = torch.randn(num_tokens, hidden)
    w_gate_up = torch.randn(num_experts, 2 * intermediate, hidden) / hidden ** 0.5
    w_down = torch.randn(num_experts, hidden, intermediate) / intermediate ** 0.5
    weights, ids = _routing(num_tokens, num_experts, top_k, skew)
    ids[0, 0] = -1  # a slot whose expert lives elsewhere adds nothing
    got = fused_moe_reference(x, w_gate_up, w_down, weights, ids, activation)
    torch.testing.assert_close(got.double(), _per_token(x, w_gate_up, w_down, weights, ids, activation),
                               rtol=1e-5, atol=1e-5)
    assert torch.equal(fused_moe(x, w_gate_up, w_down, weights, ids, activation), got)


def test_reference_rounds_like_hugging_face_bf16():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    config = MixtralConfig(hidden_size=32, intermediate_size=48, num_local_experts=8, num_experts_per_tok=2)
    experts = MixtralExperts(config).to(torch.bfloat16)
    torch.nn.init.normal_(experts.gate_up_proj, std=0.2)
    torch.nn.init.normal_(experts.down_proj, std=0.2)
    x = torch.randn(11, 32, dtype=torch.bfloat16)
    weights, ids = _routing(11, 8, 2, skew=True)
    with torch.no_grad():
        want = experts(x, ids, weights)
    got = fused_moe_reference(x, experts.gate_up_proj.data, experts.down_proj.data, weights, ids)
    assert torch.equal(got, want)


def test_reference_names_the_bad_argument():
    x = torch.randn(3, 8)
    w_gate_up, w_down = torch.randn(4, 10, 8), torch.randn(4, 8, 5)
    weights, ids = _routing(3, 4, 2)
    with pytest.raises(ValueError, match="activation"):
        fused_moe_reference(x, w_gate_up, w_down, weights, ids, "relu")
    with pytest.raises(ValueError, match="w_down"):
        fused_moe_reference(x, w_gate_up, torch.randn(4, 8, 6), weights, ids)
    with pytest.raises(ValueError, match="topk_ids"):
        fused_moe_reference(x, w_gate_up, w_down, weights, ids.int())
