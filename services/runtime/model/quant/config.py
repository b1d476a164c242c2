"""``quantization_config`` in config.json: which weights a checkpoint stores quantized, and how.

    "quantization_config": {
      "quant_method": "tokenmill",
      "format": "q4_1",             # q4_0 | q4_1 | q8_0 | int8 (formats.py) | q4_k | q5_k | q6_k | q5_0 | q5_1
      "group_size": 32,             # values per scale along the input axis (not used by int8)
      "modules": {                  # exceptions to "format", by module name (the weight without ".weight")
        "model.embed_tokens": "q8_0",
        "model.layers.0.mlp.down_proj": "none"
      }
    }

``format`` applies to every linear projection of the decoder layers (q, k, v, o, gate, up,
down) and to an untied ``lm_head``. The embedding is stored in float unless ``modules`` gives
it a format; a quantized embedding is dequantized at load for the lookup, and a tied LM head
then multiplies by the quantized numbers (as llama.cpp does with a Q8_0 ``token_embd``).
``"none"`` keeps a module in float (e.g. a projection whose input size is not a multiple of
the group size). Any other ``quant_method`` is refused rather than loaded wrong.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.runtime.model.quant.formats import FORMATS, GGUF_GROUP_SIZE

QUANT_METHOD = "tokenmill"
NONE = "none"
LINEAR_NAMES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
EMBEDDING = "model.embed_tokens"
LM_HEAD = "lm_head"


@dataclass(frozen=True, slots=True)
class QuantizationConfig:
    format: str
    """Format of every linear projection (and an untied LM head) not named in ``modules``."""
    group_size: int = GGUF_GROUP_SIZE
    """Values per scale along the input axis for q4_0, q4_1 and q8_0."""
    modules: dict[str, str] = field(default_factory=dict)
    """Per-module exceptions: module name -> format, or "none" for float."""

    def __post_init__(self) -> None:
        for name, fmt in {"format": self.format, **self.modules}.items():
            if fmt not in FORMATS and not (fmt == NONE and name != "format"):
                raise ValueError(f"quantization_config {name!r}: format must be one of {', '.join(FORMATS)}"
                                 f"{' or none' if name != 'format' else ''}; got {fmt!r}")
        if self.group_size <= 0:
            raise ValueError(f"quantization_config group_size must be positive; got {self.group_size}")

    def format_of(self, module: str) -> str | None:
        """The module's format, or None when it is stored in float."""
        default = None if module == EMBEDDING else self.format
        fmt = self.modules.get(module, default)
        return None if fmt == NONE else fmt

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "QuantizationConfig":
        method = raw.get("quant_method")
        if method != QUANT_METHOD:
            raise ValueError(f"quantization_config quant_method {method!r} is not supported; tokenmill loads "
                             f"{QUANT_METHOD!r} checkpoints (written by `tokenmill quantize` or "
                             "`tokenmill convert gguf --weights keep`)")
        if "format" not in raw:
            raise ValueError("quantization_config is missing required field 'format'")
        return cls(str(raw["format"]), int(raw.get("group_size", GGUF_GROUP_SIZE)),
                   {str(k): str(v) for k, v in (raw.get("modules") or {}).items()})

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"quant_method": QUANT_METHOD, "format": self.format, "group_size": self.group_size}
        if self.modules:
            out["modules"] = dict(sorted(self.modules.items()))
        return out
