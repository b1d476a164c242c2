"""The synthetic tokenizer written beside random-weight models makes them servable by the engine."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer

from services.tools.random_model import PRESETS, build_random_model, write_synthetic_tokenizer
from services.common.sampling_params import SamplingParams
from services.scheduler.request.stop import StopConditions
from services.tokenizer.text_tokenizer import TextTokenizer
from services.executor.config import ExecutorConfig
from services.inprocess.engine import Engine, EngineConfig
from tests.helpers.engine_runs import generate_all


@pytest.mark.parametrize("vocab_size", [259, 512, 32000])
def test_vocabulary_has_exactly_vocab_size_ids_with_specials_first(tmp_path, vocab_size):
    write_synthetic_tokenizer(tmp_path, vocab_size)
    raw = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert raw.get_vocab_size(with_added_tokens=True) == vocab_size
    assert [raw.id_to_token(i) for i in (0, 1, 2, 3, 258)] == ["<unk>", "<s>", "</s>", "<0x00>", "<0xFF>"]
    tokenizer = TextTokenizer.from_dir(tmp_path)
    assert (tokenizer.bos_token_id, tuple(tokenizer.eos_token_ids)) == (1, (2,))


def test_text_round_trips_through_characters_and_byte_fallback(tmp_path):
    write_synthetic_tokenizer(tmp_path, 32000)
    tokenizer = TextTokenizer.from_dir(tmp_path)
    text = "Hello, wörld 42! 猫"
    ids = tokenizer.encode(text)
    # BOS, the prefix "▁", one id per ASCII character ("▁" for a space), two byte pieces for ö,
    # three for 猫.
    assert ids[:2] == [1, 259] and len(ids) == 2 + len(text) + 1 + 2
    assert tokenizer.decode(ids) == text
    # Filler ids decode to visible text, so a random model's output is never empty.
    assert tokenizer.decode([31999]) == "w31999"


def test_too_small_a_vocabulary_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"vocab_size 200 is below 259"):
        write_synthetic_tokenizer(tmp_path, 200)


def test_random_model_without_a_tokenizer_source_runs_in_the_engine(tmp_path):
    model_dir = build_random_model(PRESETS["tiny"], tmp_path / "tiny")
    assert json.loads((model_dir / "tokenizer_config.json").read_text())["bos_token"] == "<s>"
    engine = Engine(EngineConfig(ExecutorConfig(model=str(model_dir), device="cpu", num_blocks=64)))
    text_out, ids_out = generate_all(engine, ["Hi there", [5, 300, 7]], SamplingParams(temperature=0.0),
                                            StopConditions(max_tokens=8, ignore_eos=True))
    for prompt, out in (("Hi there", text_out), ([5, 300, 7], ids_out)):
        prompt_ids = engine.encode_prompt(prompt)
        assert len(out.token_ids) == 8 and out.text.strip() != ""
        decode = engine.tokenizer.decode
        assert decode(prompt_ids) + out.text == decode(prompt_ids + out.token_ids)
