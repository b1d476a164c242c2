"""Drafter service configuration: flags and TOKENMILL_DRAFTER_* environment variables.

This module stays torch-free: an n-gram drafter never loads torch, and ``--help`` is quick.
The draft model's settings are a dataclass of their own (``DraftModelSettings``), validated
here without loading anything; services/drafter/draft_model.py loads what they describe.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.service_config import service_process_fields
from services.drafter.ngram import MAX_SPECULATIVE_TOKENS, NgramProposer
from services.drafter.proposer import DraftMethod, Proposer

DEFAULT_PORT = 50054

_NGRAM_DEFAULTS = NgramProposer()

DEFAULT_DRAFT_KV_CACHE_BYTES = 256 * 1024**2
"""The draft model's KV pool on a CPU: 256 MiB holds about 57K tokens of SmolLM2-135M's first
four layers in fp32, or 8K tokens of all 30."""


@dataclass(frozen=True, slots=True)
class DraftModelSettings:
    """What the draft-model proposer loads and how; names match the drafter's flags."""

    draft_model: str
    """Model directory of the draft (config.json, *.safetensors), with the target's vocabulary."""
    draft_layers: int = 0
    """Run only the first N decoder layers (then the final norm and head): self-speculative
    drafting when draft_model is the target itself. 0 = every layer."""
    num_speculative_tokens: int = _NGRAM_DEFAULTS.num_speculative_tokens
    target_model: str = ""
    """The target's model directory; when set, its vocab_size must equal the draft's."""
    device: str = "auto"
    dtype: str = "auto"
    attention_backend: str = "auto"
    block_size: int = 16
    kv_cache_bytes: int = DEFAULT_DRAFT_KV_CACHE_BYTES
    num_blocks: int = 0
    """Exact number of KV blocks (0 = size from kv_cache_bytes, or GPU memory on CUDA). Tests use it."""

    def __post_init__(self) -> None:
        if not self.draft_model:
            raise ValueError("draft_model must name a model directory when method is draft_model")
        if self.draft_layers < 0:
            raise ValueError(f"draft_layers must be >= 0 (0 = every layer), got {self.draft_layers}")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], "
                             f"got {self.num_speculative_tokens}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be > 0, got {self.kv_cache_bytes}")
        if self.num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0 (0 = from kv_cache_bytes), got {self.num_blocks}")


def _flag(default, help_text: str, name: str):
    return field(default=default, metadata={"help": help_text, "env": f"TOKENMILL_DRAFTER_{name.upper()}"})


@dataclass(slots=True)
class DrafterConfig(service_process_fields("drafter", DEFAULT_PORT)):
    """tokenmill drafter: proposes draft tokens for speculative decoding (prompt lookup or a draft model)."""

    method: DraftMethod = _flag(DraftMethod.NGRAM, "how drafts are made: ngram (prompt lookup) or draft_model",
                                "method")
    num_speculative_tokens: int = _flag(_NGRAM_DEFAULTS.num_speculative_tokens,
                                        "default and largest number of draft tokens per sequence per step",
                                        "num_speculative_tokens")
    ngram_min: int = _flag(_NGRAM_DEFAULTS.min_ngram, "ngram: shortest suffix n-gram to look up", "ngram_min")
    ngram_max: int = _flag(_NGRAM_DEFAULTS.max_ngram, "ngram: longest suffix n-gram to look up, tried first",
                           "ngram_max")
    draft_model: str = _flag("", "draft_model: model directory of the draft, with the target's vocabulary "
                                 "(the target's own directory with --draft-layers: self-speculative)", "draft_model")
    draft_layers: int = _flag(0, "draft_model: run only the first N layers plus the final norm and head "
                                 "(0 = every layer)", "draft_layers")
    target_model: str = _flag("", "draft_model: the target's model directory; its vocab_size must equal the "
                                  "draft's (empty = not checked here)", "target_model")
    device: str = _flag("auto", "draft_model: cpu, cuda, cuda:N, or auto (cuda when available)", "device")
    dtype: str = _flag("auto", "draft_model: fp32, bf16, fp16, or auto (fp32 on a CPU, else the checkpoint's "
                               "or bf16)", "dtype")
    attention_backend: str = _flag("auto", "draft_model: torch, triton, cpu, or auto", "attention_backend")
    block_size: int = _flag(16, "draft_model: tokens per block of the draft's own KV pool", "block_size")
    kv_cache_bytes: int = _flag(DEFAULT_DRAFT_KV_CACHE_BYTES,
                                "draft_model: the draft's KV pool budget in bytes (a sequence that finds the "
                                "pool full gets no draft, never an error)", "kv_cache_bytes")
    num_blocks: int = _flag(0, "draft_model: exact number of KV blocks (0 = from --kv-cache-bytes)", "num_blocks")

    def validate(self) -> None:
        if self.method is DraftMethod.NGRAM:
            self.ngram_proposer()
        else:
            self.draft_model_settings()

    def ngram_proposer(self) -> NgramProposer:
        """The n-gram proposer these settings describe; raises ValueError naming a bad field."""
        return NgramProposer(
            max_ngram=self.ngram_max, min_ngram=self.ngram_min, num_speculative_tokens=self.num_speculative_tokens
        )

    def draft_model_settings(self) -> DraftModelSettings:
        return DraftModelSettings(
            draft_model=self.draft_model, draft_layers=self.draft_layers,
            num_speculative_tokens=self.num_speculative_tokens, target_model=self.target_model, device=self.device,
            dtype=self.dtype, attention_backend=self.attention_backend, block_size=self.block_size,
            kv_cache_bytes=self.kv_cache_bytes, num_blocks=self.num_blocks,
        )

    def proposer(self) -> Proposer:
        """The configured proposer; for draft_model this loads the model (imported only then,
        so an n-gram drafter never imports torch)."""
        if self.method is DraftMethod.NGRAM:
            return self.ngram_proposer()
        from services.drafter.draft_model import DraftModelProposer

        return DraftModelProposer(self.draft_model_settings())
