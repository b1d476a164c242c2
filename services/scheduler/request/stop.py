"""When a generation ends: a request's stop rules, one type checked by one validator.

``StopConditions`` is the only home of the stop rules. The public API's StopConditions
message maps onto it; the request (request.py) holds it beside the model's EOS ids and
applies its token rules to every token a step brings (``token_stop``); its stop strings go
with the request's text stream to the tokenizer, which matches them where the text is made
(services/common/detokenize.py). The executor's sampler needs one consequence of it only,
which ids it may not sample before ``min_tokens`` tokens were generated: ``min_tokens_ban``
derives that small value once per request and the step contract carries it
(``NewSequence.min_tokens_ban``), so SamplingParams says how a token is drawn and nothing
about when generation ends.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.common.detokenize import validate_stop_strings
from services.common.step import MinTokensBan
from services.scheduler.request.finish_reason import FinishReason

MAX_STOP_TOKEN_IDS = 64
"""Upper bound on a request's stop_token_ids, named in the error it produces."""


def validate_stop_token_ids(stop_token_ids: Sequence[int], vocab_size: int) -> None:
    """Raise ValueError when there are more than MAX_STOP_TOKEN_IDS or one is outside the vocabulary."""
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"stop_token_ids has {len(stop_token_ids)} entries; the limit MAX_STOP_TOKEN_IDS is "
                         f"{MAX_STOP_TOKEN_IDS}")
    for token_id in stop_token_ids:
        if not (0 <= token_id < vocab_size):
            raise ValueError(f"stop_token_ids entry {token_id} is outside [0, {vocab_size})")


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
        """Raise ValueError naming the field, its value and the limit it breaks: the one check of
        the stop rules, which the scheduler core runs when a request is added."""
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
        validate_stop_token_ids(self.stop_token_ids, vocab_size)

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

    def token_stop(self, token_id: int, num_output_tokens: int,
                   eos_token_ids: Sequence[int]) -> tuple[FinishReason, int | None] | None:
        """Whether generating ``token_id`` as output number ``num_output_tokens`` ends the request.

        In order: stop_token_ids (STOP, the id as stop reason) and EOS (EOS, unless ignore_eos),
        both only once more than min_tokens tokens came, then max_tokens (LENGTH). The context
        limit is the request's own check (it knows its length).
        """
        if num_output_tokens > self.min_tokens:
            if token_id in self.stop_token_ids:
                return FinishReason.STOP, token_id
            if not self.ignore_eos and token_id in eos_token_ids:
                return FinishReason.EOS, None
        if self.max_tokens is not None and num_output_tokens >= self.max_tokens:
            return FinishReason.LENGTH, None
        return None
