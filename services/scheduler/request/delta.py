"""What a client gets back for a generation, as plain values (protobuf lives at the edges)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.step import TokenLogprobs
from services.scheduler.request.finish_reason import FinishReason


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    """Prompt tokens whose K/V came from the prefix cache."""


@dataclass(slots=True)
class Timings:
    queue_time_ms: float
    """Arrival until first scheduled."""
    time_to_first_token_ms: float
    """Arrival until the first output token was produced."""
    decode_time_ms: float
    """First output token until the last."""
    e2e_ms: float
    """Arrival until finish."""
    accepted_draft_tokens: int = 0
    """Output tokens that came from accepted speculative drafts."""


@dataclass(slots=True)
class GenerationDelta:
    """One event of one request's stream: new text and tokens, and, on the last, how it ended."""

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[tuple[int, TokenLogprobs]] | None = None
    """On the first delta of a request that asked: (prompt token id, logprobs) of every prompt
    token (RequestUpdate.prompt_logprobs)."""
    finish_reason: FinishReason | None = None
    """None while running; set on the stream's last delta."""
    stop_reason: str | int | None = None
    """The stop string or stop token id that ended it, for finish_reason == "stop"."""
    error_message: str | None = None
    """What went wrong, for finish_reason == "error" (a backend went away, the server stops)."""
    usage: Usage | None = None
    timings: Timings | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def absorb(self, later: GenerationDelta) -> None:
        """Append the request's next delta to this one, which then stands for both.

        For a stream whose writes fall behind its steps: the deltas that queued meanwhile go
        out as one message instead of one each, so a busy server spends its CPU on fewer writes
        exactly when it has least to spare. Text, ids and logprobs keep their order; the later
        delta's ending (reason, usage, timings) becomes this one's.
        """
        if self.finished:
            raise ValueError(f"request {self.request_id}: a finished delta cannot absorb another")
        self.text += later.text
        self.token_ids = self.token_ids + later.token_ids
        if later.logprobs:
            self.logprobs = [*(self.logprobs or ()), *later.logprobs]
        if later.prompt_logprobs:
            self.prompt_logprobs = [*(self.prompt_logprobs or ()), *later.prompt_logprobs]
        self.finish_reason = later.finish_reason
        self.stop_reason = later.stop_reason
        self.error_message = later.error_message
        self.usage = later.usage
        self.timings = later.timings
