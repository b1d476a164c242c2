"""StructuredOutput -> the grammar the executor's matcher runs, compiled once per content.

llguidance (its Rust core: an Earley parser over a lazily built lexer) does the work, in the
scheduler as in the executor, with no torch in either's import. Compiling here means three
things, none of which needs the model's vocabulary:

1. translate the request's kind into llguidance's grammar JSON (a JSON schema in
   services/common/json_layout.py's layout, a regex, a Lark grammar; a choice becomes a Lark alternation of literals);
2. validate it (``LLMatcher.validate_grammar``): an unsupported or contradictory schema, a
   regex or grammar that does not parse, is refused with the library's message;
3. open a matcher over a byte-level vocabulary and ask for its first mask: a language with no
   first byte and no empty word (an empty regex class, an impossible pattern) admits nothing
   and is refused too, rather than left to end every stream with an empty output.

The result is cached by content (an LRU of ``CACHE_SIZE`` entries, failures included), so a
schema sent by every request of an application is compiled once. ``compile`` runs the work on
a worker thread (llguidance releases the GIL while it builds a grammar): the event loop and
the step path never wait for it; the request enters the waiting queue only once its grammar is
ready. Concurrent requests with one new schema share one compilation.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict

import llguidance
import llguidance.numpy

from services.common.errors import InvalidArgumentError
from services.common.json_layout import JSON_LAYOUT
from services.scheduler.structured.structured_output import StructuredKind, StructuredOutput

CACHE_SIZE = 256

MAX_CHOICES = 4096


class _ByteVocabulary:
    """A vocabulary of the 256 bytes plus an end token: enough to ask a grammar whether it
    admits any first byte, with no model's tokenizer in the scheduler."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([b]) for b in range(256)] + [b"<end>"]
    special_token_ids = [256]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


class GrammarCompiler:
    def __init__(self, max_grammar_bytes: int, cache_size: int = CACHE_SIZE) -> None:
        self.max_grammar_bytes = max_grammar_bytes
        self.cache_size = cache_size
        self._cache: OrderedDict[StructuredOutput, str | InvalidArgumentError] = OrderedDict()
        self._pending: dict[StructuredOutput, asyncio.Future] = {}
        self._bytes: llguidance.LLTokenizer | None = None
        self.compiled = 0
        """Compilations run (cache misses), for tests and benchmarks."""

    async def compile(self, request: StructuredOutput) -> str:
        """The grammar for ``request``, compiled on a worker thread unless cached. Raises
        InvalidArgumentError naming the field and the problem."""
        self.check_size(request)
        cached = self._lookup(request)
        if cached is None:
            pending = self._pending.get(request)
            if pending is None:
                pending = asyncio.get_running_loop().run_in_executor(None, self._compile_and_store, request)
                self._pending[request] = pending
                pending.add_done_callback(lambda _: self._pending.pop(request, None))
            cached = await asyncio.shield(pending)
        if isinstance(cached, InvalidArgumentError):
            raise InvalidArgumentError(str(cached))
        return cached

    def compile_now(self, request: StructuredOutput) -> str:
        """``compile`` on the calling thread (the in-process engine, tests)."""
        self.check_size(request)
        cached = self._lookup(request)
        if cached is None:
            cached = self._compile_and_store(request)
        if isinstance(cached, InvalidArgumentError):
            raise InvalidArgumentError(str(cached))
        return cached

    def check_size(self, request: StructuredOutput) -> None:
        size = request.num_bytes
        if size > self.max_grammar_bytes:
            raise InvalidArgumentError(f"{request.field} has {size} bytes; the limit is max_grammar_bytes="
                                       f"{self.max_grammar_bytes}")

    def _lookup(self, request: StructuredOutput) -> str | InvalidArgumentError | None:
        cached = self._cache.get(request)
        if cached is not None:
            self._cache.move_to_end(request)
        return cached

    def _compile_and_store(self, request: StructuredOutput) -> str | InvalidArgumentError:
        try:
            result: str | InvalidArgumentError = self._compile(request)
        except InvalidArgumentError as exc:
            result = exc
        self.compiled += 1
        self._cache[request] = result
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return result

    def _compile(self, request: StructuredOutput) -> str:
        grammar = _to_grammar(request)
        error = llguidance.LLMatcher.validate_grammar(grammar)
        if error:
            raise InvalidArgumentError(f"{request.field} does not compile: {_first_lines(error)}")
        self._check_admits_something(request, grammar)
        return grammar

    def _check_admits_something(self, request: StructuredOutput, grammar: str) -> None:
        if self._bytes is None:
            self._bytes = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteVocabulary()))
        matcher = llguidance.LLMatcher(self._bytes, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidArgumentError(f"{request.field} does not compile: {_first_lines(matcher.get_error())}")
        mask = llguidance.numpy.allocate_token_bitmask(1, self._bytes.vocab_size)
        llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
        # Words 0..7 hold the 256 byte tokens.
        if not mask[0, :8].any() and not matcher.is_accepting():
            raise InvalidArgumentError(f"{request.field} admits no output: no string matches it")


def _to_grammar(request: StructuredOutput) -> str:
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


def _first_lines(message: str, limit: int = 6) -> str:
    """llguidance's message with its context, cut to a few lines (a grammar dump can follow)."""
    lines = message.strip().splitlines()
    return "\n".join(lines[:limit]) + ("\n..." if len(lines) > limit else "")
