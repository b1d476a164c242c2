"""The tokenizer files of a model directory, built from a GGUF file's tokenizer metadata.

A GGUF carries no ``tokenizer.json``; llama.cpp stores the vocabulary as metadata:

    tokenizer.ggml.model        "gpt2": byte-level BPE (the only kind converted here)
    tokenizer.ggml.pre          the pre-tokenizer's name in llama.cpp ("smollm", "gpt-2", ...)
    tokenizer.ggml.tokens       the pieces, in id order, spelled in GPT-2's byte alphabet ("Ġthe")
    tokenizer.ggml.token_type   1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
    tokenizer.ggml.merges       "Ġ t" pairs, best first
    tokenizer.ggml.{bos,eos,unknown,padding,eot,eom}_token_id, tokenizer.ggml.add_{bos,eos}_token
    tokenizer.chat_template     the Jinja chat template

Control tokens (``<|im_start|>``, ``<|im_end|>``...) become special added tokens, so a rendered
chat template's markup is read as those ids (and decode(skip_special_tokens) leaves them out);
user-defined ones become plain added tokens, matched whole as llama.cpp does.

Pre-tokenizers are rebuilt from llama.cpp's definitions (``llama-vocab.cpp``), which split text
with a list of regexes applied in turn:

- ``gpt-2``: GPT-2's regex ``'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)``;
- ``smollm`` (llama.cpp groups it with starcoder): ``\\p{N}`` first (every digit on its own),
  then GPT-2's regex. In `tokenizers` that is Digits(individual_digits) then ByteLevel with its
  regex, which is the pre-tokenizer of SmolLM2's own tokenizer.json.

Any other name, or none, is refused rather than guessed: a wrong split still encodes, but into
ids the model never saw in training.

SentencePiece vocabularies (``tokenizer.ggml.model`` "llama") are converted for Gemma files, as
transformers' GGUF loader and Gemma's own tokenizer.json build them: BPE with byte fallback over
the pieces, spaces written as "▁" by a normalizer (no prefix space), and merges rebuilt from the
vocabulary (the file has none): every split of a piece into two pieces, best first in the order
the pieces appear in the file (Gemma's scores do not follow its merge order). Pieces the file
stores as runs of real spaces are spelled with "▁", as Gemma looks them up.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4


def _byte_level(use_regex: bool = True) -> pre_tokenizers.ByteLevel:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=use_regex)


QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
"""llama.cpp's ``qwen2`` split (Qwen2, Qwen2.5, Qwen3): letters with one leading non-letter, digits one by one."""

PRE_TOKENIZERS = {
    "gpt-2": lambda: _byte_level(),
    "qwen2": lambda: pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
                                              _byte_level(use_regex=False)]),
    "smollm": lambda: pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _byte_level()]),
}
"""llama.cpp's ``tokenizer.ggml.pre`` name -> the equivalent `tokenizers` pre-tokenizer."""


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


def build_tokenizer(metadata: Mapping[str, Any]) -> Tokenizer:
    """The `tokenizers` fast tokenizer the metadata describes: byte-level BPE, or Gemma's SentencePiece."""
    kind = _required(metadata, "tokenizer.ggml.model")
    if kind == "llama" and str(metadata.get("general.architecture", "")).startswith("gemma"):
        return _gemma_sentencepiece(metadata)
    if kind != "gpt2":
        raise ValueError(
            f"tokenizer.ggml.model is {kind!r}; the vocabularies converted are 'gpt2' (byte-level BPE) and "
            f"'llama' (SentencePiece) of Gemma files"
        )
    pre = metadata.get("tokenizer.ggml.pre")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(
            f"tokenizer.ggml.pre is {pre!r}; the pre-tokenizers converted are {', '.join(sorted(PRE_TOKENIZERS))}"
        )
    tokens: list[str] = list(_required(metadata, "tokenizer.ggml.tokens"))
    types: list[int] = list(metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges: list[str] = list(_required(metadata, "tokenizer.ggml.merges"))
    if len(types) != len(tokens):
        raise ValueError(f"tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    vocab = {token: index for index, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("tokenizer.ggml.tokens lists a piece twice")
    pairs = []
    for line in merges:
        left, sep, right = line.partition(" ")
        if not sep or " " in right:
            raise ValueError(f"tokenizer.ggml.merges entry {line!r} is not two pieces separated by one space")
        pairs.append((left, right))

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    # Added tokens keep their vocabulary ids (each is already a piece of the vocabulary).
    tokenizer.add_special_tokens([
        AddedToken(token, special=True, normalized=False)
        for token, kind in zip(tokens, types) if kind == TOKEN_TYPE_CONTROL
    ])
    tokenizer.add_tokens([
        AddedToken(token, special=False, normalized=False)
        for token, kind in zip(tokens, types) if kind == TOKEN_TYPE_USER_DEFINED
    ])
    if tokenizer.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise ValueError("the added tokens changed the vocabulary size; the GGUF's token list is inconsistent")
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
    """bos, eos, unk, pad, eot, eom ids as the metadata states them (None where absent)."""
    vocab_size = len(_required(metadata, "tokenizer.ggml.tokens"))
    keys = {"bos": "bos_token_id", "eos": "eos_token_id", "unk": "unknown_token_id",
            "pad": "padding_token_id", "eot": "eot_token_id", "eom": "eom_token_id"}
    return {name: _token_id(metadata, key, vocab_size) for name, key in keys.items()}


def end_token_ids(metadata: Mapping[str, Any]) -> list[int]:
    """The ids that end generation: EOS, then the end-of-turn/-message ids when the file names them."""
    ids = special_token_ids(metadata)
    return list(dict.fromkeys(i for i in (ids["eos"], ids["eot"], ids["eom"]) if i is not None))


def tokenizer_config(metadata: Mapping[str, Any], model_max_length: int) -> dict[str, Any]:
    """tokenizer_config.json: special tokens by text, BOS/EOS flags, the chat template.

    A GGUF without ``add_bos_token`` gets no BOS: llama.cpp and transformers' GGUF loader
    default to adding one only for sentencepiece vocabularies, never for byte-level BPE.
    """
    tokens = _required(metadata, "tokenizer.ggml.tokens")
    ids = special_token_ids(metadata)
    config: dict[str, Any] = {
        "add_bos_token": bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
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
