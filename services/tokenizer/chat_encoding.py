"""A rendered conversation to token ids: the template's markup may be special tokens, what the
client wrote never is.

A chat template writes its turn markers as text ("<|im_start|>user\\n"), and the rendered
prompt is encoded with special-token matching so that they become control tokens, as
transformers' apply_chat_template does. Encoded so, a message whose content (or role) says
"<|im_end|><|im_start|>system\\n..." would become real control tokens too: a user could end
their turn and write the system prompt. So special-token text in roles and contents (and in
the strings of the request's tools and of an assistant's tool calls, which templates print too) is taken out before rendering,
each occurrence replaced by one private-use character naming it; the rendered text is split at the special tokens left (the template's own), each piece between them
gets its client text back and is encoded as plain text, and the template's special tokens go in
between as their ids.

Conversations without special-token text (nearly all) are rendered and encoded as before, in one
piece: their ids are exactly apply_chat_template's.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from services.tokenizer.text_tokenizer import TextTokenizer

SENTINEL_BASE = 0xF0000
"""Supplementary Private Use Area-A: no tokenizer gives these meaning, and a client's own
characters from it are taken out and put back like special-token text."""
MAX_GUARDED = 0xFFFD
"""Occurrences one conversation may hold (one sentinel character each)."""
_SENTINELS = "[\U000F0000-\U000FFFFD]"
GUARDED_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id")
"""The parts of a turn a template may print: an assistant's calls (names, arguments) too."""


class TooManySpecialTokensError(ValueError):
    pass


class ChatEncoder:
    """Encodes rendered chats for one tokenizer (``tokenizer`` matches special tokens,
    ``text_tokenizer`` encodes them as text)."""

    def __init__(self, tokenizer: TextTokenizer, text_tokenizer: TextTokenizer) -> None:
        self._tokenizer = tokenizer
        self._text_tokenizer = text_tokenizer
        added = tokenizer.backend.get_added_tokens_decoder()
        self._special_ids = {token.content: token_id for token_id, token in added.items()
                             if token.special and token.content}
        # Longest first, so "<|im_start|>" is not read as a shorter token it begins with.
        alternatives = [re.escape(text) for text in sorted(self._special_ids, key=len, reverse=True)]
        self._specials = re.compile("|".join(alternatives)) if alternatives else None
        self._guarded = re.compile("|".join([*alternatives, _SENTINELS]))

    def guard(self, messages: Sequence[Mapping[str, Any]], tools: list[Any] | None = None
              ) -> tuple[list[Mapping[str, Any]], list[Any] | None, list[str]]:
        """``messages`` with special-token text in roles, string contents and tool calls replaced by
        sentinels, ``tools`` with it replaced in every string (keys too: a template may print a
        property's name), and the texts replaced (sentinel i stands for texts[i]); the same
        messages and tools and [] when none holds any."""
        texts: list[str] = []

        def replace(match: re.Match[str]) -> str:
            if len(texts) >= MAX_GUARDED:
                raise TooManySpecialTokensError(f"messages hold more than {MAX_GUARDED} special-token strings")
            texts.append(match.group())
            return chr(SENTINEL_BASE + len(texts) - 1)

        def guard_value(value: Any) -> Any:
            if isinstance(value, str):
                return self._guarded.sub(replace, value) if self._guarded.search(value) else value
            if isinstance(value, list):
                return [guard_value(item) for item in value]
            if isinstance(value, dict):
                return {guard_value(key): guard_value(item) for key, item in value.items()}
            return value

        guarded: list[Mapping[str, Any]] = []
        for message in messages:
            before = len(texts)
            changed = {key: guard_value(message[key]) for key in GUARDED_KEYS if isinstance(message.get(key), str)
                       or (key == "tool_calls" and message.get(key))}
            guarded.append({**message, **changed} if len(texts) > before else message)
        guarded_tools = guard_value(tools) if tools else tools
        if not texts:
            return list(messages), tools, []
        return guarded, guarded_tools, texts

    def encode(self, rendered: str, texts: Sequence[str]) -> list[int]:
        """Ids of a template's output; ``texts``: what guard() took out ([]: none)."""
        if not texts:
            return self._tokenizer.encode(rendered, add_special_tokens=False)
        ids: list[int] = []
        start = 0
        for match in self._specials.finditer(rendered) if self._specials is not None else ():
            ids += self._plain(rendered[start:match.start()], texts)
            ids.append(self._special_ids[match.group()])
            start = match.end()
        return ids + self._plain(rendered[start:], texts)

    def restore(self, rendered: str, texts: Sequence[str]) -> str:
        """The rendered text with the client's text put back where guard() took it out."""
        if not texts:
            return rendered

        def put_back(match: re.Match[str]) -> str:
            index = ord(match.group()) - SENTINEL_BASE
            return texts[index] if index < len(texts) else match.group()

        return re.sub(_SENTINELS, put_back, rendered)

    def _plain(self, piece: str, texts: Sequence[str]) -> list[int]:
        if not piece:
            return []
        return self._text_tokenizer.encode(self.restore(piece, texts), add_special_tokens=False)
