"""What a structured output may ask of the grammar library, checked before it is compiled.

llguidance builds lazily and bounds its own work with fuel (services/common/grammar_limits.py),
but some shapes cost far more than their size before any fuel runs out, or recurse in native
code where no limit applies. Each is refused here, in microseconds, with INVALID_ARGUMENT naming
the field and the limit:

- nesting (``MAX_NESTING``): a JSON schema's brackets, a regex's or a Lark grammar's groups.
  Python's json parser raised RecursionError (an INTERNAL) at 5,000 nested ``[``;
- a regex's counted repeats multiplied out (``MAX_REGEX_EXPANSION``): ``^(((a{50}){50}){50}){50}$`` is
  58 bytes and demands a 6,250,000-character match; its lexer took 2-3 s to build and its
  first masks failed with "too many expressions constructed". ``a{10000}`` or ``(a{100}){100}``
  builds in milliseconds, so the limit is 10,000;
- rules in a Lark grammar (``MAX_GRAMMAR_RULES``): a chain of 3,000 rules (``r0: r1``,
  ``r1: r2``, ...) overflowed the native stack of the thread compiling it.

The counts are conservative approximations of the library's work (alternatives count their
longest branch, unbounded repeats once); what slips past them still meets the library's fuel,
the compile worker's deadline and its own process (compile_workers.py).
"""

from __future__ import annotations

import json
import re

from services.common.errors import InvalidArgumentError
from services.scheduler.structured.structured_output import StructuredKind, StructuredOutput

MAX_NESTING = 64
"""Deepest nesting of a JSON schema's objects and arrays, or of a regex's or grammar's groups."""

MAX_REGEX_EXPANSION = 10_000
"""Longest match a regex's counted repeats may demand, multiplied out (``(a{100}){100}`` = 10,000)."""

MAX_GRAMMAR_RULES = 1_000
"""Most rule and terminal definitions in a Lark grammar."""

_QUANTIFIER = re.compile(r"\{(\d*)(?:(,)(\d*))?\}")
_LARK_STRING = re.compile(r'"(?:[^"\\\n]|\\.)*"i?')
_LARK_REGEX = re.compile(r"/((?:[^/\\\n]|\\.)+)/[imslux]*")
_LARK_COMMENT = re.compile(r"//[^\n]*")
_LARK_DEFINITION = re.compile(r"^\s*[?!]?[A-Za-z_][A-Za-z_0-9]*(?:\.-?\d+)?\s*:", re.MULTILINE)


def check_bounds(request: StructuredOutput) -> None:
    """Raise InvalidArgumentError when ``request`` is beyond a bound above."""
    field = request.field
    if request.kind is StructuredKind.JSON_SCHEMA:
        depth = json_depth(request.spec, MAX_NESTING)
        if depth > MAX_NESTING:
            raise InvalidArgumentError(f"{field} nests objects and arrays deeper than {MAX_NESTING} levels; the limit "
                                       f"is {MAX_NESTING} (max nesting depth)")
        try:
            schema = json.loads(request.spec)
        except ValueError:
            return  # the compiler says what is wrong with it
        for pattern in _schema_patterns(schema):
            _check_regex(f"{field} pattern {_quote(pattern)}", pattern)
    elif request.kind is StructuredKind.REGEX:
        _check_regex(field, request.spec)
    elif request.kind is StructuredKind.GRAMMAR:
        rules = len(_LARK_DEFINITION.findall(request.spec))
        if rules > MAX_GRAMMAR_RULES:
            raise InvalidArgumentError(f"{field} defines {rules} rules; the limit is {MAX_GRAMMAR_RULES} "
                                       "(max grammar rules)")
        text = _LARK_COMMENT.sub("", _LARK_STRING.sub('"x"', request.spec))
        for match in _LARK_REGEX.finditer(text):
            _check_regex(f"{field} regex {_quote(match.group(1))}", match.group(1))
        # The grammar's own group nesting, its literals and regexes as one symbol each.
        _, nesting = regex_cost(_LARK_REGEX.sub("x", text).replace('"x"', "x"), limit=len(text))
        _check_nesting(field, nesting)


def json_depth(text: str, limit: int) -> int:
    """The nesting depth of ``text``'s brackets outside strings; stops counting past ``limit``."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    return deepest
        elif char in "]}":
            depth -= 1
    return deepest


def regex_cost(pattern: str, limit: int = MAX_REGEX_EXPANSION) -> tuple[int, int]:
    """(expansion, nesting) of ``pattern``: the longest match its counted repeats demand,
    multiplied out (capped just past ``limit``), and its deepest group nesting. A scan of the
    syntax every dialect shares: escapes, classes, groups, alternatives, ``{m,n}``."""
    frames = [[0, 0, 0]]  # per open group: [longest finished alternative, current alternative, last atom]
    deepest = 0
    i, n = 0, len(pattern)
    while i < n:
        char = pattern[i]
        frame = frames[-1]
        if char == "\\":
            i += 2
            if i < n and pattern[i] == "{" and pattern[i - 1] in "pPxu":  # \p{L}, \x{41}, \u{41}
                end = pattern.find("}", i)
                i = n if end < 0 else end + 1
            _atom(frame, 1)
            continue
        if char == "[":
            i = _class_end(pattern, i)
            _atom(frame, 1)
            continue
        if char == "(":
            frames.append([0, 0, 0])
            deepest = max(deepest, len(frames) - 1)
            if deepest > MAX_NESTING:
                return 0, deepest
            i += 1
            if i < n and pattern[i] == "?":  # (?:, (?P<name>, (?<name>, (?=, (?i) ...
                while i < n and pattern[i] not in ":)>":
                    i += 1
                i += i < n and pattern[i] in ":>"
            continue
        if char == ")" and len(frames) > 1:
            frames.pop()
            _atom(frames[-1], max(frame[0], frame[1]))
        elif char == "|":
            frame[0], frame[1], frame[2] = max(frame[0], frame[1]), 0, 0
        elif char == "{" and (quantifier := _QUANTIFIER.match(pattern, i)):
            low, comma, high = quantifier.groups()
            count = int(high) if comma and high else int(low or 0)
            count = min(count, limit + 1)
            frame[1] += frame[2] * (count - 1)
            frame[2] *= count
            i = quantifier.end()
            if frame[1] > limit:
                return frame[1], deepest
            continue
        elif char not in "*+?^$":
            _atom(frame, 1)
        i += 1
    while len(frames) > 1:
        frame = frames.pop()
        _atom(frames[-1], max(frame[0], frame[1]))
    return max(frames[0][0], frames[0][1]), deepest


def _atom(frame: list[int], size: int) -> None:
    frame[1] += size
    frame[2] = size


def _class_end(pattern: str, start: int) -> int:
    """The index after the ``]`` closing the class at ``start`` (a leading ``]`` or ``^]`` is literal)."""
    i = start + 1
    if i < len(pattern) and pattern[i] == "^":
        i += 1
    if i < len(pattern) and pattern[i] == "]":
        i += 1
    while i < len(pattern) and pattern[i] != "]":
        i += 2 if pattern[i] == "\\" else 1
    return i + 1


def _check_nesting(field: str, nesting: int) -> None:
    if nesting > MAX_NESTING:
        raise InvalidArgumentError(f"{field} nests groups deeper than {MAX_NESTING} levels; the limit is "
                                   f"{MAX_NESTING} (max nesting depth)")


def _check_regex(field: str, pattern: str) -> None:
    expansion, nesting = regex_cost(pattern)
    _check_nesting(field, nesting)
    if expansion > MAX_REGEX_EXPANSION:
        raise InvalidArgumentError(f"{field} repeats demand a match of at least {expansion:,} characters; the limit is "
                                   f"{MAX_REGEX_EXPANSION:,} (max regex expansion: counted repeats multiplied out)")


def _schema_patterns(schema: object):
    """Every regex a JSON schema holds: ``pattern`` values and ``patternProperties`` keys."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "pattern" and isinstance(value, str):
                    yield value
                elif key == "patternProperties" and isinstance(value, dict):
                    yield from (k for k in value if isinstance(k, str))
                stack.append(value)
        elif isinstance(node, list):
            stack.extend(node)


def _quote(text: str, limit: int = 40) -> str:
    return json.dumps(text if len(text) <= limit else text[:limit] + "...")
