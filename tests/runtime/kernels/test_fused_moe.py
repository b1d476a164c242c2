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


# The Triton kernels (in the interpreter on a CPU), judged as flash-attention's tests judge a kernel:
# at most LOW_PRECISION_FACTOR times further from the float64 reference than the reference itself
# computed in the kernel's dtype, plus FP32_TOLERANCE.

def _expert_weights(num_experts, hidden, intermediate):
    w_gate_up = torch.randn(num_experts, 2 * intermediate, hidden) / hidden ** 0.5
    w_down = torch.randn(num_experts, hidden, intermediate) / intermediate ** 0.5
    return w_gate_up, w_down


def _route(kind: str, num_tokens: int, num_experts: int, top_k: int):
    if kind == "one_expert":  # every token's slots on the same few experts, the rest empty
        ids = torch.arange(top_k).repeat(num_tokens, 1) + num_experts - top_k
        return torch.rand(num_tokens, top_k), ids
    weights, ids = _routing(num_tokens, num_experts, top_k, skew=kind == "skewed")
    if kind == "some_elsewhere":  # expert parallelism: slots whose expert another rank holds
        ids[::2, 0] = -1
    return weights, ids


def _check_kernel(device, x, w_gate_up, w_down, weights, ids, activation, tiles=None):
    """The kernel on ``device`` (the interpreter on a CPU), the references on the CPU."""
    from tests.helpers.kernel_cases import FP32_TOLERANCE, LOW_PRECISION_FACTOR
    from services.runtime.kernels.fused_moe import fused_moe_triton

    dtype = x.dtype
    got = fused_moe_triton(*(t.to(device) for t in (x, w_gate_up, w_down, weights, ids)), activation, tiles=tiles)
    got = got.cpu()
    assert got.shape == x.shape and got.dtype == dtype and not got.isnan().any()
    exact = fused_moe_reference(x.double(), w_gate_up.double(), w_down.double(), weights.double(), ids, activation)
    torch_error = (fused_moe_reference(x, w_gate_up, w_down, weights, ids, activation).double() - exact).abs().max()
    kernel_error = (got.double() - exact).abs().max()
    assert kernel_error <= LOW_PRECISION_FACTOR * torch_error + FP32_TOLERANCE, (kernel_error, torch_error)


@pytest.mark.parametrize("num_tokens,num_experts,top_k,route,activation,dtype", [
    (1, 4, 1, "random", "silu", torch.float32),  # one token: one expert busy, three empty
    (37, 8, 2, "skewed", "gelu_tanh", torch.bfloat16),  # rows not a multiple of the tile
    (19, 8, 1, "one_expert", "silu", torch.float16),  # every token on one expert
    (6, 64, 8, "random", "silu", torch.bfloat16),  # 64 experts, most of them empty
    (9, 16, 2, "some_elsewhere", "gelu_tanh", torch.float32),
])
def test_triton_matches_reference(num_tokens, num_experts, top_k, route, activation, dtype, device):
    hidden, intermediate = 40, 24  # neither a multiple of the column or reduction tiles
    w_gate_up, w_down = _expert_weights(num_experts, hidden, intermediate)
    weights, ids = _route(route, num_tokens, num_experts, top_k)
    x = torch.randn(num_tokens, hidden)
    _check_kernel(device, x.to(dtype), w_gate_up.to(dtype), w_down.to(dtype), weights, ids, activation, tiles=(16, 16, 16))


def test_triton_default_tiles_and_an_empty_batch(device):
    w_gate_up, w_down = _expert_weights(4, 72, 80)
    weights, ids = _route("skewed", 70, 4, 2)  # > 8 pairs per expert: the 64-row tiles
    _check_kernel(device, torch.randn(70, 72).half(), w_gate_up.half(), w_down.half(), weights, ids, "silu")
    from services.runtime.kernels.fused_moe import fused_moe_triton

    empty = fused_moe_triton(torch.empty(0, 72, device=device), w_gate_up.to(device), w_down.to(device),
                             torch.empty(0, 2, device=device), torch.empty(0, 2, dtype=torch.int64, device=device))
    assert empty.shape == (0, 72)


def test_align_pairs_pads_each_expert_to_the_tile():
    from services.runtime.kernels.fused_moe import align_pairs

    ids = torch.tensor([[2, 0], [2, -1], [0, 2], [2, 3]])  # expert 1 empty, one skipped slot
    sorted_pairs, block_expert, num_padded = align_pairs(ids, num_experts=4, block_m=2)
    pad = ids.numel()
    # expert 0: pairs 1, 4; expert 2: pairs 0, 2, 5, 6 (padded to 4); expert 3: pair 7 (padded to 2)
    assert sorted_pairs.tolist()[:8] == [1, 4, 0, 2, 5, 6, 7, pad]
    assert sorted_pairs.tolist()[8:] == [pad] * (len(sorted_pairs) - 8)
    assert block_expert.tolist()[:4] == [0, 2, 2, 3] and num_padded.tolist() == [8]


def test_model_ops_run_the_reference_and_the_triton_kernel(device):
    from services.runtime.model.ops import TorchOps, TritonOps

    w_gate_up, w_down = _expert_weights(8, 32, 48)
    weights, ids = _route("random", 5, 8, 2)
    x = torch.randn(5, 32)
    want = fused_moe_reference(x, w_gate_up, w_down, weights, ids)
    assert torch.equal(TorchOps.moe_experts(x, w_gate_up, w_down, weights, ids), want)
    got = TritonOps().moe_experts(*(t.to(device) for t in (x, w_gate_up, w_down, weights, ids)))
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
