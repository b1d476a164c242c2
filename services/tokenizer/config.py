"""Tokenizer service configuration: flags and TOKENMILL_TOKENIZER_* environment variables."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.service_config import model_field, service_process_fields

DEFAULT_PORT = 50052


@dataclass(slots=True)
class TokenizerConfig(service_process_fields("tokenizer", DEFAULT_PORT)):
    """tokenmill tokenizer: text <-> token ids, chat templates and streaming detokenization."""

    model: str = model_field("model directory holding tokenizer.json (and tokenizer_config.json)")
    chat_template_timeout_s: float = field(default=2.0, metadata={
        "help": "longest a chat template may take to render one conversation; past it the call is interrupted "
                "and answered DEADLINE_EXCEEDED (a template is code shipped with the model)",
        "env": "TOKENMILL_TOKENIZER_CHAT_TEMPLATE_TIMEOUT_S"})

    def validate(self) -> None:
        if not self.chat_template_timeout_s > 0:
            raise ValueError(f"chat_template_timeout_s must be > 0, got {self.chat_template_timeout_s}")
