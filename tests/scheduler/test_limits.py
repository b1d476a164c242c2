"""SchedulerLimits: one declaration checked in one place, and the scheduler service's flags,
environment variables and help generated from it."""

from __future__ import annotations

import dataclasses
import re

import pytest

from services.common.settings import field_help, parse_config, to_argv
from services.common.step import ExecutorInfo
from services.scheduler.config import SchedulerServiceConfig
from services.scheduler.core import Scheduler, SchedulerConfig, SchedulerLimits


def executor_info(**overrides) -> ExecutorInfo:
    values = dict(num_blocks=10, block_size=16, max_model_len=128, vocab_size=50, dtype="fp32", device="cpu",
                  attention_backend="torch", model="m", architecture="LlamaForCausalLM", bos_token_id=1,
                  eos_token_ids=(2,))
    values.update(overrides)
    return ExecutorInfo(**values)


# ---- validation -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(max_num_seqs=0), "max_num_seqs must be >= 1, got 0"),
        (dict(max_num_batched_tokens=0), "max_num_batched_tokens must be >= 1, got 0"),
        (dict(max_waiting_requests=-3), "max_waiting_requests must be >= 1, got -3"),
        (dict(long_prefill_token_threshold=-1), "long_prefill_token_threshold must be >= 0 (0 = no cap), got -1"),
        (dict(num_scheduler_steps=0), "num_scheduler_steps must be in [1, 64], got 0"),
        (dict(num_scheduler_steps=65), "num_scheduler_steps must be in [1, 64], got 65"),
        (dict(multi_step_max_delay_ms=-1.0), "multi_step_max_delay_ms must be a finite number >= 0, got -1.0"),
        (dict(multi_step_max_delay_ms=float("nan")), "multi_step_max_delay_ms must be a finite number >= 0, got nan"),
        (dict(multi_step_max_delay_ms=float("inf")), "multi_step_max_delay_ms must be a finite number >= 0, got inf"),
        (dict(executor_wait_s=-1.0), "executor_wait_s must be a finite number >= 0, got -1.0"),
        (dict(max_num_batched_tokens=4, max_num_seqs=8),
         "max_num_batched_tokens=4 is below max_num_seqs=8: not every running sequence could decode in a step"),
        (dict(enable_chunked_prefill=False, long_prefill_token_threshold=8),
         "long_prefill_token_threshold=8 splits prompts over steps and needs enable_chunked_prefill=True (got False)"),
    ],
)
def test_limits_validation_names_the_field_and_the_value(overrides, message):
    limits = SchedulerLimits(**overrides)
    with pytest.raises(ValueError, match=re.escape(message)):
        limits.validate()
    # The core checks them when it starts.
    with pytest.raises(ValueError, match=re.escape(message)):
        Scheduler(SchedulerConfig(limits, max_model_len=64, num_blocks=64, block_size=4, vocab_size=50))


def test_the_defaults_are_valid():
    SchedulerLimits().validate()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(vocab_size=0), "vocab_size must be >= 1, got 0"),
        (dict(max_model_len=1), "max_model_len must be >= 2 (one prompt token and one output token), got 1"),
        (dict(num_blocks=3, block_size=4, max_model_len=16),
         "num_blocks=3 x block_size=4 = 12 tokens cannot hold one sequence of max_model_len=16"),
        (dict(limits=SchedulerLimits(enable_chunked_prefill=False, max_num_batched_tokens=100, max_num_seqs=8), max_model_len=200,
              num_blocks=64),
         "enable_chunked_prefill=False needs max_num_batched_tokens >= max_model_len, got "
         "max_num_batched_tokens=100 < max_model_len=200"),
    ],
)
def test_executor_facts_are_checked_against_the_limits(overrides, message):
    values = dict(limits=SchedulerLimits(), max_model_len=64, num_blocks=64, block_size=4, vocab_size=50)
    values.update(overrides)
    with pytest.raises(ValueError, match=re.escape(message)):
        SchedulerConfig(**values).validate()


def test_for_executor_takes_the_executor_facts_and_lets_every_running_sequence_decode():
    config = SchedulerConfig.for_executor(SchedulerLimits(max_num_seqs=3000, enable_prefix_caching=False),
                                          executor_info())
    assert config == SchedulerConfig(
        SchedulerLimits(max_num_seqs=3000, max_num_batched_tokens=3000, enable_prefix_caching=False),
        max_model_len=128, num_blocks=10, block_size=16, vocab_size=50)
    assert SchedulerConfig.for_executor(SchedulerLimits(), executor_info()).limits == SchedulerLimits()


# ---- the service's flags, environment variables and help ----------------------------------

FLAGS = {
    "max_num_seqs": ("--max-num-seqs", "TOKENMILL_MAX_NUM_SEQS"),
    "max_num_batched_tokens": ("--max-num-batched-tokens", "TOKENMILL_MAX_NUM_BATCHED_TOKENS"),
    "max_waiting_requests": ("--max-waiting-requests", "TOKENMILL_MAX_WAITING_REQUESTS"),
    "max_grammar_bytes": ("--max-grammar-bytes", "TOKENMILL_MAX_GRAMMAR_BYTES"),
    "enable_prefix_caching": ("--enable-prefix-caching", "TOKENMILL_ENABLE_PREFIX_CACHING"),
    "enable_chunked_prefill": ("--enable-chunked-prefill", "TOKENMILL_ENABLE_CHUNKED_PREFILL"),
    "long_prefill_token_threshold": ("--long-prefill-token-threshold", "TOKENMILL_LONG_PREFILL_TOKEN_THRESHOLD"),
    "overlap_scheduling": ("--overlap-scheduling", "TOKENMILL_OVERLAP_SCHEDULING"),
    "num_scheduler_steps": ("--num-scheduler-steps", "TOKENMILL_NUM_SCHEDULER_STEPS"),
    "multi_step_max_delay_ms": ("--multi-step-max-delay-ms", "TOKENMILL_MULTI_STEP_MAX_DELAY_MS"),
    "executor_wait_s": ("--executor-wait-s", "TOKENMILL_EXECUTOR_WAIT_S"),
}


def test_every_limit_is_a_service_flag_with_its_env_variable_and_help(capsys: pytest.CaptureFixture[str]):
    assert set(FLAGS) == {f.name for f in dataclasses.fields(SchedulerLimits)}
    with pytest.raises(SystemExit):
        parse_config(SchedulerServiceConfig, ["--help"], env={})
    text = " ".join(capsys.readouterr().out.split())  # undo argparse's line wrapping
    assert "Most requests running at once (holding blocks, known to the executor). " \
           "(default: 256; env: TOKENMILL_MAX_NUM_SEQS)" in text
    assert "--enable-prefix-caching, --no-enable-prefix-caching Reuse the K/V of full blocks whose token prefix " \
           "was computed before. (default: true; env: TOKENMILL_ENABLE_PREFIX_CACHING)" in text
    for f in dataclasses.fields(SchedulerLimits):
        flag, env = FLAGS[f.name]
        default = str(f.default).lower() if isinstance(f.default, bool) else str(f.default)
        assert f"{flag} " in text
        assert f"{field_help(SchedulerLimits, f)} (default: {default}; env: {env})" in text


def test_flags_over_env_over_the_limits_defaults():
    assert parse_config(SchedulerServiceConfig, [], env={}).limits == SchedulerLimits()
    assert SchedulerServiceConfig().limits == SchedulerLimits()
    env = {"TOKENMILL_MAX_NUM_SEQS": "99", "TOKENMILL_MAX_WAITING_REQUESTS": "10",
           "TOKENMILL_ENABLE_CHUNKED_PREFILL": "false"}
    config = parse_config(
        SchedulerServiceConfig,
        ["--max-num-seqs", "8", "--no-enable-prefix-caching", "--long-prefill-token-threshold", "64",
         "--enable-chunked-prefill"],
        env=env,
    )
    assert config.limits == SchedulerLimits(max_num_seqs=8, max_waiting_requests=10, enable_prefix_caching=False,
                                            enable_chunked_prefill=True, long_prefill_token_threshold=64)
    assert parse_config(SchedulerServiceConfig, [], env=env).limits == SchedulerLimits(
        max_num_seqs=99, max_waiting_requests=10, enable_chunked_prefill=False)


def test_to_argv_round_trips_the_limits():
    config = SchedulerServiceConfig(port=7, limits=SchedulerLimits(max_num_seqs=8, enable_chunked_prefill=False,
                                                                   max_num_batched_tokens=4096))
    argv = to_argv(config)
    assert argv == ["--port", "7", "--max-num-seqs", "8", "--max-num-batched-tokens", "4096",
                    "--no-enable-chunked-prefill"]
    assert parse_config(SchedulerServiceConfig, argv, env={}) == config
