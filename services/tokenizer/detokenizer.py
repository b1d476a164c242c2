"""Streaming detokenization: token ids in, text deltas out, in O(window) per token.

Decoding one token at a time is wrong in two ways. A sentencepiece decoder drops the "▁" (space)
of the first token it sees, so decoding tokens one by one loses every space; and with byte
fallback a character such as "中" or an emoji is spelled by several "<0xNN>" pieces, so a token
alone may decode to U+FFFD. Decoding the whole sequence at every step is right but O(n) per
token. The vLLM scheme decodes a small window instead:

    window = ids[prefix_offset:]        context = ids[prefix_offset:read_offset] (already emitted)
    delta  = text(window)[len(text(context)):]

When a delta is emitted, prefix_offset moves to read_offset and read_offset to the end.

A decoder's start-of-text rule (the "▁" dropped from the first piece, or from every piece while
nothing has been written, as sentencepiece does; Metaspace's first-token rule) applies to whatever
token a decoded window starts with. Plain vLLM windows count on the context to take it, which
fails when the context is a lone "▁": for "▁had" "▁" "▁upon" the window ["▁", "▁upon"] decodes
to "upon" after an empty context, and the stream says "had upon" where the text is "had  upon".
So a window that does not start the text is decoded behind the tokenizer's anchor token
(TextTokenizer.anchor_token_id, "a" in most vocabularies), which takes the start rule:

    text(window) = decode([anchor] + window)[len(decode([anchor])):]

A window starts the text until the first visible text has been emitted; it is decoded plainly,
as the full decode does. With keep_leading_space the output continues the prompt's text, so its
windows are anchored from the first token, unless the prompt decodes to nothing (BOS alone): then
the output starts the text, and the prompt's visible tokens are the first window's context (a
prompt "▁" changes what a one-space Strip removes). Without an anchor (no token qualifies)
windows are decoded plainly, as vLLM does, and a keep_leading_space output as if it started the
text.

Invariant (the tests check it): the deltas concatenated are always a prefix of
``tokenizer.decode(output_ids)``, and after ``finish()`` they equal it. With keep_leading_space
they equal ``decode(prompt + output)`` minus ``decode(prompt)`` whenever that is defined: the
prompt's text is a prefix of the full text and does not end in U+FFFD. (When the prompt ends in
an unfinished or invalid byte run, the output's bytes join that run in the full decode and change
the prompt's text; the output is then decoded on its own. Output bytes join a complete run too,
which matters only where a decoder treats that run specially: Metaspace drops every "▁" of the
first token, so a prompt that is one byte run can take the output's byte-spelled "▁" with it.)
Two rules keep it exact:

1. Hold back while the window's text ends in U+FFFD (an incomplete UTF-8 sequence: byte-level
   BPE decodes it so until its last byte arrives).
2. Hold back while the last visible token is a byte-fallback piece. ByteFallback decodes a run
   of consecutive "<0xNN>" pieces all or nothing: [E4 B8 AD] is "中" but [E4 B8 AD 80] is four
   U+FFFD. A completed character inside a run is therefore not final until the run ends. No
   decoding happens while a run grows, so a long run still costs O(1) per token, and one
   decode of the run when it ends.

Emission happens only after a visible non-byte token (or at finish), so a window never starts
inside a byte run, and the anchor (never a byte piece) cannot join one. Special tokens that
skip_special_tokens removes are invisible: the decoder never sees them, so byte runs continue
across them.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice

from services.common.detokenize import DetokenizeBatch, DetokenizeResult, validate_stop_strings
from services.tokenizer.stop_strings import StopStringMatcher
from services.tokenizer.text_tokenizer import TextTokenizer

REPLACEMENT_CHAR = "\ufffd"
# A keep_leading_space prompt with more visible tokens than this is taken to have text (it is not
# decoded to check); a prompt without text holds BOS, "▁" pieces and the like, a few tokens.
MAX_EMPTY_PROMPT_TOKENS = 64
DEFAULT_MAX_STREAMS = 65536


class IncrementalDetokenizer:
    """Turn one sequence's output ids into text deltas.

    keep_leading_space=False (default): the deltas add up to decode(output_ids), so a leading
    "▁" of the first output token is dropped exactly as the full decode drops it.
    keep_leading_space=True: the output is decoded as a continuation of the prompt, so a first
    token "▁there" after "Once upon a time" yields " there"; the deltas then add up to
    decode(prompt + output) minus decode(prompt). A prompt that decodes to "" (BOS alone) has no
    text to continue: the output's leading space is dropped, as in that full decode.
    """

    __slots__ = (
        "_tokenizer",
        "_skip_special",
        "_special_ids",
        "_byte_ids",
        "_anchor",
        "_anchor_text",
        "_at_start",
        "_window",
        "_read",
        "_prefix_text",
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
        anchor = tokenizer.anchor_token_id
        self._anchor: list[int] = [] if anchor is None else [anchor]
        self._anchor_text = tokenizer.anchor_text
        self._window: list[int] = []
        """ids[prefix_offset:]; the first `_read` of them were already emitted (or are context)."""
        self._at_start = True
        """The window starts the text: decode it plainly (the start-of-text rule applies to it)."""
        if keep_leading_space:
            visible_ids = (t for t in prompt_token_ids if t not in self._special_ids)
            visible = list(islice(visible_ids, MAX_EMPTY_PROMPT_TOKENS + 1))
            if len(visible) <= MAX_EMPTY_PROMPT_TOKENS and self._decode(visible) == "":
                self._window = visible  # no text to continue; context for the start rule
            else:
                self._at_start = False
        self._read = len(self._window)
        self._prefix_text: str | None = ""
        """Cached text(window[:read]); None until needed after each advance ("" at first: the
        context is empty or a prompt without text)."""
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
        if last_visible in self._byte_ids:
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
            self._prefix_text = self._text(self._window[: self._read])
        prefix_text = self._prefix_text
        new_text = self._text(self._window)
        if not final and (len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR)):
            # Nothing visible yet (keep the window: at the start its tokens carry the start rule),
            # or rule 1: an incomplete character at the end.
            return ""
        delta = new_text[len(prefix_text) :]
        # The emitted tokens become the next window's context; that window no longer starts the
        # text once some text has been written.
        del self._window[: self._read]
        self._read = len(self._window)
        self._prefix_text = None
        if delta:
            self._at_start = False
        return delta

    def _text(self, ids: list[int]) -> str:
        """What `ids` decode to at the window's place: the start of the text, or after the anchor."""
        if self._at_start:
            return self._decode(ids)
        return self._decode(self._anchor + ids)[len(self._anchor_text) :]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)


class _TextStream:
    """One request's text: its incremental detokenizer and, with stop strings, their matcher."""

    __slots__ = ("detokenizer", "matcher")

    def __init__(self, detokenizer: IncrementalDetokenizer, matcher: StopStringMatcher | None) -> None:
        self.detokenizer = detokenizer
        self.matcher = matcher


class DetokenizerPool:
    """The text streams of one scheduler, keyed by stream id: the tokenizer service's
    Detokenize stream, and the in-process engine's detokenizer.

    ``apply`` takes one step's DetokenizeBatch (services/common/detokenize.py): open, decode,
    match stop strings, close. One owner calls it; no locking.
    """

    def __init__(self, tokenizer: TextTokenizer, max_streams: int = DEFAULT_MAX_STREAMS) -> None:
        if max_streams < 1:
            raise ValueError(f"max_streams must be >= 1, got {max_streams}")
        self._tokenizer = tokenizer
        self._max_streams = max_streams
        self._streams: dict[int, _TextStream] = {}

    def apply(self, batch: DetokenizeBatch) -> DetokenizeResult:
        """One step: open ``new_streams``, decode ``appended``, then close ``closed`` (a stream
        closed with tokens in this batch gets its held-back text); closing an unknown id is
        ignored, since a stream stopped here may be closed by the scheduler too.

        A stream the batch cannot serve (opened twice, appended to while not open, an id outside
        the vocabulary, bad stop strings, the open-stream limit) is dropped and named in
        ``failed`` with the reason: only its request ends. The streams of every other request
        share this pool (and, in the services, one Detokenize call), so one request's bad item
        must never fail the batch.
        """
        result = DetokenizeResult()
        texts, stopped, failed = result.texts, result.stopped, result.failed
        for index, new in enumerate(batch.new_streams):
            try:
                if new.stream_id in self._streams:
                    raise ValueError(f"new_streams[{index}].stream_id {new.stream_id} is already open")
                self._check_ids(f"new_streams[{index}].prompt_token_ids", new.prompt_tail)
                validate_stop_strings(new.stop, field=f"new_streams[{index}].stop")
                self.open(new.stream_id, new.prompt_tail, skip_special=new.skip_special_tokens,
                          keep_leading_space=True, stop=new.stop,
                          include_stop_str_in_output=new.include_stop_str_in_output)
            except ValueError as exc:
                self._fail(failed, new.stream_id, str(exc))
        closed = set(batch.closed)
        for stream_id, ids in batch.appended:
            if stream_id in failed:
                continue
            stream = self._streams.get(stream_id)
            if stream is None:
                failed[stream_id] = f"stream_ids names {stream_id}, which is not open"
                continue
            try:
                self._check_ids(f"token_ids of stream {stream_id}", ids)
                text = stream.detokenizer.append(ids)
                if stream_id in closed:
                    text += stream.detokenizer.finish()
            except ValueError as exc:
                self._fail(failed, stream_id, str(exc))
                continue
            matcher = stream.matcher
            if matcher is not None:
                text, matched = matcher.feed(text)
                if matched is not None:
                    stopped[stream_id] = matched
                    del self._streams[stream_id]
                elif stream_id in closed:
                    text += matcher.finish()
            texts[stream_id] = text
        for stream_id in closed:
            self._streams.pop(stream_id, None)
        return result

    def _check_ids(self, field: str, ids: Sequence[int]) -> None:
        vocab_size = self._tokenizer.vocab_size
        if ids and (min(ids) < 0 or max(ids) >= vocab_size):
            bad = next(t for t in ids if not 0 <= t < vocab_size)
            raise ValueError(f"{field} holds {bad}, outside the vocabulary [0, {vocab_size})")

    def _fail(self, failed: dict[int, str], stream_id: int, reason: str) -> None:
        # A stream opened twice is dropped whole: two requests claim the id.
        self._streams.pop(stream_id, None)
        failed[stream_id] = reason

    def open(
        self,
        stream_id: int,
        prompt_ids: Sequence[int] = (),
        skip_special: bool = True,
        keep_leading_space: bool = False,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        if stream_id in self._streams:
            raise ValueError(f"stream_id {stream_id} is already open")
        if len(self._streams) >= self._max_streams:
            raise ValueError(f"too many open streams: the limit max_streams is {self._max_streams}")
        detokenizer = IncrementalDetokenizer(
            self._tokenizer, prompt_ids, skip_special_tokens=skip_special, keep_leading_space=keep_leading_space
        )
        matcher = StopStringMatcher(stop, include_stop_str_in_output) if stop else None
        self._streams[stream_id] = _TextStream(detokenizer, matcher)

    def __contains__(self, stream_id: int) -> bool:
        return stream_id in self._streams

    def __len__(self) -> int:
        return len(self._streams)
