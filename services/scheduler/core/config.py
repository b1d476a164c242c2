"""Scheduler limits and switches: a value object validated once at start."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class SchedulerConfig:
    max_model_len: int
    """Longest sequence (prompt + output) in tokens; from the executor's ExecutorInfo."""
    num_blocks: int
    """KV-cache blocks the executor holds; valid block ids are [0, num_blocks)."""
    block_size: int = 16
    """Tokens per KV-cache block."""
    max_num_seqs: int = 256
    """Most requests running at once (holding blocks, known to the executor)."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step: sum of num_scheduled_tokens over the plan."""
    max_waiting_requests: int = 4096
    """Most requests waiting to start; beyond it add_request raises QueueFullError."""
    enable_chunked_prefill: bool = True
    """Split a prompt over several steps when it does not fit the remaining token budget.
    Off: a prompt is scheduled whole or waits for a step with room for all of it."""
    enable_prefix_caching: bool = True
    """Reuse the K/V of full blocks whose token prefix was computed before."""
    long_prefill_token_threshold: int = 0
    """Most tokens one request may compute in a step (long prompts then share steps with
    decodes instead of taking the whole budget); 0 = no per-request cap."""
    vocab_size: int | None = None
    """When set, token ids of new requests are checked against [0, vocab_size)."""

    def validate(self) -> None:
        """Raise ValueError naming the offending field(s) and value(s)."""
        for name in ("max_model_len", "num_blocks", "block_size", "max_num_seqs",
                     "max_num_batched_tokens", "max_waiting_requests"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.max_model_len < 2:
            raise ValueError(
                f"max_model_len must be >= 2 (one prompt token and one output token), "
                f"got {self.max_model_len}"
            )
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                f"long_prefill_token_threshold must be >= 0 (0 = no cap), "
                f"got {self.long_prefill_token_threshold}"
            )
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1 when set, got {self.vocab_size}")
        capacity = self.num_blocks * self.block_size
        if capacity < self.max_model_len:
            raise ValueError(
                f"num_blocks={self.num_blocks} x block_size={self.block_size} = {capacity} tokens "
                f"cannot hold one sequence of max_model_len={self.max_model_len}"
            )
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} is below "
                f"max_num_seqs={self.max_num_seqs}: not every running sequence could decode in a step"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"enable_chunked_prefill=False needs max_num_batched_tokens >= max_model_len, got "
                f"max_num_batched_tokens={self.max_num_batched_tokens} < "
                f"max_model_len={self.max_model_len}: a long prompt could never be scheduled"
            )
        if not self.enable_chunked_prefill and self.long_prefill_token_threshold > 0:
            raise ValueError(
                f"long_prefill_token_threshold={self.long_prefill_token_threshold} splits prompts "
                f"over steps and needs enable_chunked_prefill=True (got False)"
            )
