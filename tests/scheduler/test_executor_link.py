"""The scheduler's executor link waits for an executor that is still loading its model.

An executor binds its port before it has loaded (health NOT_SERVING, GetExecutorInfo
UNAVAILABLE meanwhile); a scheduler started beside it (one pod, or a launcher that does not
wait) must connect once it is ready instead of giving up at the first UNAVAILABLE.
"""

from __future__ import annotations

import socket

import pytest

from services.scheduler.links.executor_link import ExecutorLink
from tests.helpers.service_harness import STORIES_DIR, launch_module

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


async def test_connect_waits_out_an_executor_that_is_still_loading() -> None:
    port = _free_port()
    process = await launch_module("services.executor", [
        "--port", str(port), "--model", str(STORIES_DIR), "--dtype", "fp32", "--device", "cpu", "--num-blocks", "64",
        "--allow-unauthenticated"])
    link = ExecutorLink(f"127.0.0.1:{port}")
    try:
        info = await link.connect(timeout=90)  # at once: the executor is still starting
        assert info.num_blocks == 64 and link.connected
    finally:
        await link.close()
        process.kill()
        await process.wait()
