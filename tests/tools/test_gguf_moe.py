"""Mixture-of-experts GGUF files (llama.cpp's Mixtral under arch ``llama``, ``qwen3moe``, ``olmoe``):
the router and stacked experts (``ffn_gate_inp``, ``ffn_{gate,up,down}_exps``) convert to
transformers' per-expert tensors, and the converted model computes what transformers computes on
the weights the file was written from."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file

from services.runtime.model.attention.torch_backend import TorchAttentionBackend
from services.runtime.model.families import load_model
from services.tools.gguf import convert_gguf
from services.tools.random_model import build_random_model
from tests.helpers.moe_specs import MOE_SPECS
from tests.helpers.paged_forward import assert_close_to_reference, run_chunks
from tests.tools.gguf_helpers import CONTROL_TOKENS, MERGES, TOKENS, llama_cpp_permute

transformers = pytest.importorskip("transformers")

_ARCH = {"MixtralForCausalLM": "llama", "Qwen3MoeForCausalLM": "qwen3moe", "OlmoeForCausalLM": "olmoe"}
_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
_EXPERT = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


def write_moe_gguf(model_dir, path, spec) -> None:
    """The model directory's tensors in llama.cpp's layout: experts stacked per layer, Q8_0."""
    arch = _ARCH[spec.architecture]
    tensors = load_file(str(model_dir / "model.safetensors"))
    writer = GGUFWriter(str(path), arch)
    writer.add_context_length(spec.max_position_embeddings)
    writer.add_embedding_length(spec.hidden_size)
    writer.add_block_count(spec.num_layers)
    writer.add_feed_forward_length(spec.intermediate_size)
    writer.add_head_count(spec.num_heads)
    writer.add_head_count_kv(spec.num_kv_heads)
    writer.add_key_length(spec.head_dim)
    writer.add_value_length(spec.head_dim)
    writer.add_rope_dimension_count(spec.head_dim)
    writer.add_rope_freq_base(spec.rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_expert_count(spec.num_experts)
    writer.add_expert_used_count(spec.num_experts_per_tok)
    if arch == "qwen3moe":
        writer.add_expert_feed_forward_length(spec.expert_size)
    writer.add_vocab_size(len(TOKENS))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(TOKENS)
    writer.add_token_types([3] * len(CONTROL_TOKENS) + [1] * (len(TOKENS) - len(CONTROL_TOKENS)))
    writer.add_token_merges(MERGES)
    writer.add_eos_token_id(2)
    writer.add_tensor("token_embd.weight", tensors["model.embed_tokens.weight"].numpy())
    writer.add_tensor("output_norm.weight", tensors["model.norm.weight"].numpy())
    writer.add_tensor("output.weight", tensors["lm_head.weight"].numpy())
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name, value in tensors.items():
        value = value.numpy()
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.weight", name)
        if not m:
            continue
        i, module = int(m.group(1)), m.group(2)
        e = re.fullmatch(r"(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)", module)
        if e:
            experts.setdefault((i, _EXPERT[e.group(2)]), {})[int(e.group(1))] = value
        elif module in ("block_sparse_moe.gate", "mlp.gate"):
            writer.add_tensor(f"blk.{i}.ffn_gate_inp.weight", value)
        else:
            if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
                value = llama_cpp_permute(value, spec.num_heads if "q_proj" in module else spec.num_kv_heads)
            writer.add_tensor(f"blk.{i}.{_NAMES[module]}.weight", value)
    for (i, kind), per_expert in sorted(experts.items()):
        stacked = np.stack([per_expert[e] for e in range(spec.num_experts)])  # [E, out, in]
        writer.add_tensor(f"blk.{i}.ffn_{kind}_exps.weight", quantize(stacked, GGMLQuantizationType.Q8_0),
                          raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _q8_0_round_trip(model_dir) -> None:
    """The reference weights: experts as the file holds them (Q8_0), so only conversion errors show."""
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    for name, value in tensors.items():
        if ".experts." in name:
            q = quantize(value.numpy(), GGMLQuantizationType.Q8_0)
            tensors[name] = torch.from_numpy(dequantize(q, GGMLQuantizationType.Q8_0).reshape(value.shape).copy())
    from safetensors.torch import save_file
    save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.mark.parametrize("name", ["mixtral", "qwen3-moe", "olmoe"])
def test_moe_gguf_converts_to_what_transformers_computes(tmp_path, name):
    spec = dataclasses.replace(MOE_SPECS[name], vocab_size=len(TOKENS), mlp_only_layers=(), num_layers=2)
    ref_dir = build_random_model(spec, tmp_path / "ref")
    _q8_0_round_trip(ref_dir)
    write_moe_gguf(ref_dir, tmp_path / "moe.gguf", spec)
    convert_gguf(tmp_path / "moe.gguf", tmp_path / "out")
    converted, original = load_file(str(tmp_path / "out" / "model.safetensors")), load_file(
        str(ref_dir / "model.safetensors"))
    assert sorted(converted) == sorted(original)
    for key, value in original.items():
        torch.testing.assert_close(converted[key], value, rtol=0, atol=0, msg=key)
    model = load_model(tmp_path / "out", TorchAttentionBackend())
    assert model.config.architecture == spec.architecture and model.config.moe.top_k == spec.num_experts_per_tok
    hf = transformers.AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    ids = torch.randint(3, len(TOKENS), (20,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    assert_close_to_reference(run_chunks(model, ids, [12, 1, 7], [2, 0, 1], 8), ref)


def test_keep_refuses_experts_by_name(tmp_path):
    spec = dataclasses.replace(MOE_SPECS["olmoe"], vocab_size=len(TOKENS), num_layers=1)
    ref_dir = build_random_model(spec, tmp_path / "ref")
    write_moe_gguf(ref_dir, tmp_path / "moe.gguf", spec)
    with pytest.raises(ValueError, match="--weights keep does not take mixture-of-experts"):
        convert_gguf(tmp_path / "moe.gguf", tmp_path / "out", weights="keep")
