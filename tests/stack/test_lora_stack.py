"""LoRA adapters through the served gRPC API: the four services as processes, the executor
started with `--lora NAME=PATH` flags, more loaded and unloaded through the scheduler's Admin
API, requests choosing adapters by GenerateRequest.adapter."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from services.common.pb.tokenmill.v1 import admin_pb2, admin_pb2_grpc
from services.common.server import create_channel
from services.stack.launcher import LaunchConfig, Launcher
from tests.helpers.launched_stack import generation_stub
from tests.helpers.lora_adapters import BLOCK_SIZE, NEW_TOKENS, tiny_served
from tests.helpers.service_harness import REPO_ROOT
from tests.helpers.stack_streams import greedy_request, record_stream


@pytest.mark.slow
async def test_generate_requests_choose_adapters_mixed_in_one_engine(tmp_path):
    model, paths, prompts, expected = tiny_served(tmp_path)
    # "mlp" is not on the command line: the Admin API loads it while the engine serves.
    flags = ["--dtype=fp32", f"--block-size={BLOCK_SIZE}", "--max-loras=2", "--max-lora-rank=16",
             *(f"--lora={name}={path}" for name, path in paths.items() if name != "mlp")]
    launcher = Launcher(LaunchConfig(model=str(model), public_port=0, executor_args=flags, log_dir=str(tmp_path / "logs"),
                                     env={"PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1",
                                          "TOKENMILL_LORA_DIR": str(tmp_path)}))
    launcher.start()
    try:
        async with generation_stub(launcher) as stub, create_channel(launcher.public_address) as channel:
            admin = admin_pb2_grpc.AdminStub(channel)
            loaded = await admin.LoadAdapter(admin_pb2.AdminLoadAdapterRequest(name="mlp", path=str(paths["mlp"])))
            assert (loaded.name, loaded.rank, loaded.alpha) == ("mlp", 16, 16.0)
            batch = [(p, name) for p in range(len(prompts)) for name in ["", "all", "qv", "mlp"]]

            def request(p: int, name: str):
                message = greedy_request(prompts[p], NEW_TOKENS)
                message.adapter = name
                return message

            records = await asyncio.gather(*(record_stream(stub, request(p, name)) for p, name in batch))
            for (p, name), record in zip(batch, records):
                assert record.code == grpc.StatusCode.OK, (name, record.code, record.details)
                assert record.token_ids == expected[name][p], f"prompt {p}, adapter {name or 'base'}"

            unknown = await record_stream(stub, request(0, "nope"))
            assert unknown.code == grpc.StatusCode.NOT_FOUND
            assert "adapter 'nope' is not loaded on this engine (loaded: all, mlp, qv)" in unknown.details
            too_long = await record_stream(stub, request(0, "a" * 129))
            assert too_long.code == grpc.StatusCode.INVALID_ARGUMENT and "adapter" in too_long.details
            assert "MAX_ADAPTER_NAME_CHARS" in too_long.details

            # Unloaded through the Admin API although the executor's flag names it; the executor
            # is killed and restarted by the launcher with its flags, and the scheduler brings it
            # back to the engine's set (mlp loaded, qv not) before it serves a request.
            await admin.UnloadAdapter(admin_pb2.AdminUnloadAdapterRequest(name="qv"))
            gone = await record_stream(stub, request(0, "qv"))
            assert gone.code == grpc.StatusCode.NOT_FOUND and "(loaded: all, mlp)" in gone.details
            launcher.services["executor"].process.kill()
            deadline = time.monotonic() + 120
            while True:
                record = await record_stream(stub, request(1, "mlp"))
                if record.code != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.2)
            assert launcher.events.count("executor restarted") == 1, launcher.events
            assert record.code == grpc.StatusCode.OK, record.details
            assert record.token_ids == expected["mlp"][1]
            listed = await admin.ListAdapters(admin_pb2.ListAdaptersRequest())
            assert [a.name for a in listed.adapters] == ["all", "mlp"]
    finally:
        launcher.stop()
