"""``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, as Hermes 2 Pro,
Qwen2.5 and Qwen3 templates teach it: any number of calls, with text before, between and after.

A call streams once its header (``{"name": "...", "arguments": ``) is read: its name first,
then its arguments in pieces to their closing brace. A block whose JSON has another shape (keys
in another order, ``parameters``) is judged whole at ``</tool_call>``: a valid call object is a
call, anything else (not JSON, no name, a function the request does not offer) is content, with
its markers. Arguments cut short by the end of the reply stay as written (finish_reason says
"length"), as OpenAI's own arguments may be.
"""

from __future__ import annotations

from services.gateway.tool_calls.events import CallArguments, CallOpened, Content, Event
from services.gateway.tool_calls.json_call import (
    FAILED,
    ArgumentsScanner,
    Header,
    marker_overlap,
    read_header,
    whole_call,
)
from services.gateway.tool_calls.state_machine import CallStateMachine

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
ARGUMENT_KEYS = ("arguments",)
WHOLE_ARGUMENT_KEYS = ("arguments", "parameters")

_TEXT, _HEADER, _BLOCK, _ARGS, _TAIL = range(5)


class HermesParser(CallStateMachine):
    def __init__(self, names: frozenset[str] | None = None, max_calls: int | None = None) -> None:
        super().__init__(names, _TEXT, max_calls)

    def _step(self, out: list[Event], final: bool) -> bool:
        """One move of the state machine; False once it needs more text (or the text is done)."""
        buffer = self._buffer
        if self._state == _TEXT:
            at = buffer.find(OPEN)
            if at < 0:
                keep = 0 if final else marker_overlap(buffer, OPEN)
                _content(out, buffer[:len(buffer) - keep])
                self._buffer = buffer[len(buffer) - keep:]
                return False
            _content(out, buffer[:at])
            self._buffer, self._state = buffer[at + len(OPEN):], _HEADER
            return True
        if self._state == _HEADER:
            header = read_header(buffer, ARGUMENT_KEYS, self._names)
            if isinstance(header, Header):
                out.append(CallOpened(self._index, header.name))
                self._buffer, self._state, self._scanner = buffer[header.end:], _ARGS, ArgumentsScanner()
                return True
            if header == FAILED or final or CLOSE in buffer:
                self._state = _BLOCK
                return True
            return False
        if self._state == _BLOCK:
            at = self._find(CLOSE)
            if at < 0 and not final:
                return False
            call = whole_call(buffer[:at], WHOLE_ARGUMENT_KEYS, self._names) if at >= 0 else None
            if call is None:
                _content(out, OPEN + (buffer[:at + len(CLOSE)] if at >= 0 else buffer))
            else:
                out += [CallOpened(self._index, call[0]), CallArguments(self._index, call[1])]
                self._index += 1
                self._call_closed()
            self._buffer, self._state = (buffer[at + len(CLOSE):] if at >= 0 else ""), _TEXT
            return True
        if self._state == _ARGS:
            if not self._stream_arguments(out, final, _TEXT):
                return False
            self._state, self._closing_brace = _TAIL, False
            return True
        # _TAIL: the wrapper's "}" and the close marker, whitespace around them; a reply that
        # goes on without them ends the call there and its text is content.
        stripped = self._past_closing_brace(buffer)
        if not stripped and not final:
            return False
        if stripped.startswith(CLOSE):
            self._buffer = stripped[len(CLOSE):]
        elif CLOSE.startswith(stripped) and stripped and not final:
            return False
        self._index += 1
        self._state = _TEXT
        return True


def _content(out: list[Event], text: str) -> None:
    if text:
        out.append(Content(text))
