"""``llama3_json``: the reply is ``{"name": ..., "parameters": {...}}``, as Llama 3.1-3.3's
templates ask for JSON tool calls (optionally after ``<|python_tag|>``; several separated by
``;``). ``arguments`` is read as well as ``parameters``.

Calls come at the start of the reply only: a reply that does not open with ``{`` is text, and so
is one whose JSON is not a call's header (held back only until that is clear, usually the first
key). Once a call has been made, text after it that is not another call is content.
"""

from __future__ import annotations

from services.gateway.tool_calls.events import CallOpened, Content, Event
from services.gateway.tool_calls.json_call import FAILED, MAX_HEADER_CHARS, ArgumentsScanner, Header, read_header
from services.gateway.tool_calls.state_machine import CallStateMachine

PYTHON_TAG = "<|python_tag|>"
ARGUMENT_KEYS = ("parameters", "arguments")

_START, _HEADER, _ARGS, _TAIL, _TEXT = range(5)


class Llama3JsonParser(CallStateMachine):
    def __init__(self, names: frozenset[str] | None = None, max_calls: int | None = None) -> None:
        super().__init__(names, _START, max_calls)

    def _to_text(self) -> bool:
        self._state = _TEXT
        return True

    def _step(self, out: list[Event], final: bool) -> bool:
        buffer = self._buffer
        if self._state == _TEXT:
            if buffer:
                out.append(Content(buffer))
            self._buffer = ""
            return False
        if self._state == _START:
            # Held as written (whitespace, the tag) until the first character decides, for at
            # most a header's length.
            rest = buffer.lstrip()
            if rest.startswith(PYTHON_TAG):
                rest = rest[len(PYTHON_TAG):].lstrip()
            elif rest and PYTHON_TAG.startswith(rest):
                rest = ""
            if not rest:
                return False if not final and len(buffer) <= MAX_HEADER_CHARS else self._to_text()
            if rest[0] != "{":
                return self._to_text()
            self._state = _HEADER
            return True
        if self._state == _HEADER:
            start = buffer.find("{")
            header = read_header(buffer[start:], ARGUMENT_KEYS, self._names)
            if isinstance(header, Header):
                out.append(CallOpened(self._index, header.name))
                self._buffer = buffer[start + header.end:]
                self._state, self._scanner = _ARGS, ArgumentsScanner()
                return True
            if header == FAILED or final:
                return self._to_text()
            return False
        if self._state == _ARGS:
            if not self._stream_arguments(out, final, _TEXT):
                return False
            self._state, self._closing_brace = _TAIL, False
            return True
        # _TAIL: the object's "}", then ";" and another call, or the end.
        stripped = self._past_closing_brace(buffer)
        if not stripped:
            if final:
                self._index += 1
            return False
        self._index += 1
        if stripped.startswith(";"):
            self._buffer, self._state = stripped[1:], _START
            return True
        return self._to_text()
