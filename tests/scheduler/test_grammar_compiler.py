"""Structured outputs at admission (services/scheduler/structured/grammar_compiler.py): each kind
compiles, a bad one is INVALID_ARGUMENT naming the field and the problem, the size limit, and
the cache (one compilation per content, shared by concurrent requests, off the event loop)."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from services.common.errors import InvalidArgumentError
from services.scheduler.structured.grammar_compiler import GrammarCompiler
from services.scheduler.structured.structured_output import StructuredOutput as S


@pytest.mark.parametrize("request_", [
    S.json_schema(json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})),
    S.json_schema("true"),
    S.json_object(),
    S.regex(r"[0-9]{3}-[a-z]+"),
    S.choice(["yes", "no", 'say "hi" \\ there', "é"]),
    S.grammar('start: "(" item ("," item)* ")"\nitem: /[a-z]+/'),
], ids=lambda r: r.kind.value)
def test_each_kind_compiles(request_):
    assert GrammarCompiler(65536).compile_now(request_)


@pytest.mark.parametrize("request_,message", [
    (S.json_schema("{bad"), "structured_output.json_schema is not valid JSON"),
    (S.json_schema("[1, 2]"), "structured_output.json_schema must be a JSON object"),
    (S.json_schema(json.dumps({"type": "foo"})), "structured_output.json_schema does not compile: Invalid type: foo"),
    (S.json_schema(json.dumps({"type": "integer", "minimum": 5, "maximum": 3})),
     "Unsatisfiable schema: minimum \\(5\\) is greater than maximum \\(3\\)"),
    (S.json_schema(json.dumps({"$ref": "#/$defs/missing"})), "does not exist"),
    (S.json_schema("false"), "structured_output.json_schema admits no output: the schema is false"),
    (S.regex("a(b"), "(?s)structured_output.regex does not compile: .*unclosed group"),
    (S.regex(r"[^\x00-\U0010FFFF]"), "structured_output.regex admits no output"),
    (S.choice([]), "structured_output.choice has no options"),
    (S.choice(["a", ""]), "structured_output.choice has an empty option"),
    (S.grammar("start: missing_rule"), "(?s)structured_output.grammar does not compile: .*unknown name"),
    (S.grammar("   "), "structured_output.grammar is empty"),
])
def test_a_bad_request_names_the_field_and_the_problem(request_, message):
    with pytest.raises(InvalidArgumentError, match=message):
        GrammarCompiler(65536).compile_now(request_)


def test_a_schema_over_the_limit_is_refused_before_compiling():
    compiler = GrammarCompiler(max_grammar_bytes=100)
    schema = json.dumps({"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(10)}})
    with pytest.raises(InvalidArgumentError, match=f"structured_output.json_schema has {len(schema)} bytes; "
                                                   "the limit is max_grammar_bytes=100"):
        compiler.compile_now(S.json_schema(schema))
    assert compiler.compiled == 0


def test_compiled_once_per_content_failures_included():
    compiler = GrammarCompiler(65536)
    schema = S.json_schema(json.dumps({"type": "array", "items": {"type": "number"}}))
    first = compiler.compile_now(schema)
    assert compiler.compile_now(S.json_schema(schema.spec)) == first
    for _ in range(2):
        with pytest.raises(InvalidArgumentError):
            compiler.compile_now(S.regex("a(b"))
    assert compiler.compiled == 2


def test_the_cache_keeps_the_most_recent():
    compiler = GrammarCompiler(65536, cache_size=2)
    for pattern in ("a+", "b+", "a+", "c+", "a+", "b+"):  # b+ was evicted by c+
        compiler.compile_now(S.regex(pattern))
    assert compiler.compiled == 4


async def test_concurrent_requests_share_one_compilation_off_the_event_loop():
    compiler = GrammarCompiler(65536)
    threads: set[str] = set()
    compile_once = compiler._compile

    def recording(request):
        threads.add(threading.current_thread().name)
        return compile_once(request)

    compiler._compile = recording
    schema = S.json_schema(json.dumps({"type": "object", "properties": {"x": {"enum": [1, 2, 3]}}}))
    results = await asyncio.gather(*(compiler.compile(schema) for _ in range(8)))
    assert len(set(results)) == 1 and compiler.compiled == 1
    assert threading.main_thread().name not in threads
    with pytest.raises(InvalidArgumentError, match="does not compile"):
        await compiler.compile(S.regex("("))
