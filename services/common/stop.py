"""When a generation ends: a request's stop rules, one type checked by one validator.

``StopConditions`` is the only home of the stop rules. The public API's StopConditions
message maps onto it; the scheduler core's Request holds it (beside the model's EOS ids) and
applies its token rules after every step; the scheduler's output side matches its stop
strings in the detokenized text. The executor's sampler needs one consequence of it only,
which ids it may not sample before ``min_tokens`` tokens were generated: ``min_tokens_ban``
derives that small value once per request and the step contract carries it
(``NewSequence.min_tokens_ban``), so SamplingParams says how a token is drawn and nothing
about when generation ends.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# Upper bounds on user-controlled sizes; each is named in the error it produces.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64


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


@dataclass(frozen=True, slots=True)
class MinTokensBan:
    """The sampler's share of a request's stop rules: while fewer than ``min_tokens`` tokens
    were generated, the logits of ``token_ids`` are set to -inf.

    Derived by ``StopConditions.min_tokens_ban``; a request that bans nothing has None instead.
    """

    min_tokens: int
    token_ids: tuple[int, ...]
    """The stop token ids, plus the model's EOS ids unless ignore_eos."""


@dataclass(frozen=True, slots=True)
class StopConditions:
    """When one request's generation ends. Check with ``validate`` before use."""

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
        """Raise ValueError naming the field, its value and the limit it breaks.

        The one check of the stop rules; the scheduler core runs it when a request is added.
        """
        max_tokens = self.max_tokens
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 (or None for no limit), got {max_tokens}")
        if max_tokens is not None and max_tokens >= max_model_len:
            raise ValueError(f"max_tokens {max_tokens} must be below the context limit {max_model_len}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if max_tokens is not None and self.min_tokens > max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} must not exceed max_tokens={max_tokens}")
        validate_stop_strings(self.stop)
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(
                f"stop_token_ids has {len(self.stop_token_ids)} entries; the limit MAX_STOP_TOKEN_IDS is "
                f"{MAX_STOP_TOKEN_IDS}"
            )
        for token_id in self.stop_token_ids:
            if not (0 <= token_id < vocab_size):
                raise ValueError(f"stop_token_ids entry {token_id} is outside [0, {vocab_size})")

    def min_tokens_ban(self, eos_token_ids: Sequence[int]) -> MinTokensBan | None:
        """What the sampler must ban before min_tokens, or None when nothing is banned.

        The ids that would end the request: stop_token_ids, and the model's EOS ids unless
        ignore_eos (those not already among the stop ids).
        """
        if self.min_tokens == 0:
            return None
        banned = tuple(self.stop_token_ids)
        if not self.ignore_eos:
            banned += tuple(t for t in eos_token_ids if t not in banned)
        return MinTokensBan(self.min_tokens, banned) if banned else None
