"""`tokenmill up`'s four processes with a tensor-parallel executor (--tensor-parallel-size=2,
its second rank a process of its own over gloo): served greedy streams equal the in-process
engine's on one rank, and GetModelInfo reports both ranks' KV pools."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio

from services.common.pb.tokenmill.v1 import generation_pb2
from services.stack.launcher import Launcher
from tests.helpers.launched_stack import generation_stub, in_process_greedy, launched_stack
from tests.helpers.service_harness import STORIES_DIR
from tests.helpers.stack_streams import greedy_request, record_stream

# slow: starts the four services and a second executor rank as processes
pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

ONE_RANK = dict(dtype="fp32", device="cpu", attention_backend="cpu", block_size=16, num_blocks=128)
PROMPTS = ["Once upon a time", "The little dog wanted", "Lily and Ben went to the park"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tp_logs")


@pytest.fixture(scope="module")
def launcher(log_dir) -> Launcher:
    with launched_stack(STORIES_DIR, log_dir, executor=ONE_RANK | {"tensor_parallel_size": 2}) as launcher:
        yield launcher


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stub(launcher: Launcher):
    async with generation_stub(launcher) as stub:
        yield stub


async def test_streams_equal_the_one_rank_engine(stub, log_dir):
    records = await asyncio.gather(*(record_stream(stub, greedy_request(p, MAX_TOKENS)) for p in PROMPTS))
    engine, expected = in_process_greedy(STORIES_DIR, ONE_RANK, PROMPTS, MAX_TOKENS, threads=1)
    assert [r.token_ids for r in records] == expected
    assert all(len(ids) == MAX_TOKENS for ids in expected)
    info = await stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=30)
    assert info.num_kv_blocks == engine.runner.info().num_blocks
    assert info.kv_cache_bytes == engine.runner.info().kv_cache_bytes  # both ranks' halves together
    # The second rank served: it logged its shard (KV heads 2..4 of stories260K's 4) to the executor's log.
    log = (log_dir / "executor.log").read_text()
    assert '"tensor_parallel_rank_ready"' in log and '"kv_heads": [2, 4]' in log
