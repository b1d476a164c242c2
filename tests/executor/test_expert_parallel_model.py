"""Mixture-of-experts models under tensor parallelism through the real ModelRunner, the other
ranks real processes: each sparse layer's experts split over the ranks
(services/runtime/parallel/expert_parallel.py, both exchanges) or replicated, against one rank:
greedy tokens identical, fp32 logprobs within 1e-4, at TP=2 and TP=3.

Models: a random Mixtral (6 query / 3 KV heads so TP=3 splits whole KV groups; 8 experts top-2:
runs of 4/4 and 3/3/2), a random Qwen2-MoE (12 experts top-4 beside a sigmoid-gated shared
expert, which every rank runs whole), a random Qwen3-MoE (64 experts top-8, per-head q/k norms,
one dense layer split as any MLP), a random OLMoE (16 experts top-8, q/k norms over every
head, their sums of squares added over the ranks), and a Qwen2-MoE GGUF converted with ``--weights keep`` (Q8_0
experts and shared expert), each rank dequantizing only its run of the experts.
"""

from __future__ import annotations

import dataclasses

import pytest

from services.tools.gguf import convert_gguf
from services.tools.random_model import build_random_model
from tests.executor.test_tensor_parallel import generate, make_runner, run, tokens
from tests.helpers.moe_specs import MOE_SPECS
from tests.helpers.moe_gguf import gguf_spec, write_moe_gguf

# slow: every runner starts its other ranks as processes
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("moe_tp")
    specs = {
        "mixtral": dataclasses.replace(MOE_SPECS["mixtral"], hidden_size=96, num_heads=6, num_kv_heads=3),
        "qwen2-moe": MOE_SPECS["qwen2-moe"],
        "qwen3-moe": MOE_SPECS["qwen3-moe"],
        "olmoe": MOE_SPECS["olmoe"],
    }
    dirs = {name: build_random_model(spec, root / name) for name, spec in specs.items()}
    spec = dataclasses.replace(gguf_spec("qwen2-moe"), vocab_size=512)  # the prompts' ids: more rows than TOKENS
    write_moe_gguf(build_random_model(spec, root / "qwen2-moe-gguf"), root / "qwen2-moe.gguf", spec)
    convert_gguf(root / "qwen2-moe.gguf", root / "qwen2-moe-keep", weights="keep")
    return dirs | {"qwen2-moe-keep": root / "qwen2-moe-keep"}


def assert_matches(one, many) -> None:
    assert tokens(many) == tokens(one)
    for seq, (_, want) in one.items():
        for got, expected in zip(many[seq][1], want, strict=True):
            assert got.top_token_ids == expected.top_token_ids
            assert got.top_logprobs == pytest.approx(expected.top_logprobs, abs=1e-4)


def run_split(model, tp: int, experts: str, **settings) -> dict:
    """Greedy outputs with the experts split ``tp`` ways, checking rank 0 holds its run alone."""
    runner = make_runner(model, tp, tensor_parallel_experts=experts, **settings)
    try:
        sparse = [layer.moe for layer in runner.model.layers if getattr(layer, "moe", None) is not None]
        assert sparse and all(moe.w_gate_up is None for moe in sparse)  # the full stack is gone
        for moe in sparse:
            assert moe.expert_parallel.exchange == experts
            assert moe.expert_parallel.w_gate_up.shape[0] == len(moe.expert_parallel.local) < moe.num_experts
        return generate(runner, 8, 2)
    finally:
        runner.close()


def test_mixtral_matches_one_rank_at_two_and_three(moe_dirs):
    one, _, _ = run(moe_dirs["mixtral"], 1, 8, logprobs=2)
    assert_matches(one, run_split(moe_dirs["mixtral"], 2, "all_to_all"))
    assert_matches(one, run_split(moe_dirs["mixtral"], 3, "all_to_all"))
    assert_matches(one, run_split(moe_dirs["mixtral"], 3, "all_reduce"))


def test_qwen2_moe_shared_expert_matches_one_rank(moe_dirs):
    one, _, _ = run(moe_dirs["qwen2-moe"], 1, 8, logprobs=2)
    assert_matches(one, run_split(moe_dirs["qwen2-moe"], 2, "all_to_all"))
    replicated, _, _ = run(moe_dirs["qwen2-moe"], 2, 8, logprobs=2, tensor_parallel_experts="replicated")
    assert_matches(one, replicated)


def test_qwen3_moe_matches_one_rank(moe_dirs):
    one, _, _ = run(moe_dirs["qwen3-moe"], 1, 8, logprobs=2)
    assert_matches(one, run_split(moe_dirs["qwen3-moe"], 2, "all_to_all"))


def test_kept_quantized_experts_split_match_one_rank(moe_dirs):
    """One rank dequantizes the kept experts at load under quant_activations none (what tensor
    parallelism resolves auto to); two ranks each dequantize their run: the same numbers."""
    one, _, _ = run(moe_dirs["qwen2-moe-keep"], 1, 8, logprobs=2, quant_activations="none")
    assert_matches(one, run_split(moe_dirs["qwen2-moe-keep"], 2, "all_to_all"))
    assert_matches(one, run_split(moe_dirs["qwen2-moe-keep"], 2, "all_reduce"))


def test_olmoe_matches_one_rank_with_its_norms_over_every_head(moe_dirs):
    """OLMoE's q/k norms span all heads: each rank's share of the sums of squares is added over the ranks."""
    one, _, _ = run(moe_dirs["olmoe"], 1, 8, logprobs=2)
    assert_matches(one, run_split(moe_dirs["olmoe"], 2, "all_to_all"))
    # four ranks over two KV heads: each KV head on two ranks, its sum counted once
    assert_matches(one, run_split(moe_dirs["olmoe"], 4, "all_reduce"))
