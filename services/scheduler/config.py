"""Scheduler service configuration: flags and TOKENMILL_* environment variables.

The scheduling limits are SchedulerLimits (services/scheduler/core/config.py), embedded whole:
their flags (--max-num-seqs ...), variables (TOKENMILL_MAX_NUM_SEQS ...) and help come from
its fields, so the service and the in-process engine read one declaration.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.service_config import (
    host_field,
    log_level_field,
    port_field,
    port_file_field,
    shutdown_grace_field,
)
from services.common.settings import embedded
from services.scheduler.core.config import SchedulerLimits


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
    limits: SchedulerLimits = embedded(SchedulerLimits, env_prefix="TOKENMILL_")
    max_prompt_chars: int = _f(1_000_000, "longest text prompt accepted, in characters", "TOKENMILL_MAX_PROMPT_CHARS")
    connect_timeout_s: float = _f(60.0, "how long to wait for the executor and tokenizers at start",
                                  "TOKENMILL_CONNECT_TIMEOUT_S")
    profile_window_s: float = _f(60.0, "sliding window of the latency profile (GetProfile), seconds",
                                 "TOKENMILL_PROFILE_WINDOW_S")
    metrics_port: int = _f(-1, "Prometheus metrics HTTP port (-1 = off, 0 = any free port)",
                           "TOKENMILL_SCHEDULER_METRICS_PORT")
