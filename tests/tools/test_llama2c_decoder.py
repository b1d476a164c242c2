"""The converted tokenizer's decoder against sentencepiece: ids a model may generate, not encodings.

Decoding model output meets what an encoding of text never holds: lone "▁" pieces at the start,
a space spelled as the byte piece <0x20>, special tokens anywhere. On the domain where the two
decoders are meant to agree (tests/stories_token_ids.py, sentencepiece_domain_ids) the decode of
the shipped tokenizer.json, and of a freshly built Llama-2-style tokenizer (no
remove_extra_whitespaces), equals sentencepiece's; the documented differences outside it are
pinned below.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import sentencepiece as spm
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from services.tools.llama2c_tokenizer import Llama2cVocab, build_tokenizer, check_sentencepiece_model
from tests.helpers.stories_token_ids import DETERMINISTIC, byte_pieces, byte_run, sentencepiece_domain_ids

SHIPPED = Path(__file__).resolve().parents[2] / "models" / "stories260K"
SP = spm.SentencePieceProcessor(model_file=str(SHIPPED / "tokenizer.model"))
HF = Tokenizer.from_file(str(SHIPPED / "tokenizer.json"))
HAD, SPACE, UPON = 381, 410, 407  # "▁had", "▁", "▁upon"
BYTE_SPACE = byte_pieces(" ")[0]  # <0x20>
LONE_CONTINUATION_BYTE = 3 + 0x80  # <0x80>: not valid UTF-8 on its own


@pytest.mark.parametrize(
    ("ids", "text"),
    [
        ([HAD, SPACE, UPON], "had  upon"),
        ([SPACE, SPACE, UPON], "upon"),  # every leading piece "▁" goes while the text is empty
        ([1, SPACE, UPON], "upon"),
        ([BYTE_SPACE, UPON], "  upon"),  # a byte-spelled space is text: it stays, and so does "▁upon"'s
        ([SPACE, BYTE_SPACE, UPON], "  upon"),
        ([BYTE_SPACE, SPACE, SPACE, UPON], "    upon"),
        ([HAD, BYTE_SPACE, UPON], "had  upon"),
    ],
)
def test_leading_spaces_decode_as_in_sentencepiece(ids, text):
    assert SP.decode(ids) == text
    assert HF.decode(ids) == text


@settings(DETERMINISTIC, max_examples=400)
@given(ids=sentencepiece_domain_ids())
def test_shipped_decoder_matches_sentencepiece(ids):
    assert HF.decode(ids) == SP.decode(ids)


def test_differences_from_sentencepiece_are_the_documented_ones():
    # build_tokenizer's docstring lists them; an encoding of text produces none of them.
    had_upon = [HAD, 0, UPON]  # <unk>: sentencepiece prints its unk surface, tokenizers skips it
    assert SP.decode(had_upon) != HF.decode(had_upon) == "had upon"
    block = byte_pieces("\u2581")  # U+2581 spelled in bytes: a space here, "▁" in sentencepiece
    assert (HF.decode([HAD, *block, UPON]), SP.decode([HAD, *block, UPON])) == ("had  upon", "had\u2581 upon")
    invalid = [HAD, *byte_pieces("中"), LONE_CONTINUATION_BYTE]  # the whole run vs the bad byte only
    assert (HF.decode(invalid), SP.decode(invalid)) == ("had\ufffd\ufffd\ufffd\ufffd", "had中\ufffd")
    e4, b8, ad = byte_pieces("中")
    split = [HAD, e4, 2, b8, ad]  # a skipped special inside a run: invisible to tokenizers only
    assert (HF.decode(split), SP.decode(split)) == ("had中", "had\ufffd\ufffd\ufffd")



# --- a Llama-2-style tokenizer: remove_extra_whitespaces off, only one leading "▁" is dropped --


WORDS = "Once upon a time there was little girl boy named Lily Tom Ben".split()


@pytest.fixture(scope="module")
def llama2_style(tmp_path_factory) -> tuple[spm.SentencePieceProcessor, Tokenizer]:
    rng = random.Random(5)
    corpus = ["  ".join(rng.sample(WORDS, 6)) + "   " for _ in range(300)] + [" ".join(WORDS)] * 20
    prefix = tmp_path_factory.mktemp("llama2_style") / "tok"
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus), model_prefix=str(prefix), model_type="bpe", vocab_size=320,
        character_coverage=1.0, byte_fallback=True, allow_whitespace_only_pieces=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False, self_test_sample_size=0, minloglevel=2,
    )  # fmt: skip
    sp = spm.SentencePieceProcessor(model_file=f"{prefix}.model")
    size = sp.get_piece_size()
    vocab = Llama2cVocab(
        pieces=tuple(sp.id_to_piece(i) for i in range(size)), scores=tuple(sp.get_score(i) for i in range(size))
    )
    whitespace = check_sentencepiece_model(Path(f"{prefix}.model"), vocab)
    assert not whitespace.remove_extra_whitespaces
    assert {"▁", "▁▁", "▁▁▁"} <= set(vocab.pieces)
    return sp, build_tokenizer(vocab, whitespace)


@st.composite
def llama2_style_ids(draw: st.DrawFn, sp: spm.SentencePieceProcessor) -> list[int]:
    """The common domain for the trained model: normal and whitespace pieces, BOS/EOS, whole characters."""
    normal = st.integers(259, sp.get_piece_size() - 1)
    spaces = st.sampled_from([sp.piece_to_id(p) for p in ("▁", "▁▁", "▁▁▁")])
    segment = st.one_of(
        normal.map(lambda i: [i]),
        spaces.map(lambda i: [i]),
        st.sampled_from((1, 2)).map(lambda i: [i]),
        byte_run(complete=True, exclude="\u2581"),
    )
    return [i for part in draw(st.lists(segment, max_size=12)) for i in part]


def test_llama2_style_decoder_matches_sentencepiece(llama2_style):
    sp, tokenizer = llama2_style
    space, two = sp.piece_to_id("▁"), sp.piece_to_id("▁▁")
    word = sp.encode("Tom")[-1]
    for ids in ([space, space, word], [space, word], [two, word], [BYTE_SPACE, space, word], [1, space, word]):
        assert tokenizer.decode(ids) == sp.decode(ids), ids
    assert tokenizer.decode([space, space, word]).startswith(" ")  # one "▁" goes, not all

    @settings(DETERMINISTIC, max_examples=300)
    @given(ids=llama2_style_ids(sp))
    def matches(ids):
        assert tokenizer.decode(ids) == sp.decode(ids)

    matches()
