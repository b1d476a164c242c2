"""Tokenizer service configuration: flags and TOKENMILL_TOKENIZER_* environment variables."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.metrics import metrics_port_field
from services.common.service_config import (
    host_field,
    log_level_field,
    model_field,
    port_field,
    port_file_field,
    shutdown_grace_field,
)

DEFAULT_PORT = 50052


@dataclass(slots=True)
class TokenizerConfig:
    """tokenmill tokenizer: text <-> token ids, chat templates and streaming detokenization."""

    host: str = host_field("tokenizer")
    port: int = port_field("tokenizer", DEFAULT_PORT)
    port_file: str = port_file_field()
    log_level: str = log_level_field("tokenizer")
    shutdown_grace_seconds: float = shutdown_grace_field("tokenizer")
    metrics_port: int = metrics_port_field("tokenizer")
    model: str = model_field("model directory holding tokenizer.json (and tokenizer_config.json)")
