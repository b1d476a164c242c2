"""A mixture-of-experts model served by the real services: its executor's /metrics counts the
tokens routed to each expert of each sparse layer, the served tokens only (not the warm-up's)."""

from __future__ import annotations

import pytest

from services.executor.config import ExecutorConfig, ExecutorServiceConfig
from services.executor.main import serve as serve_executor
from services.scheduler.config import SchedulerServiceConfig
from services.scheduler.main import serve as serve_scheduler
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.main import serve as serve_tokenizer
from services.tools.random_model import build_random_model
from tests.helpers.moe_specs import MOE_SPECS
from tests.stack.test_metrics import MAX_TOKENS, PROMPTS, generate_all, scrape

pytestmark = [pytest.mark.slow, pytest.mark.asyncio]


async def test_executor_metrics_count_tokens_per_expert(tmp_path):
    spec = MOE_SPECS["mixtral"]
    model = str(build_random_model(spec, tmp_path / "mixtral"))
    tokenizer = await serve_tokenizer(TokenizerConfig(port=0, model=model, metrics_port=0))
    executor = await serve_executor(ExecutorServiceConfig(port=0, metrics_port=0, executor=ExecutorConfig(
        model=model, dtype="fp32", device="cpu", attention_backend="torch", block_size=8, num_blocks=64)))
    scheduler = await serve_scheduler(SchedulerServiceConfig(
        port=0, executor_addresses=(executor.address,), tokenizer_addresses=(tokenizer.address,)))
    try:
        before = await scrape(executor.metrics_port)
        assert sum(v for k, v in before.items() if k.startswith("tokenmill:executor_moe_expert_tokens_total")) == 0
        streams = await generate_all(scheduler.address)
        assert [sum(map(len, deltas)) for deltas in streams] == [MAX_TOKENS] * len(PROMPTS)
        after = await scrape(executor.metrics_port)
        # every prompt token and every generated token but the last of each stream went through each layer
        tokens = sum(len(p) for p in PROMPTS) + (MAX_TOKENS - 1) * len(PROMPTS)
        for layer in range(spec.num_layers):
            routed = [after[f'tokenmill:executor_moe_expert_tokens_total{{expert="{e}",layer="{layer}"}}']
                      for e in range(spec.num_experts)]
            assert sum(routed) == tokens * spec.num_experts_per_tok
    finally:
        for running in (scheduler, executor, tokenizer):
            await running.stop(grace=0)
