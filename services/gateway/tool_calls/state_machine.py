"""What the three format parsers share: the text buffer, the loop that runs a parser's state
machine until it needs more text, and the streaming of one call's arguments.

A format's parser subclasses ``CallStateMachine`` and writes ``_step`` (one move; False once it
needs more text or the text is done), starting in the state it names.
"""

from __future__ import annotations

from services.gateway.tool_calls.events import CallArguments, Event
from services.gateway.tool_calls.json_call import ArgumentsScanner


class CallStateMachine:
    def __init__(self, names: frozenset[str] | None, start: int) -> None:
        self._names = names
        """The functions the request offers (a call to another is content); None = any."""
        self._state = start
        self._buffer = ""
        self._index = 0
        """The index of the call being read (the number of calls made before it)."""
        self._scanner = ArgumentsScanner()
        self._closing_brace = False

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        return self._run(final=False)

    def finish(self) -> list[Event]:
        return self._run(final=True)

    def _run(self, final: bool) -> list[Event]:
        out: list[Event] = []
        while self._step(out, final):
            pass
        return out

    def _step(self, out: list[Event], final: bool) -> bool:
        raise NotImplementedError

    def _stream_arguments(self, out: list[Event], final: bool, cut_state: int) -> bool:
        """Pass on the buffered piece of the current call's arguments; True once they are whole
        (their closing brace read). A reply that ends before that ends the call as written (its
        finish_reason says "length") and goes on in ``cut_state``."""
        size = self._scanner.scan(self._buffer)
        if size:
            out.append(CallArguments(self._index, self._buffer[:size]))
        self._buffer = self._buffer[size:]
        if self._scanner.done:
            return True
        if final:
            self._index += 1
            self._state = cut_state
        return False
