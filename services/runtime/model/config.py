"""Model configuration read from a Hugging Face-style ``config.json``.

Llama, Mistral and Qwen2 share one implementation (llama.py: GQA/MQA, RoPE with ``rope_theta``
and its scaling types (rope.py), RMSNorm, SwiGLU, tied or untied embeddings, q/k/v bias for
Qwen2); Qwen3 adds per-head q/k norms (qwen3.py); Phi-3 stores q|k|v and gate|up fused (phi3.py);
Gemma 3 is its own file (gemma3.py) and Gemma 2 its variant without q/k norms, with tanh soft-capping
of attention scores and logits (gemma2.py). The mixture-of-experts families (Mixtral, Qwen2-MoE,
Qwen3-MoE, OLMoE) are those layers with the MLP replaced by a routed set of experts (moe.py). Anything
else is refused with an error that names the architecture, rather than loaded and run wrong.

A layer's sliding window (Mistral, Gemma 3's local layers, Qwen2 with ``use_sliding_window``)
is a per-layer attention parameter that every attention backend honours, so it does not cap
the context.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from services.runtime.model.moe_config import MoeConfig
from services.runtime.model.quant.config import QuantizationConfig
from services.runtime.model.rope import RopeScaling

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM",
                           "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM")
FAMILIES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "llama",
            "Qwen3ForCausalLM": "qwen3", "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3",
            "Phi3ForCausalLM": "phi3", "MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe",
            "Qwen3MoeForCausalLM": "qwen3_moe", "OlmoeForCausalLM": "olmoe"}
"""Which model file runs each architecture."""
QWEN_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"dtype must be one of fp32, bf16, fp16; got {name!r}") from None


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype]


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    """q/k/v projections carry a bias (always for Qwen2)."""
    dtype: torch.dtype
    """The checkpoint's dtype from the config (a flag may override it at load time)."""
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None
    """The local attention window of the layers that have one (``layer_windows``)."""
    rope: RopeScaling | None = None
    """RoPE scaling (rope.py); None is plain RoPE at ``rope_theta``."""
    layer_windows: tuple[int | None, ...] = ()
    """Per layer: its sliding window in keys (the query's own and the ``window - 1`` before it),
    or None for full attention; empty when no layer has one."""
    rope_local: RopeScaling | None = None
    """Gemma 3: the RoPE of its sliding-window layers (their own base, no scaling)."""
    qk_norm: bool = False
    """Per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3)."""
    hidden_act: str = "silu"
    """The MLP's gate activation: silu (SwiGLU) or gelu_pytorch_tanh (GeGLU, Gemma)."""
    query_pre_attn_scalar: float | None = None
    """Gemma: attention scores are scaled by this ** -0.5 instead of head_dim ** -0.5."""
    attn_logit_softcapping: float | None = None
    """Gemma 2: attention scores become ``c * tanh(s / c)`` before the mask and softmax."""
    final_logit_softcapping: float | None = None
    """Gemma 2: logits become ``c * tanh(logits / c)``."""
    quantization: QuantizationConfig | None = None
    """Which weights the checkpoint stores quantized (``quantization_config``; quant/config.py)."""
    moe: MoeConfig | None = None
    """Mixture of experts: the routed MLP's shape and rule (None: a dense model)."""
    qk_norm_per_head: bool = True
    """With ``qk_norm``: each head normalized over head_dim (Qwen3), or the whole q and k
    projections over their full width (OLMoE)."""

    @property
    def family(self) -> str:
        return FAMILIES[self.architecture]

    def sparse(self, layer: int) -> bool:
        """Whether ``layer``'s MLP is the routed experts (else a dense MLP of ``intermediate_size``)."""
        return self.moe is not None and layer in self.moe.sparse_layers

    @property
    def max_model_len(self) -> int:
        """Longest context the engine serves: the position limit (stretched by ``dynamic`` RoPE).
        A sliding window does not cap it: the backends attend within each layer's window."""
        return self.rope.served_positions(self.max_position_embeddings) if self.rope else self.max_position_embeddings

    def window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        arch = _architecture(raw)
        gemma = arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
        max_positions = int(raw.get("max_position_embeddings", 2048))
        rope_theta, rope_scaling, rope_local = _rope(raw, arch, max_positions)
        hidden_act = _checked_activation(raw, arch, gemma)
        softcaps = _softcaps(raw, arch)
        hidden = int(_need(raw, "hidden_size"))
        heads = int(_need(raw, "num_attention_heads"))
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        head_dim = int(raw.get("head_dim") or hidden // heads)
        if heads % kv_heads != 0:
            raise ValueError(
                f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
            )
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        num_layers = int(_need(raw, "num_hidden_layers"))
        sliding = raw.get("sliding_window")
        if arch in QWEN_ARCHITECTURES and not raw.get("use_sliding_window", False):
            sliding = None
        layer_windows = _layer_windows(raw, arch, num_layers, int(sliding) if sliding else None)
        dtype_str = raw.get("torch_dtype") or raw.get("dtype") or "float32"
        return cls(
            architecture=arch,
            vocab_size=int(_need(raw, "vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(_need(raw, "intermediate_size")),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rope_theta=rope_theta,
            rope=rope_scaling,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", gemma)),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False))
            or (arch == "Qwen2MoeForCausalLM" and bool(raw.get("qkv_bias", True))),
            layer_windows=layer_windows,
            rope_local=rope_local,
            qk_norm=arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM"),
            qk_norm_per_head=arch != "OlmoeForCausalLM",
            moe=MoeConfig.from_dict(raw, arch, num_layers),
            hidden_act=hidden_act,
            query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar") or head_dim) if gemma else None,
            dtype=parse_dtype(str(dtype_str)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=int(sliding) if sliding else None,
            **softcaps,
            quantization=QuantizationConfig.from_dict(raw["quantization_config"])
            if raw.get("quantization_config") else None,
        )

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"model directory {model_dir} has no config.json")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not valid JSON: {exc}") from None
        return cls.from_dict(raw)


def _layer_windows(raw: dict, arch: str, num_layers: int, window: int | None) -> tuple[int | None, ...]:
    """Each layer's window: ``layer_types`` where the config lists them (transformers >= 4.53),
    else each architecture's own rule."""
    if window is None:
        return ()
    types = raw.get("layer_types")
    if types is not None:
        if len(types) != num_layers:
            raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers")
        unknown = set(types) - {"sliding_attention", "full_attention"}
        if unknown:
            raise ValueError(f"layer_types {sorted(unknown)} are not supported")
        return tuple(window if kind == "sliding_attention" else None for kind in types)
    if arch == "Gemma2ForCausalLM":  # local and global layers alternate, local first
        return tuple(window if i % 2 == 0 else None for i in range(num_layers))
    if arch == "Gemma3ForCausalLM":  # every sliding_window_pattern-th layer is global
        pattern = int(raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6)
        return tuple(None if (i + 1) % pattern == 0 else window for i in range(num_layers))
    if arch in QWEN_ARCHITECTURES:  # the layers from max_window_layers on
        first = int(raw.get("max_window_layers", num_layers))
        return tuple(window if i >= first else None for i in range(num_layers))
    return (window,) * num_layers


def _need(raw: dict, key: str):
    if key not in raw:
        raise ValueError(f"config.json is missing required field {key!r}")
    return raw[key]


def _architecture(raw: dict) -> str:
    archs = raw.get("architectures") or []
    if len(archs) != 1:
        raise ValueError(f"config.json 'architectures' must name exactly one architecture, got {archs!r}")
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {arch!r}; tokenmill serves {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def _rope(raw: dict, arch: str, max_positions: int) -> tuple[float, RopeScaling, RopeScaling | None]:
    """(rope_theta, the global layers' RoPE, Gemma 3's local layers' RoPE or None)."""
    # transformers >= 5 writes RoPE settings under "rope_parameters" (per layer type for
    # Gemma 3); older configs use "rope_theta" plus an optional "rope_scaling" (and Gemma 3's
    # "rope_local_base_freq"). rope.py implements each scaling type.
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    local_rope: dict | None = None
    if "full_attention" in rope or "sliding_attention" in rope:
        local_rope = dict(rope.get("sliding_attention") or {})
        rope = dict(rope.get("full_attention") or {})
    rope_theta = float(raw.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    if raw.get("original_max_position_embeddings") and "original_max_position_embeddings" not in rope:
        rope["original_max_position_embeddings"] = raw["original_max_position_embeddings"]  # Phi-3 keeps it here
    if raw.get("partial_rotary_factor") is not None:
        rope.setdefault("partial_rotary_factor", raw["partial_rotary_factor"])
    rope_scaling = RopeScaling.from_dict(rope, rope_theta, max_positions)
    rope_local = None
    if arch == "Gemma3ForCausalLM":
        local_rope = local_rope or {}
        local_theta = float(raw.get("rope_local_base_freq") or local_rope.get("rope_theta") or 10000.0)
        rope_local = RopeScaling.from_dict(local_rope, local_theta, max_positions)
    return rope_theta, rope_scaling, rope_local


def _checked_activation(raw: dict, arch: str, gemma: bool) -> str:
    """The MLP's activation, once the biases and clipping the runtime has no code for are refused."""
    if raw.get("mlp_bias") or raw.get("attention_out_bias"):
        raise ValueError("mlp_bias / attention_out_bias are not supported")
    if arch in ("Qwen3MoeForCausalLM", "OlmoeForCausalLM") and raw.get("attention_bias"):
        raise ValueError(f"attention_bias (which {arch} puts on o_proj too) is not supported")
    if raw.get("clip_qkv") is not None:
        raise ValueError(f"clip_qkv {raw['clip_qkv']!r} is not supported (only null)")
    hidden_act = raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
    if hidden_act != ("gelu_pytorch_tanh" if gemma else "silu"):
        raise ValueError(f"hidden_act {hidden_act!r} is not supported for {arch} "
                         f"(only {'gelu_pytorch_tanh' if gemma else 'silu'})")
    return hidden_act


def _softcaps(raw: dict, arch: str) -> dict[str, float]:
    """Gemma 2's attention and final logit soft-caps, as ModelConfig's fields."""
    if arch != "Gemma2ForCausalLM":
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if raw.get(key) is not None:
                raise ValueError(f"{key} is supported for Gemma2ForCausalLM only, not {arch}")
    softcaps = {}
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if raw.get(key) is not None:
            softcaps[key] = float(raw[key])
            if not softcaps[key] > 0:
                raise ValueError(f"{key} must be > 0 (or null for none), got {raw[key]!r}")
    return softcaps
