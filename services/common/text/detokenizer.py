"""Streaming detokenization: token ids in, text deltas out, in O(window) per token.

Decoding one token at a time is wrong in two ways. A sentencepiece decoder drops the "▁" (space)
of the first token it sees, so decoding tokens one by one loses every space; and with byte
fallback a character such as "中" or an emoji is spelled by several "<0xNN>" pieces, so a token
alone may decode to U+FFFD. Decoding the whole sequence at every step is right but O(n) per
token. The vLLM scheme decodes a small window instead:

    window = ids[prefix_offset:]        prefix_text = decode(ids[prefix_offset:read_offset])
    delta  = decode(window)[len(prefix_text):]

The context tokens ids[prefix_offset:read_offset] were already emitted; they absorb the
first-token space rule, so the delta is the text the new tokens add. When a delta is emitted,
prefix_offset moves to read_offset and read_offset to the end.

Invariant (the tests check it): the deltas concatenated are always a prefix of
``tokenizer.decode(output_ids)``, and after ``finish()`` they equal it. Two rules keep it exact:

1. Hold back while the window's text ends in U+FFFD (an incomplete UTF-8 sequence: byte-level
   BPE decodes it so until its last byte arrives).
2. Hold back while the last visible token is a byte-fallback piece. ByteFallback decodes a run
   of consecutive "<0xNN>" pieces all or nothing: [E4 B8 AD] is "中" but [E4 B8 AD 80] is four
   U+FFFD. A completed character inside a run is therefore not final until the run ends. No
   decoding happens while a run grows, so a long run still costs O(1) per token, and one
   decode of the run when it ends.

Special tokens that skip_special_tokens removes are invisible: the decoder never sees them, so
byte runs continue across them.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.common.text.tokenizer import TextTokenizer

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens used as decoding context when continuing the prompt's text (keep_leading_space).
PROMPT_CONTEXT_TOKENS = 6
# How far back the prompt context may reach to avoid starting inside a byte-fallback run.
MAX_PROMPT_CONTEXT_TOKENS = 64
DEFAULT_MAX_STREAMS = 65536


class IncrementalDetokenizer:
    """Turn one sequence's output ids into text deltas.

    keep_leading_space=False (default): the deltas add up to decode(output_ids), so a leading
    "▁" of the first output token is dropped exactly as the full decode drops it.
    keep_leading_space=True: the output is decoded as a continuation of the prompt (its last
    tokens are the first window's context), so a first token "▁there" after "Once upon a time"
    yields " there"; the deltas then add up to decode(prompt + output) minus decode(prompt).
    """

    __slots__ = (
        "_tokenizer",
        "_skip_special",
        "_special_ids",
        "_byte_ids",
        "_window",
        "_read",
        "_prefix_text",
        "_last_visible_is_byte",
        "_finished",
        "num_output_tokens",
    )

    def __init__(
        self,
        tokenizer: TextTokenizer,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
        keep_leading_space: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._special_ids = tokenizer.skipped_special_ids if skip_special_tokens else frozenset()
        self._byte_ids = tokenizer.byte_token_ids
        context = (
            _prompt_context(prompt_token_ids, self._byte_ids, self._decode) if keep_leading_space else []
        )
        self._window: list[int] = context
        """ids[prefix_offset:]; the first `_read` of them were already emitted (or are context)."""
        self._read = len(context)
        self._prefix_text: str | None = None
        """Cached decode(window[:read]); None until needed after each advance."""
        self._last_visible_is_byte = False
        self._finished = False
        self.num_output_tokens = 0

    def append(self, token_ids: Sequence[int]) -> str:
        """Add newly generated ids; return the text they complete (possibly "")."""
        if self._finished:
            raise RuntimeError("append() after finish(): the detokenizer's stream is closed")
        if not token_ids:
            return ""
        self._window.extend(token_ids)
        self.num_output_tokens += len(token_ids)
        last_visible = next((t for t in reversed(token_ids) if t not in self._special_ids), None)
        if last_visible is None:
            return ""  # only skipped special tokens: the decoder never sees them, no new text
        self._last_visible_is_byte = last_visible in self._byte_ids
        if self._last_visible_is_byte:
            return ""  # rule 2: the byte run may still turn invalid; no need to decode yet
        return self._emit(final=False)

    def finish(self) -> str:
        """Flush held-back text; an incomplete sequence at the end becomes U+FFFD, as in decode."""
        if self._finished:
            return ""
        self._finished = True
        return self._emit(final=True)

    @property
    def finished(self) -> bool:
        return self._finished

    def _emit(self, final: bool) -> str:
        if len(self._window) == self._read:
            return ""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._window[: self._read])
        prefix_text = self._prefix_text
        new_text = self._decode(self._window)
        if not final and (len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR)):
            # Nothing visible yet (keep the context, it still carries the first-token rule),
            # or rule 1: an incomplete character at the end.
            return ""
        delta = new_text[len(prefix_text) :]
        # The emitted tokens become the next window's context.
        del self._window[: self._read]
        self._read = len(self._window)
        self._prefix_text = None
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)


def _prompt_context(prompt_token_ids: Sequence[int], byte_ids: frozenset[int], decode) -> list[int]:
    """The prompt's last few ids, starting where a window may start (not inside a byte run).

    A prompt ending in a byte run keeps it as context only when the run spells whole
    characters ("мир" as bytes): the next token's space then decodes as in the full text. A
    prompt cut mid-character (token ids sent by a client) gets no context: the output would
    change the text the context decodes to.
    """
    start = max(0, len(prompt_token_ids) - PROMPT_CONTEXT_TOKENS)
    lowest = max(0, len(prompt_token_ids) - MAX_PROMPT_CONTEXT_TOKENS)
    while start > lowest and prompt_token_ids[start - 1] in byte_ids:
        start -= 1
    context = list(prompt_token_ids[start:])
    if context and context[-1] in byte_ids and REPLACEMENT_CHAR in decode(context):
        return []
    return context


class DetokenizerPool:
    """Incremental detokenizers keyed by stream id: the tokenizer service's Detokenize stream.

    One owner (the stream handler) calls open/append/close; no locking.
    """

    def __init__(self, tokenizer: TextTokenizer, max_streams: int = DEFAULT_MAX_STREAMS) -> None:
        if max_streams < 1:
            raise ValueError(f"max_streams must be >= 1, got {max_streams}")
        self._tokenizer = tokenizer
        self._max_streams = max_streams
        self._streams: dict[int, IncrementalDetokenizer] = {}

    def open(
        self,
        stream_id: int,
        prompt_ids: Sequence[int] = (),
        skip_special: bool = True,
        keep_leading_space: bool = False,
    ) -> None:
        if stream_id in self._streams:
            raise ValueError(f"stream_id {stream_id} is already open")
        if len(self._streams) >= self._max_streams:
            raise ValueError(f"too many open streams: the limit max_streams is {self._max_streams}")
        self._streams[stream_id] = IncrementalDetokenizer(
            self._tokenizer, prompt_ids, skip_special_tokens=skip_special, keep_leading_space=keep_leading_space
        )

    def append(self, stream_id: int, ids: Sequence[int]) -> str:
        """Text delta of `ids` for an open stream."""
        return self._get(stream_id).append(ids)

    def close(self, stream_id: int) -> str:
        """Flush and forget the stream; returns its held-back text."""
        detokenizer = self._streams.pop(stream_id, None)
        if detokenizer is None:
            raise ValueError(f"stream_id {stream_id} is not open")
        return detokenizer.finish()

    def discard(self, stream_id: int) -> None:
        """Forget a stream without flushing (aborted requests); unknown ids are ignored."""
        self._streams.pop(stream_id, None)

    def __contains__(self, stream_id: int) -> bool:
        return stream_id in self._streams

    def __len__(self) -> int:
        return len(self._streams)

    def _get(self, stream_id: int) -> IncrementalDetokenizer:
        detokenizer = self._streams.get(stream_id)
        if detokenizer is None:
            raise ValueError(f"stream_id {stream_id} is not open")
        return detokenizer
