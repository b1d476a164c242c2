"""Token ids as OpenAI names them in logprobs: the token's text, or ``bytes:\\xe4`` for a piece of a character.

The engine's logprobs carry token ids only. With the model's tokenizer (a route's
``tokenizer``: a model directory or its tokenizer.json) each id becomes its bytes: byte-level
vocabularies (GPT-2 style, SmolLM2) through the byte-to-character table, SentencePiece ones
(Llama, stories260K) with ``▁`` as a space and ``<0xNN>`` as a raw byte. A token whose bytes
are valid UTF-8 is named by that text; one that holds part of a character is named
``bytes:\\xNN...`` (OpenAI's own spelling). Without a tokenizer a token is named ``token_id:N``,
vLLM's spelling for ``return_tokens_as_token_ids``, and has no bytes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from tokenizers import Tokenizer

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _byte_level_table() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: the printable character that stands for each byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenizerLoadError(RuntimeError):
    """A route's tokenizer that does not load: a fault of the gateway's routes file, never of a
    request (the gateway refuses to start on one: GatewayServiceConfig.validate)."""


class TokenNamer:
    def __init__(self, tokenizer_path: str = "") -> None:
        self._tokenizer: Tokenizer | None = None
        self._byte_level = False
        self._names: dict[int, tuple[str, list[int] | None]] = {}
        if tokenizer_path:
            path = Path(tokenizer_path)
            if path.is_dir():
                path = path / "tokenizer.json"
            try:
                self._tokenizer = Tokenizer.from_file(str(path))
            except Exception as exc:  # noqa: BLE001 - the tokenizers library raises plain Exception
                raise TokenizerLoadError(f"tokenizer {tokenizer_path}: cannot load it: {exc}") from None
            decoder = json.loads(self._tokenizer.to_str()).get("decoder") or {}
            self._byte_level = "ByteLevel" in json.dumps(decoder)
            self._table = _byte_level_table()

    @property
    def has_tokenizer(self) -> bool:
        return self._tokenizer is not None

    def name(self, token_id: int) -> tuple[str, list[int] | None]:
        """(name, bytes) of one token id."""
        cached = self._names.get(token_id)
        if cached is None:
            cached = self._names[token_id] = self._lookup(token_id)
        return cached

    def _lookup(self, token_id: int) -> tuple[str, list[int] | None]:
        if self._tokenizer is None:
            return f"token_id:{token_id}", None
        piece = self._tokenizer.id_to_token(token_id)
        if piece is None:
            return f"token_id:{token_id}", None
        if self._byte_level:
            raw = bytes(self._table.get(ch, 0x3F) for ch in piece) if all(ch in self._table for ch in piece) \
                else piece.encode()
        elif (match := _BYTE_TOKEN.match(piece)) is not None:
            raw = bytes([int(match.group(1), 16)])
        else:
            raw = piece.replace("\u2581", " ").encode()
        try:
            return raw.decode("utf-8"), list(raw)
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), list(raw)

    def decode(self, ids: list[int]) -> str | None:
        """The text of a token-id prompt (for echo); None without a tokenizer."""
        if self._tokenizer is None:
            return None
        return self._tokenizer.decode(ids, skip_special_tokens=True)
