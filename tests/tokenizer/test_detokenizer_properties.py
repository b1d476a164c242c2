"""Streamed stories260K text equals the full decode for any ids and any chunking (hypothesis).

References: `tokenizers`' full decode of the same ids (the invariant of
services/tokenizer/detokenizer.py) and, where the two decoders agree, sentencepiece's decode
with the model's own tokenizer.model.
"""

from __future__ import annotations

from pathlib import Path

import sentencepiece
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from services.tokenizer.detokenizer import IncrementalDetokenizer
from services.tokenizer.text_tokenizer import TextTokenizer
from tests.helpers.stories_token_ids import (
    DETERMINISTIC,
    chunk_sizes,
    chunked,
    continuation,
    output_ids,
    prompt_ids,
    sentencepiece_domain_ids,
)

STORIES260K = Path(__file__).resolve().parents[2] / "models" / "stories260K"
TOKENIZER = TextTokenizer.from_dir(STORIES260K)
SP = sentencepiece.SentencePieceProcessor(model_file=str(STORIES260K / "tokenizer.model"))
EXAMPLES = settings(DETERMINISTIC, max_examples=300)


def streamed(detokenizer: IncrementalDetokenizer, output: list[int], sizes: list[int], expected: str) -> str:
    """The deltas of `output` appended in chunks, then finish(); each step's text so far must be
    a prefix of `expected` (text once emitted is never taken back)."""
    text = ""
    for chunk in chunked(output, sizes):
        text += detokenizer.append(chunk)
        assert expected.startswith(text), (chunk, text, expected)
    return text + detokenizer.finish()


@EXAMPLES
@given(output=output_ids(), sizes=chunk_sizes, skip_special=st.booleans())
def test_stream_adds_up_to_the_full_decode(output, sizes, skip_special):
    expected = TOKENIZER.decode(output, skip_special_tokens=skip_special)
    detokenizer = IncrementalDetokenizer(TOKENIZER, skip_special_tokens=skip_special)
    assert streamed(detokenizer, output, sizes, expected) == expected


@EXAMPLES
@given(prompt=prompt_ids(), output=output_ids(), sizes=chunk_sizes, skip_special=st.booleans())
def test_continuation_stream_adds_up_to_the_full_decode_minus_the_prompt(prompt, output, sizes, skip_special):
    expected = continuation(lambda ids: TOKENIZER.decode(ids, skip_special_tokens=skip_special), prompt, output)
    assume(expected is not None)  # a prompt ending in an unfinished byte run has no defined continuation
    detokenizer = IncrementalDetokenizer(TOKENIZER, prompt, skip_special_tokens=skip_special, keep_leading_space=True)
    assert streamed(detokenizer, output, sizes, expected) == expected


# On the domain where tokenizers and sentencepiece decode alike (stories_token_ids's
# sentencepiece_domain_ids: no <unk>, byte runs of whole characters, no U+2581 spelled in bytes;
# outside it the two decoders differ by design), the stream equals sentencepiece's own decode.


@EXAMPLES
@given(output=sentencepiece_domain_ids(), sizes=chunk_sizes)
def test_stream_equals_sentencepiece_decode(output, sizes):
    expected = SP.decode(output)
    assert streamed(IncrementalDetokenizer(TOKENIZER), output, sizes, expected) == expected


@EXAMPLES
@given(prompt=sentencepiece_domain_ids(max_segments=6), output=sentencepiece_domain_ids(), sizes=chunk_sizes)
def test_continuation_stream_equals_sentencepiece_decode_minus_the_prompt(prompt, output, sizes):
    expected = continuation(SP.decode, prompt, output)
    assert expected is not None  # whole characters only: the prompt's text never changes
    detokenizer = IncrementalDetokenizer(TOKENIZER, prompt, keep_leading_space=True)
    assert streamed(detokenizer, output, sizes, expected) == expected
