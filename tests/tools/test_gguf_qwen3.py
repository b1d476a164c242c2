"""A Qwen3 GGUF (written here as llama.cpp's converter writes one: q/k norms, rows not permuted,
the ``qwen2`` pre-tokenizer) converted by tokenmill equals what transformers' GGUF loader makes of it."""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer

from services.runtime.model.attention.torch_backend import TorchAttentionBackend
from services.runtime.model.families import load_model
from services.tools.gguf import convert_gguf
from tests.helpers.paged_forward import assert_close_to_reference, run_chunks
from tests.tools.gguf_helpers import write_tiny_llama_gguf

transformers = pytest.importorskip("transformers")

TEXTS = ["the 12 the12", "it's THE they'll\n\n  the\tthe 123 ٣", "<|im_start|>the<|im_end|> x'S"]


def test_qwen3_gguf_matches_transformers(tmp_path):
    source = tmp_path / "qwen3.gguf"
    # head_dim 128, the only one transformers' GGUF loader gives Qwen3 (it reads no key_length)
    write_tiny_llama_gguf(source, arch="qwen3", pre="qwen2", untied=True, dims=dict(hidden=256, heads=2, kv_heads=1))
    out = tmp_path / "model"
    convert_gguf(source, out)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=source.name)
    ours = Tokenizer.from_file(str(out / "tokenizer.json"))
    for text in TEXTS:
        assert ours.encode(text).ids == hf_tokenizer(text).input_ids, text
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=source.name, dtype=torch.float32).eval()
    model = load_model(out, TorchAttentionBackend())
    ids = torch.randint(0, config["vocab_size"], (30,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    assert_close_to_reference(run_chunks(model, ids, [20, 1, 9], [2, 0, 1], 16), ref)
