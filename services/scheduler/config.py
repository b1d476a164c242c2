"""Scheduler service configuration: flags and TOKENMILL_* environment variables.

The scheduling limits are SchedulerLimits (services/scheduler/core/config.py), embedded whole:
their flags (--max-num-seqs ...), variables (TOKENMILL_MAX_NUM_SEQS ...) and help come from
its fields, so the service and the in-process engine read one declaration. Speculation, the
grammar compilers and the latency profile are leaf groups embedded the same way; each group
checks its own ranges.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.service_config import service_process_fields
from services.common.settings import embedded, setting
from services.scheduler.auth import load_auth_tokens
from services.scheduler.core.config import SchedulerLimits
from services.scheduler.core.speculation import SpeculationConfig
from services.common.latency_profile import DEFAULT_CAPACITY


DEFAULT_PORT = 50051
MAX_PUBLIC_MESSAGE_BYTES = 16 * 1024 * 1024
"""The public API's message limit: a prompt of a million token ids is some 4 MiB."""


@dataclass(frozen=True)
class SpeculationSettings:
    """Speculative decoding: where the drafts come from and how many a step asks for."""

    drafter_address: str = setting("", env="TOKENMILL_DRAFTER_ADDRESS")
    """Drafter service address (empty = no speculative decoding)."""
    num_speculative_tokens: int = setting(0, env="TOKENMILL_NUM_SPECULATIVE_TOKENS")
    """Most draft tokens per sequence per step, 0 = no speculative decoding; needs --drafter-address (a request may
    ask for fewer or none; the drafter caps it too)."""
    spec_adaptive: bool = setting(True, env="TOKENMILL_SPEC_ADAPTIVE")
    """Adapt each request's draft count to its acceptance rate, down to 0 when drafts do not pay (off = always
    num_speculative_tokens)."""
    spec_min_acceptance: float = setting(0.3, env="TOKENMILL_SPEC_MIN_ACCEPTANCE")
    """Adaptive k: the i-th draft is sent while the request's acceptance rate to the power i is at least this (lower =
    longer drafts)."""
    spec_draft_deadline_ms: float = setting(50.0, env="TOKENMILL_SPEC_DRAFT_DEADLINE_MS")
    """How long a step waits for the drafter's proposals; later ones are dropped and the step runs without drafts."""

    def config(self) -> SpeculationConfig:
        """The engine core's speculation settings."""
        return SpeculationConfig(num_speculative_tokens=self.num_speculative_tokens, adaptive=self.spec_adaptive,
                                 min_acceptance=self.spec_min_acceptance)

    @property
    def drafting(self) -> bool:
        """A drafter is named and drafts are asked for."""
        return bool(self.drafter_address) and self.num_speculative_tokens > 0

    def validate(self) -> None:
        self.config().validate()
        if not self.spec_draft_deadline_ms > 0:
            raise ValueError(f"spec_draft_deadline_ms must be > 0, got {self.spec_draft_deadline_ms}")


@dataclass(frozen=True)
class GrammarCompileSettings:
    """The child processes that compile structured outputs, and each tenant's share of them."""

    grammar_compile_workers: int = setting(2, env="TOKENMILL_GRAMMAR_COMPILE_WORKERS")
    """Child processes that compile structured outputs (a grammar that crashes the grammar library kills one of them,
    never the scheduler)."""
    grammar_compiles_per_tenant: int = setting(1, env="TOKENMILL_GRAMMAR_COMPILES_PER_TENANT")
    """Compile workers one tenant may hold at once (the others wait); without --auth-tokens-file every client is one
    tenant."""
    grammar_compile_timeout_s: float = setting(5.0, env="TOKENMILL_GRAMMAR_COMPILE_TIMEOUT_S")
    """Longest a structured output may take to compile; a slower one is refused with INVALID_ARGUMENT and its worker
    restarted."""

    def validate(self) -> None:
        for name in ("grammar_compile_workers", "grammar_compiles_per_tenant"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.grammar_compile_timeout_s > 0:
            raise ValueError(f"grammar_compile_timeout_s must be > 0, got {self.grammar_compile_timeout_s}")


@dataclass(frozen=True)
class ProfileSettings:
    """The latency profile GetProfile answers from."""

    profile_window_s: float = setting(60.0, env="TOKENMILL_PROFILE_WINDOW_S")
    """Sliding window of the latency profile (GetProfile), seconds."""
    profile_capacity: int = setting(DEFAULT_CAPACITY, env="TOKENMILL_PROFILE_CAPACITY")
    """finished-request samples GetProfile keeps: a ring allocated at start (40 bytes a sample); a window in which
    more requests finished is answered over the newest ones and its window_seconds says the span."""

    def validate(self) -> None:
        if self.profile_capacity < 1:
            raise ValueError(f"profile_capacity must be >= 1, got {self.profile_capacity}")


@dataclass
class SchedulerServiceConfig(service_process_fields("scheduler", DEFAULT_PORT, MAX_PUBLIC_MESSAGE_BYTES,
                                                    backend_tls=True, internal_secret="present")):
    """tokenmill scheduler: the public Generation API, token-level scheduling and KV block accounting."""

    executor_addresses: tuple[str, ...] = setting(("127.0.0.1:50053",), env="TOKENMILL_EXECUTOR_ADDRESSES")
    """Executor service address(es), comma-separated: each keeps its own KV pool and requests are placed on the one
    holding their longest cached prefix, else the least loaded; a lost one's requests move to the others."""
    tokenizer_addresses: tuple[str, ...] = setting(("127.0.0.1:50052",), env="TOKENMILL_TOKENIZER_ADDRESSES")
    """Tokenizer service address(es), comma-separated; load is spread over them."""
    limits: SchedulerLimits = embedded(SchedulerLimits, env_prefix="TOKENMILL_")
    max_prompt_chars: int = setting(0, env="TOKENMILL_MAX_PROMPT_CHARS")
    """Longest text prompt accepted, in characters (0 = 32 per token of the model's context, checked before the text
    is tokenized)."""
    max_waiting_per_tenant: int = setting(0, env="TOKENMILL_MAX_WAITING_PER_TENANT")
    """Requests one tenant may have queued (not yet producing output); beyond it RESOURCE_EXHAUSTED. 0 = with
    --auth-tokens-file, max_waiting_requests shared equally among up to 4 tenants (none without it); -1 = only the
    overall max_waiting_requests."""
    connect_timeout_s: float = setting(60.0, env="TOKENMILL_CONNECT_TIMEOUT_S")
    """How long to wait for the executor and tokenizers at start."""
    lora_dir: str = setting("", env="TOKENMILL_LORA_DIR", path=True)
    """The directory LoRA adapters may be loaded from while serving (the Admin API's LoadAdapter, the gateway's
    /v1/load_lora_adapter): a relative path is taken inside it, and one that resolves outside it (.., an absolute
    path elsewhere, a symlink out) is refused. Empty = loading while serving is refused (FAILED_PRECONDITION);
    the executors' --lora NAME=PATH at start needs none. Give the executors the same directory."""
    auth_tokens_file: str = setting("", env="TOKENMILL_AUTH_TOKENS_FILE", path=True)
    """JSON list of {token, tenant, models?, max_priority?, tokens_per_minute?}; clients then send 'authorization:
    Bearer TOKEN' (empty = no authentication)."""

    speculation: SpeculationSettings = embedded(SpeculationSettings, env_prefix="TOKENMILL_")
    grammar_compile: GrammarCompileSettings = embedded(GrammarCompileSettings, env_prefix="TOKENMILL_")
    profile: ProfileSettings = embedded(ProfileSettings, env_prefix="TOKENMILL_")

    def validate(self) -> None:
        """The limits alone (the executor's facts are checked against them when it connects),
        each group's own ranges, and the auth tokens file."""
        self.limits.validate()
        self.speculation.validate()
        self.grammar_compile.validate()
        self.profile.validate()
        if self.max_waiting_per_tenant < -1:
            raise ValueError(f"max_waiting_per_tenant must be >= -1 (0 = an equal share per tenant with "
                             f"authentication, -1 = none), got {self.max_waiting_per_tenant}")
        if self.auth_tokens_file:
            load_auth_tokens(self.auth_tokens_file)
