"""A small model's decode step in one C++ call on the CPU (``--cpu-decode auto``, the default).

A decode step of a model like stories260K is dispatch-bound: ~170 torch operations of
~4-5 us each, against nanoseconds of arithmetic. ``LlamaDecoder``
(services/runtime/kernels/cpu/fused_decode.cpp) holds the weights (transposed once) and the
KV pools and runs the whole forward of a decode-only step as loops, calling the paged
attention kernel directly. Its ``logits`` runs the LM head the same way (where the head is a
plain fp32 matrix), so a row's logits never depend on its batch; sampling stays in Python as
for every step.

It takes a model only where that is the right trade (``why_not``): fp32 weights none of which
are prepacked for oneDNN, or quantized weights (QuantLinear's CPU kernels, exact or with int8
activations). A float model big enough to have prepacked matrices (fp32 from 2^18 elements,
see linear.py) spends its step in the products, where oneDNN's and MKL's kernels beat a plain
loop, so it keeps the eager path. A quantized model runs the same kernels either way, so the
fused step only takes away the per-layer Python: SmolLM2's 30 layers of ~10 dispatched
operations each.

Steps with several new tokens for a sequence (prompts, chunks, mixed and speculative steps) run
fused too while they are small (``max_step_tokens``, the executor's ``--cpu-fused-max-tokens``):
each new token becomes a row of its own, with its sequence's block table and a context ending
at its own position. That is causal attention exactly, because the decoder writes every row's
K/V of a layer into the pool before any row of that layer attends, and the eager backends also
attend over the pool (so a quantized pool's in-step tokens are read back quantized both ways).
A short prompt then costs what a decode step of its length does, instead of the ~170 dispatched
torch operations of the eager forward (about 2 ms for stories260K, whatever the prompt). Each
row reads its context again, so the attention grows with the square of the step's tokens, and
a bigger model's per-token products cost more here than in MKL's batched kernels: past the
limit the step runs eagerly.

Gemma 3 (gemma3.py) and sliding-window layers run here too: the decoder is told the layer's
differences once (``set_gemma``: q/k norms, post-norms, GeGLU, embedding and attention scales,
the local layers' RoPE tables; ``set_layout``: each layer's window and KV group), and a step
hands it every KV group's slots and block tables stacked. K-quant weights (``cpu_kquant``) and
q|k|v of several formats (StackedLinear) are projections like the others. Soft-capped models
(Gemma 2) keep the eager step. Qwen3's per-head and OLMoE's whole-projection q/k norms are
``set_qk_norms``.

Mixture-of-experts layers (moe.py: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) run here too
(``set_moe``): the router, each family's softmax / top-k / renormalisation, the experts grouped
by expert (each expert with tokens multiplies all its rows at once, through the products its
eager kernel uses: its packed GGUF tiles with int8 activations, or its fp32 matrices) and
Qwen2-MoE's sigmoid-gated shared expert. The step adds its tokens per expert to the layer's load
counter in place, as the eager layer does. Experts split over tensor-parallel ranks keep the
eager step.

Results equal the eager forward's to ~1e-6 (the same fp32 rounding points, sums in another
order), as the tests check against it over plain and quantized pools.

Steps whose rows carry LoRA adapters (services/runtime/lora/) run here too: the decoder holds
the model's adapter stacks (``ModelLoras``, read in place, so loading an adapter into a slot
needs nothing new here) and, after each q|k|v, o, gate|up and down product, adds the update of
each row's adapter with the batched kernel the eager layer calls (lora.cpp), its rows grouped by
slot once per step. Rows of the base model add nothing.

Under tensor parallelism (services/runtime/parallel/) every rank builds one over its shard and
hands it the group's shared-memory all-reduce (``reducer``), which the C++ step calls after
each layer's o and down products, where the eager model's forward hooks sum; a failed
all-reduce raises after the call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from services.runtime.kernels import cpu as cpu_kernels
from services.runtime.kernels.kquant_act import KQUANT_FORMAT_CODES
from services.runtime.kernels.kv_quant import ScaledCache
from services.runtime.model.attention.base import AttentionMetadata
from services.runtime.model.attention.cpu_backend import CpuAttentionBackend
from services.runtime.model.gemma2 import Gemma2ForCausalLM
from services.runtime.model.gemma3 import Gemma3ForCausalLM
from services.runtime.model.linear import Linear
from services.runtime.model.llama import KVCaches, LlamaForCausalLM
from services.runtime.model.moe import SparseMoe
from services.runtime.model.olmoe import OlmoeForCausalLM
from services.runtime.model.qwen3 import Qwen3ForCausalLM, Qwen3Layer
from services.runtime.model.moe_config import ROUTER_ORDERS
from services.runtime.model.quant.formats import bits
from services.runtime.model.quant.linear import INT8_FORMAT_CODES, QuantLinear, StackedLinear

if TYPE_CHECKING:
    from services.runtime.lora.batch import LoraBatch
    from services.runtime.lora.stacks import LoraStacks
    from services.runtime.parallel.shared_memory import SharedMemoryReducer

_QUANT_PATHS = ("cpu_int8", "cpu_kernel", "cpu_kquant")
"""QuantLinear paths the fused step runs (quant/linear.py): the same C++ kernels, called directly."""

QUANTIZED_STEP_FACTOR = 8
"""A quantized model's steps run fused up to this many times ``max_step_tokens`` (512 at the
default 64). The limit is set by fp32 models, whose plain-loop products lose to MKL's past it;
a quantized model's products are the same kernels fused or eager, and only its attention grows
faster fused (each row reads its context again). SmolLM2 Q4_1, int8 activations, one thread:
fused / eager 0.63 at a 64-token prompt, 0.75 at 128, 1.08 at 256, 0.98 at 512, 0.75 for 32
prompts of 10 and 0.92 for 16 of 64 (docs/benchmarks.md). It also keeps many short prompts on
the path one takes alone: with int8 activations a last-bit difference between the two paths can
round an activation to the neighbouring code, so 32 copies of a prompt gave another greedy
answer than one (from its 5th token) while their 320-token step ran eagerly."""


def why_not(model: LlamaForCausalLM, kv_caches: KVCaches) -> str | None:
    """None when the fused step can run ``model`` over ``kv_caches``, else the reason it cannot."""
    if type(model) not in (LlamaForCausalLM, Gemma3ForCausalLM, Gemma2ForCausalLM, Qwen3ForCausalLM,
                           OlmoeForCausalLM):
        return (f"the model is {type(model).__name__}; the fused step runs the Llama, Qwen3, OLMoE and Gemma 2 "
                f"and 3 layers")
    if not isinstance(model.backend, CpuAttentionBackend):
        return f"the attention backend is {model.backend.name!r}, not the cpu backend"
    if model.embed.dtype != torch.float32 or model.embed.device.type != "cpu":
        return f"the model runs in {model.embed.dtype} on {model.embed.device}; the fused step is fp32 on a CPU"
    for layer in model.layers:
        moe: SparseMoe | None = getattr(layer, "moe", None)
        if getattr(layer, "span_norm", None) is not None:
            return "the layer's q/k norms span the tensor-parallel ranks"
        if moe is not None and (reason := _why_not_experts(moe, layer)) is not None:
            return reason
        mlp = ("shared_gate_up", "shared_down") if moe is not None else ("gate_up", "down")
        for name in ("qkv", "o_proj", *mlp):
            linear = getattr(moe if name.startswith("shared") else layer, name)
            if linear is None:
                continue
            if (reason := _why_not_linear(name, linear)) is not None:
                return reason
            if name != "qkv" and linear.bias is not None:
                return "biases outside q|k|v"
    k_cache = kv_caches[0][0]
    if not isinstance(k_cache, ScaledCache) and k_cache.dtype != torch.float32:
        return f"the KV pool is {k_cache.dtype}, not fp32 or quantized"
    return None


def _why_not_linear(name: str, linear) -> str | None:
    if isinstance(linear, StackedLinear) and all(isinstance(p, QuantLinear) and p.bias is None for p in linear.parts):
        paths = {p.path for p in linear.parts}
        if not paths <= set(_QUANT_PATHS):
            return f"{name} stacks quantized linears on the {sorted(paths)} paths, not CPU kernels'"
    elif isinstance(linear, QuantLinear):
        if linear.path not in _QUANT_PATHS:
            return f"{name} is a quantized linear on the {linear.path!r} path, not a CPU kernel's"
    elif not isinstance(linear, Linear):
        return f"{name} is {type(linear).__name__}"
    elif linear.packed is not None:
        return f"{name} is prepacked for oneDNN: the model is large enough for its products to dominate"
    return None


def _why_not_experts(moe: SparseMoe, layer) -> str | None:
    if moe.expert_parallel is not None or layer.o_proj._forward_hooks:  # the hooks sum a tensor-parallel shard's
        return "the sparse layers run under tensor parallelism"
    if moe.path not in ("dense", "dequantized", "cpu_int8"):
        return f"the layer's experts are on the {moe.path!r} path"
    if moe.path != "cpu_int8" and moe.w_gate_up.dtype != torch.float32:
        return f"the layer's experts are {moe.w_gate_up.dtype}, not fp32"
    return None


class FusedDecode:
    """``model``'s forward (decode steps, and steps of up to ``max_step_tokens`` new tokens) and
    LM head through ``LlamaDecoder``."""

    def __init__(self, model: LlamaForCausalLM, kv_caches: KVCaches, max_step_tokens: int = 0,
                 reducer: SharedMemoryReducer | None = None):
        reason = why_not(model, kv_caches)
        if reason is not None:
            raise ValueError(f"the fused CPU decode step cannot run this model: {reason}")
        cpu_kernels.load()
        self.backend: CpuAttentionBackend = model.backend
        norms: list[torch.Tensor] = []
        projections = []
        gemma = isinstance(model, Gemma3ForCausalLM)
        experts = {i: expert_projections(layer.moe) for i, layer in enumerate(model.layers)
                   if getattr(layer, "moe", None) is not None}
        for i, layer in enumerate(model.layers):
            norms += [layer.input_norm.detach(), (layer.pre_mlp_norm if gemma else layer.post_norm).detach()]
            mlp = experts[i][1][::len(experts[i][1]) // 2] if i in experts else [
                projection(layer.gate_up), projection(layer.down)]  # a sparse layer's: set_moe's below
            projections += [projection(layer.qkv), projection(layer.o_proj), *mlp]
        quantized = isinstance(kv_caches[0][0], ScaledCache)
        lm_head = model.lm_head
        self.computes_logits = lm_head.bias is None and (
            (isinstance(lm_head, Linear) and lm_head.packed is None and lm_head.weight.dtype == torch.float32)
            or (isinstance(lm_head, QuantLinear) and lm_head.path in _QUANT_PATHS))
        """Whether ``logits`` runs here (a plain fp32 or a CPU-kernel quantized LM head); else the model's own."""
        if self.computes_logits:
            projections.append(projection(lm_head))
        self._decoder = torch.classes.tokenmill_cpu.LlamaDecoder(
            model.embed.detach(), norms, projections, model.final_norm.detach(),
            model.rotary.cos_full, model.rotary.sin_signed, model.config.num_heads, model.config.num_kv_heads,
            model.config.head_dim, float(model.config.rms_norm_eps),
            [k.data if quantized else k for k, _ in kv_caches], [v.data if quantized else v for _, v in kv_caches],
            [k.scale for k, _ in kv_caches] if quantized else [], [v.scale for _, v in kv_caches] if quantized else [],
            torch.get_num_threads(),
        )
        windows = [layer.window or 0 for layer in model.layers]
        self._groups = model.kv_group_of
        """Each layer's KV group, or None for one: the step hands the decoder every group's tables."""
        if self._groups is not None or any(windows):
            self._decoder.set_layout(windows, self._groups or [0] * len(windows))
        if gemma:
            self._set_gemma_layers(model)
        self._set_qwen3_layers(model, experts, reducer)
        self._reducer = reducer
        """A tensor-parallel rank's all-reduce, which the C++ step sums its o and down outputs over."""
        if reducer is not None:
            self._decoder.set_all_reduce(reducer.handle)
        self._k_cache = kv_caches[0][0]
        self.quantized = any(isinstance(m, QuantLinear) for m in model.layers.modules())
        self.max_step_tokens = max_step_tokens * (QUANTIZED_STEP_FACTOR if self.quantized else 1)
        """Steps with several new tokens for a sequence run fused up to this many tokens (0: never)."""
        self._lora_stacks: LoraStacks | None = None
        """The adapter stacks handed to the decoder (the registry makes one set, at its first adapter)."""

    def _set_gemma_layers(self, model: Gemma3ForCausalLM) -> None:
        """Hands the decoder Gemma's norms, local RoPE tables and scales, and Gemma 2's soft caps."""
        gemma_norms = []
        empty = torch.empty(0)
        for layer in model.layers:
            qk = layer.qk_norm
            gemma_norms += [layer.post_attn_norm.detach(), layer.post_mlp_norm.detach(),
                            qk[0].detach() if qk is not None else empty,
                            qk[model.config.num_heads].detach() if qk is not None else empty]
        local = model.rotary_local
        self._decoder.set_gemma(gemma_norms, local.cos_full, local.sin_signed, float(model.embed_scale),
                                float(model.layers[0].scale))
        caps = (model.config.attn_logit_softcapping, model.config.final_logit_softcapping)
        if any(cap is not None for cap in caps):  # Gemma 2
            self._decoder.set_softcap(*(float(cap or 0.0) for cap in caps))

    def _set_qwen3_layers(self, model: LlamaForCausalLM, experts: dict, reducer) -> None:
        """Hands the decoder the q/k norms of Qwen3's and OLMoE's layers and the sparse layers'
        routers and experts (``experts``: layer index -> ``expert_projections``)."""
        if experts and reducer is not None:
            raise ValueError("the fused CPU decode step cannot run this model: its experts are sharded")
        if isinstance(model.layers[0], Qwen3Layer):  # OLMoE's norms span all heads, Qwen3's one head
            self._decoder.set_qk_norms([n.detach() for layer in model.layers for n in (layer.q_norm, layer.k_norm)],
                                       isinstance(model, OlmoeForCausalLM))
        for i, (router, per_expert, shared) in experts.items():
            moe = model.layers[i].moe
            self._decoder.set_moe(i, router, per_expert, shared, moe.top_k, moe.renormalize,
                                  ROUTER_ORDERS.index(moe.router_order), moe.load)

    @property
    def isa(self) -> str:
        """The instruction set its quantized products run (cpu_isa.h)."""
        return cpu_kernels.isa()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, D] -> fp32 logits [N, V], each row's independent of the others in the
        batch (the BLAS product the eager LM head uses is not: one or two rows take another
        kernel than more, which moved logprobs in their last digits between batch sizes)."""
        return self._decoder.logits(hidden)

    def takes(self, meta: AttentionMetadata) -> bool:
        """Whether this step runs fused: one new token per sequence, or few enough in all."""
        return meta.is_decode_only or meta.slot_mapping.shape[0] <= self.max_step_tokens

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: KVCaches,
                 meta: AttentionMetadata, lora: LoraBatch | None = None) -> torch.Tensor:
        """input_ids, positions: [B] -> final hidden states [B, D], as ``model(..., lora)`` computes them."""
        if kv_caches[0][0] is not self._k_cache:
            raise ValueError("the fused decode step runs over the KV pools it was built with")
        # Raw pointer reads and writes follow: the tables and slots are checked against the pool
        # first, in one C++ pass each (the kernel's own checks are a second line).
        metas = meta.groups if self._groups is not None else (meta,)
        for group in metas:
            self.backend.check_step(group, self._k_cache)
        tables = [group.block_tables for group in metas]
        context_lens = meta.context_lens
        if not meta.is_decode_only:
            # One row per new token: its sequence's table, its context up to its own position.
            # Each row's context lies within its sequence's, which check_step just checked.
            query_lens = torch.tensor(meta.query_lens_cpu, device=context_lens.device)
            tables = [table.repeat_interleave(query_lens, dim=0) for table in tables]
            context_lens = (positions + 1).to(torch.int32)
        if len(metas) == 1:
            block_tables, slot_mapping = tables[0], meta.slot_mapping
        else:  # every KV group's rows stacked, group 0's first, tables padded to one width
            width = max(table.shape[1] for table in tables)
            block_tables = torch.cat([torch.nn.functional.pad(table, (0, width - table.shape[1])) for table in tables])
            slot_mapping = torch.cat([group.slot_mapping for group in metas])
        if lora is None:
            hidden = self._decoder.forward(input_ids, positions, slot_mapping, block_tables, context_lens)
        else:
            if lora.stacks is not self._lora_stacks:
                self._decoder.set_lora(model_loras(lora.stacks))
                self._lora_stacks = lora.stacks
            hidden = self._decoder.forward_lora(input_ids, positions, slot_mapping, block_tables, context_lens,
                                                lora.row_slots)
        if self._reducer is not None:
            self._reducer.check()  # an all-reduce that failed inside ended the step early
        return hidden


def projection(linear: Linear | QuantLinear | StackedLinear):
    """The decoder's handle on one of the model's projections: the weight it multiplies by, as
    the eager linear holds it (a plain fp32 matrix, a quantized one on a CPU kernel's path, or
    quantized ones of several formats side by side)."""
    bias = linear.bias.detach() if linear.bias is not None else torch.empty(0)
    cls = torch.classes.tokenmill_cpu.Projection
    if isinstance(linear, StackedLinear):
        return cls.stacked([projection(part) for part in linear.parts], bias)
    if isinstance(linear, Linear):
        return cls.plain(linear.weight.detach(), bias)
    w = linear.quantized
    if linear.path == "cpu_int8":
        return cls.int8(linear.packed, INT8_FORMAT_CODES[w.fmt], linear.out_features, linear.in_features, bias)
    if linear.path == "cpu_kquant":
        return cls.kquant(linear.packed, KQUANT_FORMAT_CODES[w.fmt], linear.out_features, linear.in_features, bias)
    scales, zeros, group = linear.cpu_operands()
    return cls.exact(w.qweight, scales, zeros, bits(w.fmt), group, bias)


def expert_projections(moe: SparseMoe):
    """A sparse layer's router, its experts' projections (every gate|up, then every down) and its
    shared expert's (gate|up, down, gate; or none), as ``set_moe`` takes them."""
    cls = torch.classes.tokenmill_cpu.Projection
    empty = torch.empty(0)
    e_range = range(moe.num_experts)
    if moe.path == "cpu_int8":
        hidden, inter = moe.router.shape[1], moe.inter

        def packed(w: torch.Tensor, fmt: str, out: int, in_: int):
            if fmt in INT8_FORMAT_CODES:
                return cls.int8(w, INT8_FORMAT_CODES[fmt], out, in_, empty)
            return cls.kquant(w, KQUANT_FORMAT_CODES[fmt], out, in_, empty)

        experts = ([packed(moe.w13[e], moe.formats[0], 2 * inter, hidden) for e in e_range]
                   + [packed(moe.w2[e], moe.formats[1], hidden, inter) for e in e_range])
    else:
        experts = ([cls.plain(moe.w_gate_up[e].detach(), empty) for e in e_range]
                   + [cls.plain(moe.w_down[e].detach(), empty) for e in e_range])
    shared = []
    if moe.shared_gate_up is not None:
        shared = [projection(moe.shared_gate_up), projection(moe.shared_down), cls.plain(moe.shared_gate.detach(), empty)]
    return cls.plain(moe.router.detach(), empty), experts, shared


LORA_KINDS = ("qkv", "o_proj", "gate_up", "down")
"""The decoder's adapted products per layer, in ModelLoras's order (lora.h)."""


def model_loras(stacks: LoraStacks):
    """The decoder's handle on every layer's adapter stacks (the tensors themselves, not copies)."""
    lora_a, lora_b = [], []
    for layer in stacks.layers:
        for kind in LORA_KINDS:
            lora_a.append(layer[kind].lora_a)
            lora_b.append(layer[kind].lora_b)
    first = stacks.layers[0]
    splits = [list(first[kind].out_splits or (first[kind].lora_b.shape[1],)) for kind in LORA_KINDS]
    return torch.classes.tokenmill_cpu.ModelLoras(lora_a, lora_b, stacks.scales, [len(s) for s in splits],
                                                  [w for s in splits for w in s])
