"""The JSON of one call as it arrives: its header (``{"name": "...", "arguments": ``) read to a
verdict, then its arguments object followed to its closing brace.

The formats (hermes, llama3_json, mistral) differ in the markers around a call; inside, each
writes one JSON object naming the function and holding its arguments. Streaming the arguments in
pieces needs to know, before the object is complete, that this is a call (the header) and where
the arguments end (the brace that closes them), so both are read here on text that may stop
anywhere: every answer is "yes", "no" or "not yet", never a guess from a partial text.

The parsers run on the gateway's one event loop, on text a prompt can steer, and read a header
again on every delta until it is whole: so a header is read with C-speed regular expressions and
is at most MAX_HEADER_CHARS long (whitespace, an unterminated name, a name that never ends),
which keeps each delta's work bounded and a reply's work linear in its length.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

MAX_HEADER_CHARS = 512
"""Most characters a call's header (``{"name": "...", "arguments": {``, the whitespace in it, and
what precedes it after a call marker) may take before it is judged not a call. OpenAI's function
names are at most 64 characters."""

_WHITESPACE_RUN = re.compile(r"[ \t\r\n]*")
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)

PARTIAL = "partial"
"""The text so far could still become a header."""
FAILED = "failed"
"""It cannot: not this shape (another key order, not JSON, an unknown function)."""


@dataclass(frozen=True, slots=True)
class Header:
    name: str
    end: int
    """Where the arguments object begins (its ``{``) in the text read."""


def _skip(text: str, i: int) -> int:
    return _WHITESPACE_RUN.match(text, i).end()


def _literal(text: str, i: int, literal: str) -> tuple[str | None, int]:
    """(PARTIAL/FAILED/None for matched, the index after it)."""
    piece = text[i:i + len(literal)]
    if piece == literal:
        return None, i + len(literal)
    return (PARTIAL if literal.startswith(piece) else FAILED), i


def _string(text: str, i: int) -> tuple[str | None, int, str]:
    """A JSON string at i: (None when whole, the index after it, its value)."""
    if i >= len(text):
        return PARTIAL, i, ""
    if text[i] != '"':
        return FAILED, i, ""
    match = _JSON_STRING.match(text, i)
    if match is None:  # no unescaped closing quote yet
        return PARTIAL, i, ""
    try:
        return None, match.end(), json.loads(match.group())
    except ValueError:
        return FAILED, i, ""


def read_header(text: str, argument_keys: tuple[str, ...], names: frozenset[str] | None) -> Header | str:
    """``{"name": <string>, "<one of argument_keys>": {`` at the start of ``text`` (whitespace
    allowed between the parts): a Header once the arguments' ``{`` is read, else PARTIAL or
    FAILED. ``names``: the functions the request offers (None: any); another name is FAILED.
    Text past MAX_HEADER_CHARS that is not yet a header is FAILED."""
    verdict = _read_header(text[:MAX_HEADER_CHARS], argument_keys, names)
    return FAILED if verdict == PARTIAL and len(text) > MAX_HEADER_CHARS else verdict


def _read_header(text: str, argument_keys: tuple[str, ...], names: frozenset[str] | None) -> Header | str:
    i = _skip(text, 0)
    steps: list[str | None] = ["{", '"name"', ":", None, ","]
    name = ""
    for step in steps:
        i = _skip(text, i)
        if i >= len(text):
            return PARTIAL
        if step is None:
            verdict, i, name = _string(text, i)
            if verdict is not None:
                return verdict
            if not isinstance(name, str) or (names is not None and name not in names):
                return FAILED
            continue
        verdict, i = _literal(text, i, step)
        if verdict is not None:
            return verdict
    i = _skip(text, i)
    rest = text[i:]
    key = next((json.dumps(k) for k in argument_keys if rest.startswith(json.dumps(k))), None)
    if key is None:
        return PARTIAL if any(json.dumps(k).startswith(rest) for k in argument_keys) else FAILED
    after = i + len(key)
    i = _skip(text, after)
    verdict, i = _literal(text, i, ":")
    if verdict is not None:
        return verdict
    i = _skip(text, i)
    if i >= len(text):
        return PARTIAL
    return Header(name, i) if text[i] == "{" else FAILED


class ArgumentsScanner:
    """Follows a JSON object from its ``{`` to the brace that closes it, across pieces of text:
    depth, and whether a string (and an escape in it) is open, are all it needs to know."""

    __slots__ = ("depth", "in_string", "escaped", "done")

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.done = False

    def scan(self, text: str) -> int:
        """How much of ``text`` belongs to the object (all of it until the closing brace)."""
        for i, char in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i + 1
        return len(text)


def whole_call(text: str, argument_keys: tuple[str, ...], names: frozenset[str] | None) -> tuple[str, str] | None:
    """(name, arguments as JSON) of a complete call object in any key order; None when ``text`` is
    not one (not JSON, no string name, arguments not an object, an unknown function)."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = next((value[k] for k in argument_keys if k in value), None)
    if not isinstance(arguments, dict) or (names is not None and value["name"] not in names):
        return None
    return value["name"], json.dumps(arguments, ensure_ascii=False)


def marker_overlap(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker`` (held back: it may be one)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
