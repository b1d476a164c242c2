"""A Gemma 2 GGUF (written here as llama.cpp's converter writes one: pre- and post-norms stored
as ``1 + w``, rows not permuted, the caps as metadata) converted by tokenmill computes what
transformers' GGUF loader makes of it: weights equal, logits within 1e-4 past the window."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from services.runtime.model.attention.torch_backend import TorchAttentionBackend
from services.runtime.model.families import load_model
from services.tools.gguf import convert_gguf
from tests.helpers.paged_forward import assert_close_to_reference, run_chunks
from tests.tools.gguf_helpers import write_tiny_llama_gguf

transformers = pytest.importorskip("transformers")

WINDOW = 16
CAPS = (4.0, 3.0)  # low enough that random weights' scores and logits reach them


def test_gemma2_gguf_matches_transformers(tmp_path):
    source = tmp_path / "gemma2.gguf"
    weights = write_tiny_llama_gguf(source, arch="gemma2", sliding_window=WINDOW, rope_base=10000.0, softcaps=CAPS,
                                    dims=dict(layers=4))
    out = tmp_path / "model"
    convert_gguf(source, out)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Gemma2ForCausalLM"] and config["sliding_window"] == WINDOW
    assert (config["attn_logit_softcapping"], config["final_logit_softcapping"]) == CAPS
    assert config["query_pre_attn_scalar"] == config["head_dim"] == 16
    # transformers' GGUF loader reads the window but not the caps or the score scale: given here
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=source.name, dtype=torch.float32, attn_logit_softcapping=CAPS[0],
        final_logit_softcapping=CAPS[1], query_pre_attn_scalar=16, attn_implementation="eager").eval()
    ours = load_file(out / "model.safetensors")  # the stored 1 + w less 1, in fp32 as transformers does
    for name, value in hf.state_dict().items():
        if name == "lm_head.weight":  # tied: the embedding
            continue
        torch.testing.assert_close(ours[name], value, rtol=0, atol=0, msg=name)
    np.testing.assert_allclose(ours["model.layers.1.post_feedforward_layernorm.weight"].numpy(),
                               weights["model.layers.1.post_feedforward_layernorm.weight"], atol=1e-7)
    model = load_model(out, TorchAttentionBackend())
    ids = torch.randint(0, config["vocab_size"], (40,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    assert ref.abs().max() > 0.9 * CAPS[1]  # the final cap bends these logits
    assert_close_to_reference(run_chunks(model, ids, [25, 1, 14], [2, 0, 1], 16), ref)
