"""Scheduler service configuration: flags and TOKENMILL_* environment variables."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.service_config import (
    host_field,
    log_level_field,
    port_field,
    port_file_field,
    shutdown_grace_field,
)


def _f(default, help_: str, env: str):
    return field(default=default, metadata={"help": help_, "env": env})


@dataclass
class SchedulerServiceConfig:
    host: str = host_field("scheduler")
    port: int = port_field("scheduler", 50051)
    port_file: str = port_file_field()
    log_level: str = log_level_field("scheduler")
    shutdown_grace_seconds: float = shutdown_grace_field("scheduler")
    executor_address: str = _f("127.0.0.1:50053", "executor service address", "TOKENMILL_EXECUTOR_ADDRESS")
    tokenizer_addresses: tuple[str, ...] = _f(
        ("127.0.0.1:50052",), "tokenizer service address(es), comma-separated; load is spread over them",
        "TOKENMILL_TOKENIZER_ADDRESSES")
    drafter_address: str = _f("", "drafter service address (empty = no speculative decoding)",
                              "TOKENMILL_DRAFTER_ADDRESS")
    max_num_seqs: int = _f(256, "most sequences running at once", "TOKENMILL_MAX_NUM_SEQS")
    max_num_batched_tokens: int = _f(2048, "token budget of one step (prefill chunks + decodes)",
                                     "TOKENMILL_MAX_NUM_BATCHED_TOKENS")
    max_waiting_requests: int = _f(4096, "waiting queue bound; beyond it Generate returns RESOURCE_EXHAUSTED",
                                   "TOKENMILL_MAX_WAITING_REQUESTS")
    enable_prefix_caching: bool = _f(True, "reuse K/V of shared prompt prefixes", "TOKENMILL_ENABLE_PREFIX_CACHING")
    enable_chunked_prefill: bool = _f(True, "split long prompts over steps", "TOKENMILL_ENABLE_CHUNKED_PREFILL")
    max_prompt_chars: int = _f(1_000_000, "longest text prompt accepted, in characters", "TOKENMILL_MAX_PROMPT_CHARS")
    connect_timeout_s: float = _f(60.0, "how long to wait for the executor and tokenizers at start",
                                  "TOKENMILL_CONNECT_TIMEOUT_S")
    profile_window_s: float = _f(60.0, "sliding window of the latency profile (GetProfile), seconds",
                                 "TOKENMILL_PROFILE_WINDOW_S")
    metrics_port: int = _f(-1, "Prometheus metrics HTTP port (-1 = off, 0 = any free port)",
                           "TOKENMILL_SCHEDULER_METRICS_PORT")
