"""When a generation ends: the public stop conditions of a request."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.common.sampling_params import MAX_STOP_TOKEN_IDS

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256


def validate_stop_strings(stop: Sequence[str]) -> tuple[str, ...]:
    """Check a request's `stop` field; return it deduplicated, in order.

    Raises ValueError naming the field `stop` and the limit it breaks.
    """
    if isinstance(stop, str):
        raise ValueError("stop must be a list of strings, got a single string")
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"stop has {len(stop)} strings; the limit MAX_STOP_STRINGS is {MAX_STOP_STRINGS}")
    for index, text in enumerate(stop):
        if not isinstance(text, str):
            raise ValueError(f"stop[{index}] must be a string, got {type(text).__name__}")
        if not text:
            raise ValueError(f"stop[{index}] is empty; stop strings must be non-empty")
        if len(text) > MAX_STOP_STRING_CHARS:
            raise ValueError(
                f"stop[{index}] has {len(text)} characters; the limit MAX_STOP_STRING_CHARS is {MAX_STOP_STRING_CHARS}"
            )
    return tuple(dict.fromkeys(stop))


@dataclass(slots=True)
class StopConditions:
    max_tokens: int | None = None
    """Most tokens to generate; None = until the context is full."""
    stop: tuple[str, ...] = ()
    """Strings that end the generation when they appear in the text (also across tokens)."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end the generation (finish reason STOP)."""
    ignore_eos: bool = False
    """Keep generating past the end-of-sequence token."""
    min_tokens: int = 0
    """EOS and stop tokens cannot be generated before this many tokens."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string at the end of the text."""

    def validate(self, vocab_size: int, max_model_len: int) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.max_tokens is not None and self.max_tokens >= max_model_len:
            raise ValueError(f"max_tokens {self.max_tokens} must be below the context limit {max_model_len}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens {self.min_tokens} exceeds max_tokens {self.max_tokens}")
        validate_stop_strings(self.stop)
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids has {len(self.stop_token_ids)} entries; the limit is {MAX_STOP_TOKEN_IDS}")
        for t in self.stop_token_ids:
            if not (0 <= t < vocab_size):
                raise ValueError(f"stop_token_ids entry {t} is outside [0, {vocab_size})")
