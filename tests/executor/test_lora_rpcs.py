"""The executor's LoadAdapter / UnloadAdapter RPCs on a real server (port 0, stories260K): an
adapter loaded while serving is reported by GetExecutorInfo, a bad one is refused with
INVALID_ARGUMENT naming the file and field (a weights file over --max-lora-file-bytes before it
is read), and unloading says whether it was loaded."""

from __future__ import annotations

import os

import grpc
import pytest

from services.common.pb.tokenmill.v1 import executor_pb2, executor_pb2_grpc
from services.common.server import create_channel
from services.executor.config import ExecutorConfig, ExecutorServiceConfig
from services.executor.main import serve as serve_executor
from tests.helpers.lora_adapters import write_adapter
from tests.helpers.service_harness import STORIES_DIR


async def test_adapters_load_and_unload_through_the_executor_rpcs(tmp_path):
    server = await serve_executor(ExecutorServiceConfig(port=0, skip_warmup=True, executor=ExecutorConfig(
        model=str(STORIES_DIR), dtype="fp32", device="cpu", num_blocks=64, max_loras=2, max_lora_rank=8,
        lora_dir=str(tmp_path))))
    try:
        async with create_channel(server.address) as channel:
            stub = executor_pb2_grpc.ExecutorStub(channel)
            good = write_adapter(tmp_path / "good", rank=4)
            info = await stub.LoadAdapter(executor_pb2.LoadAdapterRequest(name="support", path=str(good)))
            assert (info.name, info.rank, list(info.target_modules)) == ("support", 4, ["down_proj", "q_proj", "v_proj"])
            assert len(info.fingerprint) == 32
            reported = await stub.GetExecutorInfo(executor_pb2.GetExecutorInfoRequest())
            assert [a.name for a in reported.adapters] == ["support"] and reported.max_loras == 2

            too_big = write_adapter(tmp_path / "big", rank=16)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.LoadAdapter(executor_pb2.LoadAdapterRequest(name="big", path=str(too_big)))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert str(too_big / "adapter_config.json") in refused.value.details()
            assert "field r: rank 16 exceeds max_lora_rank=8" in refused.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as missing:
                await stub.LoadAdapter(executor_pb2.LoadAdapterRequest(name="gone", path=str(tmp_path / "nowhere")))
            assert missing.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "is not a directory" in missing.value.details()

            # A file far over the bound (sparse: 4 GiB on paper) is refused from its size alone.
            huge = write_adapter(tmp_path / "huge", rank=4)
            os.truncate(huge / "adapter_model.safetensors", 4 << 30)
            with pytest.raises(grpc.aio.AioRpcError) as oversized:
                await stub.LoadAdapter(executor_pb2.LoadAdapterRequest(name="huge", path="huge"), timeout=10)
            assert oversized.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"is {4 << 30} bytes, over max_lora_file_bytes={1 << 30}" in oversized.value.details()

            assert (await stub.UnloadAdapter(executor_pb2.UnloadAdapterRequest(name="support"))).found
            assert not (await stub.UnloadAdapter(executor_pb2.UnloadAdapterRequest(name="support"))).found
            reported = await stub.GetExecutorInfo(executor_pb2.GetExecutorInfoRequest())
            assert list(reported.adapters) == []
    finally:
        await server.stop(grace=0)
