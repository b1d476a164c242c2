"""RoPE scaling: the inverse frequencies of each ``rope_type``, computed once per model.

The formulas are Hugging Face's (modeling_rope_utils), so a scaled model rotates exactly as
transformers does:
  default   inv_freq_i = theta^(-2i/D)
  linear    inv_freq / factor                       (position interpolation)
  llama3    low frequencies / factor, high ones kept, a smooth ramp between (Llama 3.1+)
  yarn      a per-frequency blend of interpolation and extrapolation, with cos/sin scaled
            by an attention factor (Qwen2.5 long context, DeepSeek)
  dynamic   NTK-aware base growth with the context length
  longrope  per-frequency factors, short ones inside the original context, long ones past it (Phi-3)

Two of them depend on the sequence length in transformers, which recomputes the frequencies
whenever a forward sees a longer sequence (so its own cached keys were rotated with other
frequencies than its new ones). Here each position has one rotation for the model's life, so a
cached key never goes stale: positions inside ``original_max_position_embeddings`` use what
transformers uses for a sequence that short (plain frequencies for ``dynamic``, the short
factors for ``longrope``), and later positions use transformers' rule for a sequence as long as
the model serves (``dynamic`` at the full length, the long factors for ``longrope``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """One RoPE configuration: the base and, for a scaled type, its parameters."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()

    @classmethod
    def from_dict(cls, raw: dict, theta: float, max_positions: int) -> "RopeScaling":
        """``raw``: a config's ``rope_scaling`` / ``rope_parameters`` (may be empty)."""
        rope_type = raw.get("rope_type", raw.get("type", "default")) or "default"
        if rope_type == "su":  # the name early Phi-3 configs used for longrope
            rope_type = "longrope"
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"rope scaling type {rope_type!r} is not supported; tokenmill implements "
                             f"{', '.join(ROPE_TYPES)}")
        if float(raw.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError(f"partial_rotary_factor {raw['partial_rotary_factor']} is not supported (only 1.0)")
        original = raw.get("original_max_position_embeddings")
        if rope_type in ("llama3", "yarn", "longrope") and original is None:
            if rope_type == "yarn":
                raise ValueError("rope scaling 'yarn' needs original_max_position_embeddings")
            original = max_positions
        factor = raw.get("factor")
        if factor is None:
            if rope_type in ("linear", "llama3", "dynamic"):
                raise ValueError(f"rope scaling {rope_type!r} needs a factor")
            factor = max_positions / original if original else 1.0
        if rope_type == "longrope" and not (raw.get("short_factor") and raw.get("long_factor")):
            raise ValueError("rope scaling 'longrope' needs short_factor and long_factor")
        return cls(
            theta=float(theta), rope_type=rope_type, factor=float(factor),
            original_max_position_embeddings=int(original) if original else None,
            low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
            high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
            beta_fast=float(raw.get("beta_fast") or 32.0), beta_slow=float(raw.get("beta_slow") or 1.0),
            attention_factor=None if raw.get("attention_factor") is None else float(raw["attention_factor"]),
            mscale=raw.get("mscale"), mscale_all_dim=raw.get("mscale_all_dim"),
            truncate=bool(raw.get("truncate", True)),
            short_factor=tuple(float(x) for x in raw.get("short_factor") or ()),
            long_factor=tuple(float(x) for x in raw.get("long_factor") or ()),
        )

    def served_positions(self, max_positions: int) -> int:
        """Positions the model serves: ``dynamic`` scaling stretches the config's limit by its factor."""
        return int(max_positions * self.factor) if self.rope_type == "dynamic" else max_positions

    def frequencies(self, head_dim: int, max_positions: int) -> tuple[torch.Tensor, torch.Tensor | None, int, float]:
        """(inv_freq [D/2], inv_freq past the original context or None, where that starts, cos/sin scale)."""
        dim = head_dim
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim  # [D/2]
        plain = 1.0 / (self.theta ** exponents)
        kind = self.rope_type
        if kind == "default":
            return plain, None, 0, 1.0
        if kind == "linear":
            return plain / self.factor, None, 0, 1.0
        if kind == "llama3":
            old = self.original_max_position_embeddings
            low_wavelen, high_wavelen = old / self.low_freq_factor, old / self.high_freq_factor
            wavelen = 2 * math.pi / plain
            scaled = torch.where(wavelen > low_wavelen, plain / self.factor, plain)
            smooth = (old / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
            return torch.where(medium, smoothed, scaled), None, 0, 1.0
        if kind == "yarn":
            return self._yarn(dim)
        if kind == "dynamic":
            served = self.served_positions(max_positions)
            base = self.theta * ((self.factor * served / max_positions) - (self.factor - 1)) ** (dim / (dim - 2))
            return plain, 1.0 / (base ** exponents), max_positions, 1.0
        # longrope
        original = self.original_max_position_embeddings
        if len(self.short_factor) != dim // 2 or len(self.long_factor) != dim // 2:
            raise ValueError(f"longrope short_factor / long_factor must have {dim // 2} entries (head_dim / 2), got "
                             f"{len(self.short_factor)} / {len(self.long_factor)}")
        scale = 1.0 if self.factor <= 1.0 else math.sqrt(1 + math.log(self.factor) / math.log(original))
        if self.attention_factor is not None:
            scale = self.attention_factor
        base = self.theta ** exponents
        short = 1.0 / (torch.tensor(self.short_factor, dtype=torch.float32) * base)
        long = 1.0 / (torch.tensor(self.long_factor, dtype=torch.float32) * base)
        return short, long, original, scale

    def _yarn(self, dim: int) -> tuple[torch.Tensor, None, int, float]:
        def get_mscale(scale: float, mscale: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

        factor = self.factor
        attention = self.attention_factor
        if attention is None:
            if self.mscale and self.mscale_all_dim:
                attention = float(get_mscale(factor, self.mscale) / get_mscale(factor, self.mscale_all_dim))
            else:
                attention = get_mscale(factor)

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi))) \
                / (2 * math.log(self.theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # a zero-width ramp would divide by zero
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        pos_freqs = self.theta ** (torch.arange(0, dim, 2).float() / dim)
        extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
        keep = 1 - ramp  # share of extrapolation per frequency
        return interpolation * (1 - keep) + extrapolation * keep, None, 0, attention
