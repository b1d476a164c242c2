"""What a tool-call parser makes of a reply's text: content, and calls opened then argued.

A parser (one module per format) is fed the reply's text deltas as they come and answers with
these events; ``finish`` flushes what it held back. Every parser holds back only the text that
could still be part of a call marker or a call's header, so content flows as it is written.
The same parser run on the whole text gives the whole reply (reader.py), so a streamed reply and
a non-streamed one agree: the tests feed each format's replies split at every boundary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Content:
    text: str


@dataclass(frozen=True, slots=True)
class CallOpened:
    index: int
    """The call's place among the reply's calls, from 0."""
    name: str


@dataclass(frozen=True, slots=True)
class CallArguments:
    index: int
    text: str
    """The next piece of the call's arguments (JSON text, as the model writes it)."""


Event = Content | CallOpened | CallArguments


class ToolCallParser(Protocol):
    done: bool
    """The most calls asked for are made (``max_calls``): the rest of the reply is not read."""
    writes_content: bool
    """False where the reply can hold nothing but calls (a constrained one: ``content`` null)."""

    def feed(self, text: str) -> list[Event]:
        """The events the reply's next text completes."""

    def finish(self, whole: bool = True) -> list[Event]:
        """The reply ended: what was held back (a partial marker, a header that never completed).
        ``whole``: it ended by itself, not cut by max_tokens."""
