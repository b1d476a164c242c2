"""The executor service over loopback: Step sessions against ModelRunner.execute run in-process."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import pytest
import pytest_asyncio

from services.common.codec.step_codec import plan_to_proto, result_from_proto
from services.common.pb.tokenmill.v1 import executor_pb2, executor_pb2_grpc
from services.common.sampling_params import SamplingParams
from services.common.server import RunningServer, create_channel, start_server
from services.common.service_config import read_port_file
from services.common.settings import parse_config, to_argv
from services.common.step import NewSequence, RunningSequence, SequenceOutput, StepPlan, StepResult
from services.tokenizer.text_tokenizer import TextTokenizer
from services.executor.config import ExecutorConfig, ExecutorServiceConfig
from services.executor.forward_paths.compiled_decode import CompiledDecodeSettings
from services.executor.forward_paths.decode_graphs import DecodeGraphSettings
from services.executor.forward_paths.fused_decode import FusedDecodeSettings
from services.executor.main import serve
from services.common.step import ExecutorInfo
from services.executor.model_runner import ModelRunner
from services.executor.servicer import ExecutorServicer
from tests.helpers.service_harness import (
    SERVING,
    STORIES_DIR,
    StreamSession,
    expect_status,
    health_status,
    reflected_services,
    standard_services,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

SERVICE = "tokenmill.v1.Executor"
BLOCK_SIZE = 8
NUM_BLOCKS = 64
EOS = 2
MAX_NEW_TOKENS = 30


def engine_config() -> ExecutorConfig:
    return ExecutorConfig(model=str(STORIES_DIR), dtype="fp32", device="cpu", attention_backend="torch",
                          block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)


@pytest.fixture(scope="module")
def tokenizer() -> TextTokenizer:
    return TextTokenizer.from_dir(STORIES_DIR)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def server(tmp_path_factory) -> AsyncIterator[RunningServer]:
    port_file = tmp_path_factory.mktemp("executor") / "executor.port"
    running = await serve(ExecutorServiceConfig(port=0, port_file=str(port_file), executor=engine_config()))
    assert read_port_file(port_file) == running.port
    yield running
    await running.stop(grace=0)
    assert not port_file.exists()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stub(server: RunningServer) -> AsyncIterator[executor_pb2_grpc.ExecutorStub]:
    async with create_channel(server.address) as channel:
        yield executor_pb2_grpc.ExecutorStub(channel)


def reference_runner() -> ModelRunner:
    return ModelRunner(engine_config())


# --- a hand-made scheduler ---------------------------------------------------------------------


@dataclass
class ScriptedSequence:
    seq_id: int
    prompt_ids: list[int]
    sampling: SamplingParams
    prefill_chunk: int = 1 << 30
    tokens: list[int] = field(default_factory=list)
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)
    started: bool = False
    done: bool = False

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[len(self.prompt_ids):]


class HandPlanner:
    """Prefill (in chunks when asked), then one token a step; blocks appended as they fill up."""

    def __init__(self, sequences: list[ScriptedSequence]) -> None:
        self.sequences = sequences
        self.free_blocks = list(range(NUM_BLOCKS - 1, -1, -1))
        self.step_id = 0
        for seq in sequences:
            seq.tokens = list(seq.prompt_ids)

    def _blocks_for(self, seq: ScriptedSequence, num_tokens: int) -> list[int]:
        needed = -(-num_tokens // BLOCK_SIZE) - len(seq.blocks)
        new = [self.free_blocks.pop() for _ in range(max(0, needed))]
        seq.blocks.extend(new)
        return new

    def next_plan(self) -> StepPlan:
        self.step_id += 1
        plan = StepPlan(self.step_id)
        for seq in self.sequences:
            if seq.done:
                continue
            count = min(seq.prefill_chunk, len(seq.tokens) - seq.num_computed)
            new_blocks = self._blocks_for(seq, seq.num_computed + count)
            if not seq.started:
                seq.started = True
                plan.new.append(NewSequence(seq.seq_id, list(seq.tokens), len(seq.prompt_ids), 0, count,
                                            list(seq.blocks), seq.sampling))
            else:
                plan.running.append(RunningSequence(seq.seq_id, count, new_blocks))
        return plan

    def update(self, plan: StepPlan, result: StepResult) -> None:
        scheduled = {s.seq_id: s.num_scheduled_tokens for s in [*plan.new, *plan.running]}
        by_id = {seq.seq_id: seq for seq in self.sequences}
        for output in result.outputs:
            seq = by_id[output.seq_id]
            seq.num_computed += scheduled[output.seq_id]
            seq.tokens.extend(output.token_ids)
            if EOS in output.token_ids or len(seq.output_ids) >= MAX_NEW_TOKENS:
                seq.done = True

    @property
    def finished(self) -> bool:
        return all(seq.done for seq in self.sequences)


def scripted_sequences(tokenizer: TextTokenizer) -> list[ScriptedSequence]:
    long_prompt = tokenizer.encode("Once upon a time, there was a little girl named Lily. She loved to play outside "
                                   "in the park with her friends and her dog")
    assert len(long_prompt) > 2 * BLOCK_SIZE
    return [
        ScriptedSequence(1, tokenizer.encode("Once upon a time"), SamplingParams(temperature=0.0)),
        ScriptedSequence(2, tokenizer.encode("Tom and his mom went"), SamplingParams(temperature=0.0, logprobs=2)),
        ScriptedSequence(3, long_prompt, SamplingParams(temperature=0.8, seed=7), prefill_chunk=12),
    ]


# --- tests -------------------------------------------------------------------------------------


async def test_info_health_and_reflection(server: RunningServer, stub) -> None:
    info = await stub.GetExecutorInfo(executor_pb2.GetExecutorInfoRequest(), timeout=10)
    assert (info.num_blocks, info.block_size, info.max_model_len, info.vocab_size) == (NUM_BLOCKS, BLOCK_SIZE, 512, 512)
    assert (info.dtype, info.device, info.attention_backend) == ("float32", "cpu", "torch")
    assert info.model_path == str(STORIES_DIR) and info.architecture == "LlamaForCausalLM"
    assert list(info.eos_token_ids) == [EOS] and info.HasField("bos_token_id") and info.bos_token_id == 1
    async with create_channel(server.address) as channel:
        assert await health_status(channel) == SERVING
        assert await health_status(channel, SERVICE) == SERVING
        assert await reflected_services(channel) == standard_services(SERVICE)


async def test_step_stream_matches_the_runner_in_process(stub, tokenizer: TextTokenizer) -> None:
    reference = reference_runner()
    planner = HandPlanner(scripted_sequences(tokenizer))
    session = StreamSession(stub.Step)
    results = []
    while not planner.finished:
        plan = planner.next_plan()
        response = await session.exchange(plan_to_proto(plan))
        assert response.step_id == plan.step_id
        remote = result_from_proto(response)
        assert remote == reference.execute(plan), f"step {plan.step_id}"
        planner.update(plan, remote)
        results.append(remote)
    assert await session.close() == grpc.StatusCode.OK
    # Step 1: the chunked prefill of sequence 3 stops short of its prompt's end, so no token.
    assert [(o.seq_id, len(o.token_ids)) for o in results[0].outputs] == [(1, 1), (2, 1), (3, 0)]
    assert all(o.logprobs is not None and len(o.logprobs[0].top_token_ids) == 2
               for r in results for o in r.outputs if o.seq_id == 2)
    for seq in planner.sequences:
        assert len(seq.output_ids) == MAX_NEW_TOKENS or seq.output_ids[-1] == EOS
    assert reference.sequences.keys() == {1, 2, 3}  # the reference never heard they finished


async def test_greedy_output_is_what_the_runner_gives_alone(stub, tokenizer: TextTokenizer) -> None:
    # Whole-run comparison: the service's tokens equal a fresh runner's for one greedy prompt.
    prompt = tokenizer.encode("Lily saw a big red ball")
    local = HandPlanner([ScriptedSequence(4, prompt, SamplingParams(temperature=0.0))])
    runner = reference_runner()
    while not local.finished:
        plan = local.next_plan()
        local.update(plan, runner.execute(plan))
    remote = HandPlanner([ScriptedSequence(4, prompt, SamplingParams(temperature=0.0))])
    session = StreamSession(stub.Step)
    while not remote.finished:
        plan = remote.next_plan()
        remote.update(plan, result_from_proto(await session.exchange(plan_to_proto(plan))))
    assert await session.close() == grpc.StatusCode.OK
    assert remote.sequences[0].output_ids == local.sequences[0].output_ids
    assert len(remote.sequences[0].output_ids) == MAX_NEW_TOKENS or remote.sequences[0].output_ids[-1] == EOS


def new_sequence_request(step_id: int, seq_id: int, prompt: list[int], blocks: list[int]) -> executor_pb2.StepRequest:
    plan = StepPlan(step_id, new=[NewSequence(seq_id, prompt, len(prompt), 0, len(prompt), blocks,
                                              SamplingParams(temperature=0.0))])
    return plan_to_proto(plan)


def decode_request(step_id: int, seq_id: int, new_blocks: list[int] = ()) -> executor_pb2.StepRequest:
    return plan_to_proto(StepPlan(step_id, running=[RunningSequence(seq_id, 1, list(new_blocks))]))


PROMPT = [1, 403, 407, 261, 378]  # "Once upon a time"
GREEDY = SamplingParams(temperature=0.0)


@pytest.mark.parametrize(
    ("request_message", "details"),
    [
        (decode_request(1, 99), "step 1 continues unknown sequence 99"),
        (new_sequence_request(1, 5, list(range(3, 23)), [0]), "new[0].block_ids has 1 blocks; 20 tokens need 3"),
        # Block ids index the pool inside kernels: one outside it is refused before any kernel runs.
        (new_sequence_request(1, 5, PROMPT, [NUM_BLOCKS]),
         f"new[0].block_ids[0] = {NUM_BLOCKS} is outside the KV pool of {NUM_BLOCKS} blocks"),
        (new_sequence_request(1, 5, PROMPT, [-1]), f"new[0].block_ids[0] = -1 is outside the KV pool of {NUM_BLOCKS} blocks"),
        (decode_request(1, 5, [NUM_BLOCKS + 3]),
         f"running[0].new_block_ids[0] = {NUM_BLOCKS + 3} is outside the KV pool of {NUM_BLOCKS} blocks"),
        # Everything else a new sequence names is checked too, before the plan reaches the worker.
        (new_sequence_request(1, 5, [1, 512, 7], [0]), "new[0].token_ids[1] = 512 is outside the vocabulary [0, 512)"),
        (plan_to_proto(StepPlan(1, new=[NewSequence(5, PROMPT, len(PROMPT), len(PROMPT), 1, [0], GREEDY)])),
         f"new[0].num_computed_tokens {len(PROMPT)} must be in [0, {len(PROMPT)}): at least the last known token is "
         "computed by the step"),
        (plan_to_proto(StepPlan(1, new=[NewSequence(5, PROMPT, 0, 0, len(PROMPT), [0], GREEDY)])),
         f"new[0].prompt_len 0 must be in [1, {len(PROMPT)}] (its known tokens)"),
        (plan_to_proto(StepPlan(1, new=[NewSequence(5, list(range(3, 23)), 20, 0, 20, [4, 9, 4], GREEDY)])),
         "new[0].block_ids names a block twice: [4, 9, 4]"),
        (plan_to_proto(StepPlan(1, new=[NewSequence(5, PROMPT, len(PROMPT), 0, len(PROMPT), [0],
                                                    SamplingParams(temperature=0.0, top_p=0.0))])),
         "new[0].sampling: top_p must be in (0, 1], got 0.0"),
        (executor_pb2.StepRequest(step_id=1, running_seq_ids=[5]),
         "running_num_scheduled_tokens has 0 entries; expected 1 (one per sequence)"),
    ],
)
async def test_invalid_plan_ends_the_stream_with_invalid_argument(stub, request_message, details: str) -> None:
    session = StreamSession(stub.Step)
    got = await expect_status(session.exchange(request_message), grpc.StatusCode.INVALID_ARGUMENT)
    assert got == details


async def test_one_session_at_a_time_and_each_starts_clean(stub) -> None:
    first = StreamSession(stub.Step)
    reply = await first.exchange(new_sequence_request(1, 7, PROMPT, [0]))
    assert list(reply.seq_ids) == [7] and len(reply.token_ids) == 1

    second = StreamSession(stub.Step)
    details = await expect_status(second.exchange(decode_request(1, 7)), grpc.StatusCode.FAILED_PRECONDITION)
    assert details == ("another Step stream (session %d) is driving this executor; it serves one scheduler at a time, "
                       "so close that stream first" % _session_number(details))
    # The refused stream did not disturb the running one.
    reply = await first.exchange(decode_request(2, 7))
    assert list(reply.seq_ids) == [7] and len(reply.token_ids) == 1
    assert await first.close() == grpc.StatusCode.OK

    # The next session starts clean: sequence 7 is unknown, and its id is free for a new one.
    third = StreamSession(stub.Step)
    details = await expect_status(third.exchange(decode_request(1, 7)), grpc.StatusCode.INVALID_ARGUMENT)
    assert details == "step 1 continues unknown sequence 7"
    fourth = StreamSession(stub.Step)
    reply = await fourth.exchange(new_sequence_request(1, 7, PROMPT, [0]))
    assert list(reply.seq_ids) == [7]
    assert await fourth.close() == grpc.StatusCode.OK


def _session_number(details: str) -> int:
    return int(details.split("(session ")[1].split(")")[0])


async def test_a_cancelled_session_is_dropped(stub) -> None:
    session = StreamSession(stub.Step)
    await session.exchange(new_sequence_request(1, 8, PROMPT, [0]))
    session.call.cancel()
    # The server learns of the cancellation asynchronously; a new session gets in shortly after.
    deadline = time.monotonic() + 5
    while True:
        retry = StreamSession(stub.Step)
        try:
            details = await expect_status(retry.exchange(decode_request(1, 8)), grpc.StatusCode.INVALID_ARGUMENT)
            break
        except AssertionError:
            assert time.monotonic() < deadline, "the cancelled session still holds the executor"
            await asyncio.sleep(0.05)
    assert details == "step 1 continues unknown sequence 8"


# --- the worker thread keeps the server responsive -----------------------------------------------


class BlockingRunner:
    """Stands in for ModelRunner: each step waits until the test releases it."""

    def __init__(self) -> None:
        self.sequences: dict = {}
        self.entered = threading.Event()
        self.release = threading.Event()

    def info(self) -> ExecutorInfo:
        return ExecutorInfo(4, 16, 64, 512, "float32", "cpu", "torch", "fake", "LlamaForCausalLM", None, (2,))

    def execute(self, plan: StepPlan) -> StepResult:
        self.entered.set()
        assert self.release.wait(10)
        return StepResult(plan.step_id, [SequenceOutput(seq.seq_id, [9]) for seq in plan.new])


async def test_info_and_health_answer_while_a_step_runs() -> None:
    worker = ThreadPoolExecutor(max_workers=1)
    runner = BlockingRunner()
    loop = asyncio.get_running_loop()
    loading = ExecutorServicer(worker, loop.create_future())  # never resolved: still loading its model
    loaded = loop.create_future()
    loaded.set_result(runner)

    def add(servicer: ExecutorServicer):
        def register(server: grpc.aio.Server) -> list[str]:
            executor_pb2_grpc.add_ExecutorServicer_to_server(servicer, server)
            return [SERVICE]
        return register

    running = await start_server("executor", add(ExecutorServicer(worker, loaded)), port=0)
    still_loading = await start_server("executor", add(loading), port=0)
    try:
        async with create_channel(running.address) as channel, create_channel(still_loading.address) as other:
            details = await expect_status(
                executor_pb2_grpc.ExecutorStub(other).GetExecutorInfo(executor_pb2.GetExecutorInfoRequest(), timeout=5),
                grpc.StatusCode.UNAVAILABLE,
            )
            assert details.startswith("the executor is still loading its model")
            stub = executor_pb2_grpc.ExecutorStub(channel)
            session = StreamSession(stub.Step)
            step = asyncio.ensure_future(session.exchange(new_sequence_request(1, 1, PROMPT, [0])))
            assert await asyncio.to_thread(runner.entered.wait, 10)
            info = await stub.GetExecutorInfo(executor_pb2.GetExecutorInfoRequest(), timeout=2)
            assert info.model_path == "fake" and not info.HasField("bos_token_id")
            assert await health_status(channel) == SERVING
            assert not step.done()
            runner.release.set()
            reply = await asyncio.wait_for(step, 10)
            assert list(reply.seq_ids) == [1] and list(reply.token_ids) == [9]
            assert await session.close() == grpc.StatusCode.OK
    finally:
        runner.release.set()
        await running.stop(grace=0)
        await still_loading.stop(grace=0)
        worker.shutdown(wait=True)


async def test_service_config_carries_every_engine_field() -> None:
    config = parse_config(
        ExecutorServiceConfig, ["--num-blocks", "8", "--port", "0"],
        env={"TOKENMILL_EXECUTOR_DTYPE": "bf16", "TOKENMILL_MODEL": "/models/x", "TOKENMILL_EXECUTOR_SEED": "3"},
    )
    assert config.port == 0
    assert config.executor == ExecutorConfig(model="/models/x", dtype="bf16", num_blocks=8, seed=3)
    assert parse_config(ExecutorServiceConfig, [], env={}).executor == ExecutorConfig(model=str(STORIES_DIR))


async def test_forward_path_flags_keep_their_names_and_variables() -> None:
    argv = ["--compile", "--cuda-graph-max-batch-size", "8", "--cpu-fused-max-tokens", "0"]
    env = {"TOKENMILL_EXECUTOR_CPU_DECODE": "eager", "TOKENMILL_EXECUTOR_PADDED_DECODE_ON_CPU": "1",
           "TOKENMILL_EXECUTOR_ENFORCE_EAGER": "true"}
    config = parse_config(ExecutorServiceConfig, argv, env=env).executor
    assert config.compiled_decode == CompiledDecodeSettings(compile=True)
    assert config.decode_graphs == DecodeGraphSettings(enforce_eager=True, cuda_graph_max_batch_size=8,
                                                       padded_decode_on_cpu=True)
    assert config.fused_decode == FusedDecodeSettings(cpu_decode="eager", cpu_fused_max_tokens=0)
    # A launcher hands the settings to a child process as the same flags.
    service = ExecutorServiceConfig(executor=config)
    assert parse_config(ExecutorServiceConfig, to_argv(service, only_changed=False), env={}) == service
