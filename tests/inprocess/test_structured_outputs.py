"""Structured outputs on SmolLM2-135M-Instruct, end to end through the in-process engine (the
engine core, the model runner's matchers and masks, the real model): a corpus of JSON schemas
(tests/fixtures/json_schemas.json), greedy and sampled, whose every output parses and
validates; regex and choice likewise; a grammar that admits everything changes nothing; and
the constrained greedy output is the same with speculation and across preemptions."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from services.common.sampling_params import SamplingParams
from services.executor.config import ExecutorConfig
from services.inprocess.engine import Engine, EngineConfig
from services.scheduler.core.config import SchedulerLimits
from services.scheduler.core.speculation import SpeculationConfig
from services.scheduler.request.finish_reason import FinishReason
from services.scheduler.request.stop import StopConditions
from services.scheduler.structured.structured_output import StructuredOutput

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]
SMOLLM2_DIR = REPO_ROOT / "models" / "smollm2-135m-instruct"
CORPUS = json.loads((REPO_ROOT / "tests" / "fixtures" / "json_schemas.json").read_text())
MAX_TOKENS = 160


def engine(**limits) -> Engine:
    assert (SMOLLM2_DIR / "config.json").is_file(), f"{SMOLLM2_DIR} is absent: `make install` converts it"
    executor = ExecutorConfig(model=str(SMOLLM2_DIR), dtype="fp32", device="cpu",
                              num_blocks=limits.pop("num_blocks", 0), max_model_len=limits.pop("max_model_len", 1024))
    speculation = SpeculationConfig(num_speculative_tokens=limits.pop("num_speculative_tokens", 0), adaptive=False)
    return Engine(EngineConfig(executor, SchedulerLimits(**limits), speculation))


@pytest.fixture(scope="module")
def smollm2() -> Engine:
    e = engine()
    yield e
    e.close()


def chat(e: Engine, text: str) -> list[int]:
    return e.tokenizer.backend.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n").ids


def run(e: Engine, requests: list[tuple[list[int], SamplingParams, StructuredOutput | None]],
        max_tokens: int = MAX_TOKENS) -> list[tuple[str, list[int], FinishReason]]:
    """All requests in one continuous batch: (text, token ids, finish reason) each."""
    ids = [e.add_request(prompt, sampling, StopConditions(max_tokens=max_tokens), structured_output=structured)
           for prompt, sampling, structured in requests]
    texts = {i: "" for i in ids}
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    reasons: dict[str, FinishReason] = {}
    while e.has_unfinished():
        for delta in e.step():
            texts[delta.request_id] += delta.text
            tokens[delta.request_id] += delta.token_ids
            if delta.finished:
                reasons[delta.request_id] = delta.finish_reason
    return [(texts[i], tokens[i], reasons[i]) for i in ids]


GREEDY = SamplingParams(temperature=0.0)


def sampled(seed: int) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_p=0.95, seed=seed)


def test_every_output_of_the_schema_corpus_parses_and_validates(smollm2):
    assert len(CORPUS) >= 50
    requests = []
    for index, entry in enumerate(CORPUS):
        prompt = chat(smollm2, f"Reply with one JSON value for this JSON schema ({entry['name']}): "
                               f"{json.dumps(entry['schema'])}")
        structured = StructuredOutput.json_schema(json.dumps(entry["schema"]))
        requests += [(prompt, GREEDY, structured), (prompt, sampled(index), structured)]
    results = run(smollm2, requests)
    failures = []
    for (entry, mode), (text, _, reason) in zip([(e, m) for e in CORPUS for m in ("greedy", "sampled")], results):
        try:
            assert reason is FinishReason.EOS, f"finished by {reason.value} after {text!r}"
            jsonschema.validate(json.loads(text), entry["schema"])
        except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
            failures.append(f"{entry['name']} ({mode}): {exc}")
    assert not failures, "\n".join(failures)


def test_regex_choice_and_grammar_outputs_match(smollm2):
    cases = [
        ("What is the phone number of the office?", StructuredOutput.regex(r"\+1-[0-9]{3}-[0-9]{4}"),
         re.compile(r"\+1-[0-9]{3}-[0-9]{4}")),
        ("Give a date in ISO format.", StructuredOutput.regex(r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"),
         re.compile(r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]")),
        ("Is the sky blue?", StructuredOutput.choice(["yes", "no", "it depends"]),
         re.compile(r"yes|no|it depends")),
        ("Name a fruit.", StructuredOutput.choice(["apple", "banana", 'the "kiwi"']),
         re.compile(r'apple|banana|the "kiwi"')),
        ("List three colours.", StructuredOutput.grammar('start: item (", " item)~2\nitem: /[a-z]{3,8}/'),
         re.compile(r"[a-z]{3,8}(, [a-z]{3,8}){2}")),
    ]
    requests = [(chat(smollm2, question), sampling, structured)
                for question, structured, _ in cases for sampling in (GREEDY, sampled(7), sampled(8))]
    results = run(smollm2, requests, max_tokens=40)
    for (question, _, pattern), outputs in zip(cases, [results[i:i + 3] for i in range(0, len(results), 3)]):
        for text, _, reason in outputs:
            assert reason is FinishReason.EOS and pattern.fullmatch(text), (question, text, reason)


def test_a_grammar_that_admits_everything_leaves_greedy_output_unchanged(smollm2):
    prompts = [chat(smollm2, q) for q in ("Write a haiku about rivers.", "What is 12 times 7?",
                                          "Describe JSON in one sentence.")]
    anything = StructuredOutput.grammar(r"start: /(?s:.*)/")
    plain = run(smollm2, [(p, GREEDY, None) for p in prompts], max_tokens=48)
    constrained = run(smollm2, [(p, GREEDY, anything) for p in prompts], max_tokens=48)
    assert [t for _, t, _ in constrained] == [t for _, t, _ in plain]


def corpus_sample(e: Engine, count: int = 8):
    entries = CORPUS[:count]
    return [(chat(e, f"Reply with JSON for this schema: {json.dumps(x['schema'])}"), GREEDY,
             StructuredOutput.json_schema(json.dumps(x["schema"]))) for x in entries], entries


def test_speculation_gives_the_same_constrained_greedy_output(smollm2):
    requests, entries = corpus_sample(smollm2)
    plain = run(smollm2, requests)
    speculating = engine(num_speculative_tokens=4)
    try:
        drafted = run(speculating, corpus_sample(speculating)[0])
        stats = speculating.core.stats().spec_decode
    finally:
        speculating.close()
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens < stats.num_draft_tokens, stats
    assert [t for _, t, _ in drafted] == [t for _, t, _ in plain]
    for entry, (text, _, _) in zip(entries, drafted):
        jsonschema.validate(json.loads(text), entry["schema"])


def test_preemption_by_recompute_restores_the_matcher(smollm2):
    requests, entries = corpus_sample(smollm2)
    plain = run(smollm2, requests)
    # 40 blocks of 16 tokens cannot hold 8 running requests of ~100-token prompts and their
    # outputs: some are preempted mid-output and come back with them for the matcher to replay.
    small = engine(num_blocks=40, max_model_len=512)
    try:
        squeezed = run(small, corpus_sample(small)[0])
        preemptions = small.core.stats().num_preemptions
    finally:
        small.close()
    assert preemptions > 0
    assert [t for _, t, _ in squeezed] == [t for _, t, _ in plain]
    for entry, (text, _, _) in zip(entries, squeezed):
        jsonschema.validate(json.loads(text), entry["schema"])


def test_greedy_rows_whose_argmax_the_mask_allows_give_the_masked_output(smollm2, monkeypatch):
    """The runner keeps a greedy row's raw argmax when its mask allows that token and applies
    masks to the logits only for a step where some row's is refused; with every argmax refused
    (every step's logits masked, as before that check) the tokens are the same."""
    import services.executor.model_runner as model_runner

    requests, _ = corpus_sample(smollm2)
    checked = run(smollm2, requests)
    monkeypatch.setattr(model_runner, "token_allowed", lambda bitmask, row, token_id: False)
    masked = run(smollm2, requests)
    assert [t for _, t, _ in checked] == [t for _, t, _ in masked]
