"""Model configuration read from a Hugging Face-style ``config.json``.

Only the Llama family is supported: Llama, Mistral and Qwen2 share one implementation
(GQA/MQA, RoPE with ``rope_theta`` and its scaling types (rope.py), RMSNorm, SwiGLU, tied or untied embeddings, q/k/v bias
for Qwen2). Anything else is refused with an error that names the architecture, rather
than loaded and run wrong.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from services.runtime.model.quant.config import QuantizationConfig
from services.runtime.model.rope import RopeScaling

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")

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
    """Mistral-style local attention window; the engine caps the context at it (see max_model_len)."""
    rope: RopeScaling | None = None
    """RoPE scaling (rope.py); None is plain RoPE at ``rope_theta``."""
    quantization: QuantizationConfig | None = None
    """Which weights the checkpoint stores quantized (``quantization_config``; quant/config.py)."""

    @property
    def max_model_len(self) -> int:
        """Longest context the engine serves exactly. A sliding window shorter than the
        position limit caps it, because the attention backends attend over the full context."""
        served = self.rope.served_positions(self.max_position_embeddings) if self.rope else self.max_position_embeddings
        if self.sliding_window is not None:
            return min(served, self.sliding_window)
        return served

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        archs = raw.get("architectures") or []
        if len(archs) != 1:
            raise ValueError(f"config.json 'architectures' must name exactly one architecture, got {archs!r}")
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r}; tokenmill serves {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        # transformers >= 5 writes RoPE settings under "rope_parameters"; older configs use
        # "rope_theta" plus an optional "rope_scaling" (rope.py implements each scaling type).
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope_theta = float(raw.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        max_positions = int(raw.get("max_position_embeddings", 2048))
        rope_scaling = RopeScaling.from_dict(rope, rope_theta, max_positions)
        if raw.get("mlp_bias") or raw.get("attention_out_bias"):
            raise ValueError("mlp_bias / attention_out_bias are not supported by the Llama implementation")
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {raw.get('hidden_act')!r} is not supported (only silu)")

        def need(key: str):
            if key not in raw:
                raise ValueError(f"config.json is missing required field {key!r}")
            return raw[key]

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        head_dim = int(raw.get("head_dim") or hidden // heads)
        if heads % kv_heads != 0:
            raise ValueError(
                f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
            )
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        sliding = raw.get("sliding_window")
        if arch == "Qwen2ForCausalLM" and not raw.get("use_sliding_window", False):
            sliding = None
        dtype_str = raw.get("torch_dtype") or raw.get("dtype") or "float32"
        return cls(
            architecture=arch,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rope_theta=rope_theta,
            rope=rope_scaling,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
            dtype=parse_dtype(str(dtype_str)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=int(sliding) if sliding else None,
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
