"""Gemma 3 (text): interleaved sliding-window and global layers, each kind with its own RoPE.

Where it differs from Llama (llama.py):
  - RMSNorm scales by ``1 + w`` (computed in fp32), around attention and around the MLP
    (pre- and post-norms; the residual adds the post-normed output),
  - q and k are RMS-normed per head before RoPE; scores are scaled by query_pre_attn_scalar^-0.5,
  - local layers attend within ``sliding_window`` keys and rotate with ``rope_local`` (base 1e4),
    global layers attend over the whole context and rotate with ``rope`` (base 1e6, maybe scaled),
  - the MLP is GeGLU with tanh-approximated GELU,
  - embeddings are multiplied by sqrt(hidden_size); the LM head is the unscaled (tied) embedding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.runtime.model.attention.base import AttentionBackend, AttentionMetadata
from services.runtime.model.config import ModelConfig
from services.runtime.model.layers import RotaryEmbedding, rms_norm
from services.runtime.model.llama import KVCaches, LlamaForCausalLM
from services.runtime.model.ops import TorchOps
from services.runtime.model.quant.linear import build_linear


def gemma_norm_weight(weight: torch.Tensor) -> nn.Parameter:
    """Gemma's ``1 + w``, formed once in fp32 as transformers forms it on every call."""
    return nn.Parameter(1.0 + weight.float(), requires_grad=False)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight in fp32, rounded once to x's dtype (Gemma3RMSNorm)."""
    if x.dtype == torch.float32:
        return rms_norm(x, weight, eps)
    return (F.rms_norm(x.float(), weight.shape, eps=eps) * weight).to(x.dtype)


class Gemma3Layer(nn.Module):
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], prefix: str, index: int = 0):
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.eps = config.rms_norm_eps
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.query_pre_attn_scalar ** -0.5
        self.window = config.window(index)
        """This layer's sliding window, or None for a global layer (it also picks the RoPE)."""
        w = lambda name: weights.pop(prefix + name)  # noqa: E731 - local shorthand
        self.qkv = build_linear([w("self_attn.q_proj.weight"), w("self_attn.k_proj.weight"),
                                 w("self_attn.v_proj.weight")])
        self.o_proj = build_linear([w("self_attn.o_proj.weight")])
        self.gate_up = build_linear([w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")])
        self.down = build_linear([w("mlp.down_proj.weight")])
        self.softcap = config.attn_logit_softcapping
        """Gemma 2's cap on attention scores (None: uncapped)."""
        self.qk_norm = None
        """q's and k's ``1 + w`` as one [H + KH, hd] weight: one norm call for both (per head)."""
        if config.qk_norm:
            q_norm = gemma_norm_weight(w("self_attn.q_norm.weight"))
            k_norm = gemma_norm_weight(w("self_attn.k_norm.weight"))
            self.qk_norm = nn.Parameter(torch.cat([q_norm.expand(self.num_heads, -1),
                                                   k_norm.expand(self.num_kv_heads, -1)]), requires_grad=False)
        self.input_norm = gemma_norm_weight(w("input_layernorm.weight"))
        self.post_attn_norm = gemma_norm_weight(w("post_attention_layernorm.weight"))
        self.pre_mlp_norm = gemma_norm_weight(w("pre_feedforward_layernorm.weight"))
        self.post_mlp_norm = gemma_norm_weight(w("post_feedforward_layernorm.weight"))

    def forward(self, hidden: torch.Tensor, rope, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, backend: AttentionBackend, ops: TorchOps) -> torch.Tensor:
        # hidden: [T, D]; rope: this layer kind's rotary tables for the step
        t, h = hidden.shape[0], self.num_heads
        x = gemma_rms_norm(hidden, self.input_norm, self.eps)
        qkv = self.qkv(x)  # [T, q + 2kv]
        qk = qkv[:, : self.q_size + self.kv_size].view(t, h + self.num_kv_heads, self.head_dim)
        if self.qk_norm is not None:
            # normalized per head, then scaled: bitwise what the fused op with [hd] weights computes
            qk = (F.rms_norm(qk.float(), (self.head_dim,), eps=self.eps) * self.qk_norm).to(qk.dtype)
        q, k = ops.rotary(qk, h, rope)  # [T, H, hd], [T, KH, hd]
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        backend.write_kv(k, v, k_cache, v_cache, meta)
        if self.softcap is None:
            attn = backend.attend(q, k_cache, v_cache, meta, self.scale, self.window)  # [T, H, hd]
        else:
            attn = backend.attend(q, k_cache, v_cache, meta, self.scale, self.window, softcap=self.softcap)
        hidden = hidden + gemma_rms_norm(self.o_proj(attn.reshape(t, self.q_size)), self.post_attn_norm, self.eps)
        x = gemma_rms_norm(hidden, self.pre_mlp_norm, self.eps)
        gate, up = self.gate_up(x).chunk(2, dim=-1)  # [T, F] each
        mlp = self.down(F.gelu(gate, approximate="tanh") * up)
        return hidden + gemma_rms_norm(mlp, self.post_mlp_norm, self.eps)


class Gemma3ForCausalLM(LlamaForCausalLM):
    layer_class = Gemma3Layer

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], backend: AttentionBackend,
                 device: torch.device, prepack_cpu_weights: bool = True, quant_activations: str = "none"):
        super().__init__(config, weights, backend, device, prepack_cpu_weights, quant_activations)
        self.final_norm = gemma_norm_weight(self.final_norm.detach()).to(device)
        # transformers multiplies by sqrt(hidden) rounded to the weights' dtype
        self.embed_scale = torch.tensor(config.hidden_size**0.5).to(self.embed.dtype).item()
        # Gemma 2 rotates every layer alike (no rope_local)
        self.rotary_local = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                            config.rope_local.theta, device, config.rope_local) \
            if config.rope_local is not None else self.rotary

    def forward_with(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: KVCaches, meta,
                     backend: AttentionBackend, lora=None) -> torch.Tensor:
        assert lora is None, "LoRA adapters are refused for Gemma at load (lora/adapter.py LORA_FAMILIES)"
        hidden = F.embedding(input_ids, self.embed) * self.embed_scale
        rope_global = self.ops.rotary_tables(positions, self.rotary, hidden.dtype)
        rope_local = rope_global if self.rotary_local is self.rotary else \
            self.ops.rotary_tables(positions, self.rotary_local, hidden.dtype)
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            layer_meta = meta if self.kv_group_of is None else meta.for_group(self.kv_group_of[i])
            hidden = layer(hidden, rope_local if layer.window else rope_global, kv_cache, layer_meta, backend,
                           self.ops)
        return gemma_rms_norm(hidden, self.final_norm, self.config.rms_norm_eps)
