"""One structured output compiled: the work itself, with no cache, pool or process around it.

Compiling means four things, none of which needs the model (a byte vocabulary serves when the
model's tokenizer is not at hand):

1. check the bounds a compile must stay within (bounds.py: nesting, counted repeats, rules);
2. translate the request's kind into llguidance's grammar JSON (a JSON schema in
   services/common/json_layout.py's layout, a regex, a Lark grammar; a choice becomes a Lark
   alternation of literals);
3. validate it under the parser limits every grammar runs within (services/common/grammar_limits.py):
   an unsupported or contradictory schema, a regex or grammar that does not parse, is refused
   with the library's message;
4. open a matcher over the vocabulary and build its first mask: a language with no first token
   and no empty word admits nothing and is refused, and a grammar whose first mask exceeds the
   limits is refused here, at admission, rather than failing inside a step.

The scheduler runs this in a compile worker process (compile_workers.py); the in-process engine
on its own thread.
"""

from __future__ import annotations

import json

import llguidance
import llguidance.numpy
import numpy as np

from services.common.errors import InvalidArgumentError
from services.common.grammar_limits import parser_limits
from services.common.json_layout import JSON_LAYOUT
from services.scheduler.structured.bounds import check_bounds
from services.scheduler.structured.structured_output import StructuredKind, StructuredOutput

MAX_CHOICES = 4096


class _ByteVocabulary:
    """A vocabulary of the 256 bytes plus an end token: enough to ask a grammar whether it
    admits any first byte, with no model's tokenizer at hand."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([b]) for b in range(256)] + [b"<end>"]
    special_token_ids = [256]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


def byte_vocabulary() -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteVocabulary()))


def build(request: StructuredOutput, vocabulary: llguidance.LLTokenizer) -> str:
    """The grammar of ``request``, checked against ``vocabulary``. Raises InvalidArgumentError
    naming the field and the problem."""
    check_bounds(request)
    grammar = to_grammar(request)
    limits = parser_limits()
    error = llguidance.LLMatcher.validate_grammar(grammar, limits=limits)
    if error:
        raise InvalidArgumentError(f"{request.field} does not compile: {first_lines(error)}")
    matcher = llguidance.LLMatcher(vocabulary, grammar, log_level=0, limits=limits)
    if matcher.is_error():
        raise InvalidArgumentError(f"{request.field} does not compile: {first_lines(matcher.get_error())}")
    mask = llguidance.numpy.allocate_token_bitmask(1, vocabulary.vocab_size)
    llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
    for eos in vocabulary.eos_tokens:  # a failed matcher's mask allows EOS alone
        mask[0, eos // 32] &= ~np.int32(np.uint32(1 << (eos % 32)).view(np.int32))
    if not mask.any() and not matcher.is_accepting():
        raise InvalidArgumentError(f"{request.field} admits no output: no string matches it")
    if matcher.is_error():
        raise InvalidArgumentError(f"{request.field} is beyond the grammar limits: "
                                   f"{first_lines(matcher.get_error(), 1)}")
    return grammar


def to_grammar(request: StructuredOutput) -> str:
    kind = request.kind
    if kind is StructuredKind.JSON_SCHEMA:
        try:
            schema = json.loads(request.spec)
        except ValueError as exc:
            raise InvalidArgumentError(f"{request.field} is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidArgumentError(f"{request.field} must be a JSON object (or true/false), "
                                       f"got {type(schema).__name__}")
        if schema is False:
            raise InvalidArgumentError(f"{request.field} admits no output: the schema is false")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema({} if schema is True else schema, defaults=JSON_LAYOUT)
        except ValueError as exc:
            raise InvalidArgumentError(f"{request.field} does not compile: {exc}") from None
    if kind is StructuredKind.JSON_OBJECT:
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
    if kind is StructuredKind.REGEX:
        return llguidance.LLMatcher.grammar_from_regex(request.spec)
    if kind is StructuredKind.CHOICE:
        options = request.options
        if not options:
            raise InvalidArgumentError(f"{request.field} has no options: give at least one string")
        if len(options) > MAX_CHOICES:
            raise InvalidArgumentError(f"{request.field} has {len(options)} options; the limit is {MAX_CHOICES}")
        if any(not option for option in options):
            raise InvalidArgumentError(f"{request.field} has an empty option; every option must be a non-empty string")
        # Lark string literals take JSON's escapes, so json.dumps writes each option exactly.
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(o) for o in options))
    if not request.spec.strip():
        raise InvalidArgumentError(f"{request.field} is empty")
    return llguidance.LLMatcher.grammar_from_lark(request.spec)


def first_lines(message: str, limit: int = 6) -> str:
    """llguidance's message with its context, cut to a few lines (a grammar dump can follow)."""
    lines = message.strip().splitlines()
    return "\n".join(lines[:limit]) + ("\n..." if len(lines) > limit else "")
