"""Drafter service configuration: flags and TOKENMILL_DRAFTER_* environment variables.

This module stays torch-free: an n-gram drafter never loads torch, and ``--help`` is quick.
The draft model's settings are a dataclass of their own (``DraftModelSettings``), embedded
whole (their flags keep their own names, ``--draft-layers``) and validated here without
loading anything; services/drafter/draft_model.py loads what they describe.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.service_config import service_process_fields
from services.common.settings import embedded, setting
from services.drafter.ngram import MAX_SPECULATIVE_TOKENS, NgramProposer
from services.drafter.proposer import DraftMethod

DEFAULT_PORT = 50054
ENV_PREFIX = "TOKENMILL_DRAFTER_"

_NGRAM_DEFAULTS = NgramProposer()

DEFAULT_DRAFT_KV_CACHE_BYTES = 256 * 1024**2
"""The draft model's KV pool on a CPU: 256 MiB holds about 57K tokens of SmolLM2-135M's first
four layers in fp32, or 8K tokens of all 30."""


@dataclass(frozen=True, slots=True)
class DraftModelSettings:
    """What the draft-model proposer loads and how (``--method draft_model``)."""

    draft_model: str = setting("", path=True)
    """draft_model: model directory of the draft, with the target's vocabulary (the target's own directory with
    --draft-layers: self-speculative)."""
    draft_layers: int = setting(0)
    """draft_model: run only the first N layers plus the final norm and head (0 = every layer).

    Self-speculative drafting when draft_model is the target itself."""
    target_model: str = setting("", path=True)
    """draft_model: the target's model directory; its vocab_size must equal the draft's (empty = not checked here)."""
    device: str = setting("auto")
    """draft_model: cpu, cuda, cuda:N, or auto (cuda when available)."""
    dtype: str = setting("auto")
    """draft_model: fp32, bf16, fp16, or auto (fp32 on a CPU, else the checkpoint's or bf16)."""
    attention_backend: str = setting("auto")
    """draft_model: torch, triton, cpu, or auto."""
    block_size: int = setting(16)
    """draft_model: tokens per block of the draft's own KV pool."""
    kv_cache_bytes: int = setting(DEFAULT_DRAFT_KV_CACHE_BYTES)
    """draft_model: the draft's KV pool budget in bytes (a sequence that finds the pool full gets no draft, never an
    error)."""
    num_blocks: int = setting(0)
    """draft_model: exact number of KV blocks (0 = from --kv-cache-bytes).

    0 = size from kv_cache_bytes, or GPU memory on CUDA. Tests use it."""

    def validate(self) -> None:
        if not self.draft_model:
            raise ValueError("draft_model must name a model directory when method is draft_model")
        if self.draft_layers < 0:
            raise ValueError(f"draft_layers must be >= 0 (0 = every layer), got {self.draft_layers}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be > 0, got {self.kv_cache_bytes}")
        if self.num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0 (0 = from kv_cache_bytes), got {self.num_blocks}")


def check_num_speculative_tokens(k: int) -> None:
    if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], got {k}")


@dataclass(slots=True)
class DrafterConfig(service_process_fields("drafter", DEFAULT_PORT, internal_secret="require")):
    """tokenmill drafter: proposes draft tokens for speculative decoding (prompt lookup or a draft model)."""

    method: DraftMethod = setting(DraftMethod.NGRAM, env=f"{ENV_PREFIX}METHOD")
    """How drafts are made: ngram (prompt lookup) or draft_model."""
    num_speculative_tokens: int = setting(_NGRAM_DEFAULTS.num_speculative_tokens,
                                          env=f"{ENV_PREFIX}NUM_SPECULATIVE_TOKENS")
    """Default and largest number of draft tokens per sequence per step."""
    ngram_min: int = setting(_NGRAM_DEFAULTS.min_ngram, env=f"{ENV_PREFIX}NGRAM_MIN")
    """ngram: shortest suffix n-gram to look up."""
    ngram_max: int = setting(_NGRAM_DEFAULTS.max_ngram, env=f"{ENV_PREFIX}NGRAM_MAX")
    """ngram: longest suffix n-gram to look up, tried first."""
    draft: DraftModelSettings = embedded(DraftModelSettings, env_prefix=ENV_PREFIX)

    def validate(self) -> None:
        if self.method is DraftMethod.NGRAM:
            self.ngram_proposer()
        else:
            self.draft.validate()
            check_num_speculative_tokens(self.num_speculative_tokens)

    def ngram_proposer(self) -> NgramProposer:
        """The n-gram proposer these settings describe; raises ValueError naming a bad field."""
        return NgramProposer(
            max_ngram=self.ngram_max, min_ngram=self.ngram_min, num_speculative_tokens=self.num_speculative_tokens
        )
