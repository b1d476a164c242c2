"""An executor builds a new grammar's matcher and first mask when the scheduler admits the
request (PrepareGrammar), on a thread beside the step: the step that first runs the sequence
copies the prepared template instead of building it. stories260K's real vocabulary."""

from __future__ import annotations

import json
import threading

import llguidance
import pytest

from services.common.json_layout import JSON_LAYOUT
from services.runtime.model.config import ModelConfig
from services.runtime.sampling.grammar import GrammarMatchers
from tests.conftest import STORIES_DIR


@pytest.fixture
def grammars() -> GrammarMatchers:
    config = ModelConfig.from_model_dir(STORIES_DIR)
    return GrammarMatchers(STORIES_DIR, config.vocab_size, config.eos_token_ids)


def schema(pattern: str) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema({"type": "string", "pattern": pattern}, defaults=JSON_LAYOUT)


def test_a_prepared_grammar_is_not_built_again_in_the_step(grammars):
    grammar = schema("^(a{100}){100}$")
    thread = threading.Thread(target=lambda: results.append(grammars.prepare(grammar)))
    results: list[str] = []
    thread.start()
    thread.join()
    assert results == [""]

    def no_build(_grammar):
        raise AssertionError("the step built a grammar that was prepared")

    grammars._build = no_build
    matcher = grammars.matcher(grammar, [])
    mask = grammars.fill(1, [(matcher, 0, [])])
    assert mask.any() and not matcher.is_error()
    assert grammars.prepare(grammar) == ""  # already kept: nothing to build


def test_a_grammar_that_cannot_run_is_refused_by_prepare_and_not_kept(grammars):
    unbuildable = json.dumps({"grammars": [{"lark_grammar": "start: missing_rule"}]})
    assert grammars.prepare(unbuildable).startswith("structured output failed: the grammar does not build")
    with pytest.raises(ValueError, match="the grammar does not build"):
        grammars.matcher(unbuildable, [])
