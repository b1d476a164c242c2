"""Each architecture and RoPE variant computes what transformers computes through the paged cache:
logits within 1e-4 of the logit scale (one prompt, and chunks then single decodes), and the same
128 greedy tokens, on deterministic random weights shaped like the real configurations."""

from __future__ import annotations

import pytest
import torch

from services.runtime.model.attention.torch_backend import TorchAttentionBackend
from services.runtime.model.families import load_model
from services.tools.random_model import build_random_model
from tests.helpers.family_specs import FAMILY_SPECS
from tests.helpers.paged_forward import assert_close_to_reference, greedy, hf_greedy, run_chunks

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 128


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("family_models")
    return {name: build_random_model(spec, root / name) for name, spec in FAMILY_SPECS.items()}


@pytest.mark.parametrize("name", sorted(FAMILY_SPECS))
def test_logits_and_greedy_tokens_match_transformers(family_dirs, name):
    model_dir = family_dirs[name]
    model = load_model(model_dir, TorchAttentionBackend())
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.randint(3, model.config.vocab_size, (45,), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0].float()
    assert_close_to_reference(run_chunks(model, ids, [45], [3, 0, 2], 16), ref)
    assert_close_to_reference(run_chunks(model, ids, [20, 17] + [1] * 8, [6, 1, 4, 9, 2, 7], 8), ref)
    # a prompt longer than every window, in chunks that end inside and past it
    prompt = ids[:40]
    assert greedy(model, prompt, NEW_TOKENS, prefill_chunk=7) == hf_greedy(hf, prompt, NEW_TOKENS)


@pytest.mark.parametrize("name", ["gemma3", "mistral-window", "phi3-longrope", "gemma2"])
def test_windowed_models_match_transformers_on_the_cpu_backend(family_dirs, name):
    """The C++ decode kernel honours each layer's window: decode steps far past it give transformers' tokens
    (Gemma 2's capped scores go through the torch backend's attention on this backend)."""
    from services.runtime.model.attention.cpu_backend import CpuAttentionBackend

    model_dir = family_dirs[name]
    model = load_model(model_dir, CpuAttentionBackend())
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = torch.randint(3, model.config.vocab_size, (30,), generator=torch.Generator().manual_seed(8))
    assert greedy(model, prompt, NEW_TOKENS) == hf_greedy(hf, prompt, NEW_TOKENS)


def test_a_draft_model_runs_its_own_family(family_dirs):
    """A Gemma 3 draft (its first 4 layers: local, local, global, local) is the Gemma file with
    those layers' windows, and computes what transformers' 4-layer model computes."""

    from services.drafter.config import DraftModelSettings
    from services.drafter.draft_model import load_draft_model
    from services.runtime.model.gemma3 import Gemma3ForCausalLM

    model_dir = family_dirs["gemma3"]
    draft = load_draft_model(DraftModelSettings(draft_model=str(model_dir), device="cpu", draft_layers=4),
                             TorchAttentionBackend(), torch.device("cpu"), torch.float32)
    assert isinstance(draft, Gemma3ForCausalLM) and [layer.window for layer in draft.layers] == [16, 16, None, 16]
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, num_hidden_layers=4).eval()
    ids = torch.randint(3, draft.config.vocab_size, (40,), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    assert_close_to_reference(run_chunks(draft, ids, [25, 1, 14], [3, 1, 0], 16), ref)


def test_gemma2_refuses_backends_that_do_not_cap_scores(family_dirs):
    """Gemma 2's attention soft-capping is not in the compiled CPU decode step (nor in a backend
    outside gemma2.SOFTCAP_BACKENDS): loading it there fails naming it, rather than running
    uncapped attention."""
    from services.runtime.model.compiled_decode import CompiledDecode

    class UncappedBackend(TorchAttentionBackend):
        name = "reference"

    with pytest.raises(ValueError, match="attn_logit_softcapping.*'reference' attention backend"):
        load_model(family_dirs["gemma2"], UncappedBackend())
    model = load_model(family_dirs["gemma2"], TorchAttentionBackend())
    with pytest.raises(ValueError, match="does not cap scores"):
        CompiledDecode(model)
