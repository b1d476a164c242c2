"""A parser's events -> one choice's reply: OpenAI's streamed deltas, or the whole message.

Whitespace between calls (the newline a model writes before, between and after its
``<tool_call>`` blocks) is not content: trailing whitespace is held until text follows it, and
dropped when a call follows it or the reply ends after a call. So the content of a reply that calls is
its words alone, and ``content`` is null when it had none, streamed and whole alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.gateway.tool_calls.events import CallArguments, CallOpened, Content, Event, ToolCallParser


@dataclass(frozen=True, slots=True)
class WholeReply:
    content: str | None
    """None when the reply made calls and said nothing else."""
    calls: list[tuple[str, str]]
    """(name, arguments) of each call, in order."""


@dataclass(slots=True)
class ReplyReader:
    """One choice's text through a parser: ``feed``/``finish`` answer content pieces and OpenAI
    tool-call deltas; ``call_ids(index)`` names each call."""

    parser: ToolCallParser
    call_id_prefix: str
    numbered: bool = True
    """False: the reply makes one call at most (a constrained one), whose id is the prefix itself."""
    calls: int = 0
    _held: str = ""
    _names: list[str] = field(default_factory=list)
    _arguments: list[list[str]] = field(default_factory=list)
    _content: list[str] = field(default_factory=list)

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """(content to send, tool-call deltas to send) that ``text`` completes."""
        return self._apply(self.parser.feed(text), final=False)

    def finish(self, whole: bool = True) -> tuple[str, list[dict]]:
        """What the end releases; ``whole``: the reply ended by itself (finish "stop")."""
        return self._apply(self.parser.finish(whole), final=True)

    @property
    def done(self) -> bool:
        """The parser read the most calls it may: the rest of the reply would be dropped."""
        return self.parser.done

    def call_id(self, index: int) -> str:
        return f"{self.call_id_prefix}_{index}" if self.numbered else self.call_id_prefix

    def _apply(self, events: list[Event], final: bool) -> tuple[str, list[dict]]:
        content: list[str] = []
        deltas: list[dict] = []
        for event in events:
            if isinstance(event, Content):
                # Trailing whitespace is held wherever the text was cut, so the answer does not
                # depend on where the deltas' boundaries fell.
                text = self._held + event.text
                body = text.rstrip()
                if body:
                    content.append(body)
                self._held = text[len(body):]
            elif isinstance(event, CallOpened):
                self._held = ""
                self.calls += 1
                self._names.append(event.name)
                self._arguments.append([])
                deltas.append({"index": event.index, "id": self.call_id(event.index), "type": "function",
                               "function": {"name": event.name, "arguments": ""}})
            elif isinstance(event, CallArguments):
                self._arguments[event.index].append(event.text)
                deltas.append({"index": event.index, "function": {"arguments": event.text}})
        if final and self._held and not self.calls:
            content.append(self._held)
        if final:
            self._held = ""
        text = "".join(content)
        self._content.append(text)
        return text, deltas

    def whole(self) -> WholeReply:
        """The reply read so far (after ``finish``: all of it)."""
        content = "".join(self._content)
        calls = [(name, "".join(pieces)) for name, pieces in zip(self._names, self._arguments)]
        return WholeReply(content if (content or not calls) and self.parser.writes_content else None, calls)


def read_whole(parser: ToolCallParser, text: str) -> WholeReply:
    reader = ReplyReader(parser, "call")
    reader.feed(text)
    reader.finish()
    return reader.whole()
