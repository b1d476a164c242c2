"""Drafter service configuration: flags and TOKENMILL_DRAFTER_* environment variables."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.service_config import service_process_fields
from services.drafter.ngram import NgramProposer

DEFAULT_PORT = 50054

_NGRAM_DEFAULTS = NgramProposer()


@dataclass(slots=True)
class DrafterConfig(service_process_fields("drafter", DEFAULT_PORT)):
    """tokenmill drafter: proposes draft tokens for speculative decoding (prompt lookup)."""

    num_speculative_tokens: int = field(
        default=_NGRAM_DEFAULTS.num_speculative_tokens,
        metadata={"help": "default and largest number of draft tokens per sequence per step",
                  "env": "TOKENMILL_DRAFTER_NUM_SPECULATIVE_TOKENS"},
    )
    ngram_min: int = field(
        default=_NGRAM_DEFAULTS.min_ngram,
        metadata={"help": "shortest suffix n-gram to look up", "env": "TOKENMILL_DRAFTER_NGRAM_MIN"},
    )
    ngram_max: int = field(
        default=_NGRAM_DEFAULTS.max_ngram,
        metadata={"help": "longest suffix n-gram to look up, tried first", "env": "TOKENMILL_DRAFTER_NGRAM_MAX"},
    )

    def validate(self) -> None:
        self.proposer()

    def proposer(self) -> NgramProposer:
        """The n-gram proposer these settings describe; raises ValueError naming a bad field."""
        return NgramProposer(
            max_ngram=self.ngram_max, min_ngram=self.ngram_min, num_speculative_tokens=self.num_speculative_tokens
        )
