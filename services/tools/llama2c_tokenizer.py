"""llama2.c tokenizer (tokenizer.bin) -> Hugging Face `tokenizers` BPE that encodes like sentencepiece.

llama2.c's `tokenizer.bin` is an export of a sentencepiece BPE model (`tokenizer.py export`):

    int32 max_token_length
    vocab_size x { float32 score, int32 byte_length, byte_length bytes (UTF-8 piece) }

with two lossy edits: "▁" is written as " ", and BOS/EOS are written as "\\n<s>\\n" / "\\n</s>\\n".
Piece ids follow sentencepiece's layout for `byte_fallback` models: 0 <unk>, 1 <s>, 2 </s>,
3..258 the byte pieces <0x00>..<0xFF>, then the BPE pieces, ranked by score (higher = merged
earlier).

The optional `.model` file (the sentencepiece protobuf) is read with a small wire-format reader,
not with the sentencepiece package (a test-only dependency), to check that it holds the same pieces
and the normalizer settings that `build_tokenizer` reproduces.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, processors
from tokenizers.models import BPE

SPACE_SYMBOL = "▁"  # U+2581, sentencepiece's spelling of " "
UNK, BOS, EOS = "<unk>", "<s>", "</s>"
FIRST_BYTE_ID = 3
FIRST_NORMAL_ID = FIRST_BYTE_ID + 256

# sentencepiece.ModelProto.SentencePiece.Type
_NORMAL, _UNKNOWN, _CONTROL, _BYTE = 1, 2, 3, 6
_ALL_LEADING = 2**31 - 1  # decoders.Strip count meaning "every leading one"


@dataclass(frozen=True, slots=True)
class Llama2cVocab:
    """Pieces in sentencepiece spelling ("▁" for a space) and their BPE scores, indexed by id."""

    pieces: tuple[str, ...]
    scores: tuple[float, ...]

    @property
    def size(self) -> int:
        return len(self.pieces)


def read_llama2c_tokenizer(path: Path, vocab_size: int) -> Llama2cVocab:
    """Parse llama2.c's tokenizer.bin for a model with `vocab_size` pieces."""
    data = Path(path).read_bytes()
    offset = 4  # int32 max_token_length: a C buffer size, not needed here
    pieces: list[str] = []
    scores: list[float] = []
    for token_id in range(vocab_size):
        if offset + 8 > len(data):
            raise ValueError(
                f"{path}: tokenizer ends after {token_id} pieces ({len(data)} bytes); "
                f"the checkpoint's vocab_size is {vocab_size}"
            )
        score, length = struct.unpack_from("<fi", data, offset)
        offset += 8
        if length < 0 or offset + length > len(data):
            raise ValueError(f"{path}: piece {token_id} has byte_length {length} past the end of the file")
        text = data[offset : offset + length].decode("utf-8")
        offset += length
        pieces.append(text.replace(" ", SPACE_SYMBOL))
        scores.append(score)
    if offset != len(data):
        raise ValueError(
            f"{path}: {len(data) - offset} trailing bytes after {vocab_size} pieces; "
            "the tokenizer does not belong to this checkpoint"
        )
    # The export spells the control pieces with newlines around them; the GGUF and HF name them plainly.
    pieces[0], pieces[1], pieces[2] = UNK, BOS, EOS
    vocab = Llama2cVocab(pieces=tuple(pieces), scores=tuple(scores))
    _check_layout(vocab, str(path))
    return vocab


def _check_layout(vocab: Llama2cVocab, origin: str) -> None:
    if vocab.size <= FIRST_NORMAL_ID:
        raise ValueError(f"{origin}: vocab_size {vocab.size} leaves no room for the 256 byte pieces")
    for byte in range(256):
        expected = f"<0x{byte:02X}>"
        if vocab.pieces[FIRST_BYTE_ID + byte] != expected:
            raise ValueError(
                f"{origin}: piece {FIRST_BYTE_ID + byte} is {vocab.pieces[FIRST_BYTE_ID + byte]!r}, "
                f"expected byte piece {expected!r} (only byte_fallback tokenizers are supported)"
            )
    if len(set(vocab.pieces)) != vocab.size:
        raise ValueError(f"{origin}: pieces are not unique")


@dataclass(frozen=True, slots=True)
class WhitespaceHandling:
    """The one sentencepiece normalizer setting that varies between llama2.c tokenizers."""

    remove_extra_whitespaces: bool = True
    """Strip leading/trailing spaces and squeeze runs of spaces before encoding. On in
    sentencepiece by default and in tokenizers trained by llama2.c's `train_vocab`; off in Llama 2's
    32000-piece tokenizer (which has pieces such as "▁▁▁▁")."""


# ---------------------------------------------------------------------------------------------
# sentencepiece .model cross-check (protobuf wire format, fields from sentencepiece_model.proto)
# ---------------------------------------------------------------------------------------------


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _fields(buf: bytes) -> Iterator[tuple[int, int | bytes]]:
    """Yield (field_number, value): ints for varints, raw bytes for length-delimited and fixed."""
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            value, pos = _varint(buf, pos)
            yield number, value
        elif wire_type == 2:
            length, pos = _varint(buf, pos)
            yield number, buf[pos : pos + length]
            pos += length
        elif wire_type in (1, 5):
            width = 8 if wire_type == 1 else 4
            yield number, buf[pos : pos + width]
            pos += width
        else:
            raise ValueError(f"unsupported protobuf wire type {wire_type} (field {number})")


def check_sentencepiece_model(path: Path, vocab: Llama2cVocab) -> WhitespaceHandling:
    """Check that `path` is the BPE model `vocab` was exported from; return its whitespace setting."""
    pieces: list[tuple[str, float, int]] = []
    trainer: dict[int, int | bytes] = {}
    normalizer: dict[int, int | bytes] = {}
    for number, value in _fields(Path(path).read_bytes()):
        if number == 1:
            fields = dict(_fields(value))  # type: ignore[arg-type]
            score = struct.unpack("<f", fields[2])[0] if 2 in fields else 0.0  # type: ignore[arg-type]
            pieces.append((fields[1].decode("utf-8"), score, int(fields.get(3, _NORMAL))))  # type: ignore[union-attr]
        elif number == 2:
            trainer = dict(_fields(value))  # type: ignore[arg-type]
        elif number == 3:
            normalizer = dict(_fields(value))  # type: ignore[arg-type]

    # Defaults are proto2 defaults of sentencepiece_model.proto.
    settings = {
        "trainer_spec.model_type (2 = BPE)": (trainer.get(3, 1), 2),
        "trainer_spec.byte_fallback": (trainer.get(35, 0), 1),
        "trainer_spec.treat_whitespace_as_suffix": (trainer.get(24, 0), 0),
        "normalizer_spec.name": (normalizer.get(1, b"nmt_nfkc"), b"identity"),
        "normalizer_spec.add_dummy_prefix": (normalizer.get(3, 1), 1),
        "normalizer_spec.escape_whitespaces": (normalizer.get(5, 1), 1),
    }
    for name, (actual, supported) in settings.items():
        if actual != supported:
            raise ValueError(f"{path}: {name} is {actual!r}; the converter reproduces only {supported!r}")

    if len(pieces) != vocab.size:
        raise ValueError(f"{path}: {len(pieces)} pieces, tokenizer.bin has {vocab.size}")
    expected_types = [_UNKNOWN, _CONTROL, _CONTROL] + [_BYTE] * 256
    for token_id, (piece, score, piece_type) in enumerate(pieces):
        want_type = expected_types[token_id] if token_id < FIRST_NORMAL_ID else _NORMAL
        if (piece, score, piece_type) != (vocab.pieces[token_id], vocab.scores[token_id], want_type):
            raise ValueError(
                f"{path}: piece {token_id} is {(piece, score, piece_type)!r}, tokenizer.bin implies "
                f"{(vocab.pieces[token_id], vocab.scores[token_id], want_type)!r}"
            )
    return WhitespaceHandling(remove_extra_whitespaces=bool(normalizer.get(4, 1)))


# ---------------------------------------------------------------------------------------------
# tokenizers.Tokenizer
# ---------------------------------------------------------------------------------------------


def bpe_merges(vocab: Llama2cVocab) -> list[tuple[str, str]]:
    """Merges in the order sentencepiece BPE applies them.

    sentencepiece's encoder repeatedly joins the adjacent pair whose concatenation is the
    highest-scoring piece; a merge's rank is therefore its result's score. Every way of splitting a
    piece into two pieces is a merge with that rank (ties between splits of one piece broken by
    the ids of the halves). Byte and control pieces are never merge results or operands.
    """
    normal = {vocab.pieces[i]: i for i in range(FIRST_NORMAL_ID, vocab.size)}
    ranked: list[tuple[float, int, int, str, str]] = []
    for piece, piece_id in normal.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                ranked.append((-vocab.scores[piece_id], normal[left], normal[right], left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def build_tokenizer(vocab: Llama2cVocab, whitespace: WhitespaceHandling = WhitespaceHandling()) -> Tokenizer:
    """A `tokenizers.Tokenizer` that encodes and decodes like the sentencepiece model.

    Normalization mirrors sentencepiece's identity normalizer with add_dummy_prefix: prepend one
    "▁" and spell spaces "▁"; with remove_extra_whitespaces also drop leading spaces, squeeze runs
    of spaces and drop trailing "▁". There is no pre-tokenizer: sentencepiece BPE merges over the
    whole normalized text.

    Decoding follows sentencepiece's rule for the start of the text: it drops the leading "▁" of
    pieces while the decoded text is still empty (every such "▁" with remove_extra_whitespaces, the
    first one without), but never a space spelled by a byte piece (<0x20>): [<0x20>, "▁upon"] is
    "  upon". Hence the decoder's order: ByteFallback and Fuse first, then Strip("▁") on the fused
    text (byte-spelled spaces are already " " and survive), then "▁" -> " ".

    Known differences, none of which an encoding of text produces (a model's output can):
    - <unk>: sentencepiece prints the unk_surface (" ⁇ "), here it is skipped as special.
    - A byte run that spells U+2581 itself (<0xE2><0x96><0x81>): sentencepiece keeps "▁", here it
      becomes a space (Replace runs after ByteFallback), or nothing at the start of the text.
    - Byte runs that are not valid UTF-8: sentencepiece replaces each bad byte and keeps the valid
      characters around it ([E4 B8 AD 80] is "中" and one U+FFFD), tokenizers' ByteFallback
      replaces the whole run (four U+FFFD).
    - Special tokens inside a byte run: tokenizers skips them before the decoder runs, so the run
      continues across them; sentencepiece ends the run at the special token.
    Special tokens' text in the input ("<s>") is matched as the token unless the caller sets
    `Tokenizer.encode_special_tokens = True`; sentencepiece always reads it as text.
    """
    if whitespace.remove_extra_whitespaces:
        _check_no_double_spaces(vocab)
    token_ids = {piece: token_id for token_id, piece in enumerate(vocab.pieces)}
    tokenizer = Tokenizer(
        BPE(vocab=token_ids, merges=bpe_merges(vocab), unk_token=UNK, byte_fallback=True, fuse_unk=False)
    )
    tokenizer.normalizer = _normalizer(whitespace)
    tokenizer.pre_tokenizer = None
    tokenizer.add_special_tokens([AddedToken(piece, special=True, normalized=False) for piece in (UNK, BOS, EOS)])
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS}:0 $A:0",
        pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1",
        special_tokens=[(BOS, token_ids[BOS])],
    )
    tokenizer.decoder = _decoder(whitespace)
    return tokenizer


def _check_no_double_spaces(vocab: Llama2cVocab) -> None:
    for token_id in range(FIRST_NORMAL_ID, vocab.size):
        if vocab.pieces[token_id].startswith(SPACE_SYMBOL * 2):
            raise ValueError(
                f"piece {token_id} {vocab.pieces[token_id]!r} is whitespace that remove_extra_whitespaces "
                "would never produce: pass the sentencepiece model so its settings are read"
            )


def _normalizer(whitespace: WhitespaceHandling) -> normalizers.Normalizer:
    escape = [normalizers.Prepend(SPACE_SYMBOL), normalizers.Replace(" ", SPACE_SYMBOL)]  # Prepend skips ""
    if not whitespace.remove_extra_whitespaces:
        return normalizers.Sequence(escape)
    squeeze = [normalizers.Replace(Regex(r"\A +"), ""), normalizers.Replace(Regex(r" {2,}"), " ")]
    trailing = [normalizers.Replace(Regex(SPACE_SYMBOL + r"+\z"), "")]  # literal "▁" too, as sentencepiece
    return normalizers.Sequence(squeeze + escape + trailing)


def _decoder(whitespace: WhitespaceHandling) -> decoders.Decoder:
    # sentencepiece drops the leading "▁" of the first piece. With remove_extra_whitespaces it does
    # so for every piece while the decoded text is still empty; no piece starts with "▁▁" (checked
    # by _check_no_double_spaces), so that is exactly "strip every leading ▁": a run of "▁" pieces
    # plus the dummy prefix of the first word. Without it (Llama 2 style, pieces such as "▁▁▁") only
    # one "▁" goes. Strip runs after ByteFallback and Fuse, on the whole text and before "▁" becomes
    # " ", so it only ever removes piece spaces: a leading <0x20> byte is a space in sentencepiece's
    # output too.
    leading = _ALL_LEADING if whitespace.remove_extra_whitespaces else 1
    return decoders.Sequence(
        [
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(SPACE_SYMBOL, leading, 0),
            decoders.Replace(SPACE_SYMBOL, " "),
        ]
    )
