"""Helpers for the GGUF conversion tests: a tiny synthetic Llama GGUF, llama.cpp's q/k permutation
as its converter defines it, and the engine's logits for a prompt."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from tokenizers import pre_tokenizers

from tests.helpers.kquants import TYPES as KQUANT_NAMES
from tests.helpers.kquants import quantize_blocks

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CONTROL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BYTE_ALPHABET = sorted(pre_tokenizers.ByteLevel.alphabet())
MERGES = ["Ġ t", "h e", "Ġt he", "1 2"]  # "12" exists, so a digit split is visible in the ids
TOKENS = CONTROL_TOKENS + BYTE_ALPHABET + ["Ġt", "he", "Ġthe", "12"]
TINY = dict(hidden=64, heads=4, kv_heads=2, ffn=96, layers=2, context=128)


def llama_cpp_permute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py ``permute``: HF rows [head, half, i] -> GGUF rows [head, i, half]."""
    return weight.reshape(n_heads, 2, weight.shape[0] // n_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def write_tiny_llama_gguf(path: Path, *, untied: bool = False, arch: str = "llama", tokenizer_model: str = "gpt2",
                          pre: str = "smollm", extra_tensor: str | None = None, seed: int = 0,
                          dims: dict[str, int] | None = None,
                          qtypes: dict[str, GGMLQuantizationType] | None = None, rope_base: float = 100000.0,
                          rope_freqs: np.ndarray | None = None, sliding_window: int | None = None,
                          longrope: tuple[np.ndarray, np.ndarray, int] | None = None,
                          softcaps: tuple[float, float] | None = None,
                          sentencepiece: tuple[list[str], list[float], list[int]] | None = None) -> dict[str, np.ndarray]:
    """A 2-layer Llama as llama.cpp's converter writes it (Q4_1 linears, Q8_0 embedding, F32 norms,
    q/k rows permuted); returns the HF-layout float32 weights it was quantized from.

    ``dims`` overrides TINY's sizes; ``qtypes`` the type of tensors by GGUF name without the
    layer and ``.weight`` (``attn_q``, ``ffn_down``, ``token_embd``, ``output``), K-quants
    included (tests/helpers/kquants.py writes their blocks).

    ``arch="phi3"`` writes llama.cpp's Phi-3 layout: ``attn_qkv`` (q|k|v) and ``ffn_up`` (gate|up)
    fused, the HF names ``qkv_proj`` / ``gate_up_proj``; ``longrope`` (long factors, short
    factors, original context) adds ``rope_factors_long/short`` and the rope.scaling keys.

    ``arch="gemma2"`` writes llama.cpp's Gemma 2 layout: pre- and post-norms around attention and
    the MLP, every norm stored as ``1 + w``; ``softcaps`` (attention, final) their metadata.

    ``sentencepiece`` (pieces, scores, token types) writes that vocabulary instead, as llama.cpp's
    converter writes a Llama 2 one: model "llama", no merges, no pre-tokenizer, no add_bos key."""
    sizes = TINY | (dims or {})
    d, h, kvh, f = sizes["hidden"], sizes["heads"], sizes["kv_heads"], sizes["ffn"]
    head_dim = d // h
    rng = np.random.default_rng(seed)

    def rand(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    writer = GGUFWriter(str(path), arch)
    writer.add_context_length(sizes["context"])
    writer.add_embedding_length(d)
    writer.add_block_count(sizes["layers"])
    writer.add_feed_forward_length(f)
    writer.add_head_count(h)
    writer.add_head_count_kv(kvh)
    writer.add_rope_freq_base(rope_base)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(head_dim)
    if sliding_window is not None:
        writer.add_sliding_window(sliding_window)
    if arch == "gemma2":  # llama.cpp's Gemma 2 conversion writes the head sizes
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if softcaps is not None:
        writer.add_attn_logit_softcapping(softcaps[0])
        writer.add_final_logit_softcapping(softcaps[1])
    if longrope is not None:
        original = longrope[2]
        writer.add_rope_scaling_orig_ctx_len(original)
        # as llama.cpp's converter computes it (transformers' default for longrope)
        writer.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(sizes["context"] / original) / np.log(original))))
    tokens = TOKENS if sentencepiece is None else sentencepiece[0]
    writer.add_vocab_size(len(tokens))
    if sentencepiece is None:
        writer.add_tokenizer_model(tokenizer_model)
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(TOKENS)
        writer.add_token_types([3] * len(CONTROL_TOKENS) + [1] * (len(TOKENS) - len(CONTROL_TOKENS)))
        writer.add_token_merges(MERGES)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
        writer.add_pad_token_id(2)
        writer.add_add_bos_token(False)
        writer.add_chat_template(CHATML)
    else:
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores(sentencepiece[1])
        writer.add_token_types(sentencepiece[2])

    hf: dict[str, np.ndarray] = {}

    def add(gguf_name: str, hf_name: str, values: np.ndarray, qtype: GGMLQuantizationType,
            permute_heads: int | None = None) -> None:
        hf[hf_name] = values
        # llama.cpp permutes q/k rows for its Llama architecture only
        stored = values if permute_heads is None or arch != "llama" else llama_cpp_permute(values, permute_heads)
        short = gguf_name.split(".")[-2]
        qtype = (qtypes or {}).get(short, qtype)
        if qtype == GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, stored)
        elif qtype.name.lower() in KQUANT_NAMES:
            writer.add_tensor(gguf_name, quantize_blocks(stored, qtype.name.lower()), raw_dtype=qtype)
        elif qtype == GGMLQuantizationType.Q2_K:  # a type nothing here quantizes to: zero blocks of its size
            block, size = GGML_QUANT_SIZES[qtype]
            writer.add_tensor(gguf_name, np.zeros((stored.shape[0], stored.shape[1] // block * size), np.uint8),
                              raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, quantize(stored, qtype), raw_dtype=qtype)

    q41, q80, f32 = GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0, GGMLQuantizationType.F32
    add("token_embd.weight", "model.embed_tokens.weight", rand(len(tokens), d), q80)
    for i in range(sizes["layers"]):
        p = f"model.layers.{i}."
        if arch == "phi3":
            add(f"blk.{i}.attn_norm.weight", p + "input_layernorm.weight", 1 + rand(d), f32)
            add(f"blk.{i}.attn_qkv.weight", p + "self_attn.qkv_proj.weight", rand((h + 2 * kvh) * head_dim, d), q41)
            add(f"blk.{i}.attn_output.weight", p + "self_attn.o_proj.weight", rand(d, h * head_dim), q41)
            add(f"blk.{i}.ffn_norm.weight", p + "post_attention_layernorm.weight", 1 + rand(d), f32)
            add(f"blk.{i}.ffn_up.weight", p + "mlp.gate_up_proj.weight", rand(2 * f, d), q41)
            add(f"blk.{i}.ffn_down.weight", p + "mlp.down_proj.weight", rand(d, f), q41)
            continue
        if arch == "gemma2":  # llama.cpp stores Gemma's norm weights w as 1 + w
            def norm(gguf_name: str, hf_name: str) -> None:
                w = rand(d)
                writer.add_tensor(gguf_name, 1 + w)
                hf[p + hf_name] = w
            norm(f"blk.{i}.attn_norm.weight", "input_layernorm.weight")
            add(f"blk.{i}.attn_q.weight", p + "self_attn.q_proj.weight", rand(h * head_dim, d), q41)
            add(f"blk.{i}.attn_k.weight", p + "self_attn.k_proj.weight", rand(kvh * head_dim, d), q41)
            add(f"blk.{i}.attn_v.weight", p + "self_attn.v_proj.weight", rand(kvh * head_dim, d), q41)
            add(f"blk.{i}.attn_output.weight", p + "self_attn.o_proj.weight", rand(d, h * head_dim), q41)
            norm(f"blk.{i}.post_attention_norm.weight", "post_attention_layernorm.weight")
            norm(f"blk.{i}.ffn_norm.weight", "pre_feedforward_layernorm.weight")
            add(f"blk.{i}.ffn_gate.weight", p + "mlp.gate_proj.weight", rand(f, d), q41)
            add(f"blk.{i}.ffn_up.weight", p + "mlp.up_proj.weight", rand(f, d), q41)
            add(f"blk.{i}.ffn_down.weight", p + "mlp.down_proj.weight", rand(d, f), q41)
            norm(f"blk.{i}.post_ffw_norm.weight", "post_feedforward_layernorm.weight")
            continue
        add(f"blk.{i}.attn_norm.weight", p + "input_layernorm.weight", 1 + rand(d), f32)
        add(f"blk.{i}.attn_q.weight", p + "self_attn.q_proj.weight", rand(h * head_dim, d), q41, h)
        add(f"blk.{i}.attn_k.weight", p + "self_attn.k_proj.weight", rand(kvh * head_dim, d), q41, kvh)
        add(f"blk.{i}.attn_v.weight", p + "self_attn.v_proj.weight", rand(kvh * head_dim, d), q41)
        add(f"blk.{i}.attn_output.weight", p + "self_attn.o_proj.weight", rand(d, h * head_dim), q41)
        add(f"blk.{i}.ffn_norm.weight", p + "post_attention_layernorm.weight", 1 + rand(d), f32)
        if arch == "qwen3":
            add(f"blk.{i}.attn_q_norm.weight", p + "self_attn.q_norm.weight", 1 + rand(head_dim), f32)
            add(f"blk.{i}.attn_k_norm.weight", p + "self_attn.k_norm.weight", 1 + rand(head_dim), f32)
        add(f"blk.{i}.ffn_gate.weight", p + "mlp.gate_proj.weight", rand(f, d), q41)
        add(f"blk.{i}.ffn_up.weight", p + "mlp.up_proj.weight", rand(f, d), q41)
        add(f"blk.{i}.ffn_down.weight", p + "mlp.down_proj.weight", rand(d, f), q41)
    if arch == "gemma2":
        w = rand(d)
        writer.add_tensor("output_norm.weight", 1 + w)
        hf["model.norm.weight"] = w
    else:
        add("output_norm.weight", "model.norm.weight", 1 + rand(d), f32)
    if untied:
        add("output.weight", "lm_head.weight", rand(len(tokens), d), q80)
    if longrope is not None:
        writer.add_tensor("rope_factors_long.weight", np.asarray(longrope[0], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.asarray(longrope[1], dtype=np.float32))
    if rope_freqs is not None:  # Llama 3.1+: llama.cpp's llama3 RoPE divisors, F32
        writer.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    if extra_tensor is not None:
        writer.add_tensor(extra_tensor, rand(d))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


def load_engine_model(model_dir: Path):
    """The engine's model (fp32, torch attention backend) from a model directory."""
    from services.runtime.model.attention.torch_backend import TorchAttentionBackend
    from services.runtime.model.llama import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(model_dir, TorchAttentionBackend())


def engine_logits(model, ids: list[int]) -> torch.Tensor:
    """The engine model's fp32 logits at every position of ``ids`` (one prefill through a paged cache)."""
    from services.runtime.kv_cache import KVCache
    from services.runtime.model.attention.base import AttentionMetadata

    if isinstance(model, Path):
        model = load_engine_model(model)
    block_size, n = 16, len(ids)
    num_blocks = (n + block_size - 1) // block_size
    kv = KVCache.allocate(model.config, num_blocks, block_size, torch.float32, torch.device("cpu"))
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n), block_tables=torch.arange(num_blocks, dtype=torch.int32)[None],
        context_lens=torch.tensor([n], dtype=torch.int32), query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        query_lens_cpu=[n], context_lens_cpu=[n], max_query_len=n, max_context_len=n, block_size=block_size,
    )
    with torch.no_grad():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(n), kv.layers, meta))  # [n, V]


def assert_close_to_reference(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """fp32 logits within 1e-4 of the reference's logit scale."""
    scale = ref.abs().max().item()
    err = (ours - ref).abs().max().item()
    assert err <= 1e-4 * scale, f"max abs error {err:.3e} exceeds 1e-4 x logit scale {scale:.3f}"
