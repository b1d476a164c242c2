"""What the three format parsers share: the text buffer, the loop that runs a parser's state
machine until it needs more text, and the streaming of one call's arguments.

A format's parser subclasses ``CallStateMachine`` and writes ``_step`` (one move; False once it
needs more text or the text is done), starting in the state it names.

``max_calls`` (OpenAI's ``parallel_tool_calls: false`` is 1): once that many calls are whole
(their arguments' closing brace read), the machine is ``done``: it reads no further and what
follows is dropped, so the reply is its content and those calls, and the caller may end the
generation there. The formats' own endings after the brace (``</tool_call>``, ``]``) are not
waited for.

Work per delta stays bounded, so a reply costs time linear in its length whatever a prompt makes
the model write: a header is read to at most MAX_HEADER_CHARS (json_call.py), and a search for a
marker in a held-back block resumes where the last one ended (``_find``) instead of rescanning it.
"""

from __future__ import annotations

from services.gateway.tool_calls.events import CallArguments, Event
from services.gateway.tool_calls.json_call import ArgumentsScanner


class CallStateMachine:
    def __init__(self, names: frozenset[str] | None, start: int, max_calls: int | None = None) -> None:
        self._names = names
        """The functions the request offers (a call to another is content); None = any."""
        self._state = start
        self._text = ""
        self._searched = 0
        """How far ``_find`` has searched ``_text`` (a marker begins nowhere before it)."""
        self._index = 0
        """The index of the call being read (the number of calls made before it)."""
        self._scanner = ArgumentsScanner()
        self._closing_brace = False
        self._max_calls = max_calls
        self._closed = 0
        """Calls read whole."""

    @property
    def _buffer(self) -> str:
        """The text read and not yet passed on. A state that sets it starts a new search."""
        return self._text

    @_buffer.setter
    def _buffer(self, text: str) -> None:
        self._text, self._searched = text, 0

    def _find(self, marker: str) -> int:
        """``self._buffer.find(marker)``, resuming where the last search of this buffer ended:
        the text held back only grows between two settings of it."""
        at = self._text.find(marker, self._searched)
        if at < 0:
            self._searched = max(0, len(self._text) - len(marker) + 1)
        return at

    @property
    def done(self) -> bool:
        """``max_calls`` calls are whole: the rest of the reply is not read."""
        return self._max_calls is not None and self._closed >= self._max_calls

    def feed(self, text: str) -> list[Event]:
        if self.done:
            return []
        self._text += text  # appended: the search position stays valid
        return self._run(final=False)

    writes_content = True

    def finish(self, whole: bool = True) -> list[Event]:
        """``whole`` changes nothing here: free text is read the same however it ended."""
        return [] if self.done else self._run(final=True)

    def _run(self, final: bool) -> list[Event]:
        out: list[Event] = []
        while self._step(out, final):
            if self.done:
                self._buffer = ""
                break
        return out

    def _call_closed(self) -> None:
        """A subclass's word that the current call is whole."""
        self._closed += 1

    def _past_closing_brace(self, buffer: str) -> str:
        """``buffer`` past its leading whitespace and, once a call, the wrapper's closing "}"
        (with the whitespace after it); it becomes the buffer."""
        stripped = buffer.lstrip()
        if not self._closing_brace and stripped.startswith("}"):
            self._closing_brace, stripped = True, stripped[1:].lstrip()
        self._buffer = stripped
        return stripped

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
            self._call_closed()
            return True
        if final:
            self._index += 1
            self._state = cut_state
        return False
