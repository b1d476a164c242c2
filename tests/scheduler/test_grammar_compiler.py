"""Structured outputs at admission (services/scheduler/structured/grammar_compiler.py): each kind
compiles, a bad one is INVALID_ARGUMENT naming the field and the problem, the size limit, and
the cache (one compilation per content, shared by concurrent requests, off the event loop).
Hostile ones: the bounds checked before compiling (bounds.py), and on real compile worker
processes a grammar that crashes its worker (refused, quarantined, the worker restarted), the
compile deadline, and each tenant's share of the workers."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from services.common.errors import InvalidArgumentError, UnavailableError
from services.scheduler.structured.compile_workers import CompileWorkers
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


# ---------------------------------------------------------------- hostile structured outputs
def chained_rules(n: int) -> str:
    """A Lark grammar of ``n`` rules each naming the next: the library recurses once per rule."""
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n - 1)) + f'r{n - 1}: "a"\n'


NESTED_REPEATS = json.dumps({"type": "string", "pattern": "^(((a{50}){50}){50}){50}$"})


@pytest.mark.parametrize("request_,message", [
    # 58 bytes demanding a 6,250,000-character match: its lexer took seconds to build.
    (S.json_schema(NESTED_REPEATS), 'structured_output.json_schema pattern "\\^\\(\\(\\(a\\{50}.*at least 125,000 '
                                    "characters; the limit is 10,000 \\(max regex expansion"),
    (S.regex("(a{100}){101}"), "structured_output.regex repeats demand a match of at least 10,100 characters; the limit "
                               "is 10,000"),
    (S.json_schema(json.dumps({"type": "object", "patternProperties": {"^(x{200}){200}$": {}}})),
     "pattern .*the limit is 10,000"),
    (S.grammar('start: A\nA: /(b{1000}){20}/'), "structured_output.grammar regex .*the limit is 10,000"),
    # Python's json parser raised RecursionError (INTERNAL) at this depth.
    (S.json_schema("[" * 5000 + "]" * 5000), "structured_output.json_schema nests objects and arrays deeper than "
                                             "64 levels; the limit is 64"),
    (S.regex("(" * 65 + "a" + ")" * 65), "structured_output.regex nests groups deeper than 64 levels"),
    (S.grammar(chained_rules(3000)), "structured_output.grammar defines 3001 rules; the limit is 1000"),
], ids=["nested-repeats", "regex-expansion", "pattern-properties", "lark-regex", "json-depth", "regex-depth",
        "rule-chain"])
def test_a_structured_output_beyond_the_bounds_is_refused_before_compiling(request_, message):
    with pytest.raises(InvalidArgumentError, match=message):
        GrammarCompiler(65536).compile_now(request_)


@pytest.mark.parametrize("request_", [
    S.regex("(a{100}){100}"), S.regex(r"^[a-z0-9._%+-]+@[a-z0-9.-]+\.[a-z]{2,}$"), S.regex(r"\p{L}{20}[\]{}]{3}"),
    S.json_schema(json.dumps({"type": "string", "pattern": "^[A-Z]{3}-\\d{4}$"})), S.grammar(chained_rules(200)),
], ids=lambda r: r.spec[:20])
def test_fair_requests_within_the_bounds_compile(request_):
    assert GrammarCompiler(65536).compile_now(request_)


def workers_compiler(**options) -> GrammarCompiler:
    return GrammarCompiler(65536, workers=CompileWorkers(**{"workers": 1, "timeout_s": 30.0, **options}))


@pytest.mark.slow
async def test_a_grammar_that_crashes_its_compile_worker_is_refused_and_quarantined():
    compiler = workers_compiler()
    try:
        deep = S.grammar(chained_rules(990))  # within the rule bound; overflows the worker's 2 MiB stack
        with pytest.raises(InvalidArgumentError, match="structured_output.grammar crashed the grammar compiler "
                                                       "\\(SIGSEGV\\); it is refused"):
            await compiler.compile(deep, "attacker")
        assert compiler.workers.crashes == 1
        began = time.perf_counter()
        with pytest.raises(InvalidArgumentError, match="structured_output.grammar is quarantined: an identical one "
                                                       "crashed the grammar compiler \\(SIGSEGV\\)"):
            await compiler.compile(S.grammar(deep.spec), "someone-else")
        assert time.perf_counter() - began < 0.05 and compiler.workers.crashes == 1
        # The worker was started again: the next request compiles.
        assert await compiler.compile(S.json_schema('{"type": "integer"}'), "victim")
    finally:
        await compiler.workers.close()


@pytest.mark.slow
async def test_a_compile_past_its_deadline_is_refused_and_not_cached():
    compiler = workers_compiler(timeout_s=0.001)
    try:
        with pytest.raises(InvalidArgumentError, match="structured_output.regex took longer than "
                                                       "grammar_compile_timeout_s=0.001 to compile"):
            await compiler.compile(S.regex("[a-z]+"))
        compiler.workers.timeout_s = 30.0
        assert await compiler.compile(S.regex("[a-z]+"))  # not remembered as a failure
    finally:
        await compiler.workers.close()


@pytest.mark.slow
async def test_one_tenant_holds_at_most_its_share_of_the_workers():
    workers = CompileWorkers(workers=2, timeout_s=30.0, per_tenant=1)
    busy = 0
    most = {"a": 0, "b": 0}
    run_on = workers._run_on

    async def counting(slot, request):
        nonlocal busy
        tenant = request.spec[0]
        busy += 1
        most[tenant] = max(most[tenant], sum(1 for t in running if t == tenant) + 1)
        running.append(tenant)
        try:
            return await run_on(slot, request)
        finally:
            running.remove(tenant)

    running: list[str] = []
    workers._run_on = counting
    try:
        results = await asyncio.gather(*(workers.run(S.regex(f"{t}{i}+"), t) for t in "ab" for i in range(4)))
        assert all(isinstance(r, str) for r in results)
        assert most == {"a": 1, "b": 1}
        assert workers._tenants == {}  # a tenant's share is forgotten once unused: tenants come and go
    finally:
        await workers.close()


@pytest.mark.slow
async def test_a_worker_that_cannot_start_is_unavailable_and_quarantines_nothing(tmp_path):
    compiler = workers_compiler(vocabulary_path=str(tmp_path / "absent" / "tokenizer.json"))
    try:
        with pytest.raises(UnavailableError, match="the grammar compile worker exited with code 1"):
            await compiler.compile(S.regex("[a-z]+"))
        assert compiler.workers.crashes == 0 and not compiler.is_quarantined(S.regex("[a-z]+"))
    finally:
        await compiler.workers.close()
