"""Tokenizer service configuration: flags and TOKENMILL_TOKENIZER_* environment variables."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.service_config import model_field, service_process_fields

DEFAULT_PORT = 50052


@dataclass(slots=True)
class TokenizerConfig(service_process_fields("tokenizer", DEFAULT_PORT)):
    """tokenmill tokenizer: text <-> token ids, chat templates and streaming detokenization."""

    model: str = model_field("model directory holding tokenizer.json (and tokenizer_config.json)")
