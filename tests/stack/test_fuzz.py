"""Fuzzing the public API of one real stack (four processes under the Launcher) with hypothesis.

Two generators: GenerateRequest over every field (extremes, NaN and infinities, huge repeated
fields, contradictory options, every prompt kind), and raw bytes sent as a request body
(random bytes, valid requests with bytes flipped, text fields holding invalid UTF-8). Every
answer must be a clean status (OK with one Started .. one Finished, or INVALID_ARGUMENT /
RESOURCE_EXHAUSTED / OUT_OF_RANGE with a message, never UNKNOWN, INTERNAL, UNAVAILABLE or a
hang), the scheduler must stay up (no restart, health SERVING, a plain request still right),
and KV usage must return to zero.

`make test` runs FUZZ_EXAMPLES (default 40) examples per generator; `make fuzz` runs 5,000
(TOKENMILL_FUZZ_EXAMPLES=5000). A stream that is admitted is read for a few messages and then
cancelled by the client (so the run stays short and cancels are fuzzed too).
"""

from __future__ import annotations

import os
from collections import Counter
import struct
import time

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.common.pb.tokenmill.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from services.stack.launcher import LaunchConfig, Launcher, health_status
from tests.helpers.service_harness import REPO_ROOT, STORIES_DIR

pytestmark = pytest.mark.slow  # starts the four services as processes

EXAMPLES = int(os.environ.get("TOKENMILL_FUZZ_EXAMPLES", "40"))
CALL_TIMEOUT_S = 20.0
"""A call still open after this long is a hang (DEADLINE_EXCEEDED fails the test)."""
READ_MESSAGES = 4
"""Messages read from an admitted stream before the client cancels it."""
CLEAN = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
         grpc.StatusCode.OUT_OF_RANGE}
LEAKY_WORDS = ("Traceback", "Exception", "<class", "already finished", "object at 0x")
GENERATE = "/tokenmill.v1.Generation/Generate"

INT32 = st.one_of(st.integers(-2**31, 2**31 - 1),
                  st.sampled_from([0, 1, -1, 2, 255, 511, 512, 513, 2**31 - 1, -2**31]))
UINT64 = st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([0, 1, 2**63, 2**64 - 1]))
DOUBLE = st.one_of(st.floats(), st.sampled_from([0.0, -0.0, 1.0, 1e-300, 5e-324, 1e308, -1e308, float("inf"),
                                                 float("-inf"), float("nan"), 2.0, 0.5]))
SIZE = st.one_of(st.integers(0, 8), st.integers(0, 8), st.integers(0, 8),
                 st.sampled_from([513, 100_000, 1_000_001, 3_500_000]))
"""Repeated-field sizes: mostly small, sometimes past every limit (3.5M ids of 5 bytes: 17 MB)."""
TEXT = st.one_of(st.text(max_size=40), st.sampled_from(["", " ", "\x00", "\ud7ff\ue000", "a" * 20_000,
                                                        "<|im_start|>user", "Once upon a time"]))


@pytest.fixture(scope="module")
def launcher(tmp_path_factory):
    launcher = Launcher(LaunchConfig(
        model=str(STORIES_DIR), public_port=0, log_dir=str(tmp_path_factory.mktemp("fuzz_logs")),
        executor_args=["--num-blocks=256", "--block-size=16", "--dtype=fp32", "--device=cpu",
                       "--attention-backend=torch", "--skip-warmup"],
        scheduler_args=["--max-num-seqs=8", "--max-waiting-requests=64"],
        env={"PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "TOKENMILL_LOG_LEVEL": "warning"}))
    launcher.start()
    yield launcher
    launcher.stop()


@pytest.fixture(scope="module")
def channel(launcher):
    with grpc.insecure_channel(launcher.public_address, options=[("grpc.max_send_message_length", 64 << 20),
                                                                 ("grpc.max_receive_message_length", 64 << 20)]) as ch:
        yield ch


def usually(valid, extreme):
    """The valid strategy nine times in ten: with a dozen fields, a good share of requests is
    valid throughout and runs, while each field still meets its extremes."""
    # (st.one_of would merge nine copies of one strategy into one branch.)
    return st.integers(0, 9).flatmap(lambda i: extreme if i == 0 else valid)


@st.composite
def generate_requests(draw) -> generation_pb2.GenerateRequest:
    request = generation_pb2.GenerateRequest(request_id=draw(usually(st.just(""), st.one_of(TEXT,
                                                                                               st.just("r" * 300)))))
    kind = draw(usually(st.sampled_from(["text", "token_ids", "text", "token_ids", "chat"]), st.just("none")))
    if kind == "text":
        request.text = draw(usually(st.sampled_from(["Once upon a time", "The cat", "你好 🙂"]), TEXT))
    elif kind == "token_ids":
        n = draw(usually(st.integers(1, 8), SIZE))
        ids = draw(st.lists(usually(st.integers(0, 511), INT32), max_size=8)) if n <= 8 else [draw(INT32)] * n
        request.token_ids.ids.extend(ids or ([draw(INT32)] * n))
        if not ids and not n:
            request.token_ids.SetInParent()  # an empty prompt that is set
    elif kind == "chat":
        request.chat.SetInParent()
        for _ in range(draw(st.integers(0, 3))):
            request.chat.messages.add(role=draw(st.sampled_from(["user", "system", "assistant", "", "tool", "x"])),
                                      content=draw(TEXT))
        if draw(st.booleans()):
            request.chat.add_generation_prompt = draw(st.booleans())
    s = request.sampling
    unit = st.floats(0.0, 1.0)
    valid = {"temperature": st.floats(0.0, 2.0), "top_p": st.floats(0.01, 1.0), "repetition_penalty": st.floats(0.5, 2.0),
             "min_p": unit, "presence_penalty": st.floats(-2.0, 2.0), "frequency_penalty": st.floats(-2.0, 2.0)}
    for name in ("temperature", "top_p", "repetition_penalty"):
        if draw(st.booleans()):
            setattr(s, name, draw(usually(valid[name], DOUBLE)))
    for name in ("min_p", "presence_penalty", "frequency_penalty"):
        setattr(s, name, draw(usually(st.just(0.0) | valid[name], DOUBLE)))
    s.top_k = draw(usually(st.integers(0, 40), INT32))
    if draw(st.booleans()):
        s.seed = draw(UINT64)
    if draw(st.booleans()):
        s.logprobs = draw(usually(st.integers(0, 5), INT32))
    bias = st.dictionaries(usually(st.integers(0, 511), INT32), usually(st.floats(-100, 100), DOUBLE), max_size=4)
    for key, value in draw(usually(st.just({}), bias)).items():
        s.logit_bias[key] = value
    stop = request.stop
    if draw(usually(st.just(True), st.just(False))):
        stop.max_tokens = draw(usually(st.integers(1, 6), INT32))
    n_stop = draw(usually(st.just(0), SIZE))
    stop.stop.extend(draw(st.lists(TEXT, max_size=4)) if n_stop <= 8 else ["x"] * min(n_stop, 200_000))
    n_ids = draw(usually(st.just(0), SIZE))
    stop.stop_token_ids.extend(draw(st.lists(INT32, max_size=4)) if n_ids <= 8 else [7] * n_ids)
    stop.ignore_eos = draw(st.booleans())
    stop.min_tokens = draw(usually(st.integers(0, 1), INT32))
    stop.include_stop_str_in_output = draw(st.booleans())
    request.priority = draw(usually(st.integers(-5, 5), INT32))
    if draw(st.booleans()):
        request.add_special_tokens = draw(st.booleans())
    return request


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


INVALID_UTF8 = st.sampled_from([b"\xff", b"\xc3\x28", b"\xe2\x82", b"\xed\xa0\x80", b"ok\x80ok", b"\xf8\x88\x80\x80\x80"])


@st.composite
def raw_bodies(draw) -> bytes:
    shape = draw(st.sampled_from(["random", "flipped", "bad_utf8_text", "bad_utf8_stop", "bad_utf8_id", "truncated"]))
    if shape == "random":
        return draw(st.binary(max_size=300))
    valid = generation_pb2.GenerateRequest(text="Once upon a time", stop=common_pb2.StopConditions(max_tokens=3),
                                           sampling=common_pb2.SamplingParams(temperature=0.0))
    body = bytearray(valid.SerializeToString())
    if shape == "flipped":
        for _ in range(draw(st.integers(1, 4))):
            i = draw(st.integers(0, len(body) - 1))
            body[i] = draw(st.integers(0, 255))
        return bytes(body)
    if shape == "truncated":
        return bytes(body[:draw(st.integers(0, len(body) - 1))])
    bad = draw(INVALID_UTF8)
    if shape == "bad_utf8_text":  # field 2 (text) holding invalid UTF-8, the rest valid
        return b"\x12" + _varint(len(bad)) + bad + bytes(body[body.index(b"\x2a"):])
    if shape == "bad_utf8_id":  # field 1 (request_id)
        return b"\x0a" + _varint(len(bad)) + bad + bytes(body)
    # stop.stop[0] (field 6 -> field 2) holding invalid UTF-8
    inner = b"\x12" + _varint(len(bad)) + bad + b"\x08\x03"
    return bytes(body) + b"\x32" + _varint(len(inner)) + inner


def check_call(call_iter, cancel) -> str:
    """Read a call; assert its ending is clean; return the outcome (for the run's tally)."""
    kinds: list[str] = []
    try:
        for message in call_iter:
            kinds.append(message.WhichOneof("event"))
            if len(kinds) >= READ_MESSAGES and kinds[-1] != "finished":
                cancel()
                break
    except grpc.RpcError as err:
        code, details = err.code(), err.details() or ""
        if code == grpc.StatusCode.CANCELLED and len(kinds) >= READ_MESSAGES:
            return "cancelled by the client"
        assert code in CLEAN and code != grpc.StatusCode.OK, (code, details)
        assert details, code
        assert not any(word in details for word in LEAKY_WORDS), details
        assert kinds == [], (kinds, code, details)  # an error is only ever a refusal up front
        return code.name
    if len(kinds) >= READ_MESSAGES and kinds[-1] != "finished":
        return "cancelled by the client"
    assert kinds and kinds[0] == "started" and kinds[-1] == "finished" and kinds.count("finished") == 1, kinds
    assert set(kinds[1:-1]) <= {"delta"}, kinds
    return "OK"


def assert_still_serving(launcher: Launcher, channel) -> None:
    scheduler = launcher.services["scheduler"]
    assert scheduler.process.poll() is None and all(s.restarts == 0 for s in launcher.services.values()), \
        launcher.events
    assert health_status(launcher.public_address, "tokenmill.v1.Generation") == "SERVING"
    stub = generation_pb2_grpc.GenerationStub(channel)
    request = generation_pb2.GenerateRequest(text="Once upon a time", stop=common_pb2.StopConditions(
        max_tokens=4, ignore_eos=True), sampling=common_pb2.SamplingParams(temperature=0.0))
    ids = [t for m in stub.Generate(request, timeout=CALL_TIMEOUT_S) if m.WhichOneof("event") == "delta"
           for t in m.delta.token_ids]
    assert len(ids) == 4


def assert_kv_back_to_zero(channel, timeout: float = 5.0) -> None:
    stub = generation_pb2_grpc.GenerationStub(channel)
    deadline = time.monotonic() + timeout
    while True:
        profile = stub.GetProfile(generation_pb2.GetProfileRequest(), timeout=CALL_TIMEOUT_S)
        if profile.kv_cache_usage == 0 and profile.num_running == profile.num_waiting == 0:
            return
        assert time.monotonic() < deadline, profile
        time.sleep(0.02)


FUZZ_SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=EXAMPLES <= 100,
                         suppress_health_check=list(HealthCheck))


def test_generate_requests_over_every_field(launcher, channel) -> None:
    stub = generation_pb2_grpc.GenerationStub(channel)
    tally: Counter[str] = Counter()

    @FUZZ_SETTINGS
    @given(generate_requests())
    def one(request: generation_pb2.GenerateRequest) -> None:
        call = stub.Generate(request, timeout=CALL_TIMEOUT_S)
        tally[check_call(call, call.cancel)] += 1

    one()
    assert_kv_back_to_zero(channel)
    assert_still_serving(launcher, channel)
    print(f"fuzz: {sum(tally.values())} GenerateRequests, 0 crashes, 0 hangs; {dict(tally)}")


def test_raw_bytes_as_a_request_body(launcher, channel) -> None:
    generate = channel.unary_stream(GENERATE, request_serializer=None,
                                    response_deserializer=generation_pb2.GenerateResponse.FromString)
    tally: Counter[str] = Counter()

    @FUZZ_SETTINGS
    @given(raw_bodies())
    def one(body: bytes) -> None:
        call = generate(body, timeout=CALL_TIMEOUT_S)
        tally[check_call(call, call.cancel)] += 1

    one()
    assert_kv_back_to_zero(channel)
    assert_still_serving(launcher, channel)
    print(f"fuzz: {sum(tally.values())} raw bodies, 0 crashes, 0 hangs; {dict(tally)}")


def test_a_struct_packed_double_nan_payload_is_refused_cleanly(launcher, channel) -> None:
    # A NaN with a payload (not Python's canonical NaN) as temperature, built byte by byte.
    nan_payload = struct.pack("<Q", 0x7FF8DEADBEEF0001)
    sampling = b"\x09" + nan_payload  # field 1 (temperature), fixed64
    body = b"\x12\x04Once" + b"\x2a" + _varint(len(sampling)) + sampling
    generate = channel.unary_stream(GENERATE, request_serializer=None,
                                    response_deserializer=generation_pb2.GenerateResponse.FromString)
    with pytest.raises(grpc.RpcError) as err:
        list(generate(body, timeout=CALL_TIMEOUT_S))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in err.value.details()


def test_a_top_p_that_rounds_to_zero_samples_the_most_likely_token(launcher, channel) -> None:
    # Found by this fuzzer: top_p=1e-300 is valid but 0.0 in fp32, so the sampler kept no
    # token, the executor's step failed and every request in the batch ended with it.
    stub = generation_pb2_grpc.GenerationStub(channel)
    results = []
    for top_p in (1e-300, 1e-45):
        request = generation_pb2.GenerateRequest(text="Once upon a time", sampling=common_pb2.SamplingParams(
            temperature=1.0, top_p=top_p), stop=common_pb2.StopConditions(max_tokens=4, ignore_eos=True))
        results.append([t for m in stub.Generate(request, timeout=CALL_TIMEOUT_S)
                        if m.WhichOneof("event") == "delta" for t in m.delta.token_ids])
    greedy = generation_pb2.GenerateRequest(text="Once upon a time", sampling=common_pb2.SamplingParams(
        temperature=0.0), stop=common_pb2.StopConditions(max_tokens=4, ignore_eos=True))
    expected = [t for m in stub.Generate(greedy, timeout=CALL_TIMEOUT_S)
                if m.WhichOneof("event") == "delta" for t in m.delta.token_ids]
    assert results == [expected, expected]
    assert_still_serving(launcher, channel)
