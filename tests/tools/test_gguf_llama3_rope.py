"""A Llama 3.1-style GGUF (llama.cpp stores its llama3 RoPE scaling as ``rope_freqs.weight``, the
per-frequency divisors, and no rope_scaling keys) converts to config.json's llama3 rope_scaling and
computes what transformers computes on the same file's weights with that scaling."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from services.runtime.model.attention.torch_backend import TorchAttentionBackend
from services.runtime.model.families import load_model
from services.tools.gguf import convert_gguf, llama3_rope_factors
from tests.helpers.paged_forward import assert_close_to_reference, run_chunks
from tests.tools.gguf_helpers import write_tiny_llama_gguf

transformers = pytest.importorskip("transformers")

BASE = 500000.0  # Llama 3's; with head_dim 16 one frequency falls on the ramp between kept and divided
HEAD_DIM = 16


@pytest.mark.parametrize("factor", [8.0, 32.0])  # Llama 3.1 / 3.3 and Llama 3.2
def test_rope_freqs_become_llama3_scaling_and_match_transformers(tmp_path, factor):
    divisors = llama3_rope_factors(BASE, HEAD_DIM, factor, 1.0, 4.0, 8192)
    assert 1.0 < sorted(divisors)[4] < factor and divisors.min() == 1.0  # kept, ramped and divided frequencies
    source = tmp_path / "llama31.gguf"
    write_tiny_llama_gguf(source, rope_base=BASE, rope_freqs=divisors)
    out = tmp_path / "model"
    convert_gguf(source, out)
    config = json.loads((out / "config.json").read_text())
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    assert config["rope_scaling"] == scaling
    # transformers' GGUF loader reads neither rope_freqs nor any llama3 key: its weights, the scaling given
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=source.name, dtype=torch.float32,
        rope_parameters={**scaling, "rope_theta": BASE}).eval()
    assert hf.config.rope_parameters["rope_type"] == "llama3"
    model = load_model(out, TorchAttentionBackend())
    ids = torch.randint(0, config["vocab_size"], (40,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    assert_close_to_reference(run_chunks(model, ids, [25, 1, 14], [2, 0, 1], 16), ref)


def test_rope_freqs_off_llama3s_rule_are_refused(tmp_path):
    source = tmp_path / "odd.gguf"
    divisors = llama3_rope_factors(BASE, HEAD_DIM, 8.0, 1.0, 2.0, 8192)  # another high_freq_factor
    write_tiny_llama_gguf(source, rope_base=BASE, rope_freqs=divisors)
    with pytest.raises(ValueError, match="rope_freqs.weight holds frequency divisors"):
        convert_gguf(source, tmp_path / "model")
    assert not (tmp_path / "model").exists()
    assert not np.allclose(divisors, llama3_rope_factors(BASE, HEAD_DIM, 8.0, 1.0, 4.0, 8192))
