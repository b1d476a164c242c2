"""The tokenizer service's Detokenize stream: streamed text equals the full decode (hypothesis).

The same property as tests/tokenizer/test_detokenizer_properties.py, through the real RPC: a
`python -m services.tokenizer` process on port 0, driven over one bidi Detokenize call on a
synchronous gRPC channel (hypothesis drives plain functions, not coroutines). Every example
opens a few interleaved streams with fresh ids (prompt, output, chunk sizes, skip_special_tokens),
feeds their chunks message by message, closes each in the message carrying its last tokens, and
compares the deltas with decode(prompt + output) minus decode(prompt), as the service decodes an
output as its prompt's continuation.
"""

from __future__ import annotations

import itertools
import os
import queue
import subprocess
import sys
import time
from collections.abc import Iterator

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.pb.tokenmill.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from services.common.server import channel_options
from services.common.service_config import read_port_file
from services.tokenizer.text_tokenizer import TextTokenizer
from tests.helpers.service_harness import REPO_ROOT, STORIES_DIR
from tests.helpers.stories_token_ids import DETERMINISTIC, chunk_sizes, chunked, continuation, output_ids, prompt_ids

# slow: a tokenizer process and 120 examples over its stream
pytestmark = pytest.mark.slow

REFERENCE = TextTokenizer.from_dir(STORIES_DIR)
START_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def address(tmp_path_factory) -> Iterator[str]:
    run_dir = tmp_path_factory.mktemp("tokenizer_service")
    port_file, log_file = run_dir / "tokenizer.port", run_dir / "tokenizer.log"
    command = [sys.executable, "-m", "services.tokenizer", "--port", "0", "--port-file", str(port_file),
               "--model", str(STORIES_DIR), "--allow-unauthenticated"]  # fmt: skip
    with log_file.open("wb") as log:
        process = subprocess.Popen(
            command, cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
            stdout=subprocess.DEVNULL, stderr=log,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while (port := read_port_file(port_file)) is None:
            if process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"tokenizer service did not start:\n{log_file.read_text(errors='replace')}")
            time.sleep(0.05)
        yield f"127.0.0.1:{port}"
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class DetokenizeCall:
    """One bidi Detokenize call, driven synchronously: each request gets its one response."""

    def __init__(self, channel: grpc.Channel) -> None:
        self._requests: queue.Queue = queue.Queue()
        self._responses = tokenizer_pb2_grpc.TokenizerStub(channel).Detokenize(
            iter(self._requests.get, None), timeout=300
        )
        self._step = itertools.count(1)
        self.stream_ids = itertools.count(1)

    def exchange(self, **fields) -> tokenizer_pb2.DetokenizeResponse:
        step_id = next(self._step)
        self._requests.put(tokenizer_pb2.DetokenizeRequest(step_id=step_id, **fields))
        reply = next(self._responses)
        assert reply.step_id == step_id
        return reply

    def close(self) -> grpc.StatusCode:
        self._requests.put(None)
        assert list(self._responses) == []
        return self._responses.code()


@pytest.fixture(scope="module")
def call(address: str) -> Iterator[DetokenizeCall]:
    with grpc.insecure_channel(address, options=channel_options()) as channel:
        grpc.channel_ready_future(channel).result(timeout=START_TIMEOUT_S)
        detokenize = DetokenizeCall(channel)
        yield detokenize
        assert detokenize.close() == grpc.StatusCode.OK


stream_scripts = st.lists(
    st.tuples(prompt_ids(), output_ids(), chunk_sizes, st.booleans()), min_size=1, max_size=3
)


@settings(DETERMINISTIC, max_examples=120)
@given(scripts=stream_scripts)
def test_detokenize_stream_adds_up_to_the_full_decode(call: DetokenizeCall, scripts) -> None:
    streams = []
    for prompt, output, sizes, skip_special in scripts:
        streams.append({
            "id": next(call.stream_ids), "prompt": prompt, "chunks": chunked(output, sizes), "skip": skip_special,
            "text": "", "expected": continuation(
                lambda ids, skip=skip_special: REFERENCE.decode(ids, skip_special_tokens=skip), prompt, output),
        })  # fmt: skip
    new_streams = [
        tokenizer_pb2.DetokenizeStream(stream_id=s["id"], prompt_token_ids=s["prompt"], skip_special_tokens=s["skip"])
        for s in streams
    ]
    for step in itertools.count():
        sending = [s for s in streams if step < len(s["chunks"])]
        # A stream without output is closed in the first message, with no tokens.
        closed = [s["id"] for s in streams if len(s["chunks"]) == step + 1 or (step == 0 and not s["chunks"])]
        if not sending and not closed:
            break
        reply = call.exchange(
            new_streams=new_streams if step == 0 else [],
            stream_ids=[s["id"] for s in sending],
            token_counts=[len(s["chunks"][step]) for s in sending],
            token_ids=[token for s in sending for token in s["chunks"][step]],
            closed_stream_ids=closed,
        )
        assert list(reply.stream_ids) == [s["id"] for s in sending]
        for s, delta in zip(sending, reply.text_deltas):
            s["text"] += delta
            if s["expected"] is not None:
                assert s["expected"].startswith(s["text"]), s
    for s in streams:
        # Undefined for a prompt ending in an unfinished byte run (see stories_token_ids.continuation).
        if s["expected"] is not None:
            assert s["text"] == s["expected"], s
