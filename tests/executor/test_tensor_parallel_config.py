"""--tensor-parallel-size as a setting: the flag and its variable, the values refused before
anything starts (each naming the setting), and heads that cannot split refused before any
rank process starts."""

from __future__ import annotations

import pytest

from services.common.settings import parse_config
from services.executor.config import ExecutorConfig, ExecutorServiceConfig
from tests.conftest import STORIES_DIR


def test_the_flag_and_the_variable_set_it(monkeypatch):
    assert parse_config(ExecutorServiceConfig, ["--tensor-parallel-size=2"]).executor.tensor_parallel_size == 2
    experts = parse_config(ExecutorServiceConfig, ["--tensor-parallel-experts", "all_reduce"]).executor
    assert experts.tensor_parallel_experts == "all_reduce"
    monkeypatch.setenv("TOKENMILL_EXECUTOR_TENSOR_PARALLEL_SIZE", "3")
    assert parse_config(ExecutorServiceConfig, []).executor.tensor_parallel_size == 3


def test_bad_values_are_refused_naming_the_setting():
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1, got 0"):
        ExecutorConfig(tensor_parallel_size=0).validate()
    with pytest.raises(ValueError, match="tensor_parallel_experts must be one of all_to_all, all_reduce, "
                                         "replicated, got 'split'"):
        ExecutorConfig(tensor_parallel_experts="split").validate()
    config = ExecutorServiceConfig(executor=ExecutorConfig(tensor_parallel_size=2), role="prefill")
    with pytest.raises(ValueError, match="role 'prefill' moves KV blocks .* tensor_parallel_size 2 needs role 'mixed'"):
        config.validate()


def test_heads_that_cannot_split_fail_before_a_rank_starts():
    from services.executor.model_runner import ModelRunner

    # stories260K has 4 KV heads: 5 ranks would replicate them, and 5 is no multiple of 4.
    config = ExecutorConfig(model=str(STORIES_DIR), device="cpu", num_blocks=8, tensor_parallel_size=5)
    with pytest.raises(ValueError, match="tensor_parallel_size 5 is more than num_key_value_heads \\(4\\)"):
        ModelRunner(config)
