"""Micro-benchmark: token-mask cost of llguidance against xgrammar on SmolLM2's vocabulary.

    python -m benchmarks grammar-masks [--repeats 3]

One JSON schema (nested object, bounded array of enums, a string pattern), one 44-token
document that satisfies it; per library: the time to ready a matcher for a new schema
(llguidance parses lazily when the matcher is built; xgrammar compiles, with its per-token
cache, up front), then the mask and advance for every token of the document at batch 1 and
32 (llguidance's thread-pool fill; xgrammar's batch fill). xgrammar is not a dependency (it
pulls torch and transformers, and its import loads both): to include it, install it beside
the venv without its dependencies, ``pip install --no-deps --target DIR xgrammar
apache-tvm-ffi``, and run with ``PYTHONPATH=DIR``. docs/benchmarks.md has the figures.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass

from benchmarks.harness import flags
from benchmarks.harness.flags import setting
from benchmarks.harness.paths import REPO_ROOT
from services.common.json_layout import JSON_LAYOUT

PROG = "python -m benchmarks grammar-masks"
TOKENIZER = REPO_ROOT / "models" / "smollm2-135m-instruct" / "tokenizer.json"
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "bb", "ccc"]}, "maxItems": 4},
    "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"]}},
    "required": ["name", "age", "tags", "address"], "additionalProperties": False}
DOCUMENT = json.dumps({"name": "Alice Smith", "age": 31, "tags": ["a", "ccc"],
                       "address": {"city": "Paris", "zip": "75001"}}, separators=(",", ":"))


def llguidance_case(batch: int, ids: list[int]) -> tuple[float, float]:
    import llguidance
    import llguidance.numpy as lnp

    tokenizer = llguidance.LLTokenizer(str(TOKENIZER))
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults=JSON_LAYOUT)
    start = time.perf_counter()
    llguidance.LLMatcher(tokenizer, grammar)
    ready_s = time.perf_counter() - start
    executor = llguidance.LLExecutor()
    matchers = [llguidance.LLMatcher(tokenizer, grammar) for _ in range(batch)]
    mask = lnp.allocate_token_bitmask(batch, tokenizer.vocab_size)
    start = time.perf_counter()
    for token in ids:
        lnp.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], mask)
        for m in matchers:
            assert m.consume_token(token), m.get_error()
    return ready_s, (time.perf_counter() - start) / len(ids)


def xgrammar_case(batch: int, ids: list[int]) -> tuple[float, float]:
    import xgrammar
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(TOKENIZER))
    info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=len(hf))
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    start = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))
    ready_s = time.perf_counter() - start
    matchers = [xgrammar.GrammarMatcher(compiled) for _ in range(batch)]
    mask = xgrammar.allocate_token_bitmask(batch, info.vocab_size)
    filler = xgrammar.BatchGrammarMatcher()
    start = time.perf_counter()
    for token in ids:
        filler.batch_fill_next_token_bitmask(matchers, mask)
        for m in matchers:
            assert m.accept_token(token)
    return ready_s, (time.perf_counter() - start) / len(ids)


@dataclass(frozen=True, slots=True)
class GrammarMaskSettings:
    repeats: int = setting(3)
    """Timed runs of each case (medians printed)."""

    def validate(self) -> None:
        flags.check_at_least(self, 1, "repeats")


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    args = flags.parse(GrammarMaskSettings, argv, prog=prog, description=__doc__)
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(TOKENIZER)).encode(DOCUMENT, add_special_tokens=False).ids
    cases = [("llguidance", llguidance_case)]
    try:
        import xgrammar  # noqa: F401
        cases.append(("xgrammar", xgrammar_case))
    except ImportError:
        print("xgrammar is not importable: llguidance only (see --help)")
    print(f"{len(ids)} tokens; medians of {args.repeats}")
    print(f"{'library':>11} {'B':>3} {'new schema ms':>14} {'mask+advance us/step':>21} {'us/seq':>8}")
    for name, case in cases:
        for batch in (1, 32):
            runs = [case(batch, ids) for _ in range(args.repeats)]
            ready = statistics.median(r[0] for r in runs)
            step = statistics.median(r[1] for r in runs)
            print(f"{name:>11} {batch:>3} {ready * 1e3:>14.2f} {step * 1e6:>21.1f} {step / batch * 1e6:>8.1f}")
    return 0
