"""Tokenizer service configuration: flags and TOKENMILL_TOKENIZER_* environment variables."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.service_config import DEFAULT_MODEL_DIR, service_process_fields
from services.common.settings import setting
from services.tokenizer.text_tokenizer import read_chat_template_option

DEFAULT_PORT = 50052


@dataclass(slots=True)
class TokenizerConfig(service_process_fields("tokenizer", DEFAULT_PORT, internal_secret="require")):
    """tokenmill tokenizer: text <-> token ids, chat templates and streaming detokenization."""

    model: str = setting(str(DEFAULT_MODEL_DIR), env="TOKENMILL_MODEL", path=True)
    """model directory holding tokenizer.json (and tokenizer_config.json)"""
    chat_template_timeout_s: float = setting(2.0, env="TOKENMILL_TOKENIZER_CHAT_TEMPLATE_TIMEOUT_S")
    """Longest a chat template may take to render one conversation; past it the call is interrupted and answered
    DEADLINE_EXCEEDED (a template is code shipped with the model)."""
    chat_template: str = setting("", env="TOKENMILL_TOKENIZER_CHAT_TEMPLATE")
    """Chat template to render conversations with, replacing the model's (or standing in for none): a Jinja file's
    path, or the template's text inline (holding {{ or {%); empty = the model's own."""

    def validate(self) -> None:
        if not self.chat_template_timeout_s > 0:
            raise ValueError(f"chat_template_timeout_s must be > 0, got {self.chat_template_timeout_s}")
        self.template_text()

    def template_text(self) -> str | None:
        """The --chat-template's text (read from its file); None when not given."""
        return read_chat_template_option(self.chat_template) if self.chat_template else None
