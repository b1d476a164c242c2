"""Tiny hand-made tokenizers for the text tests, built with the `tokenizers` library.

`llama_style()` has the structure of a sentencepiece BPE converted to tokenizer.json (the same
structure as the stories260K conversion): ids 0..2 are <unk> <s> </s>, 3..258 the byte pieces
<0x00>..<0xFF> (byte fallback), then "▁" and ASCII characters, then a few merged pieces; the
decoder is Replace("▁", " ") -> ByteFallback -> Fuse -> Strip(one leading space). Anything outside
ASCII (CJK, emoji, accents) is spelled in byte pieces, so one character spans several tokens.

`metaspace_style()` spells spaces with the Metaspace pre-tokenizer/decoder instead, and
`byte_level_style()` is a GPT-2 style byte-level BPE (no byte fallback; incomplete UTF-8 decodes
to U+FFFD until its last byte arrives).
"""

from __future__ import annotations

import json
import string
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

SPACE = "▁"
UNK, BOS, EOS = "<unk>", "<s>", "</s>"
BOS_ID, EOS_ID = 1, 2
FIRST_BYTE_ID = 3

_CHARS = [SPACE] + list(string.ascii_lowercase + string.ascii_uppercase + string.digits + ".,!?'-")
# Merged pieces in merge order; each must split into two earlier pieces.
_MERGED = [
    "▁t", "he", "▁the", "▁a", "in", "er", "an", "on", "▁w", "as", "▁was", "re", "▁th", "ere",
    "▁there", "nd", "▁and", "ll", "▁H", "▁He", "▁o", "ne", "▁one", "it", "▁it", "ay", "▁d",
    "▁day", "ou", "▁y", "▁you", "ing", "▁b", "ig", "▁big", "▁O", "ce", "nce", "▁Once", "▁u", "▁up", "▁upon",
    "▁ti", "me", "▁time", "og", "▁dog",
]  # fmt: skip


def _pieces() -> list[str]:
    return [UNK, BOS, EOS] + [f"<0x{b:02X}>" for b in range(256)] + _CHARS + _MERGED


def _merges(pieces: list[str]) -> list[tuple[str, str]]:
    """Every split of a merged piece into two vocabulary pieces, ranked by the piece's order."""
    rank = {piece: i for i, piece in enumerate(pieces)}
    merges: list[tuple[str, str]] = []
    for piece in _MERGED:
        splits = [(piece[:cut], piece[cut:]) for cut in range(1, len(piece))]
        usable = [(a, b) for a, b in splits if max(rank.get(a, len(pieces)), rank.get(b, len(pieces))) < rank[piece]]
        assert usable, f"test vocabulary: {piece!r} cannot be merged from earlier pieces"
        merges.extend(usable)
    return merges


def _with_specials(tokenizer: Tokenizer) -> Tokenizer:
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (UNK, BOS, EOS)])
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1", special_tokens=[(BOS, BOS_ID)]
    )
    return tokenizer


def llama_style() -> Tokenizer:
    pieces = _pieces()
    vocab = {piece: i for i, piece in enumerate(pieces)}
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=_merges(pieces), unk_token=UNK, byte_fallback=True, fuse_unk=False))
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE), normalizers.Replace(Regex(SPACE + r"+\z"), "")]
    )
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return _with_specials(tokenizer)


def metaspace_style() -> Tokenizer:
    pieces = _pieces()
    vocab = {piece: i for i, piece in enumerate(pieces)}
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=_merges(pieces), unk_token=UNK, byte_fallback=True, fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="first", split=False)
    tokenizer.decoder = decoders.Sequence(
        [decoders.ByteFallback(), decoders.Metaspace(replacement=SPACE, prepend_scheme="first", split=False)]
    )
    return _with_specials(tokenizer)


def byte_level_style() -> Tokenizer:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    pieces = [UNK, BOS, EOS] + alphabet
    # A few merges over the byte-level alphabet ("Ġ" is the space byte); "中" is three bytes.
    merged = ["Ġt", "he", "Ġthe", "Ġa", "in", "ä¸", "ä¸Ń", "ðŁ", "ðŁĲ"]
    pieces += merged
    vocab = {piece: i for i, piece in enumerate(pieces)}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("Ġ", "a"), ("i", "n"), ("ä", "¸"), ("ä¸", "Ń"), ("ð", "Ł"), ("ðŁ", "Ĳ")]
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (UNK, BOS, EOS)])
    return tokenizer


CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def write_model_dir(
    directory: Path,
    tokenizer: Tokenizer,
    tokenizer_config: dict | None = None,
    generation_config: dict | None = None,
) -> Path:
    """Write tokenizer.json (+ configs) the way a Hugging Face model directory holds them."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    if tokenizer_config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config), encoding="utf-8")
    if generation_config is not None:
        (directory / "generation_config.json").write_text(json.dumps(generation_config), encoding="utf-8")
    return directory


LLAMA_CONFIG = {
    "bos_token": {"content": BOS, "__type": "AddedToken"},
    "eos_token": EOS,
    "unk_token": UNK,
    "add_bos_token": True,
    "add_eos_token": False,
    "model_max_length": 512,
}
