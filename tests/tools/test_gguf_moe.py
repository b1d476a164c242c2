"""Mixture-of-experts GGUF files (llama.cpp's Mixtral under arch ``llama``, ``qwen3moe``, ``olmoe``,
``qwen2moe``): the router and stacked experts (``ffn_gate_inp``, ``ffn_{gate,up,down}_exps``) convert to
transformers' per-expert tensors, Qwen2-MoE's shared expert (``ffn_*_shexp``, its gate a vector) and
q/k/v biases to transformers' names, and the converted model computes what transformers computes on
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
from tests.helpers.kquants import TYPES, quantize_blocks
from tests.helpers.moe_specs import MOE_SPECS
from tests.helpers.paged_forward import assert_close_to_reference, run_chunks
from tests.tools.gguf_helpers import CONTROL_TOKENS, MERGES, TOKENS, llama_cpp_permute

transformers = pytest.importorskip("transformers")

_ARCH = {"MixtralForCausalLM": "llama", "Qwen3MoeForCausalLM": "qwen3moe", "OlmoeForCausalLM": "olmoe",
         "Qwen2MoeForCausalLM": "qwen2moe"}
_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
_SHARED = {"mlp.shared_expert.gate_proj": "gate", "mlp.shared_expert.up_proj": "up",
           "mlp.shared_expert.down_proj": "down"}
_EXPERT = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


def _expert_blocks(stacked: np.ndarray, fmt: str) -> tuple[np.ndarray, GGMLQuantizationType]:
    """[E, out, in] float -> the GGUF blocks [E, out, row bytes] of ``fmt`` and its type."""
    if fmt == "q8_0":
        return quantize(stacked, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0
    e, n, k = stacked.shape
    return quantize_blocks(stacked.reshape(e * n, k), fmt).reshape(e, n, -1), TYPES[fmt]


def write_moe_gguf(model_dir, path, spec, expert_types: tuple[str, str] = ("q8_0", "q8_0")) -> None:
    """The model directory's tensors in llama.cpp's layout: experts stacked per layer, gate and up in
    ``expert_types[0]``, down in ``expert_types[1]`` (Q8_0; Q4_K_M files: Q4_K and Q6_K); a shared expert
    likewise, its gate a vector as llama.cpp reads it."""
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
    if arch in ("qwen3moe", "qwen2moe"):
        writer.add_expert_feed_forward_length(spec.expert_size)
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(spec.shared_expert_intermediate_size)
    writer.add_vocab_size(spec.vocab_size)  # the embedding's rows (TOKENS or more)
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
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", name)
        if not m:
            continue
        i, module = int(m.group(1)), m.group(2)
        if m.group(3) == "bias":
            writer.add_tensor(f"blk.{i}.{_NAMES[module]}.bias", value)
            continue
        if module in _SHARED:
            blocks, qtype = _expert_blocks(value[None], expert_types[_SHARED[module] == "down"])
            writer.add_tensor(f"blk.{i}.ffn_{_SHARED[module]}_shexp.weight", blocks[0], raw_dtype=qtype)
            continue
        if module == "mlp.shared_expert_gate":
            writer.add_tensor(f"blk.{i}.ffn_gate_inp_shexp.weight", value.reshape(-1))
            continue
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
        blocks, qtype = _expert_blocks(stacked, expert_types[kind == "down"])
        writer.add_tensor(f"blk.{i}.ffn_{kind}_exps.weight", blocks, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _q8_0_round_trip(model_dir) -> None:
    """The reference weights: experts (and a shared expert) as the file holds them (Q8_0), so only
    conversion errors show."""
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    for name, value in tensors.items():
        if ".experts." in name or ".shared_expert." in name:
            q = quantize(value.numpy(), GGMLQuantizationType.Q8_0)
            tensors[name] = torch.from_numpy(dequantize(q, GGMLQuantizationType.Q8_0).reshape(value.shape).copy())
    from safetensors.torch import save_file
    save_file(tensors, str(path), metadata={"format": "pt"})


def _gguf_spec(name: str):
    """The family's parity spec in two layers, every one sparse (a GGUF file has no dense MoE layer), a
    shared expert a whole number of Q8_0 blocks wide."""
    spec = dataclasses.replace(MOE_SPECS[name], vocab_size=len(TOKENS), mlp_only_layers=(), num_layers=2)
    if spec.shared_expert_intermediate_size:
        spec = dataclasses.replace(spec, shared_expert_intermediate_size=96)
    return spec


@pytest.mark.parametrize("name", ["mixtral", "qwen3-moe", "olmoe", "qwen2-moe"])
def test_moe_gguf_converts_to_what_transformers_computes(tmp_path, name):
    spec = _gguf_spec(name)
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


@pytest.mark.parametrize("name,types", [("mixtral", ("q8_0", "q8_0")), ("olmoe", ("q4_k", "q6_k")),
                                        ("qwen2-moe", ("q4_k", "q6_k"))])
def test_keep_runs_experts_in_their_gguf_type(tmp_path, name, types):
    """``--weights keep`` of a MoE file: each expert's blocks stored as they are and multiplied in their type
    by the grouped CPU kernel, within int8 activations' rounding of the dequantized (fp32) conversion."""
    from services.runtime.kernels import cpu

    if not cpu.available():
        pytest.skip("the C++ CPU kernels cannot be built here")
    spec = _gguf_spec(name)
    if types[0] != "q8_0":  # K-quant blocks hold 256 values: hidden, expert and shared expert sizes of 256
        spec = dataclasses.replace(spec, hidden_size=256, intermediate_size=256, num_experts=8, num_experts_per_tok=2,
                                   moe_intermediate_size=256 if spec.moe_intermediate_size else 0,
                                   shared_expert_intermediate_size=256 if spec.shared_expert_intermediate_size else 0)
    ref_dir = build_random_model(spec, tmp_path / "ref")
    write_moe_gguf(ref_dir, tmp_path / "moe.gguf", spec, types)
    convert_gguf(tmp_path / "moe.gguf", tmp_path / "keep", weights="keep")
    convert_gguf(tmp_path / "moe.gguf", tmp_path / "fp32")
    kept = load_file(str(tmp_path / "keep" / "model.safetensors"))
    gate = next(k for k in kept if re.search(r"layers\.1\..*experts\.7\.(w1|gate_proj)\.qweight", k))
    assert kept[gate].dtype in (torch.uint8, torch.int8) and not any(".experts." in k and k.endswith(".weight")
                                                                      for k in kept)
    if spec.shared_expert_intermediate_size:  # the shared expert kept too, its sigmoid gate in fp32
        assert kept["model.layers.1.mlp.shared_expert.down_proj.qweight"].dtype == torch.uint8
        assert kept["model.layers.1.mlp.shared_expert_gate.weight"].shape == (1, spec.hidden_size)
    model = load_model(tmp_path / "keep", TorchAttentionBackend(), quant_activations="auto")
    assert [layer.moe.path for layer in model.layers] == ["cpu_int8"] * 2
    assert model.layers[0].moe.formats == types
    dense = load_model(tmp_path / "fp32", TorchAttentionBackend())
    ids = torch.randint(3, len(TOKENS), (20,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours, ref = run_chunks(model, ids, [12, 1, 7], [2, 0, 1], 8), run_chunks(dense, ids, [12, 1, 7], [2, 0, 1], 8)
    # int8 activations (per 32 values) ahead of every expert product: 1-3.4% of the logits' norm on these
    # random weights (two layers, flat logits), the top token the same at 19-20 of 20 positions.
    assert (ours - ref).norm() <= 0.05 * ref.norm()
    assert (ours.argmax(-1) == ref.argmax(-1)).sum() >= 18
    # none: the kept experts dequantized at load, the fp32 conversion's numbers.
    exact = load_model(tmp_path / "keep", TorchAttentionBackend(), quant_activations="none")
    assert exact.layers[0].moe.path == "dequantized"
    with torch.no_grad():
        assert_close_to_reference(run_chunks(exact, ids, [12, 1, 7], [2, 0, 1], 8), ref)


def _meta(arch: str, **extra) -> dict:
    return {"general.architecture": arch, f"{arch}.embedding_length": 64, f"{arch}.attention.head_count": 4,
            f"{arch}.block_count": 1, f"{arch}.feed_forward_length": 96, f"{arch}.context_length": 128,
            f"{arch}.attention.layer_norm_rms_epsilon": 1e-5, f"{arch}.vocab_size": 32, f"{arch}.expert_count": 4,
            f"{arch}.expert_used_count": 2, f"{arch}.expert_feed_forward_length": 32, **extra}


def test_shared_experts_and_biases_are_placed_or_refused_by_name():
    from services.tools.gguf import hf_tensor_name, llama_config

    shared = {"blk.0.ffn_gate_inp_shexp.weight", "blk.0.ffn_gate_shexp.weight", "blk.0.attn_q.bias"}
    with pytest.raises(ValueError, match="shared experts .*Qwen3-MoE has no place for"):
        llama_config(_meta("qwen3moe"), shared, torch.float32)
    with pytest.raises(ValueError, match="no 'qwen2moe.expert_shared_feed_forward_length'"):
        llama_config(_meta("qwen2moe"), shared, torch.float32)
    config = llama_config(_meta("qwen2moe", **{"qwen2moe.expert_shared_feed_forward_length": 48}), shared,
                          torch.float32)
    assert (config["architectures"], config["shared_expert_intermediate_size"], config["qkv_bias"],
            config["norm_topk_prob"]) == (["Qwen2MoeForCausalLM"], 48, True, False)
    assert llama_config(_meta("qwen2moe"), set(), torch.float32)["shared_expert_intermediate_size"] == 0
    assert hf_tensor_name("blk.3.attn_k.bias", "qwen2moe") == "model.layers.3.self_attn.k_proj.bias"
    assert hf_tensor_name("blk.3.ffn_gate_inp_shexp.weight", "qwen2moe") == "model.layers.3.mlp.shared_expert_gate.weight"
    for name, arch in (("blk.3.attn_k.bias", "llama"), ("blk.3.attn_output.bias", "qwen2moe")):
        with pytest.raises(ValueError, match="has no place in the"):
            hf_tensor_name(name, arch)
