"""The grouped expert computation (the layer's one reference, fused_moe_reference) against a loop over tokens, over awkward routings, and the
routing rules and config checks of the mixture-of-experts layer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.runtime.model.config import ModelConfig
from services.runtime.kernels.fused_moe import fused_moe_reference
from services.runtime.model.moe import route


def per_token_reference(x, w_gate_up, w_down, topk_weights, topk_ids):
    """Each token through each of its experts, one at a time, in fp64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            gate, up = (w_gate_up[e].double() @ x[t].double()).chunk(2)
            out[t] += float(topk_weights[t, j]) * (w_down[e].double() @ (F.silu(gate) * up))
    return out


def _ids(kind: str, t: int, k: int, e: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "random":
        return torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    if kind == "one_expert_gets_all":  # expert 3 in every token's first slot; the rest spread
        ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
        rows = ids != 3
        ids[:, 0] = 3
        ids[:, 1:] = torch.where(rows[:, 1:], ids[:, 1:], ids[:, :1].new_full((), 5))
        return ids
    if kind == "skewed":  # two experts take everything; the others are empty
        return torch.stack([torch.tensor([0, e - 1])[torch.randperm(2, generator=gen)][:k] for _ in range(t)])
    raise ValueError(kind)


@pytest.mark.parametrize("t,k,e,kind", [
    (1, 2, 8, "random"), (1, 8, 64, "random"), (7, 2, 8, "one_expert_gets_all"), (33, 2, 16, "skewed"),
    (5, 1, 4, "skewed"), (64, 8, 64, "random"), (3, 2, 3, "random")])
def test_grouped_experts_match_a_loop_over_tokens(t, k, e, kind):
    gen = torch.Generator().manual_seed(t * 100 + k * 10 + e)
    h, i = 24, 40  # neither a power of two
    x = torch.randn(t, h, generator=gen)
    w_gate_up, w_down = torch.randn(e, 2 * i, h, generator=gen) * 0.2, torch.randn(e, h, i, generator=gen) * 0.2
    ids = _ids(kind, t, k, e, gen)
    weights = torch.rand(t, k, generator=gen)
    got = fused_moe_reference(x, w_gate_up, w_down, weights, ids)
    torch.testing.assert_close(got.double(), per_token_reference(x, w_gate_up, w_down, weights, ids),
                               rtol=1e-5, atol=1e-5)


def test_no_tokens_give_an_empty_output():
    out = fused_moe_reference(torch.zeros(0, 8), torch.zeros(4, 6, 8), torch.zeros(4, 8, 3), torch.zeros(0, 2),
                              torch.zeros(0, 2, dtype=torch.int64))
    assert out.shape == (0, 8)


def test_the_two_routing_orders_agree_when_renormalized():
    logits = torch.randn(9, 16, generator=torch.Generator().manual_seed(1))
    w1, ids1 = route(logits, 4, renormalize=True, order="softmax_topk")
    w2, ids2 = route(logits, 4, renormalize=False, order="topk_softmax")
    assert torch.equal(ids1, ids2)
    torch.testing.assert_close(w1, w2)
    w3, _ = route(logits, 4, renormalize=False)
    assert (w3.sum(-1) < 1).all()  # without renormalization the top-k keep their share of all experts


def _raw(**extra):
    return {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 32, "hidden_size": 16, "intermediate_size": 24,
            "num_hidden_layers": 4, "num_attention_heads": 2, "num_experts": 8, "num_experts_per_tok": 2,
            "moe_intermediate_size": 8, **extra}


def test_config_reads_each_family_and_names_what_it_refuses():
    config = ModelConfig.from_dict(_raw(mlp_only_layers=[0], decoder_sparse_step=1, norm_topk_prob=True))
    assert [config.sparse(i) for i in range(4)] == [False, True, True, True]
    assert config.moe.intermediate_size == 8 and config.moe.renormalize
    assert [ModelConfig.from_dict(_raw(decoder_sparse_step=2)).sparse(i) for i in range(4)] == [False, True, False, True]
    mixtral = ModelConfig.from_dict(_raw(architectures=["MixtralForCausalLM"], num_local_experts=4))
    assert (mixtral.moe.num_experts, mixtral.moe.intermediate_size, mixtral.moe.renormalize) == (4, 24, True)
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(9\) exceeds the 8 experts"):
        ModelConfig.from_dict(_raw(num_experts_per_tok=9))
    with pytest.raises(ValueError, match="num_experts must be >= 1"):
        ModelConfig.from_dict(_raw(num_experts=0))
    with pytest.raises(ValueError, match="clip_qkv"):
        ModelConfig.from_dict(_raw(architectures=["OlmoeForCausalLM"], clip_qkv=8.0))


def test_expert_load_counts_every_routed_token_and_reaches_the_metrics_text(tmp_path):
    from prometheus_client import CollectorRegistry, generate_latest

    from services.common.metrics import expert_load_collector, parse_samples
    from services.runtime.model.attention.torch_backend import TorchAttentionBackend
    from services.runtime.model.families import load_model
    from services.runtime.model.moe import expert_loads, reset_expert_loads
    from services.tools.random_model import build_random_model
    from tests.helpers.moe_specs import MOE_SPECS
    from tests.helpers.paged_forward import run_chunks

    spec = MOE_SPECS["qwen3-moe"]
    model = load_model(build_random_model(spec, tmp_path / "m"), TorchAttentionBackend())
    ids = torch.randint(3, spec.vocab_size, (9,), generator=torch.Generator().manual_seed(1))
    run_chunks(model, ids, [5, 4], [0], 16)
    loads = expert_loads(model)
    assert [layer for layer, _ in loads] == [0, 2]  # layer 1 is dense
    assert all(sum(counts) == 9 * spec.num_experts_per_tok and len(counts) == 64 for _, counts in loads)
    registry = CollectorRegistry()
    expert_load_collector(registry).watch(lambda: expert_loads(model))
    samples = parse_samples(generate_latest(registry).decode())
    assert sum(v for k, v in samples.items() if k.startswith('tokenmill:executor_moe_expert_tokens_total{expert="')
               and 'layer="2"' in k) == 9 * spec.num_experts_per_tok
    reset_expert_loads(model)
    assert all(sum(counts) == 0 for _, counts in expert_loads(model))
