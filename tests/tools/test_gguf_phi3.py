"""A Phi-3 GGUF written as llama.cpp's converter writes one (q|k|v and gate|up fused as ``attn_qkv`` /
``ffn_up``, rows not permuted, a window; long-context files with ``rope_factors_long/short`` and the
``phi3.rope.scaling.*`` keys) converted by tokenmill computes what transformers computes with the
weights its GGUF loader reads from the same file."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from services.runtime.model.attention.torch_backend import TorchAttentionBackend
from services.runtime.model.families import load_model
from services.tools.gguf import convert_gguf
from tests.helpers.paged_forward import assert_close_to_reference, run_chunks
from tests.tools.gguf_helpers import write_tiny_llama_gguf

transformers = pytest.importorskip("transformers")

WINDOW = 24
LONG = np.array([1.5 + 0.5 * i for i in range(8)], dtype=np.float32)  # head_dim 16: 8 frequencies
SHORT = np.array([1.0 + 0.25 * i for i in range(8)], dtype=np.float32)
ORIGINAL = 64  # of the file's 128 positions: the scale sqrt(1 + ln 2 / ln 64) applies


def _logits(out, ids):
    model = load_model(out, TorchAttentionBackend())
    return run_chunks(model, ids, [25, 1, 14], [2, 0, 1], 16)


@pytest.mark.parametrize("longrope", [False, True])
def test_phi3_gguf_matches_transformers(tmp_path, longrope):
    source = tmp_path / "phi3.gguf"
    write_tiny_llama_gguf(source, arch="phi3", sliding_window=WINDOW, rope_base=10000.0,
                          longrope=(LONG, SHORT, ORIGINAL) if longrope else None)
    out = tmp_path / "model"
    convert_gguf(source, out)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Phi3ForCausalLM"] and config["sliding_window"] == WINDOW
    # transformers' GGUF loader reads the weights but neither the window nor longrope: given here
    overrides: dict = {"sliding_window": WINDOW}
    if longrope:
        assert config["rope_scaling"] == {"rope_type": "longrope", "long_factor": LONG.tolist(),
                                          "short_factor": SHORT.tolist()}
        assert config["original_max_position_embeddings"] == ORIGINAL
        overrides |= {"original_max_position_embeddings": ORIGINAL, "rope_parameters": {
            "rope_type": "longrope", "rope_theta": 10000.0, "long_factor": LONG.tolist(),
            "short_factor": SHORT.tolist(), "original_max_position_embeddings": ORIGINAL}}
    else:
        assert "rope_scaling" not in config
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=source.name, dtype=torch.float32,
                                                           **overrides).eval()
    assert hf.config.sliding_window == WINDOW
    ids = torch.randint(0, config["vocab_size"], (40,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]  # 40 positions: inside the original context, the short factors
    assert_close_to_reference(_logits(out, ids), ref)


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(arch="phi3", weights="keep"), "--weights keep does not take Phi-3's fused"),
    (dict(arch="llama", longrope=(LONG, SHORT, ORIGINAL)), "'rope_factors_long.weight' has no place in the Llama"),
])
def test_what_the_phi3_conversion_cannot_take_is_refused_by_name(tmp_path, kwargs, message):
    source = tmp_path / "bad.gguf"
    weights = kwargs.pop("weights", "fp32")
    write_tiny_llama_gguf(source, **kwargs)
    with pytest.raises(ValueError, match=message):
        convert_gguf(source, tmp_path / "model", weights=weights)
    assert not (tmp_path / "model").exists()
