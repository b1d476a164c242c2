"""The detokenize contract between the scheduler (who knows the tokens) and the tokenizer (who
makes the text): one batch per step for every stream of one tokenizer, as plain values.

The in-process engine hands these to a local ``DetokenizerPool`` directly; the services
convert them to the Detokenize stream's packed protobuf arrays at the edge, as the step
contract (``services/common/step.py``) is converted for the executor.

Stop strings are matched where the text is made: a stream opened with ``stop`` strings is
watched by the tokenizer, which cuts its text at the first match, closes the stream and
reports the string in ``DetokenizeResult.stopped``. The text then travels one way (tokenizer
to scheduler to client) and the scheduler never re-reads it; it only ends the request in its
core. Text that could begin a stop string is held back until the next tokens decide it, and
released when the stream is closed with its last tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

# Upper bounds on a request's stop strings; each is named in the error it produces.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256


def validate_stop_strings(stop: Sequence[str], field: str = "stop") -> tuple[str, ...]:
    """Check a request's stop strings; return them deduplicated, in order.

    Raises ValueError naming ``field`` and the limit it breaks. The scheduler checks a request's
    ``stop`` with it, the tokenizer each stream it is asked to open.
    """
    if isinstance(stop, str):
        raise ValueError(f"{field} must be a list of strings, got a single string")
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"{field} has {len(stop)} strings; the limit MAX_STOP_STRINGS is {MAX_STOP_STRINGS}")
    for index, text in enumerate(stop):
        if not isinstance(text, str):
            raise ValueError(f"{field}[{index}] must be a string, got {type(text).__name__}")
        if not text:
            raise ValueError(f"{field}[{index}] is empty; stop strings must be non-empty")
        if len(text) > MAX_STOP_STRING_CHARS:
            raise ValueError(f"{field}[{index}] has {len(text)} characters; the limit MAX_STOP_STRING_CHARS is "
                             f"{MAX_STOP_STRING_CHARS}")
    return tuple(dict.fromkeys(stop))


@dataclass(slots=True)
class NewTextStream:
    """A request's text stream, opened with its first tokens."""

    stream_id: int
    prompt_tail: list[int]
    """The last few prompt tokens, so the first output token gets the spacing it has in context."""
    stop: tuple[str, ...] = ()
    """Stop strings (already validated by the request's StopConditions)."""
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    """Leave special tokens (BOS, EOS, ...) out of the text."""


@dataclass(slots=True)
class DetokenizeBatch:
    """One step's work for one tokenizer: streams to open, tokens to decode, streams to close."""

    new_streams: list[NewTextStream] = field(default_factory=list)
    appended: list[tuple[int, list[int]]] = field(default_factory=list)
    """(stream id, its new tokens), each stream at most once."""
    closed: list[int] = field(default_factory=list)
    """Streams to forget after this batch's tokens are decoded; one closed in the batch that
    carries its last tokens gets its held-back text flushed into that text."""

    @property
    def is_empty(self) -> bool:
        return not (self.new_streams or self.appended or self.closed)


@dataclass(slots=True)
class DetokenizeResult:
    texts: dict[int, str] = field(default_factory=dict)
    """New text per stream of ``appended`` (possibly "")."""
    stopped: dict[int, str] = field(default_factory=dict)
    """Streams whose text reached a stop string this batch: the string. Their text is cut
    there (the string kept only with include_stop_str_in_output) and the stream is closed."""
    failed: dict[int, str] = field(default_factory=dict)
    """Streams this batch could not serve, with why (naming the field): each is dropped, and
    only its request ends; one bad stream never fails the others of the batch."""
