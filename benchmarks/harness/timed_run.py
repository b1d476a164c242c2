"""One timed run of one system, the unit the llama.cpp comparisons count in (pure Python)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Run:
    """One timed run of one system: ``streams`` requests, ``output_tokens`` in all, ``seconds`` wall."""

    streams: int
    output_tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        """Output tokens / wall time (request sent → last token), prompt processing included."""
        return self.output_tokens / self.seconds
