"""Mixture-of-experts GGUF files written from a random-weight model, as llama.cpp lays them out
(experts stacked per layer, in Q8_0 or K-quant blocks): what the GGUF converter's tests and the
fused step's tests of kept experts read."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from safetensors.torch import load_file

from services.tools.gguf import convert_gguf
from services.tools.random_model import build_random_model
from tests.helpers.kquants import TYPES, quantize_blocks
from tests.helpers.moe_specs import MOE_SPECS
from tests.tools.gguf_helpers import CONTROL_TOKENS, MERGES, TOKENS, llama_cpp_permute

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


def gguf_spec(name: str):
    """The family's parity spec in two layers, every one sparse (a GGUF file has no dense MoE layer), a
    shared expert a whole number of Q8_0 blocks wide."""
    spec = dataclasses.replace(MOE_SPECS[name], vocab_size=len(TOKENS), mlp_only_layers=(), num_layers=2)
    if spec.shared_expert_intermediate_size:
        spec = dataclasses.replace(spec, shared_expert_intermediate_size=96)
    return spec



def kept_moe_model(name: str, expert_types: tuple[str, str], root: Path) -> tuple[object, Path]:
    """The family's GGUF spec (256 wide for K-quants, whose blocks hold 256 values), its random model
    under root/ref, written to root/moe.gguf with ``expert_types`` and converted to root/keep with
    the experts kept in their blocks; (spec, the reference model's directory)."""
    spec = gguf_spec(name)
    if expert_types[0] != "q8_0":
        spec = dataclasses.replace(spec, hidden_size=256, intermediate_size=256, num_experts=8, num_experts_per_tok=2,
                                   moe_intermediate_size=256 if spec.moe_intermediate_size else 0,
                                   shared_expert_intermediate_size=256 if spec.shared_expert_intermediate_size else 0)
    ref_dir = build_random_model(spec, root / "ref")
    write_moe_gguf(ref_dir, root / "moe.gguf", spec, expert_types)
    convert_gguf(root / "moe.gguf", root / "keep", weights="keep")
    return spec, ref_dir
