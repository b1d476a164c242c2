"""Mixture-of-experts layers in the fused CPU step (services/runtime/model/fused_decode.py)
against the eager forward (moe.py), on deterministic random weights for every family: Mixtral
(8 experts top-2, renormalized), Qwen3-MoE (64 experts top-8, per-head q/k norms, a dense layer
between sparse ones), OLMoE (16 experts top-8, not renormalized, q/k norms over all heads) and
Qwen2-MoE (12 experts top-4, q/k/v biases, a sigmoid-gated shared expert). Decode steps, one-token
steps (most experts get no token), mixed prompt/decode steps; fp32 experts and experts kept in
their GGUF blocks (Q8_0, Q4_K/Q6_K) on the int8-activation products.
"""

from __future__ import annotations

import pytest
import torch

from services.executor.forward_paths.fused_decode import FusedDecodeSettings
from services.runtime.model.fused_decode import why_not
from services.runtime.model.moe import expert_loads
from services.tools.random_model import build_random_model
from tests.helpers.forward_paths import fused_decode
from tests.helpers.moe_specs import MOE_SPECS
from tests.helpers.scripted_requests import run_requests
from tests.runtime.model.test_fused_decode import CONTEXTS, MIXED, fill_pool, make_runner, step_inputs

FAMILIES = sorted(MOE_SPECS)
STEPS = [(CONTEXTS, [1] * len(CONTEXTS)), ([7], [1]), ([n for n, _ in MIXED], [q for _, q in MIXED])]
"""A decode step of 9 rows, a one-token step, and a step of prompts, chunks and decode rows (60 tokens)."""


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fused_moe")
    return {name: build_random_model(spec, root / name) for name, spec in MOE_SPECS.items()}


def assert_fused_equals_eager(runner, tolerance: float, rows_close: float = 1.0) -> None:
    fused = fused_decode(runner)
    assert fused is not None, why_not(runner.model, runner.kv_cache.layers)
    caches = runner.kv_cache.layers
    for seed, (contexts, query_lens) in enumerate(STEPS):
        tables, (ids, positions, meta, _) = step_inputs(runner, contexts, query_lens, seed=seed)
        assert fused.takes(meta)
        fill_pool(runner, tables, contexts, seed=seed + 10)
        with torch.inference_mode():
            before = [list(load) for _, load in expert_loads(runner.model)]
            got = fused(ids, positions, caches, meta)
            counted = [[b - a for a, b in zip(old, new)] for old, (_, new) in zip(before, expert_loads(runner.model))]
            eager = runner.model(ids, positions, caches, meta)
        assert got.shape == eager.shape == (sum(query_lens), runner.model_config.hidden_size)
        assert torch.isfinite(got).all()
        # Each sparse layer counted every routed (token, expert) pair of the fused step.
        assert counted and all(sum(c) == sum(query_lens) * runner.model.config.moe.top_k for c in counted)
        if sum(query_lens) == 1:
            assert all(c.count(0) == len(c) - runner.model.config.moe.top_k for c in counted)
        close = ((got - eager).abs() <= tolerance + tolerance * eager.abs()).all(dim=1)
        assert close.float().mean() >= rows_close, f"{int((~close).sum())} of {len(close)} rows differ"


@pytest.mark.parametrize("name", FAMILIES)
def test_sparse_layers_run_fused_as_they_run_eagerly(name, moe_dirs):
    runner = make_runner(moe_dirs[name], fused_decode=FusedDecodeSettings(cpu_fused_max_tokens=64))
    assert why_not(runner.model, runner.kv_cache.layers) is None
    assert_fused_equals_eager(runner, 1e-4)
    hidden = torch.randn(3, runner.model_config.hidden_size)
    torch.testing.assert_close(fused_decode(runner).logits(hidden), runner.model.compute_logits(hidden),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["mixtral", "qwen3-moe"])
def test_a_sparse_model_serves_the_eager_runners_greedy_tokens(name, moe_dirs):
    fused = make_runner(moe_dirs[name])
    eager = make_runner(moe_dirs[name], fused_decode=FusedDecodeSettings(cpu_decode="eager"))
    assert fused_decode(fused) is not None and fused_decode(eager) is None
    assert run_requests(fused) == run_requests(eager)


@pytest.mark.parametrize("name,types", [("mixtral", ("q8_0", "q8_0")), ("qwen2-moe", ("q4_k", "q6_k")),
                                        ("olmoe", ("q4_k", "q6_k"))])
def test_experts_kept_in_their_gguf_blocks_run_fused_as_eagerly(name, types, tmp_path):
    from tests.helpers.moe_gguf import kept_moe_model

    kept_moe_model(name, types, tmp_path)
    runner = make_runner(tmp_path / "keep", quant_activations="auto",
                         fused_decode=FusedDecodeSettings(cpu_fused_max_tokens=64))
    assert {layer.moe.path for layer in runner.model.layers} == {"cpu_int8"}
    # int8 activations: a last-bit difference can round an input to the neighbouring code and move
    # its row (as for dense quantized models); a wiring mistake moves every row.
    assert_fused_equals_eager(runner, 1e-4, rows_close=0.75)
