"""Hypothesis strategies: stories260K token id sequences that stress streaming detokenization.

A model's output is not an encoding of text: it can hold a lone "▁" piece (where a decoder's
leading-space rule bites), byte-fallback runs that split a multi-byte character or stop halfway,
stray bytes and special tokens anywhere. `output_ids` draws such sequences over the whole
vocabulary; `sentencepiece_domain_ids` draws the subset on which the shipped tokenizer.json and
sentencepiece must decode alike (see its docstring for why the rest differs).

Examples are deterministic (`DETERMINISTIC`: derandomized, no example database), so a failure in
CI fails the same way on every run.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

VOCAB_SIZE = 512
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
FIRST_BYTE_ID = 3  # <0x00> .. <0xFF> are ids 3 .. 258
FIRST_NORMAL_ID = FIRST_BYTE_ID + 256
SPACE_ID = 410  # "▁" alone
SPECIAL_IDS = (UNK_ID, BOS_ID, EOS_ID)
SPACE_SYMBOL = "\u2581"

# Characters worth spelling in bytes besides arbitrary ones: spaces (the leading-space rules),
# U+2581 (the space symbol itself), one-, two-, three- and four-byte characters.
NOTABLE_CHARS = " \t\n" + SPACE_SYMBOL + "é中😀\x00"

DETERMINISTIC = settings(
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def byte_pieces(text: str) -> list[int]:
    """The <0xNN> piece ids that spell `text` in UTF-8."""
    return [FIRST_BYTE_ID + byte for byte in text.encode("utf-8")]


def characters(exclude: str = "") -> st.SearchStrategy[str]:
    """Any character (surrogates excluded, they have no UTF-8), notable ones often."""
    notable = [c for c in NOTABLE_CHARS if c not in exclude]
    return st.one_of(st.sampled_from(notable), st.characters(codec="utf-8", exclude_characters=exclude))


normal_ids = st.integers(FIRST_NORMAL_ID, VOCAB_SIZE - 1)


@st.composite
def byte_run(draw: st.DrawFn, complete: bool = False, exclude: str = "") -> list[int]:
    """One to three characters spelled as byte pieces; unless `complete`, sometimes cut short."""
    ids = byte_pieces("".join(draw(st.lists(characters(exclude), min_size=1, max_size=3))))
    if not complete and draw(st.booleans()):
        ids = ids[: draw(st.integers(0, len(ids) - 1))]
    return ids


@st.composite
def output_ids(draw: st.DrawFn, max_segments: int = 16) -> list[int]:
    """Any ids of the vocabulary, built to hold lone "▁", split characters and special tokens."""
    segment = st.one_of(
        normal_ids.map(lambda i: [i]),
        st.just([SPACE_ID]),
        st.sampled_from(SPECIAL_IDS).map(lambda i: [i]),
        byte_run(),
        st.integers(FIRST_BYTE_ID, FIRST_NORMAL_ID - 1).map(lambda i: [i]),  # a stray byte
        st.integers(0, VOCAB_SIZE - 1).map(lambda i: [i]),
    )
    return [i for part in draw(st.lists(segment, max_size=max_segments)) for i in part]


@st.composite
def sentencepiece_domain_ids(draw: st.DrawFn, max_segments: int = 16) -> list[int]:
    """Ids on which tokenizers' full decode (skip_special_tokens=True) and sentencepiece agree.

    The domain leaves out, for known reasons (see build_tokenizer's docstring):
    - <unk>: sentencepiece prints " ⁇ ", tokenizers skips it as a special token;
    - byte runs that are not whole characters (cut short, stray bytes, or a special token between
      a character's bytes): sentencepiece replaces each bad byte and ends a run at a special
      token, tokenizers' ByteFallback replaces the whole run and never sees skipped specials;
    - U+2581 spelled in bytes: sentencepiece keeps "▁", the decoder's Replace makes it a space.
    Inside it: normal pieces, lone "▁" pieces (also at the start), BOS/EOS anywhere, and byte runs
    of whole characters (a space <0x20> at the start included), next to each other or not.
    """
    segment = st.one_of(
        normal_ids.map(lambda i: [i]),
        st.just([SPACE_ID]),
        st.sampled_from((BOS_ID, EOS_ID)).map(lambda i: [i]),
        byte_run(complete=True, exclude=SPACE_SYMBOL),
    )
    return [i for part in draw(st.lists(segment, max_size=max_segments)) for i in part]


@st.composite
def prompt_ids(draw: st.DrawFn) -> list[int]:
    """A prompt: one without text (BOS, lone "▁"), one ending in a normal piece, or any ids."""
    return draw(
        st.one_of(
            st.lists(st.sampled_from((BOS_ID, SPACE_ID)), max_size=3),
            st.tuples(output_ids(max_segments=6), normal_ids).map(lambda pair: [*pair[0], pair[1]]),
            output_ids(max_segments=6),
        )
    )


chunk_sizes = st.lists(st.integers(1, 6), min_size=1, max_size=6)


def chunked(ids: list[int], sizes: list[int]) -> list[list[int]]:
    """`ids` cut into consecutive chunks of the given sizes (cycled)."""
    chunks, position, index = [], 0, 0
    while position < len(ids):
        size = sizes[index % len(sizes)]
        chunks.append(ids[position : position + size])
        position += size
        index += 1
    return chunks


def continuation(decode, prompt: list[int], output: list[int]) -> str | None:
    """decode(prompt + output) minus decode(prompt), or None where that is not defined.

    It is not defined when the prompt's text is not a prefix of the full text, or ends in U+FFFD
    (an unfinished or invalid byte run that the output's bytes may join).
    """
    full = decode(prompt + output)
    head = decode(prompt)
    if not full.startswith(head) or head.endswith("\ufffd"):
        return None
    return full[len(head) :]
