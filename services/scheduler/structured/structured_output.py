"""What a constrained request asks its output to be: the domain value of StructuredOutput.

One of five kinds, each with its text: a JSON schema (JSON text), any JSON object, a regular
expression, a choice among strings, or a Lark grammar. ``GrammarCompiler`` turns it into the
grammar the executor's matcher runs.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class StructuredKind(enum.Enum):
    JSON_SCHEMA = "json_schema"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    CHOICE = "choice"
    GRAMMAR = "grammar"


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    kind: StructuredKind
    spec: str = ""
    """The JSON schema's text, the regex or the Lark grammar; "" for json_object and choice."""
    options: tuple[str, ...] = ()
    """The strings a choice may be."""

    @classmethod
    def json_schema(cls, schema: str) -> StructuredOutput:
        return cls(StructuredKind.JSON_SCHEMA, schema)

    @classmethod
    def json_object(cls) -> StructuredOutput:
        return cls(StructuredKind.JSON_OBJECT)

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutput:
        return cls(StructuredKind.REGEX, pattern)

    @classmethod
    def choice(cls, options: tuple[str, ...] | list[str]) -> StructuredOutput:
        return cls(StructuredKind.CHOICE, options=tuple(options))

    @classmethod
    def grammar(cls, lark: str) -> StructuredOutput:
        return cls(StructuredKind.GRAMMAR, lark)

    @property
    def field(self) -> str:
        """Its field in the API, for error messages."""
        return f"structured_output.{self.kind.value}"

    @property
    def num_bytes(self) -> int:
        """The size the max_grammar_bytes limit applies to."""
        return len(self.spec.encode()) + sum(len(option.encode()) for option in self.options)
