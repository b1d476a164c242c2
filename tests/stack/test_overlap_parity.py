"""Overlapped scheduling (and the decode-graph path's padded buffers), and multi-step
scheduling (with the fused CPU decode step), on vs off through the real services: the same
outputs.

Three stacks in this process on loopback (tokenizer, executor and scheduler gRPC servers):
"off" (one step at a time, the torch attention backend), "overlap" (overlap on, one decode
step per plan, decode through the padded decode-graph buffers) and "multi-step" (the
scheduler's defaults: overlap on, bursts of decode steps sized from the measured step time
while nothing waits; the cpu backend's fused decode step). They receive the same mix of
concurrent requests:
greedy and seeded sampling, max_tokens, EOS (with and without min_tokens), stop token ids,
stop strings (with and without the stop text), logprobs, and streams aborted mid-flight by
a cancelled call and by the Abort RPC. Every finished stream must carry the same tokens,
text, finish and stop reasons and usage on both stacks, the aborted ones must end as aborted,
and afterwards each scheduler's core holds no block and no request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest
import pytest_asyncio
import structlog

from services.common.pb.tokenmill.v1 import generation_pb2, generation_pb2_grpc
from services.common.server import RunningServer, create_channel
from services.executor.config import ExecutorConfig, ExecutorServiceConfig
from services.executor.forward_paths.decode_graphs import DecodeGraphSettings
from services.executor.forward_paths.fused_decode import FusedDecodeSettings
from services.executor.main import serve as serve_executor
from services.scheduler.config import SchedulerServiceConfig
from services.scheduler.core.config import SchedulerLimits
from services.scheduler.main import serve as serve_scheduler
from services.stack.client import build_request
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.main import serve as serve_tokenizer
from tests.helpers.service_harness import STORIES_DIR
from tests.helpers.stack_streams import StreamRecord, assert_framed, record_stream

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.usefixtures("one_torch_thread")]

MODEL = str(STORIES_DIR)
ENGINE_FLAGS = dict(dtype="fp32", device="cpu", attention_backend="torch")
NUM_BLOCKS = 256
EOS = 2
STORY = "Once upon a time"


@dataclass
class Stack:
    executor: RunningServer
    scheduler: RunningServer
    stub: generation_pb2_grpc.GenerationStub
    channel: grpc.aio.Channel

    def stats(self):
        return self.scheduler.app.core.stats()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stacks(one_torch_thread) -> AsyncIterator[dict[bool, Stack]]:
    tokenizer = await serve_tokenizer(TokenizerConfig(port=0, model=MODEL))
    stacks: dict[str, Stack] = {}
    for name in ("overlap", "multi-step", "off"):
        overlap, steps = name != "off", SchedulerLimits().num_scheduler_steps if name == "multi-step" else 1
        # The overlapped stack's executor also runs decode steps through the CUDA-graph path's
        # padded buffers (what a GPU replays), so "every switch on" is held to "every switch off".
        multi_step = {"attention_backend": "cpu", "fused_decode": FusedDecodeSettings(cpu_decode="fused")}
        with structlog.testing.capture_logs() as logs:
            executor = await serve_executor(ExecutorServiceConfig(port=0, executor=ExecutorConfig(
                model=MODEL, block_size=16, num_blocks=NUM_BLOCKS,
                decode_graphs=DecodeGraphSettings(padded_decode_on_cpu=name == "overlap"),
                **{**ENGINE_FLAGS, **(multi_step if steps > 1 else {})})))
        (loaded,) = [entry for entry in logs if entry["event"] == "model_loaded"]
        expected_paths = {"overlap": ["decode_graphs", "eager"], "multi-step": ["fused_decode", "eager"]}
        assert loaded["forward_paths"] == expected_paths.get(name, ["eager"])
        scheduler = await serve_scheduler(SchedulerServiceConfig(
            port=0, executor_addresses=(executor.address,), tokenizer_addresses=(tokenizer.address,),
            connect_timeout_s=10, limits=SchedulerLimits(overlap_scheduling=overlap, num_scheduler_steps=steps)))
        assert scheduler.app.core.scheduler.config.limits.overlap_scheduling is overlap
        channel = create_channel(scheduler.address)
        stacks[name] = Stack(executor, scheduler, generation_pb2_grpc.GenerationStub(channel), channel)
    yield stacks
    for stack in stacks.values():
        await stack.channel.close()
        await stack.scheduler.stop(grace=0)
        await stack.executor.stop(grace=0)
    await tokenizer.stop(grace=0)


def request(prompt: str, max_tokens: int, *, temperature: float = 0.0, seed: int | None = None,
            ignore_eos: bool = True, stop: tuple[str, ...] = (), eos_bias: float = 0.0, min_tokens: int = 0,
            stop_token_ids: tuple[int, ...] = (), include_stop_str: bool = False,
            logprobs: int | None = None) -> generation_pb2.GenerateRequest:
    req = build_request(prompt, max_tokens=max_tokens, temperature=temperature, seed=seed, ignore_eos=ignore_eos,
                        stop=stop, top_p=0.9 if temperature else 1.0)
    if eos_bias:
        req.sampling.logit_bias[EOS] = eos_bias
    if logprobs is not None:
        req.sampling.logprobs = logprobs
    req.stop.min_tokens = min_tokens
    req.stop.stop_token_ids.extend(stop_token_ids)
    req.stop.include_stop_str_in_output = include_stop_str
    return req


async def wait_idle(stack: Stack, timeout: float = 10.0) -> None:
    """Freed blocks show up at the next step boundary at the latest; poll briefly."""
    deadline = time.monotonic() + timeout
    while (stats := stack.stats()).num_free_blocks != stats.num_blocks and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert (stats.num_free_blocks, stats.num_running, stats.num_waiting) == (stats.num_blocks, 0, 0), stats
    assert not stack.scheduler.app.core.has_unfinished()


def outcome(record: StreamRecord) -> tuple:
    """What must be equal with every switch on and off (cached_tokens and timings may differ):
    everything but the logprob values, which are compared apart (logprob_values)."""
    finished = record.finished
    logprob_ids = [(lp.token_id, list(lp.top_token_ids)) for d in record.deltas for lp in d.logprobs]
    return (record.code, record.token_ids, record.text, record.finish_reason,
            finished.stop_reason if finished.HasField("stop_reason") else None,
            finished.usage.prompt_tokens, finished.usage.completion_tokens, logprob_ids)


def logprob_values(record: StreamRecord) -> list[float]:
    """The sampled and top logprobs, in order. The "off" stack runs the eager forward, the
    others the padded decode buffers or the fused CPU step, whose sums round differently in the
    last bits (~1e-6 on the hidden state): equal within a tolerance, not digit for digit."""
    return [value for d in record.deltas for lp in d.logprobs for value in (lp.logprob, *lp.top_logprobs)]


async def reference_text(stack: Stack, prompt: str, tokens: int) -> StreamRecord:
    record = await record_stream(stack.stub, request(prompt, tokens))
    assert record.finish_reason == "length"
    return record


async def test_outputs_with_overlap_equal_outputs_without(stacks) -> None:
    # Stop rules picked from the plain greedy continuation, so that each of them fires.
    plain = await reference_text(stacks["off"], STORY, 40)
    stop_id = plain.token_ids[6]
    first_stop = plain.token_ids.index(stop_id)
    words = plain.text.split()
    stop_text = f"{words[3]} {words[4]}"  # spans a word boundary, likely two or more tokens
    assert stop_text in plain.text
    cases = {
        "greedy length": request(STORY, 24),
        "greedy other prompt": request("The little dog", 31),
        "greedy one token": request("Lily wanted", 1),
        "seeded": request(STORY, 32, temperature=0.8, seed=7),
        "seeded other seed": request("Tom and his dog", 29, temperature=1.0, seed=1234),
        "eos": request("The dog", 100, ignore_eos=False, eos_bias=25.0),
        "eos after min_tokens": request("The dog", 100, ignore_eos=False, eos_bias=25.0, min_tokens=6),
        "seeded eos": request("A fish swam", 100, temperature=0.7, seed=3, ignore_eos=False, eos_bias=8.0),
        "stop token id": request(STORY, 40, stop_token_ids=(stop_id,)),
        "stop token id after min_tokens": request(STORY, 40, stop_token_ids=(stop_id,), min_tokens=first_stop + 1),
        "stop string": request(STORY, 40, stop=("never appears", stop_text)),
        "stop string kept": request(STORY, 40, stop=(stop_text,), include_stop_str=True),
        "seeded stop string": request(STORY, 60, temperature=0.8, seed=7, stop=("the",)),
        "logprobs": request("The sun was hot", 12, logprobs=3),
    }
    results: dict[str, dict[str, StreamRecord]] = {}
    for stack_name, stack in stacks.items():
        overlap = stack_name != "off"
        names = list(cases)
        aborted_by_rpc = asyncio.Event()
        calls = [record_stream(stack.stub, cases[name]) for name in names]
        calls.append(record_stream(stack.stub, request("Sam had a red ball", 400), cancel_after_deltas=3))
        req = request("The king", 400)
        req.request_id = f"abort-me-{stack_name}"
        calls.append(record_stream(stack.stub, req, on_delta=aborted_by_rpc))

        async def abort_when_running() -> None:
            await asyncio.wait_for(aborted_by_rpc.wait(), 30)
            reply = await stack.stub.Abort(generation_pb2.AbortRequest(request_id=req.request_id), timeout=10)
            assert reply.found

        *records, cancelled, aborted, _ = await asyncio.gather(*calls, abort_when_running())
        results[stack_name] = dict(zip(names, records))
        assert cancelled.code == grpc.StatusCode.CANCELLED and len(cancelled.deltas) == 3
        assert 3 <= len(cancelled.token_ids) < 400  # cancelled mid-stream (a message may carry several steps)
        assert aborted.finish_reason == "abort" and 1 <= len(aborted.token_ids) < 400
        await wait_idle(stack)
        totals = stack.scheduler.app.core.step_times
        assert (totals.overlapped > totals.steps // 2) if overlap else totals.overlapped == 0, totals

    for stack_name in ("overlap", "multi-step"):
        for name in cases:
            on, off = results[stack_name][name], results["off"][name]
            assert_framed(on, prompt_tokens=off.started.prompt_tokens)
            assert outcome(on) == outcome(off), (stack_name, name)
            assert logprob_values(on) == pytest.approx(logprob_values(off), abs=1e-4), (stack_name, name)
    # Multi-step ran: some stream got tokens in bursts of more than one.
    assert any(len(d.token_ids) > 1 for r in results["multi-step"].values() for d in r.deltas)

    on = results["multi-step"]
    got = {name: (r.finish_reason, len(r.token_ids)) for name, r in on.items()}
    assert got["greedy length"] == ("length", 24) and got["greedy one token"] == ("length", 1)
    assert got["eos"][0] == "eos" and on["eos"].token_ids[-1] == EOS
    assert got["eos after min_tokens"][0] == "eos" and got["eos after min_tokens"][1] > 6
    assert got["stop token id"] == ("stop", first_stop + 1)
    assert stop_id not in on["stop token id after min_tokens"].token_ids[:first_stop + 1]  # banned
    assert got["stop string"][0] == "stop" and on["stop string"].text == plain.text[
        :plain.text.index(stop_text)]
    assert on["stop string kept"].text.endswith(stop_text)
    assert len(on["logprobs"].deltas[0].logprobs[0].top_token_ids) == 3
