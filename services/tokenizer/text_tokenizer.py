"""A model's tokenizer: `tokenizers.Tokenizer` plus the settings Hugging Face keeps beside it.

A model directory in the Hugging Face layout holds:

- ``tokenizer.json``: the fast tokenizer (normalizer, BPE model, post-processor, decoder);
- ``tokenizer_config.json``: bos/eos/unk tokens, ``add_bos_token``/``add_eos_token``,
  ``chat_template``, ``model_max_length``;
- ``generation_config.json`` (optional): ``eos_token_id`` may list several stop ids
  (Llama 3 stops on both ``<|end_of_text|>`` and ``<|eot_id|>``);
- ``chat_template.jinja`` / ``chat_template.json`` (optional): where newer transformers
  versions save the chat template instead of inside ``tokenizer_config.json``.

The server's ``--chat-template`` (a file or inline text) replaces the model's template, so a
model that ships none can serve chat.

Only ``tokenizer.json`` is required. This module never imports transformers: it reads the JSON
files itself so the services carry one dependency (``tokenizers``) for text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

# transformers writes int(1e30) as model_max_length when a model declares none.
_UNSET_MAX_LENGTH_THRESHOLD = 10**12
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
# Texts tried, in order, for the anchor token (see TextTokenizer.anchor_token_id); then the first
# _ANCHOR_SCAN ids of the vocabulary.
_ANCHOR_TEXTS = ("a", "e", "o", "x", "A", "0", "1", ".", ",")
_ANCHOR_SCAN = 1024


def _token_content(value: Any) -> str | None:
    """A token in tokenizer_config.json is a string or an AddedToken dict {"content": ...}."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"tokenizer_config.json: cannot read a token from {value!r}")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _select_chat_template(value: Any, origin: str) -> str | None:
    """A chat template is a string, or a list of named templates of which we take "default"."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {item.get("name"): item.get("template") for item in value if isinstance(item, dict)}
        template = named.get("default")
        if template is None:
            raise ValueError(f"{origin}: chat_template lists {sorted(map(str, named))} but no 'default' template")
        return template
    raise ValueError(f"{origin}: chat_template must be a string or a list of named templates")


def read_chat_template_option(value: str, field: str = "chat_template") -> str:
    """A chat template given to the server (vLLM's ``--chat-template``): the text of the file
    ``value`` names, or ``value`` itself when it is inline Jinja (holds ``{``). A value that is
    neither is refused naming the field, not rendered as a template of plain text."""
    path = Path(value).expanduser()
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{field}: cannot read {value}: {exc}") from None
    if "{" in value:
        return value
    raise ValueError(f"{field}: {value!r} is not a file (resolved from {Path.cwd()}) and holds no Jinja tag "
                     "({{ ... }} or {% ... %}); give a template file's path or the template's text")


def _decoder_has_byte_fallback(tokenizer_json: dict[str, Any]) -> bool:
    """True when the decoder pipeline contains a ByteFallback step (at any nesting depth)."""

    def walk(node: Any) -> bool:
        if isinstance(node, dict):
            if node.get("type") == "ByteFallback":
                return True
            return any(walk(child) for child in node.values())
        if isinstance(node, list):
            return any(walk(child) for child in node)
        return False

    return walk(tokenizer_json.get("decoder"))


class TextTokenizer:
    """Encode text to ids and decode ids to text, the way the model's Hugging Face files say.

    BOS handling: when tokenizer_config.json states ``add_bos_token`` / ``add_eos_token``, those
    flags decide (the post-processor in tokenizer.json is bypassed so BOS is never added twice);
    otherwise the post-processor in tokenizer.json decides, as transformers' fast tokenizer does.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        tokenizer_config: dict[str, Any] | None = None,
        generation_config: dict[str, Any] | None = None,
        chat_template: str | None = None,
    ) -> None:
        config = tokenizer_config or {}
        generation = generation_config or {}
        self._tokenizer = tokenizer
        # A tokenizer.json saved with truncation or padding would silently cut or pad prompts.
        self._tokenizer.no_truncation()
        self._tokenizer.no_padding()
        self._vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

        self.bos_token = _token_content(config.get("bos_token"))
        self.eos_token = _token_content(config.get("eos_token"))
        self.unk_token = _token_content(config.get("unk_token"))
        self.pad_token = _token_content(config.get("pad_token"))
        self._bos_token_id = self._lookup(self.bos_token, "bos_token")
        if self._bos_token_id is None and isinstance(generation.get("bos_token_id"), int):
            self._bos_token_id = generation["bos_token_id"]

        eos_ids: list[int] = []
        tokenizer_eos = self._lookup(self.eos_token, "eos_token")
        if tokenizer_eos is not None:
            eos_ids.append(tokenizer_eos)
        generation_eos = generation.get("eos_token_id")
        for token_id in generation_eos if isinstance(generation_eos, list) else [generation_eos]:
            if isinstance(token_id, int) and token_id not in eos_ids:
                eos_ids.append(token_id)
        self._eos_token_ids = eos_ids

        # None: let tokenizer.json's post-processor decide; a bool: the config decides.
        self._add_bos: bool | None = config.get("add_bos_token")
        self._add_eos: bool | None = config.get("add_eos_token")

        max_length = config.get("model_max_length")
        self.model_max_length: int | None = (
            int(max_length)
            if isinstance(max_length, (int, float)) and 0 < max_length < _UNSET_MAX_LENGTH_THRESHOLD
            else None
        )
        self.chat_template: str | None = chat_template

        special = {token_id for token_id, added in tokenizer.get_added_tokens_decoder().items() if added.special}
        self._skipped_special_ids = frozenset(special)
        for token_id in (self._bos_token_id, self._lookup(self.unk_token, "unk_token"), *eos_ids):
            if token_id is not None:
                special.add(token_id)
        self._all_special_ids = sorted(special)

        tokenizer_json = json.loads(tokenizer.to_str())
        if _decoder_has_byte_fallback(tokenizer_json):
            vocab = tokenizer.get_vocab(with_added_tokens=False)
            self._byte_token_ids = frozenset(i for piece, i in vocab.items() if _BYTE_TOKEN.fullmatch(piece))
        else:
            self._byte_token_ids = frozenset()
        self._anchor_token_id = self._choose_anchor()
        self._anchor_text = "" if self._anchor_token_id is None else self.decode([self._anchor_token_id])

    @classmethod
    def from_dir(cls, model_dir: str | Path, chat_template: str | None = None) -> TextTokenizer:
        """Load tokenizer.json and the optional config files from a Hugging Face model directory;
        ``chat_template`` (a template's text) replaces the model's own, or stands in for none."""
        model_dir = Path(model_dir)
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"{model_dir}: no tokenizer.json (a Hugging Face fast tokenizer is required)")
        config = _read_json(model_dir / "tokenizer_config.json")
        generation = _read_json(model_dir / "generation_config.json")
        template = _select_chat_template(config.get("chat_template"), "tokenizer_config.json")
        jinja_file = model_dir / "chat_template.jinja"
        json_file = model_dir / "chat_template.json"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        elif template is None and json_file.is_file():
            template = _select_chat_template(_read_json(json_file).get("chat_template"), str(json_file))
        if chat_template is not None:
            template = chat_template
        return cls(Tokenizer.from_file(str(tokenizer_file)), config, generation, template)

    def _lookup(self, token: str | None, field: str) -> int | None:
        if token is None:
            return None
        token_id = self._tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(f"tokenizer_config.json: {field} {token!r} is not in the vocabulary")
        return token_id

    def _choose_anchor(self) -> int | None:
        """A token that decodes alone to plain text and keeps that text when more follows."""
        candidates = []
        for text in _ANCHOR_TEXTS:
            ids = self._tokenizer.encode(text, add_special_tokens=False).ids
            if len(ids) == 1:
                candidates.append(ids[0])
        candidates.extend(range(min(self._vocab_size, _ANCHOR_SCAN)))
        added = set(self._tokenizer.get_added_tokens_decoder())  # matched before the model, text as is
        excluded = added | set(self._all_special_ids) | self._byte_token_ids
        for token_id in candidates:
            if token_id in excluded:
                continue
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            if not text or text != text.strip() or "\ufffd" in text:
                continue
            doubled = self._tokenizer.decode([token_id, token_id], skip_special_tokens=False)
            if len(doubled) > len(text) and doubled.startswith(text):
                return token_id
        return None

    # -- encode / decode ------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; add_special_tokens adds BOS (and EOS) as the model's config says.

        Text rendered from a chat template already carries its special tokens: encode it with
        add_special_tokens=False, as transformers' apply_chat_template does.
        """
        if not add_special_tokens:
            return self._tokenizer.encode(text, add_special_tokens=False).ids
        if self._add_bos is None and self._add_eos is None:
            return self._tokenizer.encode(text, add_special_tokens=True).ids
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        if self._add_bos and self._bos_token_id is not None:
            ids.insert(0, self._bos_token_id)
        if self._add_eos and self._eos_token_ids:
            ids.append(self._eos_token_ids[0])
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids`; raises ValueError for an id outside [0, vocab_size)."""
        if ids and (min(ids) < 0 or max(ids) >= self._vocab_size):
            bad = next(i for i in ids if not 0 <= i < self._vocab_size)
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {self._vocab_size})")
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # -- vocabulary facts -----------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (the largest valid id is vocab_size - 1)."""
        return self._vocab_size

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_ids(self) -> list[int]:
        """Every id that ends generation: the tokenizer's EOS first, then generation_config's."""
        return list(self._eos_token_ids)

    @property
    def all_special_ids(self) -> list[int]:
        """Ids that skip_special_tokens removes from decoded text, plus bos/eos/unk, sorted."""
        return list(self._all_special_ids)

    @property
    def skipped_special_ids(self) -> frozenset[int]:
        """Exactly the ids decode(skip_special_tokens=True) removes: added tokens marked special."""
        return self._skipped_special_ids

    @property
    def byte_token_ids(self) -> frozenset[int]:
        """Ids of the "<0xNN>" pieces when the decoder has ByteFallback (else empty).

        ByteFallback decodes a run of consecutive byte pieces as a whole: valid UTF-8 becomes
        text, anything else becomes one U+FFFD per piece. The incremental detokenizer needs to
        know where such runs start and end.
        """
        return self._byte_token_ids

    @property
    def anchor_token_id(self) -> int | None:
        """A plain token ("a" where the vocabulary has it) for decoding text in the middle of a sequence.

        Decoders treat the start of the text specially (sentencepiece conversions strip the
        leading space of the first piece, or of every piece while nothing has been written yet).
        Decoding ``[anchor, *ids]`` and dropping ``decode([anchor])`` gives the text `ids` add
        after earlier text, whatever that rule is. The anchor is a vocabulary piece (not an added
        or special token, not a byte piece) that decodes alone to non-empty text without surrounding whitespace and
        whose text stays a prefix when another token follows (checked with itself). None when no
        token qualifies.
        """
        return self._anchor_token_id

    @property
    def anchor_text(self) -> str:
        """decode([anchor_token_id]) ("" without an anchor)."""
        return self._anchor_text

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary piece of `token_id` (e.g. "▁the", "<0xE4>"), None when out of range."""
        return self._tokenizer.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    @property
    def backend(self) -> Tokenizer:
        """The wrapped `tokenizers.Tokenizer` (for batch encoding in the tokenizer service)."""
        return self._tokenizer
