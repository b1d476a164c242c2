"""Speculative decoding through the real services: a drafter (n-gram prompt lookup, or a
self-speculative draft model: stories260K's first 3 layers) and a scheduler that asks it every
step, against the same stack without speculation.

Three stacks in this process on loopback share a tokenizer; two schedulers are wired to a drafter.
Concurrent greedy requests (plus seeded sampling, whose noise depends only on seed and
position) must produce identical tokens, text and finish reasons on both, with a KV pool
small enough that requests are preempted and prompts sharing a prefix so that the prefix
cache serves them; drafts must really have been accepted, and every block comes back.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from services.common.metrics import SchedulerCollector
from services.common.pb.tokenmill.v1 import generation_pb2, generation_pb2_grpc
from services.common.server import RunningServer, create_channel
from services.drafter.config import DraftModelSettings, DrafterConfig
from services.drafter.main import serve as serve_drafter
from services.drafter.proposer import DraftMethod
from services.executor.config import ExecutorConfig, ExecutorServiceConfig
from services.executor.main import serve as serve_executor
from services.scheduler.config import SchedulerServiceConfig, SpeculationSettings
from services.scheduler.main import serve as serve_scheduler
from services.stack.client import build_request
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.main import serve as serve_tokenizer
from tests.helpers.service_harness import REPO_ROOT, STORIES_DIR
from tests.helpers.stack_streams import record_stream

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = str(STORIES_DIR)
ENGINE_FLAGS = dict(dtype="fp32", device="cpu", attention_backend="torch")
NUM_BLOCKS = 24  # x 16 tokens (max_model_len 256): eight requests of ~140 tokens do not fit at once -> preemption
# Stories260K repeats itself about birds and cats: the n-gram drafter finds its own output.
PREFIX = "One day, Lily saw a bird. The bird was red. Lily saw a bird. The bird was red. Tom said: the cat"
PROMPTS = [PREFIX + tail for tail in (" sat on the mat.", " was happy.", " saw a bird.", " said: the bird",
                                      " and the bird.", " was red.", " ran.", " said: the cat sat")]


@dataclass
class Stack:
    scheduler: RunningServer
    stub: generation_pb2_grpc.GenerationStub
    channel: grpc.aio.Channel

    def stats(self):
        return self.scheduler.app.core.stats()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stacks() -> AsyncIterator[dict[str, Stack]]:
    tokenizer = await serve_tokenizer(TokenizerConfig(port=0, model=MODEL))
    drafter = await serve_drafter(DrafterConfig(port=0))
    # Self-speculative: stories260K's first 3 of 5 layers, with its own KV pool in the drafter.
    draft_model = await serve_drafter(DrafterConfig(port=0, method=DraftMethod.DRAFT_MODEL, draft=DraftModelSettings(
        draft_model=MODEL, draft_layers=3, target_model=MODEL, device="cpu", dtype="fp32", attention_backend="torch",
        num_blocks=256)))
    servers = [tokenizer, drafter, draft_model]
    stacks: dict[str, Stack] = {}
    speculation = dict(num_speculative_tokens=4, spec_draft_deadline_ms=2000)
    for name, spec in (("plain", {}),
                       ("ngram", dict(speculation=SpeculationSettings(drafter_address=drafter.address, **speculation))),
                       ("draft", dict(speculation=SpeculationSettings(drafter_address=draft_model.address,
                                                                      **speculation)))):
        executor = await serve_executor(ExecutorServiceConfig(port=0, skip_warmup=True, executor=ExecutorConfig(
            model=MODEL, block_size=16, num_blocks=NUM_BLOCKS, max_model_len=256, **ENGINE_FLAGS)))
        scheduler = await serve_scheduler(SchedulerServiceConfig(
            port=0, executor_addresses=(executor.address,), tokenizer_addresses=(tokenizer.address,),
            connect_timeout_s=10, **spec))
        channel = create_channel(scheduler.address)
        stacks[name] = Stack(scheduler, generation_pb2_grpc.GenerationStub(channel), channel)
        servers += [executor, scheduler]
    for name in ("ngram", "draft"):
        link = stacks[name].scheduler.app.drafter
        for _ in range(200):
            if link.connected:
                break
            await asyncio.sleep(0.02)
        assert link.connected and link.method == {"ngram": "ngram", "draft": "draft_model"}[name]
    yield stacks
    for stack in stacks.values():
        await stack.channel.close()
    for server in reversed(servers):
        await server.stop(grace=0)


def requests():
    out = [build_request(prompt, max_tokens=120, temperature=0.0) for prompt in PROMPTS]
    out += [build_request(PROMPTS[0], max_tokens=60, temperature=0.8, top_k=40, seed=7),
            build_request(PROMPTS[1], max_tokens=60, temperature=0.0, stop=["park"])]
    return out


async def run_all(stack: Stack):
    records = await asyncio.gather(*(record_stream(stack.stub, request) for request in requests()))
    for record in records:
        assert record.code == grpc.StatusCode.OK, record.details
    return records


async def wait_idle(stack: Stack) -> None:
    for _ in range(300):
        stats = stack.stats()
        if stats.num_running == stats.num_waiting == 0 and stats.num_free_blocks == stats.num_blocks:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"blocks still held: {stack.stats()}")


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
async def test_greedy_and_seeded_outputs_are_identical_with_and_without_speculation(stacks, proposer):
    plain = await run_all(stacks["plain"])
    spec = await run_all(stacks[proposer])
    for a, b in zip(plain, spec):
        assert b.token_ids == a.token_ids
        assert b.text == a.text
        assert b.finish_reason == a.finish_reason
    stats = stacks[proposer].stats()
    assert stats.num_preemptions > 0, "the pool was meant to be too small for every request at once"
    assert stats.prefix_cache_hits > 0
    # n-gram lookup pays on this repetitive text; an untrained early exit is right less often.
    assert stats.spec_decode.num_accepted_tokens > (20 if proposer == "ngram" else 5), stats.spec_decode
    assert stats.spec_decode.num_accepted_tokens < stats.spec_decode.num_draft_tokens
    finished = [r.finished for r in spec]
    assert sum(f.timings.accepted_draft_tokens for f in finished) > 0
    assert all(f.timings.accepted_draft_tokens < f.usage.completion_tokens for f in finished)
    await wait_idle(stacks[proposer])
    await wait_idle(stacks["plain"])


async def test_a_request_can_turn_speculation_off_or_is_refused_a_negative_k(stacks):
    stack = stacks["ngram"]
    before = stack.stats().spec_decode.num_draft_tokens
    request = build_request(PROMPTS[2], max_tokens=60, temperature=0.0)
    request.num_speculative_tokens = 0
    off = await record_stream(stack.stub, request)
    assert off.code == grpc.StatusCode.OK and off.finished.timings.accepted_draft_tokens == 0
    assert stack.stats().spec_decode.num_draft_tokens == before, "no draft was sent for it"
    plain = await record_stream(stacks["plain"].stub, build_request(PROMPTS[2], max_tokens=60, temperature=0.0))
    assert off.token_ids == plain.token_ids
    request.num_speculative_tokens = -1
    refused = await record_stream(stack.stub, request)
    assert refused.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "num_speculative_tokens must be >= 0" in refused.details


async def _start_drafter_process(port_file: Path, port: int = 0) -> asyncio.subprocess.Process:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.drafter", "--port", str(port), "--port-file", str(port_file), "--allow-unauthenticated",
        cwd=REPO_ROOT, env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    for _ in range(600):
        if port_file.is_file() and port_file.read_text().strip():
            return process
        assert process.returncode is None, "the drafter exited while starting"
        await asyncio.sleep(0.05)
    raise AssertionError("the drafter did not start")


async def _wait_for(condition, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached in time")


async def test_sigkill_of_the_drafter_mid_run_leaves_every_stream_complete_and_correct(stacks, tmp_path):
    port_file = tmp_path / "drafter.port"
    drafter = await _start_drafter_process(port_file)
    port = int(port_file.read_text())
    tokenizer = await serve_tokenizer(TokenizerConfig(port=0, model=MODEL))
    executor = await serve_executor(ExecutorServiceConfig(port=0, skip_warmup=True, executor=ExecutorConfig(
        model=MODEL, block_size=16, num_blocks=64, **ENGINE_FLAGS)))
    scheduler = await serve_scheduler(SchedulerServiceConfig(
        port=0, executor_addresses=(executor.address,), tokenizer_addresses=(tokenizer.address,), connect_timeout_s=10,
        speculation=SpeculationSettings(drafter_address=f"127.0.0.1:{port}", num_speculative_tokens=4,
                                        spec_draft_deadline_ms=2000)))
    channel = create_channel(scheduler.address)
    stub = generation_pb2_grpc.GenerationStub(channel)
    supervisor = scheduler.app
    try:
        await _wait_for(lambda: supervisor.drafter.connected)
        expected = await run_all(stacks["plain"])
        streams = [asyncio.create_task(record_stream(stub, request)) for request in requests()]
        await _wait_for(lambda: supervisor.core.stats().spec_decode.num_accepted_tokens >= 5)
        assert not all(stream.done() for stream in streams), "the drafter must die mid-run"
        drafter.send_signal(signal.SIGKILL)
        await drafter.wait()
        killed_at = supervisor.core.stats().spec_decode.num_draft_tokens
        records = await asyncio.gather(*streams)
        assert not supervisor.drafter.connected
        assert any(not r.finished.timings.accepted_draft_tokens for r in records) or killed_at > 0
        for record, reference in zip(records, expected):
            assert record.code == grpc.StatusCode.OK, record.details
            assert record.finish_reason == reference.finish_reason
            assert record.token_ids == reference.token_ids
        # Back on the same port, the link finds it again by itself and drafts resume.
        drafter = await _start_drafter_process(port_file, port)
        await _wait_for(lambda: supervisor.drafter.connected and supervisor.drafter.num_sessions == 2)
        accepted = supervisor.core.stats().spec_decode.num_accepted_tokens
        again = await record_stream(stub, requests()[0])
        assert again.token_ids == expected[0].token_ids
        assert supervisor.core.stats().spec_decode.num_accepted_tokens > accepted
    finally:
        if drafter.returncode is None:
            drafter.send_signal(signal.SIGKILL)
            await drafter.wait()
        await channel.close()
        for server in (scheduler, executor, tokenizer):
            await server.stop(grace=0)


async def test_metrics_and_profile_report_acceptance(stacks):
    stack = stacks["ngram"]
    await run_all(stack)
    collector = SchedulerCollector()
    collector.watch(stack.scheduler.app.core)
    samples = {(s.name, s.labels.get("position")): s.value for m in collector.collect() for s in m.samples}
    spec = stack.stats().spec_decode
    assert samples[("tokenmill:spec_decode_num_drafts_total", None)] == spec.num_drafts > 0
    assert samples[("tokenmill:spec_decode_num_draft_tokens_total", None)] == spec.num_draft_tokens
    assert samples[("tokenmill:spec_decode_num_accepted_tokens_total", None)] == spec.num_accepted_tokens > 0
    per_pos = [samples[("tokenmill:spec_decode_num_accepted_tokens_per_pos_total", str(i))]
               for i in range(len(spec.accepted_per_position))]
    assert sum(per_pos) == spec.num_accepted_tokens
    assert per_pos == sorted(per_pos, reverse=True), "a later draft is accepted only after every earlier one"
    profile = await stack.stub.GetProfile(generation_pb2.GetProfileRequest())
    assert profile.spec_mean_accepted_length == pytest.approx(1 + spec.num_accepted_tokens / spec.num_drafts)
    assert profile.spec_mean_accepted_length > 1.0
    assert 0 < profile.spec_acceptance_rate < 1
