"""TextTokenizer: tokenizer.json plus the config files around it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, decoders
from tokenizers.models import WordLevel

from services.tokenizer.text_tokenizer import TextTokenizer
from tests.helpers.tiny_bpe import BOS_ID, EOS_ID, FIRST_BYTE_ID, LLAMA_CONFIG, byte_level_style, llama_style, write_model_dir

STORIES260K = Path(__file__).resolve().parents[2] / "models" / "stories260K"


@pytest.fixture()
def llama(tmp_path) -> TextTokenizer:
    return TextTokenizer.from_dir(write_model_dir(tmp_path, llama_style(), LLAMA_CONFIG))


def test_encode_adds_bos_once_when_the_config_says_so(llama):
    # tokenizer.json's post-processor also adds BOS; the config flag must not double it.
    ids = llama.encode("Once upon a time")
    assert ids == [BOS_ID] + [llama.token_to_id(p) for p in ("▁Once", "▁upon", "▁a", "▁time")]
    assert llama.encode("Once upon a time", add_special_tokens=False) == ids[1:]


def test_config_flags_decide_over_the_post_processor(tmp_path):
    config = dict(LLAMA_CONFIG, add_bos_token=False, add_eos_token=True)
    tok = TextTokenizer.from_dir(write_model_dir(tmp_path, llama_style(), config))
    assert tok.encode("a") == [tok.token_to_id("▁a"), EOS_ID]


def test_without_config_flags_the_post_processor_decides(tmp_path):
    tok = TextTokenizer.from_dir(write_model_dir(tmp_path, llama_style(), {"bos_token": "<s>"}))
    assert tok.encode("a") == [BOS_ID, tok.token_to_id("▁a")]
    bare = TextTokenizer.from_dir(write_model_dir(tmp_path / "bare", byte_level_style()))
    assert bare.encode("a") == [bare.token_to_id("a")]
    assert bare.bos_token_id is None and bare.eos_token_ids == [] and bare.chat_template is None


def test_decode_skips_special_tokens_and_spells_bytes(llama):
    ids = [BOS_ID, llama.token_to_id("▁a")] + [FIRST_BYTE_ID + b for b in "中".encode()] + [EOS_ID]
    assert llama.decode(ids) == "a中"
    assert llama.decode(ids, skip_special_tokens=False) == "<s> a中</s>"


def test_decode_rejects_ids_outside_the_vocabulary(llama):
    with pytest.raises(ValueError, match=f"token id {llama.vocab_size} is outside the vocabulary"):
        llama.decode([5, llama.vocab_size])
    with pytest.raises(ValueError, match="token id -1"):
        llama.decode([-1])


def test_vocabulary_facts(llama):
    assert llama.vocab_size == len(llama_style().get_vocab())
    assert llama.bos_token_id == BOS_ID
    assert llama.eos_token_ids == [EOS_ID]
    assert llama.all_special_ids == [0, 1, 2]
    assert llama.id_to_token(FIRST_BYTE_ID + 0xE4) == "<0xE4>"
    assert llama.id_to_token(10**6) is None
    assert llama.byte_token_ids == frozenset(range(FIRST_BYTE_ID, FIRST_BYTE_ID + 256))
    assert llama.model_max_length == 512


def test_byte_level_decoder_has_no_byte_fallback_pieces(tmp_path):
    tok = TextTokenizer.from_dir(write_model_dir(tmp_path, byte_level_style()))
    assert tok.byte_token_ids == frozenset()


def test_anchor_token_decodes_to_plain_text(tmp_path, llama):
    # The detokenizer decodes mid-text windows behind this token; "a" where the vocabulary has it.
    assert llama.id_to_token(llama.anchor_token_id) == "▁a" and llama.anchor_text == "a"
    assert llama.decode([llama.anchor_token_id, llama.token_to_id("▁")]) == "a "  # the strip is spent on it
    byte_level = TextTokenizer.from_dir(write_model_dir(tmp_path / "bl", byte_level_style()))
    assert byte_level.id_to_token(byte_level.anchor_token_id) == "a"
    stories = TextTokenizer.from_dir(STORIES260K)
    assert (stories.anchor_token_id, stories.anchor_text) == (261, "a")


def test_anchor_falls_back_to_another_plain_token(tmp_path):
    # No "a" (nor the other preferred characters) in the vocabulary: the first plain piece.
    pieces = {"<unk>": 0, "▁": 1, "▁▁": 2, "zz": 3, "▁q": 4}
    tokenizer = Tokenizer(WordLevel(pieces, unk_token="<unk>"))
    tokenizer.add_special_tokens([AddedToken("<unk>", special=True, normalized=False)])
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok = TextTokenizer.from_dir(write_model_dir(tmp_path, tokenizer))
    assert (tok.anchor_token_id, tok.anchor_text) == (3, "zz")


def test_generation_config_adds_eos_ids_after_the_tokenizers(tmp_path):
    tok = TextTokenizer.from_dir(
        write_model_dir(tmp_path, llama_style(), LLAMA_CONFIG, {"eos_token_id": [7, EOS_ID, 9], "bos_token_id": 1})
    )
    assert tok.eos_token_ids == [EOS_ID, 7, 9]
    assert tok.all_special_ids == [0, 1, 2, 7, 9]
    assert tok.skipped_special_ids == frozenset({0, 1, 2})  # what decode(skip_special_tokens=True) drops


def test_unset_model_max_length_is_none(tmp_path):
    tok = TextTokenizer.from_dir(write_model_dir(tmp_path, llama_style(), dict(LLAMA_CONFIG, model_max_length=int(1e30))))
    assert tok.model_max_length is None


def test_chat_template_sources(tmp_path):
    listed = dict(LLAMA_CONFIG, chat_template=[{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}])
    assert TextTokenizer.from_dir(write_model_dir(tmp_path / "a", llama_style(), listed)).chat_template == "D"
    jinja_dir = write_model_dir(tmp_path / "b", llama_style(), LLAMA_CONFIG)
    (jinja_dir / "chat_template.jinja").write_text("J", encoding="utf-8")
    assert TextTokenizer.from_dir(jinja_dir).chat_template == "J"
    json_dir = write_model_dir(tmp_path / "c", llama_style(), LLAMA_CONFIG)
    (json_dir / "chat_template.json").write_text(json.dumps({"chat_template": "S"}), encoding="utf-8")
    assert TextTokenizer.from_dir(json_dir).chat_template == "S"
    no_default = dict(LLAMA_CONFIG, chat_template=[{"name": "tool_use", "template": "T"}])
    with pytest.raises(ValueError, match="no 'default' template"):
        TextTokenizer.from_dir(write_model_dir(tmp_path / "d", llama_style(), no_default))


def test_missing_files_and_unknown_tokens_are_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        TextTokenizer.from_dir(tmp_path)
    with pytest.raises(ValueError, match="eos_token '<eot>' is not in the vocabulary"):
        TextTokenizer.from_dir(write_model_dir(tmp_path, llama_style(), dict(LLAMA_CONFIG, eos_token="<eot>")))


def test_stories260k_matches_sentencepiece():
    import sentencepiece  # test-only reference (requirements-test.txt), never imported by the services

    tok = TextTokenizer.from_dir(STORIES260K)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(STORIES260K / "tokenizer.model"))
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_ids) == (512, 1, [2, 1])
    assert len(tok.byte_token_ids) == 256
    for text in ["Once upon a time, there was a little girl named Lily.", "中文🐶 naïve", "  two  spaces\nnewline"]:
        ids = tok.encode(text)
        assert ids == [sp.bos_id()] + sp.encode(text)
        assert tok.decode(ids) == sp.decode(ids)
