"""A gateway in front of real engines, for tests: routes files written on the fly, servers on port 0."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from services.common.server import RunningServer
from services.common.settings import parse_config
from services.executor.config import ExecutorConfig, ExecutorServiceConfig
from services.executor.main import serve as serve_executor
from services.gateway.config import GatewayServiceConfig
from services.gateway.main import serve as serve_gateway
from services.scheduler.config import SchedulerServiceConfig
from services.scheduler.main import serve as serve_scheduler
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.main import serve as serve_tokenizer
from tests.helpers.service_harness import STORIES_DIR


CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def stories_with_chat_template(root: Path) -> Path:
    """stories260K with a small chat template beside it (the shipped model has none)."""
    target = root / "stories260K-chat"
    if not target.exists():
        shutil.copytree(STORIES_DIR, target)
        (target / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return target


async def serve_engine(*, model: str | Path = STORIES_DIR, auth_tokens_file: str = "", num_blocks: int = 256,
                       scheduler: Mapping[str, Any] | None = None, max_model_len: int = 0,
                       tokenizer_flags: Sequence[str] = (),
                       executor: Mapping[str, Any] | None = None) -> list[RunningServer]:
    """A model's tokenizer, executor and scheduler in this process (stories260K by default); the
    scheduler is last. ``tokenizer_flags``: more of the tokenizer's flags, as typed; ``executor``:
    more ExecutorConfig fields (LoRA slots and ranks)."""
    model = str(model)
    tokenizer = await serve_tokenizer(parse_config(TokenizerConfig, ["--port=0", f"--model={model}",
                                                                     *tokenizer_flags], env={}))
    executor = await serve_executor(ExecutorServiceConfig(port=0, executor=ExecutorConfig(
        model=model, num_blocks=num_blocks, dtype="fp32", device="cpu", attention_backend="torch",
        max_model_len=max_model_len, **dict(executor or {}))))
    sched = await serve_scheduler(SchedulerServiceConfig(
        port=0, executor_addresses=(executor.address,), tokenizer_addresses=(tokenizer.address,), connect_timeout_s=10,
        auth_tokens_file=auth_tokens_file, **dict(scheduler or {})))
    return [tokenizer, executor, sched]


def write_routes(path: Path, routes: Mapping[str, Any]) -> str:
    path.write_text(json.dumps(routes))
    return str(path)


async def serve_gateway_for(routes_path: str, **fields: Any) -> RunningServer:
    """The gateway process's serve() in this process: gRPC and HTTP on free ports."""
    config = GatewayServiceConfig(**{"port": 0, "http_port": 0, "config": routes_path, "profile_interval_s": 0.1,
                                     **fields})
    return await serve_gateway(config)


async def wait_healthy(gateway: RunningServer, names: Sequence[str], timeout_s: float = 60.0) -> None:
    """Until the gateway's pool holds every named target (a loaded machine may answer its first
    polls late)."""
    targets = gateway.dispatcher.pool.targets
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not all(targets[n].state.healthy for n in names):
        assert asyncio.get_running_loop().time() < deadline, f"targets {list(names)} never became healthy"
        await asyncio.sleep(0.05)


async def stop_all(servers: Sequence[RunningServer]) -> None:
    for running in servers:
        await running.stop(grace=0)
