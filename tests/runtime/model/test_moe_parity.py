"""The mixture-of-experts families compute what transformers computes through the paged cache:
logits within 1e-4 of the logit scale (a prompt at once, then chunks and single decodes) and the
same 128 greedy tokens, on deterministic random weights."""

from __future__ import annotations

import pytest
import torch

from services.runtime.model.attention.torch_backend import TorchAttentionBackend
from services.runtime.model.families import load_model
from services.tools.random_model import build_random_model
from tests.helpers.moe_specs import MOE_SPECS
from tests.helpers.paged_forward import assert_close_to_reference, greedy, hf_greedy, run_chunks

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 128


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_models")
    return {name: build_random_model(spec, root / name) for name, spec in MOE_SPECS.items()}


@pytest.mark.parametrize("name", sorted(MOE_SPECS))
def test_logits_and_greedy_tokens_match_transformers(moe_dirs, name):
    model_dir = moe_dirs[name]
    model = load_model(model_dir, TorchAttentionBackend())
    spec = MOE_SPECS[name]
    sparse = [layer.moe is not None for layer in model.layers]
    assert sparse == [spec.sparse(i) for i in range(spec.num_layers)] and any(sparse)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.randint(3, model.config.vocab_size, (45,), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0].float()
    assert_close_to_reference(run_chunks(model, ids, [45], [3, 0, 2], 16), ref)
    assert_close_to_reference(run_chunks(model, ids, [20, 17] + [1] * 8, [6, 1, 4, 9, 2, 7], 8), ref)
    prompt = ids[:40]
    assert greedy(model, prompt, NEW_TOKENS, prefill_chunk=7) == hf_greedy(hf, prompt, NEW_TOKENS)
