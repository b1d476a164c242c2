"""What the tokenizer service does, without gRPC: encode, decode, render chats, describe itself.

Special-token text in prompts. A client's prompt is text, not markup: the literal string
"<s>" in it must become the tokens of the characters "<", "s", ">", never BOS. Otherwise a
user can inject control tokens (end a turn, fake a system message) by typing them, and the
tokens differ from what sentencepiece, the model's own tokenizer, produces. `tokenizers`
matches added tokens inside the input text by default, so prompts are encoded with a second
copy of the tokenizer whose ``encode_special_tokens`` is set. Rendered chat templates are the
one place where special-token text is meant as such (the template writes "<|im_start|>"),
and only the template's: the messages' own special-token text stays text there too
(chat_encoding.py).

Limits (each error names the request field and the limit):
- MAX_TEXT_BYTES: Encode.text, in UTF-8 bytes;
- MAX_DECODE_TOKENS: Decode.token_ids;
- chat messages and templates: the limits of services/tokenizer/chat_template.py.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import structlog

from services.common.errors import InvalidArgumentError, TokenmillError
from services.tokenizer.chat_encoding import ChatEncoder
from services.tokenizer.chat_messages import calls_as_text, reads_tool_calls
from services.tokenizer.chat_template import MAX_TOTAL_CONTENT_CHARS, ChatTemplate, ChatTemplateError, validate_messages
from services.tokenizer.chat_tools import parse_tools_json, tool_call_format
from services.tokenizer.detokenizer import DetokenizerPool
from services.tokenizer.text_tokenizer import TextTokenizer

MAX_TEXT_BYTES = 1 << 20
"""Largest Encode.text (1 MiB of UTF-8, some 250K tokens of English)."""
MAX_DECODE_TOKENS = 1 << 20
"""Most ids in one Decode call."""

_log = structlog.get_logger("tokenmill.tokenizer")


class NoChatTemplateError(TokenmillError):
    """RenderChat on a model without a usable chat template: the server, not the request, lacks it."""

    code = grpc.StatusCode.FAILED_PRECONDITION


@dataclass(frozen=True, slots=True)
class TokenizerFacts:
    """What GetTokenizerInfo reports."""

    tokenizer_path: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    pad_token_id: int | None
    has_chat_template: bool
    tool_call_format: str = ""
    """The template's tool-call syntax (chat_tools.py); "" for none."""


@dataclass(frozen=True, slots=True)
class RenderedChat:
    text: str
    token_ids: list[int]


class TextService:
    """The tokenizer service's operations over one model's tokenizer files. Thread-safe reads only."""

    def __init__(self, model_dir: str | Path, chat_template: str | None = None) -> None:
        """``chat_template``: a template's text that replaces the model's (the server's
        ``--chat-template``); one that does not compile is a ValueError here, at startup."""
        self.model_dir = Path(model_dir)
        # Recognises special-token text: for rendered chat templates and for decoding.
        self.tokenizer = TextTokenizer.from_dir(self.model_dir, chat_template)
        # Treats special-token text in prompts as plain characters (see the module docstring).
        self._prompt_tokenizer = TextTokenizer.from_dir(self.model_dir, chat_template)
        self._prompt_tokenizer.backend.encode_special_tokens = True
        self._chat_encoder = ChatEncoder(self.tokenizer, self._prompt_tokenizer)
        self._template, self._template_problem = self._load_template()
        if chat_template is not None and self._template is None:
            raise ValueError(f"chat_template: {self._template_problem}")
        self._reads_tool_calls = reads_tool_calls(self.tokenizer.chat_template)
        pad = self.tokenizer.pad_token
        self.facts = TokenizerFacts(
            tokenizer_path=str(self.model_dir),
            vocab_size=self.tokenizer.vocab_size,
            eos_token_ids=tuple(self.tokenizer.eos_token_ids),
            bos_token_id=self.tokenizer.bos_token_id,
            pad_token_id=self.tokenizer.token_to_id(pad) if pad is not None else None,
            has_chat_template=self._template is not None,
            tool_call_format=tool_call_format(self.tokenizer.chat_template) if self._template is not None else "",
        )

    def _load_template(self) -> tuple[ChatTemplate | None, str]:
        if self.tokenizer.chat_template is None:
            return None, (
                "the model has no chat template (none in tokenizer_config.json, chat_template.jinja or "
                "chat_template.json): send a plain prompt instead of chat messages"
            )
        try:
            return ChatTemplate.from_tokenizer(self.tokenizer), ""
        except ChatTemplateError as exc:
            # A broken template must not take plain prompts down with it; RenderChat reports it.
            _log.warning("chat_template_unusable", model=str(self.model_dir), error=str(exc))
            return None, f"the model's chat template is unusable: {exc}"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt; special-token text in it stays plain text."""
        size = len(text.encode("utf-8"))
        if size > MAX_TEXT_BYTES:
            raise InvalidArgumentError(
                f"text is {size} bytes of UTF-8; the limit MAX_TEXT_BYTES is {MAX_TEXT_BYTES}"
            )
        return self._prompt_tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool) -> str:
        if len(token_ids) > MAX_DECODE_TOKENS:
            raise InvalidArgumentError(
                f"token_ids has {len(token_ids)} entries; the limit MAX_DECODE_TOKENS is {MAX_DECODE_TOKENS}"
            )
        check_token_ids("token_ids", token_ids, self.tokenizer.vocab_size)
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    tools_json: str = "") -> RenderedChat:
        """The template's prompt text and its ids (the template's special tokens recognised, the
        messages' and tools' own special-token text encoded as text; no BOS added).
        ``tools_json``: the template's ``tools`` (a JSON array of tool objects; "" = none).
        An assistant turn's ``tool_calls`` reach a template that reads them as they are, and
        any other as text in the turn's content (chat_messages.py)."""
        if self._template is None:
            raise NoChatTemplateError(self._template_problem)
        used = validate_messages(messages)  # before anything is copied for the guard
        if not self._reads_tool_calls:
            messages = calls_as_text(messages)
        tools = parse_tools_json(tools_json, MAX_TOTAL_CONTENT_CHARS - used)
        guarded, guarded_tools, taken = self._chat_encoder.guard(messages, tools)
        extra = {"tools": guarded_tools} if guarded_tools is not None else None
        text = self._template.render(guarded, add_generation_prompt, extra)
        return RenderedChat(self._chat_encoder.restore(text, taken), self._chat_encoder.encode(text, taken))

    def new_detokenizer_pool(self) -> DetokenizerPool:
        return DetokenizerPool(self.tokenizer)


def check_token_ids(field: str, token_ids: Sequence[int], vocab_size: int) -> None:
    """Raise InvalidArgumentError naming `field` when an id is outside [0, vocab_size)."""
    if token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab_size):
        bad = next(t for t in token_ids if not 0 <= t < vocab_size)
        raise InvalidArgumentError(f"{field} holds {bad}, outside the vocabulary [0, {vocab_size})")
