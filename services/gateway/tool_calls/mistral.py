"""``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (Mistral 7B v0.3, Nemo,
Small: a JSON array of calls after the marker), and the newer ``[TOOL_CALLS]name[ARGS]{...}``
(one call per marker).

``[TOOL_CALLS]`` is a special token of Mistral's own tokenizers, and the engine's text leaves
special tokens out (``NewTextStream.skip_special_tokens``; the Generation API has no switch for
it yet), so with those tokenizers the marker does not reach the gateway: this parser reads calls
where the marker is text.
A marker followed by neither shape, or an array item that is not a call, makes the rest content.
"""

from __future__ import annotations

import re

from services.gateway.tool_calls.events import CallOpened, Content, Event
from services.gateway.tool_calls.json_call import (
    FAILED,
    MAX_HEADER_CHARS,
    ArgumentsScanner,
    Header,
    marker_overlap,
    read_header,
)
from services.gateway.tool_calls.state_machine import CallStateMachine

MARKER = "[TOOL_CALLS]"
ARGS_MARKER = "[ARGS]"
ARGUMENT_KEYS = ("arguments",)
_NAME = re.compile(r"[A-Za-z0-9_-]*")

_TEXT, _AFTER_MARKER, _ITEM, _ARGS, _TAIL, _NAMED, _REST = range(7)


class MistralParser(CallStateMachine):
    def __init__(self, names: frozenset[str] | None = None, max_calls: int | None = None) -> None:
        super().__init__(names, _TEXT, max_calls)
        self._in_array = False

    def _rest_is_content(self) -> bool:
        self._state = _REST
        return True

    def _not_a_call(self, after_marker: str) -> bool:
        self._buffer = MARKER + after_marker
        return self._rest_is_content()

    def _step(self, out: list[Event], final: bool) -> bool:
        return _STEPS[self._state](self, self._buffer, out, final)

    def _step_rest(self, buffer: str, out: list[Event], final: bool) -> bool:
        if buffer:
            out.append(Content(buffer))
        self._buffer = ""
        return False

    def _step_text(self, buffer: str, out: list[Event], final: bool) -> bool:
        at = buffer.find(MARKER)
        if at < 0:
            keep = 0 if final else marker_overlap(buffer, MARKER)
            if len(buffer) > keep:
                out.append(Content(buffer[:len(buffer) - keep]))
            self._buffer = buffer[len(buffer) - keep:]
            return False
        if at:
            out.append(Content(buffer[:at]))
        self._buffer, self._state = buffer[at + len(MARKER):], _AFTER_MARKER
        return True

    def _step_after_marker(self, buffer: str, out: list[Event], final: bool) -> bool:
        """Which shape follows the marker: ``[`` an array of calls, anything else a name then ``[ARGS]``."""
        rest = buffer.lstrip()
        if len(buffer) - len(rest) > MAX_HEADER_CHARS:
            return self._not_a_call(buffer)
        if not rest:
            return False if not final else self._not_a_call(buffer)
        if rest[0] == "[":
            self._buffer, self._state, self._in_array = rest[1:], _ITEM, True
            return True
        self._state = _NAMED  # the buffer as written: it is content if no call follows
        return True

    def _step_named(self, buffer: str, out: list[Event], final: bool) -> bool:
        at = buffer.find(ARGS_MARKER, 0, MAX_HEADER_CHARS + len(ARGS_MARKER))
        if at < 0:
            keep = marker_overlap(buffer, ARGS_MARKER)
            if (not final and len(buffer) <= MAX_HEADER_CHARS
                    and _NAME.fullmatch(buffer[:len(buffer) - keep].strip()) is not None):
                return False  # a name so far, maybe followed by the start of "[ARGS]"
            return self._not_a_call(buffer)
        name = buffer[:at].strip()
        if not name or _NAME.fullmatch(name) is None or (self._names is not None and name not in self._names):
            return self._not_a_call(buffer)
        rest = buffer[at + len(ARGS_MARKER):].lstrip()
        if not rest:
            return False if not final else self._not_a_call(buffer)
        if rest[0] != "{":
            return self._not_a_call(buffer)
        out.append(CallOpened(self._index, name))
        self._buffer, self._state, self._scanner = rest, _ARGS, ArgumentsScanner()
        self._in_array = False
        return True

    def _step_item(self, buffer: str, out: list[Event], final: bool) -> bool:
        header = read_header(buffer, ARGUMENT_KEYS, self._names)
        if isinstance(header, Header):
            out.append(CallOpened(self._index, header.name))
            self._buffer, self._state, self._scanner = buffer[header.end:], _ARGS, ArgumentsScanner()
            return True
        if header == FAILED or final:
            if self._index == 0:
                self._buffer = MARKER + "[" + buffer
            return self._rest_is_content()
        return False

    def _step_args(self, buffer: str, out: list[Event], final: bool) -> bool:
        if not self._stream_arguments(out, final, _REST):
            return False
        if not self._in_array:
            self._index += 1
            self._state = _TEXT
            return True
        self._state, self._closing_brace = _TAIL, False
        return True

    def _step_tail(self, buffer: str, out: list[Event], final: bool) -> bool:
        """The item's ``}``, then ``,`` and another call, or ``]``."""
        stripped = self._past_closing_brace(buffer)
        if not stripped:
            if final:
                self._index += 1
            return False
        self._index += 1
        if stripped[0] == ",":
            self._buffer, self._state = stripped[1:], _ITEM
            return True
        if stripped[0] == "]":
            self._buffer, self._state = stripped[1:], _TEXT
            return True
        return self._rest_is_content()


_STEPS = {_TEXT: MistralParser._step_text, _AFTER_MARKER: MistralParser._step_after_marker,
          _ITEM: MistralParser._step_item, _ARGS: MistralParser._step_args, _TAIL: MistralParser._step_tail,
          _NAMED: MistralParser._step_named, _REST: MistralParser._step_rest}
