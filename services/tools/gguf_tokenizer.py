"""The tokenizer files of a model directory, built from a GGUF file's tokenizer metadata.

A GGUF carries no ``tokenizer.json``; llama.cpp stores the vocabulary as metadata:

    tokenizer.ggml.model        "gpt2": byte-level BPE; "llama": SentencePiece (BPE with byte fallback)
    tokenizer.ggml.pre          the BPE pre-tokenizer's name in llama.cpp ("llama-bpe", "qwen2", ...)
    tokenizer.ggml.tokens       the pieces, in id order ("Ġthe" in GPT-2's byte alphabet, "▁the" in SentencePiece's)
    tokenizer.ggml.scores       SentencePiece: each piece's score (higher merges first)
    tokenizer.ggml.token_type   1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
    tokenizer.ggml.merges       BPE: "Ġ t" pairs, best first
    tokenizer.ggml.add_space_prefix   SentencePiece: a "▁" before the text (llama.cpp's default: yes)
    tokenizer.ggml.{bos,eos,unknown,padding,eot,eom}_token_id, tokenizer.ggml.add_{bos,eos}_token
    tokenizer.chat_template     the Jinja chat template

The rules are llama.cpp's (``llama-vocab.cpp``), whose encoding of a file is the reference the
tests compare with, text by text:

- Control and unknown pieces become special added tokens (matched whole in the text, left out by
  decode(skip_special_tokens)); user-defined ones plain added tokens, also matched whole.
- BOS is added when ``add_bos_token`` says so; without the key llama.cpp adds it for SentencePiece
  and for the Llama 3 pre-tokenizer family, not for other byte-level BPE.

Byte-level BPE. Pre-tokenizers are rebuilt from llama.cpp's definitions, which split text with a
list of regexes applied in turn (a `tokenizers` Sequence of isolating Splits):

- ``gpt-2``: GPT-2's regex ``'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)``;
- ``smollm`` (llama.cpp groups it with starcoder): ``\\p{N}`` first (every digit on its own),
  then GPT-2's regex. In `tokenizers` that is Digits(individual_digits) then ByteLevel with its
  regex, which is the pre-tokenizer of SmolLM2's own tokenizer.json.
- ``qwen2``: QWEN2_SPLIT; ``llama-bpe`` (Llama 3.x): LLAMA3_SPLIT, the same with digits in runs
  of up to three, and a word that is a piece of its own taken whole before any merge
  (``ignore_merges``, as Llama 3's tokenizer.json and llama.cpp do). PRE_TOKENIZERS lists the
  names llama.cpp gives the same split.

Any other name, or none, is refused rather than guessed: a wrong split still encodes, but into
ids the model never saw in training.

SentencePiece (``tokenizer.ggml.model`` "llama": Llama 2, Mistral / Mixtral, Phi-3, TinyLlama...).
llama.cpp escapes spaces as "▁", puts one "▁" before each run of text that opens the input or
follows a special token (``add_space_prefix``), then joins adjacent symbols, starting from single
characters, always taking the pair whose join is the best-scoring piece (ties: the leftmost);
characters no piece covers become their UTF-8 bytes' ``<0xNN>`` pieces. That is BPE with byte
fallback whose merges are every split of a piece into two pieces, ranked by the joined piece's
score: what transformers' LlamaTokenizerFast builds too. Decoding turns "▁" back into spaces and
drops the one "▁" the prefix put before the first piece. Phi-3 files (``general.name`` containing
"phi-3" or "phi3") get llama.cpp's Phi-3 rule: whitespace after a special token other than <unk>,
<s> and <|endoftext|> is dropped.

Gemma's SentencePiece vocabularies (``general.architecture`` gemma*) are built as transformers'
GGUF loader and Gemma's own tokenizer.json build them: no prefix space, and merges rebuilt from
the piece order (the file has none): every split of a piece into two pieces, best first in the
order the pieces appear in the file. Pieces the file stores as runs of real spaces are spelled
with "▁", as Gemma looks them up.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
SPACE = "\u2581"  # SentencePiece's "▁"


def _byte_level(use_regex: bool = True) -> pre_tokenizers.ByteLevel:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=use_regex)


QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
"""llama.cpp's ``qwen2`` split (Qwen2, Qwen2.5, Qwen3): letters with one leading non-letter, digits one by one."""

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
"""llama.cpp's ``llama3`` split (Llama 3.x's tokenizer.json): qwen2's with digits in runs of up to three."""

GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
"""GPT-2's regex; ByteLevel's own regex is this one."""

TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
                r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
                r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
"""llama.cpp's ``tekken`` split (Mistral NeMo, Pixtral 12B, Mistral Small 3): its rewrite of the
tokenizer.json regex without \p{Lu}/\p{Ll}, which treats a non-ASCII letter as both cases."""

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
GPT4O_SPLIT = (rf"[^\r\n\p{{L}}\p{{N}}]?((?=[\p{{L}}])([^a-z]))*((?=[\p{{L}}])([^A-Z]))+{_CONTRACTIONS}"
               rf"|[^\r\n\p{{L}}\p{{N}}]?((?=[\p{{L}}])([^a-z]))+((?=[\p{{L}}])([^A-Z]))*{_CONTRACTIONS}"
               r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
"""llama.cpp's ``gpt-4o`` split (o200k: Phi-4-mini, Llama 4), rewritten the same way."""

_DEEPSEEK_LETTERS = (
    "A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚ"
    # Greek Extended and letterlike symbols in escapes: several of them normalize (NFC) to other letters
    "\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d"
    "\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec"
    "\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d"
    "\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e"
    "Ⰰ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ"
    "\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2"
    "\U000118a0-\U000118df\U0001e900-\U0001e943")
"""deepseek-llm's letters: the cased letters of several scripts, listed (no CJK, no \\p{L})."""

DEEPSEEK_V3_SPLIT = (r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
                     r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
"""llama.cpp's ``deepseek-v3`` third split: an ASCII punctuation mark may lead ASCII letters,
other letters take combining marks, punctuation and symbols group."""

_BLOOM = r" ?[^(\s|.,!?…。，、।۔،)]+"
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"


def _splits(*patterns: str) -> Callable[[], pre_tokenizers.PreTokenizer]:
    """llama.cpp's list of regexes, each splitting what the previous left, then the byte alphabet."""
    return lambda: pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(p), behavior="isolated") for p in patterns]
                                           + [_byte_level(use_regex=False)])


_GPT2 = _byte_level
_SMOLLM = lambda: pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _byte_level()])  # noqa: E731

PRE_TOKENIZERS: dict[str, Callable[[], pre_tokenizers.PreTokenizer]] = {
    "gpt-2": _GPT2, "phi-2": _GPT2, "mpt": _GPT2, "olmo": _GPT2, "jais": _GPT2,
    "smollm": _SMOLLM, "starcoder": _SMOLLM, "refact": _SMOLLM, "codeshell": _SMOLLM, "command-r": _SMOLLM,
    "exaone": _SMOLLM, "minerva-7b": _SMOLLM,
    "qwen2": _splits(QWEN2_SPLIT), "stablelm2": _splits(QWEN2_SPLIT), "deepseek-r1-qwen": _splits(QWEN2_SPLIT),
    "megrez": _splits(QWEN2_SPLIT),
    **{name: _splits(LLAMA3_SPLIT) for name in ("llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral", "dbrx",
                                                "smaug-bpe")},
    "tekken": _splits(TEKKEN_SPLIT),
    "gpt-4o": _splits(GPT4O_SPLIT), "llama4": _splits(GPT4O_SPLIT),
    "falcon": _splits(r"[\p{P}\$\+<=>\^~\|`]+", GPT2_SPLIT, r"[0-9][0-9][0-9]"),
    "default": _splits(r"[\p{P}\$\+<=>\^~\|]+", GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]"),
    "deepseek-coder": _splits("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}"),
    "deepseek-llm": _splits("[\r\n]", rf"\s?[{_DEEPSEEK_LETTERS}]+", r"\s?[!-/:-~！-／：-～‘-‟　-。]+", r"\s+$", _CJK,
                            r"\p{N}+"),
    "deepseek-v3": _splits(r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+", DEEPSEEK_V3_SPLIT),
    "chatglm-bpe": _splits(LLAMA3_SPLIT),
    "bloom": _splits(_BLOOM), "poro-chat": _splits(_BLOOM), "viking": _splits(_BLOOM, r"\p{N}"),
}
"""llama.cpp's ``tokenizer.ggml.pre`` name -> the equivalent `tokenizers` pre-tokenizer (llama.cpp
maps each group of names to one list of regexes; a file without the key, which llama.cpp reads
as "default" with a warning that quality will suffer, is refused)."""

LLAMA3_FAMILY = frozenset({"llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral"})
WHOLE_WORDS_AND_BOS = LLAMA3_FAMILY | {"tekken"}
"""Names for which llama.cpp takes a word that is a piece whole (``ignore_merges``) and adds BOS
by default; ``dbrx`` and ``smaug-bpe`` share Llama 3's split but neither setting."""

_PHI3_NOT_RSTRIPPED = ("<unk>", "<s>", "<|endoftext|>")

EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~["})
"""Pieces llama.cpp (llama-cpp-python 0.3.36, llama-vocab.cpp) ends generation on by their text,
whatever their type and whatever ids the metadata names: Gemma's ``<end_of_turn>``, SmolLM2's
and Qwen's ``<|im_end|>`` and ``<|endoftext|>``, Phi-3's ``<|end|>``, Llama 3's ``<|eot_id|>``."""

FIM_END_TEXTS = {
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
"""Fill-in-the-middle pieces llama.cpp also ends on: the one the metadata names
(``tokenizer.ggml.<name>_token_id``), else one piece of these texts (SmolLM2's ``<reponame>``,
Qwen2.5's ``<|fim_pad|>``, ``<|repo_name|>`` and ``<|file_sep|>``)."""


def _required(metadata: Mapping[str, Any], key: str) -> Any:
    if key not in metadata:
        raise ValueError(f"GGUF metadata has no {key!r}, which a tokenizer needs")
    return metadata[key]


def _token_id(metadata: Mapping[str, Any], key: str, vocab_size: int) -> int | None:
    value = metadata.get(f"tokenizer.ggml.{key}")
    if value is None:
        return None
    if not 0 <= int(value) < vocab_size:
        raise ValueError(f"tokenizer.ggml.{key} is {value}, outside the vocabulary [0, {vocab_size})")
    return int(value)


def _is_gemma(metadata: Mapping[str, Any]) -> bool:
    return str(metadata.get("general.architecture", "")).startswith("gemma")


def _is_sentencepiece(metadata: Mapping[str, Any]) -> bool:
    """A SentencePiece vocabulary as llama.cpp encodes it (Gemma's is built as transformers builds it)."""
    return metadata.get("tokenizer.ggml.model") == "llama" and not _is_gemma(metadata)


def _token_types(metadata: Mapping[str, Any], tokens: list[str]) -> list[int]:
    types: list[int] = [int(t) for t in metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)]
    if len(types) != len(tokens):
        raise ValueError(f"tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    return types


def _vocab(tokens: list[str]) -> dict[str, int]:
    vocab = {token: index for index, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("tokenizer.ggml.tokens lists a piece twice")
    return vocab


def _add_vocabulary_tokens(tokenizer: Tokenizer, tokens: list[str], types: list[int],
                           rstrip: frozenset[str] = frozenset()) -> None:
    """Control and unknown pieces as special added tokens, user-defined ones as plain added tokens;
    each keeps its vocabulary id (it is already a piece of the vocabulary)."""
    tokenizer.add_special_tokens([
        AddedToken(token, special=True, normalized=False, rstrip=token in rstrip)
        for token, kind in zip(tokens, types) if kind in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN)
    ])
    tokenizer.add_tokens([
        AddedToken(token, special=False, normalized=False, rstrip=token in rstrip)
        for token, kind in zip(tokens, types) if kind == TOKEN_TYPE_USER_DEFINED
    ])
    if tokenizer.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise ValueError("the added tokens changed the vocabulary size; the GGUF's token list is inconsistent")


def build_tokenizer(metadata: Mapping[str, Any]) -> Tokenizer:
    """The `tokenizers` fast tokenizer the metadata describes: byte-level BPE or SentencePiece."""
    kind = _required(metadata, "tokenizer.ggml.model")
    if kind == "llama":
        return _gemma_sentencepiece(metadata) if _is_gemma(metadata) else _sentencepiece(metadata)
    if kind != "gpt2":
        raise ValueError(
            f"tokenizer.ggml.model is {kind!r}; the vocabularies converted are 'gpt2' (byte-level BPE) and "
            f"'llama' (SentencePiece)"
        )
    pre = metadata.get("tokenizer.ggml.pre")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(
            f"tokenizer.ggml.pre is {pre!r}; the pre-tokenizers converted are {', '.join(sorted(PRE_TOKENIZERS))}"
        )
    tokens: list[str] = list(_required(metadata, "tokenizer.ggml.tokens"))
    types = _token_types(metadata, tokens)
    merges: list[str] = list(_required(metadata, "tokenizer.ggml.merges"))
    vocab = _vocab(tokens)
    pairs = []
    for line in merges:
        left, sep, right = line.partition(" ")
        if not sep or " " in right:
            raise ValueError(f"tokenizer.ggml.merges entry {line!r} is not two pieces separated by one space")
        pairs.append((left, right))

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False,
                                     ignore_merges=pre in WHOLE_WORDS_AND_BOS))
    tokenizer.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tokenizer.decoder = decoders.ByteLevel()
    byte_level = processors.ByteLevel(trim_offsets=False)
    ends = _bos_eos_processor(metadata, tokens)
    tokenizer.post_processor = byte_level if ends is None else processors.Sequence([byte_level, ends])
    _add_vocabulary_tokens(tokenizer, tokens, types)
    return tokenizer


def _bos_eos_processor(metadata: Mapping[str, Any], tokens: list[str]) -> processors.TemplateProcessing | None:
    """BOS / EOS around the text as llama.cpp adds them (the tokenizer service reads the same flags
    from tokenizer_config.json; this keeps tokenizer.json alone faithful too)."""
    ids = special_token_ids(metadata)
    bos = ids["bos"] if add_bos_token(metadata) else None
    eos = ids["eos"] if metadata.get("tokenizer.ggml.add_eos_token") else None
    if bos is None and eos is None:
        return None
    head = f"{tokens[bos]}:0 " if bos is not None else ""
    tail = f" {tokens[eos]}:0" if eos is not None else ""
    used = {(tokens[i], i) for i in (bos, eos) if i is not None}
    return processors.TemplateProcessing(single=f"{head}$A:0{tail}", pair=f"{head}$A:0{tail} {head}$B:1{tail}",
                                         special_tokens=sorted(used))


def _sentencepiece_merges(tokens: list[str], scores: list[float], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces, ranked as llama.cpp joins them: the joined piece's
    score, higher first (ties between pieces: the lower id; between splits of one piece: the ids of
    the halves)."""
    ranked: list[tuple[float, int, int, int, str, str]] = []
    for piece_id, piece in enumerate(tokens):
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[piece_id], piece_id, vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _sentencepiece(metadata: Mapping[str, Any]) -> Tokenizer:
    tokens: list[str] = list(_required(metadata, "tokenizer.ggml.tokens"))
    types = _token_types(metadata, tokens)
    scores = [float(s) for s in _required(metadata, "tokenizer.ggml.scores")]
    if len(scores) != len(tokens):
        raise ValueError(f"tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens")
    vocab = _vocab(tokens)
    unk_id = special_token_ids(metadata)["unk"]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=_sentencepiece_merges(tokens, scores, vocab),
                                     unk_token=tokens[unk_id] if unk_id is not None else None,
                                     fuse_unk=True, byte_fallback=True))
    prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    # The added tokens split the text first, and the normalizer runs on each run of text between
    # them, so Prepend gives every run its "▁": llama.cpp's prefix at the start and after a special.
    escape = [normalizers.Replace(" ", SPACE)]
    tokenizer.normalizer = normalizers.Sequence(([normalizers.Prepend(SPACE)] if prefix else []) + escape)
    tokenizer.pre_tokenizer = None  # llama.cpp joins symbols over the whole run, across words
    # Strip after ByteFallback and Fuse: it removes the prefix's "▁" only, never a byte-spelled space.
    tokenizer.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse(),
                                           *([decoders.Strip(SPACE, 1, 0)] if prefix else []),
                                           decoders.Replace(SPACE, " ")])
    name = str(metadata.get("general.name", "")).lower()
    rstrip: frozenset[str] = frozenset()
    if "phi-3" in name or "phi3" in name:  # llama.cpp's Phi-3 token attributes, chosen by the model's name
        rstrip = frozenset(t for t, kind in zip(tokens, types)
                           if kind in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_USER_DEFINED)
                           or t == "</s>") - set(_PHI3_NOT_RSTRIPPED)
    _add_vocabulary_tokens(tokenizer, tokens, types, rstrip)
    tokenizer.post_processor = _bos_eos_processor(metadata, tokens)
    return tokenizer


def _gemma_sentencepiece(metadata: Mapping[str, Any]) -> Tokenizer:
    tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t
              for t in _required(metadata, "tokenizer.ggml.tokens")]
    types: list[int] = list(metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if len(types) != len(tokens):
        raise ValueError(f"tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    vocab = {token: index for index, token in enumerate(tokens)}
    # Merges: each piece's splits into two pieces, ranked by the piece's place in the file (earlier is
    # better), then longer left and right parts first (a stable sort, as transformers sorts them).
    merges: list[tuple[str, str, int, int]] = []
    for rank, piece in enumerate(tokens):
        local = [(piece[:i], piece[i:]) for i in range(1, len(piece)) if piece[:i] in vocab and piece[i:] in vocab]
        local.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        merges.extend((left, right, rank, 0) for left, right in local)
    merges.sort(key=lambda m: (-m[2], len(m[0]), len(m[1])), reverse=True)
    unk_id = _token_id(metadata, "unknown_token_id", len(tokens))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[(m[0], m[1]) for m in merges], fuse_unk=True,
                                     unk_token=tokens[unk_id] if unk_id is not None else None, byte_fallback=True))
    tokenizer.normalizer = normalizers.Replace(" ", "\u2581")
    tokenizer.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False)
                                  for token, kind in zip(tokens, types) if kind == TOKEN_TYPE_CONTROL])
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False)
                          for token, kind in zip(tokens, types) if kind == TOKEN_TYPE_USER_DEFINED and token in vocab])
    bos = _token_id(metadata, "bos_token_id", len(tokens))
    if metadata.get("tokenizer.ggml.add_bos_token") and bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]}:0 $A:0", pair=f"{tokens[bos]}:0 $A:0 {tokens[bos]}:1 $B:1",
            special_tokens=[(tokens[bos], bos)])
    return tokenizer


def special_token_ids(metadata: Mapping[str, Any]) -> dict[str, int | None]:
    """bos, eos, unk, pad, eot, eom ids as the metadata states them (None where absent); a
    SentencePiece vocabulary without them has llama.cpp's defaults, <unk> 0, <s> 1, </s> 2."""
    vocab_size = len(_required(metadata, "tokenizer.ggml.tokens"))
    keys = {"bos": "bos_token_id", "eos": "eos_token_id", "unk": "unknown_token_id",
            "pad": "padding_token_id", "eot": "eot_token_id", "eom": "eom_token_id"}
    ids = {name: _token_id(metadata, key, vocab_size) for name, key in keys.items()}
    if _is_sentencepiece(metadata):
        for name, default in (("unk", 0), ("bos", 1), ("eos", 2)):
            if ids[name] is None and default < vocab_size:
                ids[name] = default
    return ids


def end_token_ids(metadata: Mapping[str, Any]) -> list[int]:
    """The ids that end generation, llama.cpp's end-of-generation set: EOS first, then the
    end-of-turn/-message ids the file names, the fill-in-the-middle ones (FIM_END_TEXTS) and every
    piece of EOG_TEXTS, in id order. As llama.cpp does, ``<|end|>`` is no end beside
    ``<|return|>`` and ``<|call|>`` (or ``<|calls|>`` and ``<|flush|>``), nor ``</s>`` beside
    ``<|tool_response>``."""
    ids = special_token_ids(metadata)
    tokens = list(_required(metadata, "tokenizer.ggml.tokens"))
    vocab_size = len(tokens)
    by_text = {t: i for i, t in enumerate(tokens)}  # the last of a repeated piece, as llama.cpp's map keeps
    found = set()
    for name, texts in FIM_END_TEXTS.items():
        fim = _token_id(metadata, f"{name}_token_id", vocab_size)
        if fim is None:  # llama.cpp takes whichever its hash map meets first; the lowest id here
            fim = min((by_text[t] for t in texts if t in by_text), default=None)
        if fim is not None:
            found.add(fim)
    found |= {i for t, i in by_text.items() if t in EOG_TEXTS}
    found |= {i for i in (ids["eos"], ids["eot"], ids["eom"]) if i is not None}
    texts = {tokens[i]: i for i in found}
    if "<|end|>" in texts and ({"<|return|>", "<|call|>"} <= texts.keys() or {"<|calls|>", "<|flush|>"} <= texts.keys()):
        found.discard(texts["<|end|>"])
    if "</s>" in texts and "<|tool_response>" in texts:
        found.discard(texts["</s>"])
    first = [ids["eos"]] if ids["eos"] is not None and ids["eos"] in found else []
    return first + sorted(found - set(first))


def add_bos_token(metadata: Mapping[str, Any]) -> bool:
    """``add_bos_token``, or llama.cpp's default without it: yes for SentencePiece and the Llama 3
    family, no for other byte-level BPE (Gemma's files always state it)."""
    if "tokenizer.ggml.add_bos_token" in metadata:
        return bool(metadata["tokenizer.ggml.add_bos_token"])
    return _is_sentencepiece(metadata) or metadata.get("tokenizer.ggml.pre") in WHOLE_WORDS_AND_BOS


def tokenizer_config(metadata: Mapping[str, Any], model_max_length: int) -> dict[str, Any]:
    """tokenizer_config.json: special tokens by text, BOS/EOS flags, the chat template.

    A GGUF without ``add_bos_token`` gets llama.cpp's default (``add_bos_token``).
    """
    tokens = _required(metadata, "tokenizer.ggml.tokens")
    ids = special_token_ids(metadata)
    config: dict[str, Any] = {
        "add_bos_token": add_bos_token(metadata),
        "add_eos_token": bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(model_max_length),
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    for name in ("bos", "eos", "unk", "pad"):
        if ids[name] is not None:
            config[f"{name}_token"] = tokens[ids[name]]
    template = metadata.get("tokenizer.chat_template")
    if template is not None:
        config["chat_template"] = str(template)
    return config


def generation_config(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """generation_config.json: BOS, the end ids (EOS first), padding."""
    ids = special_token_ids(metadata)
    ends = end_token_ids(metadata)
    config: dict[str, Any] = {}
    if ids["bos"] is not None:
        config["bos_token_id"] = ids["bos"]
    if ends:
        config["eos_token_id"] = ends[0] if len(ends) == 1 else ends
    if ids["pad"] is not None:
        config["pad_token_id"] = ids["pad"]
    return config
