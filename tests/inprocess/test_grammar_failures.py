"""A grammar that fails in the executor ends its own request with an error, and nothing else.

The scheduler refuses hostile structured outputs at admission (tests/scheduler/test_grammar_compiler.py),
but the executor must not trust that: a grammar the model runner cannot build, or whose matcher
fails at a parser limit mid-generation, ends that request with FinishReason.ERROR and a message
(never a silent EOS whose output breaks its schema), while a request batched beside it runs to
its length with the tokens it gets alone. The grammars here reach the runner raw, as
``SamplingParams.grammar``, past the compiler that would refuse them. The in-process engine over
stories260K: the engine core, the model runner's matchers and the real model.
"""

from __future__ import annotations

import json

import llguidance
import pytest

from services.common.json_layout import JSON_LAYOUT
from services.common.sampling_params import SamplingParams
from services.executor.config import ExecutorConfig
from services.inprocess.engine import Engine, EngineConfig
from services.scheduler.request.finish_reason import FinishReason
from services.scheduler.request.stop import StopConditions
from tests.conftest import STORIES_DIR

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0)
PROMPT = "Once upon a time"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def engine() -> Engine:
    e = Engine(EngineConfig(ExecutorConfig(model=str(STORIES_DIR), dtype="fp32", device="cpu", num_blocks=64)))
    yield e
    e.close()


def run(e: Engine, samplings: list[SamplingParams]) -> list[tuple[list[int], FinishReason, str | None]]:
    ids = [e.add_request(PROMPT, s, StopConditions(max_tokens=MAX_TOKENS, ignore_eos=True)) for s in samplings]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    ends: dict[str, tuple[FinishReason, str | None]] = {}
    while e.has_unfinished():
        for delta in e.step():
            tokens[delta.request_id] += delta.token_ids
            if delta.finished:
                ends[delta.request_id] = (delta.finish_reason, delta.error_message)
    return [(tokens[i], *ends[i]) for i in ids]


# 58 bytes; its lexer's expressions run past the parser limits at the token after the opening quote.
NESTED_REPEATS = llguidance.LLMatcher.grammar_from_json_schema(
    {"type": "string", "pattern": "^(((a{50}){50}){50}){50}$"}, defaults=JSON_LAYOUT)
UNBUILDABLE = json.dumps({"grammars": [{"lark_grammar": "start: missing_rule"}]})


@pytest.mark.parametrize("grammar,message", [
    (NESTED_REPEATS, "structured output failed: lexer error: too many expressions constructed"),
    (UNBUILDABLE, "structured output failed: the grammar does not build"),
], ids=["matcher-fails-at-a-limit", "does-not-build"])
def test_a_grammar_failing_in_the_executor_ends_its_request_alone_with_an_error(engine, grammar, message):
    [(alone, _, _)] = run(engine, [GREEDY])
    (victim, victim_end, _), (_, end, error) = run(engine, [GREEDY, SamplingParams(temperature=0.0, grammar=grammar)])
    assert end is FinishReason.ERROR and error is not None and error.startswith(message), (end, error)
    assert victim_end is FinishReason.LENGTH and victim == alone
