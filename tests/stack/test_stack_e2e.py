"""The four-service stack end to end: tokenizer, executor and scheduler servers in this process,
on loopback, against the in-process engine (the same core and model runner without gRPC).

Every check reads what a client of the public Generation API sees: tokens and text equal to
the engine's, streams framed Started .. Finished, blocks freed after cancellations, and
INVALID_ARGUMENT naming the field for bad requests while the server keeps serving.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from services.scheduler.request.delta import GenerationDelta
from services.common.pb.tokenmill.v1 import generation_pb2, generation_pb2_grpc
from services.common.sampling_params import SamplingParams
from services.scheduler.request.stop import StopConditions
from services.common.server import RunningServer, create_channel
from services.tokenizer.text_tokenizer import TextTokenizer
from services.executor.config import ExecutorConfig, ExecutorServiceConfig
from services.executor.main import serve as serve_executor
from services.inprocess.engine import Engine, EngineConfig
from services.scheduler.config import SchedulerServiceConfig
from services.scheduler.core.config import SchedulerLimits
from services.scheduler.main import serve as serve_scheduler
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.main import serve as serve_tokenizer
from tests.helpers.service_harness import REPO_ROOT, SERVING, STORIES_DIR, health_status, reflected_services, standard_services
from tests.helpers.stack_streams import (
    StreamRecord,
    assert_framed,
    assert_no_stray_replacement_chars,
    continuation_text,
    greedy_request,
    record_stream,
)
from tests.helpers.engine_runs import generate_all

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.usefixtures("one_torch_thread")]

MODEL = str(STORIES_DIR)
ENGINE_FLAGS = dict(dtype="fp32", device="cpu", attention_backend="torch")
BLOCK_SIZE = 16
NUM_BLOCKS = 512
VOCAB_SIZE = 512
MAX_MODEL_LEN = 512
EOS, BOS = 2, 1
GENERATION = "tokenmill.v1.Generation"

PARITY_TOKENS = 24
"""Greedy tokens per parity stream (ignore_eos: stories260K rarely ends a story that soon)."""

PROMPTS: list[str | list[int]] = [
    "Once upon a time", "The cat", "Lily wanted", "Tom and his dog", "One day, a little bird", "The sun was hot",
    "Ben saw a big", "Mom said", "The little girl", "A fish swam", "The tree was tall", "Sam had a red ball",
    "It was a rainy day", "The king", "Two friends", "Max ran fast", "She found a box", "The park was",
    "你好", "日本語のテキスト", "小猫在花园里玩", "🙂 hi", "I love 🍕 and 🍦", "🐶🐱 played", "Café au lait",
    "Привет, мир!", "The moon 🌙 was bright", 'Lily said, "Look!"', "Grüße aus Köln", "naïve résumé",
    [BOS, 403, 261, 300, 79], [BOS, 17, 18, 19, 20, 21],
]
"""32 distinct prompts: English, CJK and emoji (byte-fallback tokens), accents, and two given as ids."""

SEVERAL = [PROMPTS[i] for i in (0, 5, 18, 19, 21, 22, 30)]


@dataclass
class Stack:
    tokenizer: RunningServer
    executor: RunningServer
    scheduler: RunningServer
    stub: generation_pb2_grpc.GenerationStub
    channel: grpc.aio.Channel

    def stats(self):
        return self.scheduler.app.core.stats()


class References:
    """Solo greedy runs of the in-process engine, computed once per (prompt, settings)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._cache: dict[tuple, GenerationDelta] = {}

    def solo(self, prompt: str | list[int], max_tokens: int = PARITY_TOKENS, ignore_eos: bool = True,
             logit_bias: dict[int, float] | None = None) -> GenerationDelta:
        key = (prompt if isinstance(prompt, str) else tuple(prompt), max_tokens, ignore_eos,
               tuple(sorted((logit_bias or {}).items())))
        if key not in self._cache:
            sampling = SamplingParams(temperature=0.0, logit_bias=dict(logit_bias or {}))
            stop = StopConditions(max_tokens=max_tokens, ignore_eos=ignore_eos)
            self._cache[key] = generate_all(self.engine, [prompt], sampling, stop)[0]
        return self._cache[key]


def greedy(prompt, max_tokens: int = PARITY_TOKENS, **kwargs) -> generation_pb2.GenerateRequest:
    return greedy_request(prompt, max_tokens, **kwargs)


@pytest.fixture(scope="module")
def tokenizer() -> TextTokenizer:
    return TextTokenizer.from_dir(STORIES_DIR)


@pytest.fixture(scope="module")
def references(one_torch_thread) -> References:
    executor = ExecutorConfig(model=MODEL, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, **ENGINE_FLAGS)
    return References(Engine(EngineConfig(executor)))


def prompt_ids(tokenizer: TextTokenizer, prompt: str | list[int]) -> list[int]:
    return tokenizer.encode(prompt, add_special_tokens=True) if isinstance(prompt, str) else list(prompt)


async def start_scheduler(executor: RunningServer, tokenizer: RunningServer, **overrides) -> RunningServer:
    return await serve_scheduler(SchedulerServiceConfig(
        port=0, executor_addresses=(executor.address,), tokenizer_addresses=(tokenizer.address,), connect_timeout_s=10,
        **overrides))


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stack(one_torch_thread) -> AsyncIterator[Stack]:
    tokenizer = await serve_tokenizer(TokenizerConfig(port=0, model=MODEL))
    executor = await serve_executor(ExecutorServiceConfig(port=0, executor=ExecutorConfig(
        model=MODEL, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, **ENGINE_FLAGS)))
    scheduler = await start_scheduler(executor, tokenizer)
    async with create_channel(scheduler.address) as channel:
        yield Stack(tokenizer, executor, scheduler, generation_pb2_grpc.GenerationStub(channel), channel)
    for running in (scheduler, executor, tokenizer):
        await running.stop(grace=0)


async def wait_all_blocks_free(stack: Stack, timeout: float = 3.0) -> None:
    """Freed blocks show up at the next step boundary at the latest; poll briefly."""
    deadline = time.monotonic() + timeout
    while (stats := stack.stats()).num_free_blocks != stats.num_blocks and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert (stats.num_free_blocks, stats.num_running, stats.num_waiting) == (stats.num_blocks, 0, 0), stats


def assert_matches_reference(record: StreamRecord, reference: GenerationDelta, ids: list[int],
                             tokenizer: TextTokenizer) -> None:
    assert record.token_ids == reference.token_ids
    assert record.text == reference.text
    assert record.text == continuation_text(tokenizer, ids, record.token_ids)
    assert record.finish_reason == reference.finish_reason
    assert_no_stray_replacement_chars(record)


# --- parity with the in-process engine ---------------------------------------------------------


async def test_greedy_streams_equal_the_inprocess_engine(stack, references, tokenizer) -> None:
    for n, prompt in enumerate(SEVERAL):
        ids = prompt_ids(tokenizer, prompt)
        record = await record_stream(stack.stub, greedy(prompt, request_id=f"parity-{n}"))
        assert_framed(record, prompt_tokens=len(ids), request_id=f"parity-{n}")
        assert record.finish_reason == "length" and len(record.token_ids) == PARITY_TOKENS
        assert_matches_reference(record, references.solo(prompt), ids, tokenizer)
    await wait_all_blocks_free(stack)


async def test_32_concurrent_streams_each_get_their_solo_output(stack, references, tokenizer) -> None:
    expected = [references.solo(prompt) for prompt in PROMPTS]
    records = await asyncio.gather(*(record_stream(stack.stub, greedy(p, request_id=f"c{i}"))
                                     for i, p in enumerate(PROMPTS)))
    for i, (prompt, record, reference) in enumerate(zip(PROMPTS, records, expected)):
        ids = prompt_ids(tokenizer, prompt)
        assert_framed(record, prompt_tokens=len(ids), request_id=f"c{i}")
        assert_matches_reference(record, reference, ids, tokenizer)
    await wait_all_blocks_free(stack)


@pytest.mark.parametrize("prompt", ["你好，世界", "日本語のテキスト", "🙂🙃 emoji 🎉", "小猫 🐱 and 🐶 狗"])
async def test_streamed_text_of_cjk_and_emoji_prompts_is_the_continuation(stack, references, tokenizer,
                                                                         prompt) -> None:
    ids = prompt_ids(tokenizer, prompt)
    record = await record_stream(stack.stub, greedy(prompt, max_tokens=40))
    assert_framed(record, prompt_tokens=len(ids))
    assert_matches_reference(record, references.solo(prompt, max_tokens=40), ids, tokenizer)


BYTE_FINAL_PROMPTS = ["Привет, мир", "x 😀"]
"""Prompts whose last token is a byte-fallback piece completing a character, and whose greedy
continuation starts with a "▁word" token."""


@pytest.mark.parametrize("prompt", BYTE_FINAL_PROMPTS)
async def test_prompt_ending_in_a_byte_fallback_character_streams_the_continuation(stack, references, tokenizer,
                                                                                 prompt) -> None:
    ids = prompt_ids(tokenizer, prompt)
    assert ids[-1] in tokenizer.byte_token_ids
    record = await record_stream(stack.stub, greedy(prompt))
    assert_framed(record, prompt_tokens=len(ids))
    assert_matches_reference(record, references.solo(prompt), ids, tokenizer)


# --- how streams end ---------------------------------------------------------------------------


async def test_eos_ends_the_stream_with_reason_eos(stack, references, tokenizer) -> None:
    # Greedy stories260K does not pick EOS within a short story; a logit bias makes it do so
    # after a few tokens, the same in the engine and the stack.
    bias = {EOS: 25.0}
    prompt = "The dog"
    reference = references.solo(prompt, max_tokens=100, ignore_eos=False, logit_bias=bias)
    assert reference.finish_reason == "eos" and 1 < len(reference.token_ids) < 100
    request = greedy(prompt, max_tokens=100, ignore_eos=False)
    request.sampling.logit_bias[EOS] = bias[EOS]
    record = await record_stream(stack.stub, request)
    ids = prompt_ids(tokenizer, prompt)
    assert_framed(record, prompt_tokens=len(ids))
    assert record.token_ids[-1] == EOS
    assert_matches_reference(record, reference, ids, tokenizer)


async def test_stop_string_ends_the_stream_without_the_stop_text(stack, references, tokenizer) -> None:
    prompt = "Once upon a time"
    full = references.solo(prompt).text
    stop = "little girl"  # spans two tokens
    assert stop in full, full
    record = await record_stream(stack.stub, greedy(prompt, stop=("never appears", stop)))
    ids = prompt_ids(tokenizer, prompt)
    assert_framed(record, prompt_tokens=len(ids))
    assert record.finish_reason == "stop"
    assert record.finished.stop_reason == stop
    assert record.text == full[:full.index(stop)]
    assert len(record.token_ids) < PARITY_TOKENS
    await wait_all_blocks_free(stack)


async def test_cancelled_streams_free_their_blocks_and_spare_the_others(stack, references, tokenizer) -> None:
    # 20 survivors with known solo outputs, interleaved with 10 long streams that the client
    # abandons after three deltas (while the survivors are mid-flight too).
    survivors = PROMPTS[:20]
    doomed = PROMPTS[20:30]
    expected = [references.solo(p) for p in survivors]
    calls = []
    for i in range(20):
        calls.append(record_stream(stack.stub, greedy(survivors[i], request_id=f"keep-{i}")))
        if i % 2:
            calls.append(record_stream(stack.stub, greedy(doomed[i // 2], max_tokens=400, request_id=f"drop-{i}"),
                                       cancel_after_deltas=3))
    records = await asyncio.gather(*calls)
    kept = [r for r in records if r.started is not None and r.started.request_id.startswith("keep-")]
    dropped = [r for r in records if r.started is not None and r.started.request_id.startswith("drop-")]
    assert (len(kept), len(dropped)) == (20, 10)
    for record in dropped:
        assert record.code == grpc.StatusCode.CANCELLED and record.finished is None
        # Three messages: three tokens or more, since a stream that falls behind gets the
        # steps queued meanwhile in one message.
        assert len(record.token_ids) >= 3
    for prompt, record, reference in zip(survivors, kept, expected):
        ids = prompt_ids(tokenizer, prompt)
        assert_framed(record, prompt_tokens=len(ids))
        assert_matches_reference(record, reference, ids, tokenizer)
    await wait_all_blocks_free(stack)


async def test_abort_by_request_id_ends_the_stream_with_reason_abort(stack, tokenizer) -> None:
    running = asyncio.Event()
    stream = asyncio.create_task(record_stream(stack.stub, greedy("The cat", max_tokens=400, request_id="abort-me"),
                                               on_delta=running))
    await asyncio.wait_for(running.wait(), 30)
    reply = await stack.stub.Abort(generation_pb2.AbortRequest(request_id="abort-me"), timeout=10)
    assert reply.found
    record = await asyncio.wait_for(stream, 30)
    assert_framed(record, prompt_tokens=len(prompt_ids(tokenizer, "The cat")), request_id="abort-me")
    assert record.finish_reason == "abort"
    assert 1 <= len(record.token_ids) < 400
    again = await stack.stub.Abort(generation_pb2.AbortRequest(request_id="abort-me"), timeout=10)
    assert not again.found
    await wait_all_blocks_free(stack)


# --- bad input ---------------------------------------------------------------------------------


def _with(mutate):
    request = greedy("Once upon a time", max_tokens=8)
    mutate(request)
    return request


def _clear_prompt(r):
    r.ClearField("text")


def _empty_text(r):
    r.text = ""


def _empty_token_ids(r):
    r.ClearField("text")
    r.token_ids.SetInParent()


def _long_prompt(r):
    r.token_ids.ids.extend([BOS] + [300] * MAX_MODEL_LEN)


def _text(text: str):
    def mutate(r):
        r.text = text
    return mutate


def _set(path: str, value):
    def mutate(r):
        message_name, field_name = path.split(".")
        setattr(getattr(r, message_name), field_name, value)
    return mutate


def _prompt_plus_max_tokens(r):
    r.token_ids.ids.extend([BOS] + [300] * 99)
    r.stop.max_tokens = 450


def _token_beyond_vocab(r):
    r.token_ids.ids.extend([BOS, VOCAB_SIZE])


def _seventeen_stops(r):
    r.stop.stop.extend(f"stop{i}" for i in range(17))


BAD_REQUESTS = {
    "no prompt": (_clear_prompt, ["prompt"]),
    "empty text": (_empty_text, ["prompt text"]),
    "empty token_ids": (_empty_token_ids, ["token_ids"]),
    # Refused before the ids are copied (a 12M-id prompt once stalled the scheduler for seconds).
    "prompt beyond the context": (_long_prompt, ["prompt token_ids has 513 tokens", "max_model_len=512"]),
    # Refused before tokenizing: 32 characters per token of context by default.
    "text beyond the character limit": (_text("a " * 10_000), ["prompt text has 20000 characters",
                                                               "max_prompt_chars is 16384"]),
    # The error names the field the client set (it used to name prompt_token_ids).
    "text beyond the context": (_text("Once upon a time " * 150), ["prompt text encodes to", "max_model_len=512"]),
    "max_tokens beyond the context": (_set("stop.max_tokens", 600), ["max_tokens", "512"]),
    "prompt + max_tokens beyond the context": (_prompt_plus_max_tokens, ["max_tokens=450", "max_model_len=512"]),
    "negative temperature": (_set("sampling.temperature", -0.5), ["temperature"]),
    "top_p zero": (_set("sampling.top_p", 0.0), ["top_p"]),
    "top_p above one": (_set("sampling.top_p", 1.5), ["top_p"]),
    "negative top_k": (_set("sampling.top_k", -1), ["top_k"]),
    "token id beyond the vocabulary": (_token_beyond_vocab, ["prompt_token_ids[1]", "512"]),
    "17 stop strings": (_seventeen_stops, ["stop", "16"]),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
async def test_bad_request_is_invalid_argument_naming_the_field(stack, case) -> None:
    mutate, words = BAD_REQUESTS[case]
    record = await record_stream(stack.stub, _with(mutate))
    assert record.code == grpc.StatusCode.INVALID_ARGUMENT, (record.code, record.details)
    assert record.messages == []
    for word in words:
        assert word in record.details, record.details
    # The server keeps serving.
    ok = await record_stream(stack.stub, greedy("Once upon a time", max_tokens=3))
    assert ok.finish_reason == "length" and len(ok.token_ids) == 3


async def test_full_waiting_queue_is_resource_exhausted(stack) -> None:
    # Its own executor (one scheduler session per executor) and a scheduler that runs one
    # request and lets one wait.
    executor = await serve_executor(ExecutorServiceConfig(port=0, executor=ExecutorConfig(
        model=MODEL, block_size=BLOCK_SIZE, num_blocks=64, **ENGINE_FLAGS)))
    scheduler = await start_scheduler(executor, stack.tokenizer,
                                      limits=SchedulerLimits(max_num_seqs=1, max_waiting_requests=1))
    try:
        async with create_channel(scheduler.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            running = asyncio.Event()
            first = asyncio.create_task(record_stream(stub, greedy("The cat", max_tokens=400), on_delta=running))
            await asyncio.wait_for(running.wait(), 30)
            waiting_call = stub.Generate(greedy("The dog", max_tokens=400), timeout=60)
            assert (await waiting_call.read()).WhichOneof("event") == "started"
            assert scheduler.app.core.stats().num_waiting == 1
            refused = await record_stream(stub, greedy("The sun", max_tokens=4))
            assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED, (refused.code, refused.details)
            assert "max_waiting_requests=1" in refused.details
            waiting_call.cancel()
            first.cancel()
            await asyncio.gather(first, return_exceptions=True)
            deadline = time.monotonic() + 5
            while (stats := scheduler.app.core.stats()).num_running + stats.num_waiting:
                assert time.monotonic() < deadline, stats  # the cancelled calls were aborted
                await asyncio.sleep(0.02)
            ok = await record_stream(stub, greedy("The sun", max_tokens=4))
            assert ok.finish_reason == "length" and len(ok.token_ids) == 4
    finally:
        await scheduler.stop(grace=0)
        await executor.stop(grace=0)


# --- model info, health, reflection ------------------------------------------------------------


async def test_model_info_health_and_reflection(stack) -> None:
    info = await stack.stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=10)
    assert (info.vocab_size, info.max_model_len, info.block_size, info.num_kv_blocks) == (
        VOCAB_SIZE, MAX_MODEL_LEN, BLOCK_SIZE, NUM_BLOCKS)
    assert info.model_name == "stories260K" and info.architecture == "LlamaForCausalLM"
    assert list(info.eos_token_ids) == [EOS, BOS] and info.bos_token_id == BOS
    assert (info.device, info.attention_backend, info.dtype) == ("cpu", "torch", "float32")
    assert await health_status(stack.channel) == SERVING
    assert await health_status(stack.channel, GENERATION) == SERVING
    # the scheduler also serves the adapters' Admin API on its port
    assert await reflected_services(stack.channel) == standard_services(GENERATION) | {"tokenmill.v1.Admin"}


# --- a client in another language ---------------------------------------------------------------

NODE_CLIENT_DIR = Path(__file__).parent / "node_client"
NPM_INSTALL_TIMEOUT_S = 300  # npm retries an unreachable registry for about two minutes


def ensure_node_client() -> None:
    """npm install the client's two packages once; without them the test fails, never skips."""
    for tool in ("node", "npm"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is not on PATH: the Node.js client test needs Node.js 18+ and npm")
    if (NODE_CLIENT_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir() and \
            (NODE_CLIENT_DIR / "node_modules" / "@grpc" / "proto-loader").is_dir():
        return
    try:
        done = subprocess.run(["npm", "install", "--no-audit", "--no-fund"], cwd=NODE_CLIENT_DIR,
                              capture_output=True, text=True, timeout=NPM_INSTALL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"npm install in {NODE_CLIENT_DIR} did not finish within {NPM_INSTALL_TIMEOUT_S} s; "
                    f"it needs the npm registry (network)")
    if done.returncode != 0:
        pytest.fail(f"npm install in {NODE_CLIENT_DIR} failed (exit {done.returncode}); it needs the npm "
                    f"registry (network). Output:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")


async def run_node_client(address: str, prompt: str, max_tokens: int) -> list[dict]:
    process = await asyncio.create_subprocess_exec(
        "node", str(NODE_CLIENT_DIR / "client.js"), address, prompt, str(max_tokens),
        cwd=NODE_CLIENT_DIR, env={**os.environ, "TOKENMILL_PROTO_ROOT": str(REPO_ROOT / "protos")},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    stdout, stderr = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, stderr.decode(errors="replace")
    return [json.loads(line) for line in stdout.decode().splitlines() if line.strip()]


@pytest.mark.parametrize("prompt", ["Once upon a time", "小猫 🐱 and 🐶 狗"])
async def test_node_client_streams_the_same_text_as_the_python_client(stack, tokenizer, prompt) -> None:
    await asyncio.to_thread(ensure_node_client)
    events = await run_node_client(stack.scheduler.address, prompt, PARITY_TOKENS)
    python = await record_stream(stack.stub, greedy(prompt, ignore_eos=False))
    assert [e["event"] for e in events][0] == "started" and events[-1]["event"] == "finished"
    assert events[0]["prompt_tokens"] == len(prompt_ids(tokenizer, prompt))
    node_text = "".join(e["text"] for e in events if e["event"] == "delta")
    node_ids = [t for e in events if e["event"] == "delta" for t in e["token_ids"]]
    assert node_text == python.text and node_ids == python.token_ids
    assert events[-1]["finish_reason"] == "FINISH_REASON_LENGTH"
    assert events[-1]["completion_tokens"] == PARITY_TOKENS
