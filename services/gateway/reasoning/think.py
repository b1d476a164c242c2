"""``<think>...</think>``: a reply's reasoning section apart from its content, as the text comes.

``feed`` answers the (reasoning, content) that the new text completes and holds back only what
could still be part of a tag (at most 7 characters) and the whitespace at the end of the
reasoning; ``finish`` flushes it. Each piece of text is scanned once from where the last scan
stopped, so a reply costs time linear in its length however it is cut into deltas, and the same
parser fed the whole text at once gives the same split (the tests cut replies at every point).

- ``starts_inside``: the chat template already wrote ``<think>`` (DeepSeek-R1's opens it in the
  generation prompt), so the reply is reasoning up to ``</think>``; a ``<think>`` the model
  writes anyway at the start is dropped. A reply without ``</think>`` (cut by ``max_tokens``) is
  all reasoning.
- otherwise (Qwen3's): the reply is reasoning only when it opens with ``<think>`` (after any
  whitespace); a reply that does not is content, byte for byte.

The whitespace that templates put around the tags (``<think>\\n``, ``\\n</think>\\n\\n``) is not
part of either: the reasoning is trimmed at both ends, the content at its start.
A second ``<think>`` after the section closed is content, as is anything after ``</think>``.
"""

from __future__ import annotations

OPEN = "<think>"
CLOSE = "</think>"

_START, _INSIDE, _AFTER = 0, 1, 2


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ThinkParser:
    """One choice's reply split into reasoning and content (see the module docstring)."""

    __slots__ = ("starts_inside", "_state", "_pending", "_opening", "_tail", "_space", "_reasoned", "_answered")

    def __init__(self, starts_inside: bool) -> None:
        self.starts_inside = starts_inside
        self._state = _START
        self._pending: list[str] = []
        """_START: the whitespace the reply opened with, in pieces (joined once)."""
        self._opening = ""
        """_START: what followed that whitespace, a start of ``<think>`` (at most 6 characters)."""
        self._tail = ""
        """_INSIDE: the end of the text read that may be the start of ``</think>``."""
        self._space: list[str] = []
        """_INSIDE: whitespace after the last reasoning sent, in pieces (dropped if the section
        closes)."""
        self._reasoned = False
        self._answered = False

    @property
    def reasoning_closed(self) -> bool:
        """The reply is past its reasoning (or never had one)."""
        return self._state == _AFTER

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that ``text`` completes."""
        reasoning: list[str] = []
        content: list[str] = []
        self._read(text, reasoning, content)
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """The reply ended: what was held back (an unfinished tag is text of its section)."""
        reasoning: list[str] = []
        content: list[str] = []
        if self._state == _START:
            pending = "".join(self._pending) + self._opening
            self._pending, self._opening = [], ""
            if self.starts_inside:
                self._state = _INSIDE
                self._reason(pending, reasoning)
            else:
                self._state = _AFTER
                self._answered = True
                content.append(pending)
        elif self._state == _INSIDE:
            self._reason(self._tail, reasoning)
            self._tail = ""
        self._space = []  # trailing whitespace of reasoning that never closed
        return "".join(reasoning), "".join(content)

    def _read(self, text: str, reasoning: list[str], content: list[str]) -> None:
        if self._state == _START:
            text = self._decide(text)
            if text is None:
                return
        if self._state == _INSIDE:
            buffer = self._tail + text
            end = buffer.find(CLOSE)
            if end < 0:
                keep = _partial_suffix(buffer, CLOSE)
                self._tail = buffer[len(buffer) - keep:]
                self._reason(buffer[:len(buffer) - keep], reasoning)
                return
            self._reason(buffer[:end], reasoning)
            self._tail, self._space = "", []
            self._state = _AFTER
            text = buffer[end + len(CLOSE):]
        if not self._answered:
            text = text.lstrip()
            self._answered = bool(text)
        if text:
            content.append(text)

    def _decide(self, text: str) -> str | None:
        """_START: the text to read in the state the reply's opening decides, or None while
        the opening is still undecided (only whitespace, or a start of ``<think>``, read)."""
        if self._opening:
            opening = self._opening + text
        else:  # the whitespace before the opening is set apart once, not stripped again per delta
            opening = text.lstrip()
            self._pending.append(text[:len(text) - len(opening)])
        if not opening or (len(opening) < len(OPEN) and OPEN.startswith(opening)):
            self._opening = opening
            return None
        space = "".join(self._pending)
        self._pending, self._opening = [], ""
        if opening.startswith(OPEN):
            self._state = _INSIDE
            return opening[len(OPEN):]
        if self.starts_inside:
            self._state = _INSIDE
            return opening
        self._state = _AFTER
        self._answered = True
        return space + opening

    def _reason(self, piece: str, reasoning: list[str]) -> None:
        """Reasoning text, trimmed: leading whitespace dropped, trailing held until more follows."""
        if not self._reasoned:
            piece = piece.lstrip()
            if not piece:
                return
            self._reasoned = True
        body = piece.rstrip()
        if not body:
            self._space.append(piece)
            return
        reasoning.extend(self._space)
        reasoning.append(body)
        self._space = [piece[len(body):]]
