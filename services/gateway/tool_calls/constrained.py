"""The parser of a reply constrained to one tool call (``tool_choice`` required or a named
function; http/structured.py builds the constraint): one more format behind the parsers'
interface, so a chat reply has one reader whatever reads its calls.

The engine's grammar guarantees the shape, so nothing is content: the reply is the call's
arguments (a named function), or ``{"name": <one of names>, "arguments": <its arguments>}``
(``required``), read as its name becomes known. A reply cut by max_tokens keeps everything
after the name as its (partial) arguments, as OpenAI returns a cut call; one that ended by
itself (``finish(whole=True)``) drops the wrapper's closing brace, held back one character
behind the text for that.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from services.gateway.tool_calls.events import CallArguments, CallOpened, Event


@dataclass(frozen=True, slots=True)
class ToolCallShape:
    """How a constrained reply encodes its call: the whole reply is the arguments of ``name``,
    or (``name`` None) ``{"name": ..., "arguments": ...}`` over ``names``."""

    name: str | None
    names: tuple[str, ...] = ()

    def prefix_of(self, name: str) -> str:
        return '{"name": ' + json.dumps(name) + ', "arguments": '


class ConstrainedCallParser:
    writes_content = False
    """Its reply is the call alone: no content, streamed (``content`` null) or whole."""
    done = False
    """The grammar ends the reply after its one call: nothing to cut short here."""

    def __init__(self, shape: ToolCallShape) -> None:
        self._shape = shape
        self._name = shape.name
        self._buffered = ""
        """With ``required``: the text before the call's name is known."""
        self._opened = False
        self._held = ""
        """With ``required``: the last character, which may be the closing brace of the wrapper."""

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        if self._shape.name is None:
            if self._name is None:
                self._buffered += text
                found = next((n for n in self._shape.names if self._buffered.startswith(self._shape.prefix_of(n))),
                             None)
                if found is None:
                    return out
                self._name, text = found, self._buffered[len(self._shape.prefix_of(found)):]
                out.append(self._open())
            # Hold the last character back: the wrapper's closing brace is not an argument.
            text, self._held = (self._held + text)[:-1], (self._held + text)[-1:]
        elif not self._opened:
            out.append(self._open())
        if text:
            out.append(CallArguments(0, text))
        return out

    def finish(self, whole: bool = True) -> list[Event]:
        """The held character, unless it closed the wrapper of a reply that ended by itself."""
        held, self._held = self._held, ""
        if not self._opened or not held or (whole and held == "}"):
            return []
        return [CallArguments(0, held)]

    def _open(self) -> CallOpened:
        self._opened = True
        return CallOpened(0, self._name)
