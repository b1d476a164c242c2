"""The Llama family (Llama, Mistral, Qwen2; Mixtral and Qwen2-MoE with routed experts) as one forward
over a flattened varlen batch.

Every sequence in a step contributes any number of new tokens (a prompt, a prefill chunk,
one decode token, k+1 speculative tokens); the batch is flattened to T tokens and the
attention backend reads each sequence's context out of the paged KV cache.
Projections are fused (q|k|v and gate|up) so a layer runs four matmuls.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from services.common.kv_groups import kv_groups
from services.runtime.lora.batch import LoraBatch
from services.runtime.model.attention.base import AttentionBackend, AttentionMetadata
from services.runtime.model.config import ModelConfig
from services.runtime.model.layers import RotaryEmbedding
from services.runtime.model.linear import Linear, worth_prepacking
from services.runtime.model.moe import SparseMoe
from services.runtime.model.ops import TorchOps, get_model_ops
from services.runtime.model.quant.formats import QuantizedWeight, dequantize
from services.runtime.model.quant.linear import QuantLinear, build_linear, model_activations
from services.runtime.model.weights import load_checkpoint

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


class LlamaLayer(nn.Module):
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], prefix: str, index: int = 0):
        super().__init__()
        self.index = index
        self.window = config.window(index)
        """This layer's sliding window (keys per query), or None: full attention."""
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.eps = config.rms_norm_eps
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        w = lambda name: weights.pop(prefix + name)  # noqa: E731 - local shorthand
        # A weight is a tensor, or a QuantizedWeight when config.json says it is stored quantized.
        self.qkv = build_linear(
            [w("self_attn.q_proj.weight"), w("self_attn.k_proj.weight"), w("self_attn.v_proj.weight")],
            torch.cat([w("self_attn.q_proj.bias"), w("self_attn.k_proj.bias"), w("self_attn.v_proj.bias")])
            if config.attention_bias
            else None,
        )
        self.o_proj = build_linear([w("self_attn.o_proj.weight")])
        self.moe = SparseMoe(config, weights, prefix) if config.sparse(index) else None
        """The routed experts in place of the MLP (moe.py), or None: a dense layer."""
        if self.moe is None:
            self.gate_up = build_linear([w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")])
            self.down = build_linear([w("mlp.down_proj.weight")])
        self.input_norm = nn.Parameter(w("input_layernorm.weight"), requires_grad=False)
        self.post_norm = nn.Parameter(w("post_attention_layernorm.weight"), requires_grad=False)

    def forward(
        self,
        hidden: torch.Tensor,
        rope,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
        ops: TorchOps,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        # hidden: [T, D]; rope: this step's rotary tables (ops.rotary_tables)
        t = hidden.shape[0]
        x = ops.rms_norm(hidden, self.input_norm, self.eps)
        qkv = self.qkv(x)  # [T, q + 2kv]
        if lora is not None:
            lora.apply(self.index, "qkv", qkv, x)
        qk = self.norm_qk(qkv[:, : self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads,
                                                                     self.head_dim))
        q, k = ops.rotary(qk, self.num_heads, rope)  # [T, H, hd], [T, KH, hd]
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        backend.write_kv(k, v, k_cache, v_cache, meta)
        attn = backend.attend(q, k_cache, v_cache, meta, self.head_dim**-0.5, self.window)  # [T, H, hd]
        attn = attn.reshape(t, self.q_size)
        attn_out = self.o_proj(attn)
        if lora is not None:
            lora.apply(self.index, "o_proj", attn_out, attn)
        x, hidden = ops.add_rms_norm(attn_out, hidden, self.post_norm, self.eps)  # hidden += attn_out
        if self.moe is not None:
            return hidden + self.moe(x)
        gate_up = self.gate_up(x)  # [T, 2F]
        if lora is None:
            return hidden + self.down(ops.silu_and_mul(gate_up))
        lora.apply(self.index, "gate_up", gate_up, x)
        act = ops.silu_and_mul(gate_up)
        down = self.down(act)
        lora.apply(self.index, "down", down, act)
        return hidden + down

    def norm_qk(self, qk: torch.Tensor) -> torch.Tensor:
        """qk: [T, H + KH, hd], before RoPE. Llama has no q/k norm (Qwen3 does: qwen3.py)."""
        return qk


class LlamaForCausalLM(nn.Module):
    layer_class = LlamaLayer

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        backend: AttentionBackend,
        device: torch.device,
        prepack_cpu_weights: bool = True,
        quant_activations: str = "none",
    ):
        super().__init__()
        self.config = config
        self.backend = backend
        self.ops = get_model_ops(backend.name)
        weights = dict(weights)
        embed = weights.pop("model.embed_tokens.weight")
        # A quantized embedding is dequantized for the lookup; a tied head multiplies by its quantized numbers.
        embed_q = embed if isinstance(embed, QuantizedWeight) else None
        if embed_q is not None:
            embed = dequantize(embed_q, weights["model.norm.weight"].dtype)
        self.embed = nn.Parameter(embed, requires_grad=False)
        self.layers = nn.ModuleList(self.layer_class(config, weights, f"model.layers.{i}.", i)
                                    for i in range(config.num_layers))
        groups = kv_groups(config.layer_windows, config.num_layers)
        self.kv_group_of = [groups.place(i)[0] for i in range(config.num_layers)] if groups.num_groups > 1 else None
        """Each layer's KV group where there are several (its metadata: ``meta.for_group``)."""
        self.final_norm = nn.Parameter(weights.pop("model.norm.weight"), requires_grad=False)
        lm_head = weights.pop("lm_head.weight", None)
        # Tied: the same Parameter object, so moving the model moves one matrix.
        if config.tie_word_embeddings:
            lm_head = embed_q if embed_q is not None else self.embed
        self.lm_head = build_linear([lm_head])
        assert not weights, f"unused weights: {sorted(weights)[:5]}"
        self.to(device)
        if device.type == "cpu" and prepack_cpu_weights:
            # Only where it pays: oneDNN's per-call cost outweighs a small fp32 product (linear.py).
            for module in self.modules():
                if isinstance(module, Linear) and worth_prepacking(module.weight):
                    module.prepack()
        quantized = [m for m in self.modules() if isinstance(m, (QuantLinear, SparseMoe))]
        activations = model_activations(quant_activations if device.type == "cpu" else "none", quantized)
        for module in quantized:
            module.prepare(activations)  # after the move: each device packs its own way (quant/linear.py, moe.py)
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta, device,
                                      config.rope)

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        backend: AttentionBackend,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        config: ModelConfig | None = None,
        prepack_cpu_weights: bool = True,
        quant_activations: str = "none",
    ) -> "LlamaForCausalLM":
        """``quant_activations``: how quantized linears on a CPU take their input, ``none``
        (exact) or ``int8`` (quant/linear.py)."""
        config = config or ModelConfig.from_model_dir(model_dir)
        dtype = dtype or config.dtype
        weights = load_checkpoint(model_dir, config, dtype)
        return cls(config, weights, backend, torch.device(device), prepack_cpu_weights, quant_activations)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: KVCaches,
        meta: AttentionMetadata,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, D] (normed). ``lora``: each row's
        adapter (services/runtime/lora/), None when no row has one."""
        return self.forward_with(input_ids, positions, kv_caches, meta, self.backend, lora)

    def forward_with(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: KVCaches, meta,
                     backend: AttentionBackend, lora: LoraBatch | None = None) -> torch.Tensor:
        """The forward through a given attention backend, which alone reads ``meta``: the compiled
        decode step (compiled_decode.py) passes an attention over tensors only."""
        hidden = F.embedding(input_ids, self.embed)
        rope = self.ops.rotary_tables(positions, self.rotary, hidden.dtype)
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            layer_meta = meta if self.kv_group_of is None else meta.for_group(self.kv_group_of[i])
            hidden = layer(hidden, rope, kv_cache, layer_meta, backend, self.ops, lora)
        return self.ops.rms_norm(hidden, self.final_norm, self.config.rms_norm_eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, D] -> logits [N, V] in fp32 (sampling and logprobs want full precision)."""
        return self.lm_head(hidden).float()
