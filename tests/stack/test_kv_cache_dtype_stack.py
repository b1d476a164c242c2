"""`tokenmill up`'s stack (four processes under the Launcher) with --kv-cache-dtype int8.

The executor sizes an int8 pool from its byte budget and says so: GetModelInfo reports the KV
dtype, blocks, tokens and bytes, and the scheduler's /metrics the same capacity. Requests stream
the tokens the in-process engine computes with the same int8 cache (the cpu attention backend:
the C++ quantized write and decode), so the quantized path is the one serving.
"""

from __future__ import annotations

import asyncio
import socket
import urllib.request

import pytest
import pytest_asyncio
import torch

from services.common.metrics import parse_samples
from services.common.pb.tokenmill.v1 import generation_pb2
from services.runtime.kv_cache import bytes_per_block, num_blocks_for_budget
from services.runtime.model.config import ModelConfig
from services.stack.launcher import Launcher
from tests.helpers.launched_stack import generation_stub, in_process_greedy, launched_stack
from tests.helpers.service_harness import STORIES_DIR
from tests.helpers.stack_streams import greedy_request, record_stream

# slow: starts the four services as processes
pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

BLOCK_SIZE = 16
KV_CACHE_BYTES = 4 * 1024**2
EXECUTOR = dict(dtype="fp32", device="cpu", attention_backend="cpu", kv_cache_dtype="int8",
                block_size=BLOCK_SIZE, kv_cache_bytes=KV_CACHE_BYTES)
PROMPTS = ["Once upon a time", "The little dog wanted", "Lily and Ben went to the park"]
MAX_TOKENS = 24


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def metrics_port() -> int:
    return _free_port()


@pytest.fixture(scope="module")
def launcher(tmp_path_factory, metrics_port) -> Launcher:
    with launched_stack(STORIES_DIR, tmp_path_factory.mktemp("kv_logs"), executor=EXECUTOR,
                        scheduler_args=[f"--metrics-port={metrics_port}"]) as launcher:
        yield launcher


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stub(launcher: Launcher):
    async with generation_stub(launcher) as stub:
        yield stub


async def test_model_info_reports_the_int8_pool(stub):
    info = await stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=30)
    config = ModelConfig.from_model_dir(STORIES_DIR)
    blocks = num_blocks_for_budget(config, BLOCK_SIZE, torch.int8, KV_CACHE_BYTES)
    assert info.kv_cache_dtype == "int8"
    assert (info.num_kv_blocks, info.block_size) == (blocks, BLOCK_SIZE)
    assert info.kv_cache_tokens == blocks * BLOCK_SIZE
    assert info.kv_cache_bytes == blocks * bytes_per_block(config, BLOCK_SIZE, torch.int8) <= KV_CACHE_BYTES
    # stories260K's head_dim is 8: int8 rows of 8 bytes plus a 2-byte scale against fp32's 32 bytes
    fp32_blocks = num_blocks_for_budget(config, BLOCK_SIZE, torch.float32, KV_CACHE_BYTES)
    assert info.num_kv_blocks >= 3 * fp32_blocks


async def test_scheduler_metrics_report_the_capacity(stub, metrics_port):
    info = await stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=30)

    def scrape() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as reply:
            return reply.read().decode()

    samples = parse_samples(await asyncio.to_thread(scrape))
    labels = f'{{block_size="{BLOCK_SIZE}",kv_cache_dtype="int8"}}'
    assert samples[f"tokenmill:kv_cache_blocks{labels}"] == info.num_kv_blocks
    assert samples[f"tokenmill:kv_cache_capacity_tokens{labels}"] == info.kv_cache_tokens
    assert samples[f"tokenmill:kv_cache_bytes{labels}"] == info.kv_cache_bytes


async def test_streams_equal_the_in_process_engine_with_the_same_cache(stub):
    records = await asyncio.gather(*(record_stream(stub, greedy_request(p, MAX_TOKENS)) for p in PROMPTS))
    served = [r.token_ids for r in records]
    engine, expected = in_process_greedy(STORIES_DIR, EXECUTOR, PROMPTS, MAX_TOKENS, threads=1)
    assert engine.runner.info().kv_cache_dtype == "int8"
    assert served == expected
    assert all(len(ids) == MAX_TOKENS for ids in served)
