"""The tokenizer service over loopback: parity with TextTokenizer, Detokenize streams, limits, process."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
import sentencepiece

from services.common.pb.tokenmill.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from services.common.server import RunningServer, create_channel
from services.tokenizer.chat_template import MAX_MESSAGES
from services.tokenizer.text_tokenizer import TextTokenizer
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.main import serve
from services.tokenizer.text_service import MAX_TEXT_BYTES
from tests.helpers.service_harness import (
    SERVING,
    STORIES_DIR,
    StreamSession,
    expect_status,
    health_status,
    launch_module,
    reflected_services,
    standard_services,
    wait_for_port_file,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

SERVICE = "tokenmill.v1.Tokenizer"
TEXTS = [
    "Once upon a time, the cat sat on the mat.",
    "The word 日本語 means Japan, 中文 means Chinese.",
    "Tom saw 😀 and 🎉 and waved 👋🏽 bye.",
    "  leading spaces,\ttabs\nand newlines  ",
    "",
]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


@pytest.fixture(scope="module")
def reference() -> TextTokenizer:
    return TextTokenizer.from_dir(STORIES_DIR)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def server() -> AsyncIterator[RunningServer]:
    running = await serve(TokenizerConfig(port=0, model=str(STORIES_DIR)))
    yield running
    await running.stop(grace=0)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stub(server: RunningServer) -> AsyncIterator[tokenizer_pb2_grpc.TokenizerStub]:
    async with create_channel(server.address) as channel:
        yield tokenizer_pb2_grpc.TokenizerStub(channel)


# --- unary calls -----------------------------------------------------------------------------


async def test_health_reflection_and_info(server: RunningServer, stub, reference: TextTokenizer) -> None:
    async with create_channel(server.address) as channel:
        assert await health_status(channel) == SERVING
        assert await health_status(channel, SERVICE) == SERVING
        assert await reflected_services(channel) == standard_services(SERVICE)
    info = await stub.GetTokenizerInfo(tokenizer_pb2.GetTokenizerInfoRequest(), timeout=10)
    assert info.tokenizer_path == str(STORIES_DIR)
    assert info.vocab_size == 512
    assert list(info.eos_token_ids) == [2, 1]  # EOS, and BOS: llama2.c stories end at BOS
    assert info.HasField("bos_token_id") and info.bos_token_id == 1
    assert not info.HasField("pad_token_id")  # stories260K declares no pad token
    assert info.has_chat_template is False


@pytest.mark.parametrize("text", TEXTS)
async def test_encode_and_decode_match_text_tokenizer(stub, reference: TextTokenizer, text: str) -> None:
    default = await stub.Encode(tokenizer_pb2.EncodeRequest(text=text), timeout=10)
    with_bos = await stub.Encode(tokenizer_pb2.EncodeRequest(text=text, add_special_tokens=True), timeout=10)
    without = await stub.Encode(tokenizer_pb2.EncodeRequest(text=text, add_special_tokens=False), timeout=10)
    assert list(default.token_ids) == list(with_bos.token_ids) == reference.encode(text)
    assert list(without.token_ids) == reference.encode(text, add_special_tokens=False)
    assert default.token_ids[0] == 1  # absent add_special_tokens means true: BOS first

    ids = reference.encode(text) + [2]
    skipped = await stub.Decode(tokenizer_pb2.DecodeRequest(token_ids=ids, skip_special_tokens=True), timeout=10)
    kept = await stub.Decode(tokenizer_pb2.DecodeRequest(token_ids=ids), timeout=10)
    assert skipped.text == reference.decode(ids, skip_special_tokens=True)
    assert kept.text == reference.decode(ids, skip_special_tokens=False)
    assert kept.text.endswith("</s>") and not skipped.text.endswith("</s>")


async def test_special_token_text_in_prompts_stays_text(stub, reference: TextTokenizer) -> None:
    # sentencepiece, the model's own tokenizer, never reads the characters "<s>" as BOS.
    processor = sentencepiece.SentencePieceProcessor(model_file=str(STORIES_DIR / "tokenizer.model"))
    text = "hello <s> world </s> end"
    reply = await stub.Encode(tokenizer_pb2.EncodeRequest(text=text, add_special_tokens=False), timeout=10)
    assert list(reply.token_ids) == processor.encode(text)
    assert 1 not in reply.token_ids and 2 not in reply.token_ids
    assert 1 in reference.encode(text, add_special_tokens=False)  # the plain TextTokenizer does match them
    with_bos = await stub.Encode(tokenizer_pb2.EncodeRequest(text=text), timeout=10)
    assert list(with_bos.token_ids) == [1, *processor.encode(text)]


async def test_limits_give_invalid_argument_naming_the_field(stub) -> None:
    details = await expect_status(
        stub.Encode(tokenizer_pb2.EncodeRequest(text="a" * (MAX_TEXT_BYTES + 1)), timeout=10),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    assert details == f"text is {MAX_TEXT_BYTES + 1} bytes of UTF-8; the limit MAX_TEXT_BYTES is {MAX_TEXT_BYTES}"
    # The limit counts bytes, not characters: 2-byte characters reach it at half the length.
    details = await expect_status(
        stub.Encode(tokenizer_pb2.EncodeRequest(text="é" * (MAX_TEXT_BYTES // 2 + 1)), timeout=10),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    assert details.startswith(f"text is {MAX_TEXT_BYTES + 2} bytes")
    details = await expect_status(
        stub.Decode(tokenizer_pb2.DecodeRequest(token_ids=[5, 512]), timeout=10), grpc.StatusCode.INVALID_ARGUMENT
    )
    assert details == "token_ids holds 512, outside the vocabulary [0, 512)"


async def test_messages_beyond_max_message_bytes_are_refused_before_parsing() -> None:
    running = await serve(TokenizerConfig(port=0, model=str(STORIES_DIR), max_message_bytes=4096))
    try:
        async with create_channel(running.address) as channel:
            stub = tokenizer_pb2_grpc.TokenizerStub(channel)
            assert (await stub.Encode(tokenizer_pb2.EncodeRequest(text="Once upon a time"), timeout=10)).token_ids
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await stub.Encode(tokenizer_pb2.EncodeRequest(text="a" * 5000), timeout=10)
            assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert error.value.details() == "SERVER: Received message larger than max (5003 vs. 4096)"
    finally:
        await running.stop(grace=0)


async def test_reflection_can_be_turned_off() -> None:
    running = await serve(TokenizerConfig(port=0, model=str(STORIES_DIR), reflection=False))
    try:
        async with create_channel(running.address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await reflected_services(channel)
            assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED
            assert await health_status(channel) == SERVING  # health stays
    finally:
        await running.stop(grace=0)


async def test_render_chat_without_a_template_is_a_failed_precondition(stub) -> None:
    request = tokenizer_pb2.RenderChatRequest(messages=[common_pb2.ChatMessage(role="user", content="hi")])
    details = await expect_status(stub.RenderChat(request, timeout=10), grpc.StatusCode.FAILED_PRECONDITION)
    assert "has no chat template" in details and "send a plain prompt" in details


async def test_render_chat_with_a_template(tmp_path: Path, reference: TextTokenizer) -> None:
    model_dir = tmp_path / "chat-model"
    model_dir.mkdir()
    shutil.copy(STORIES_DIR / "tokenizer.json", model_dir / "tokenizer.json")
    config = json.loads((STORIES_DIR / "tokenizer_config.json").read_text())
    (model_dir / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    running = await serve(TokenizerConfig(port=0, model=str(model_dir)))
    try:
        async with create_channel(running.address) as channel:
            stub = tokenizer_pb2_grpc.TokenizerStub(channel)
            info = await stub.GetTokenizerInfo(tokenizer_pb2.GetTokenizerInfoRequest(), timeout=10)
            assert info.has_chat_template is True
            messages = [common_pb2.ChatMessage(role="user", content="Hi"),
                        common_pb2.ChatMessage(role="bot", content="Yo")]
            reply = await stub.RenderChat(tokenizer_pb2.RenderChatRequest(messages=messages), timeout=10)
            assert reply.text == "<s>[user] Hi</s>[bot] Yo</s>[assistant]"
            # The template's special-token text becomes the special ids; no second BOS is added.
            assert list(reply.token_ids) == reference.encode(reply.text, add_special_tokens=False)
            assert list(reply.token_ids).count(1) == 1 and reply.token_ids[0] == 1
            assert list(reply.token_ids).count(2) == 2
            no_cue = await stub.RenderChat(
                tokenizer_pb2.RenderChatRequest(messages=messages, add_generation_prompt=False), timeout=10
            )
            assert no_cue.text == "<s>[user] Hi</s>[bot] Yo</s>"
            too_many = [common_pb2.ChatMessage(role="user", content="x")] * (MAX_MESSAGES + 1)
            details = await expect_status(
                stub.RenderChat(tokenizer_pb2.RenderChatRequest(messages=too_many), timeout=10),
                grpc.StatusCode.INVALID_ARGUMENT,
            )
            assert details == f"messages has {MAX_MESSAGES + 1} entries; the limit MAX_MESSAGES is {MAX_MESSAGES}"
    finally:
        await running.stop(grace=0)


# --- Detokenize --------------------------------------------------------------------------------


@dataclass
class ScriptedStream:
    """One request's detokenization: a prompt, then its output ids fed in chunks."""

    stream_id: int
    prompt_ids: list[int]
    output_ids: list[int]
    opens_at_step: int
    chunk: int = 1
    skip_special: bool = True
    received: list[str] = field(default_factory=list)
    position: int = 0

    def expected_text(self, tokenizer: TextTokenizer) -> str:
        # Decoded as the prompt's continuation (keep_leading_space).
        full = tokenizer.decode(self.prompt_ids + self.output_ids, skip_special_tokens=self.skip_special)
        prompt = tokenizer.decode(self.prompt_ids, skip_special_tokens=self.skip_special)
        assert full.startswith(prompt)
        return full[len(prompt):]


def split_prompt(tokenizer: TextTokenizer, text: str, prompt_tokens: int) -> tuple[list[int], list[int]]:
    ids = tokenizer.encode(text)
    # A prompt cut inside a byte run would decode differently on its own; the scripts avoid it.
    assert ids[prompt_tokens - 1] not in tokenizer.byte_token_ids
    return ids[:prompt_tokens], ids[prompt_tokens:]


def scripted_streams(tokenizer: TextTokenizer) -> list[ScriptedStream]:
    english = split_prompt(tokenizer, "Once upon a time, the cat sat on the mat.", 6)
    cjk = split_prompt(tokenizer, "The word 日本語 means Japan, 中文 means Chinese.", 16)  # prompt holds 日本語
    emoji = split_prompt(tokenizer, "Tom saw 😀 and 🎉 and waved 👋🏽 bye.", 10)  # prompt holds 😀
    ends_in_emoji = tokenizer.encode("Bye now 👋🏽", add_special_tokens=False)
    assert ends_in_emoji[-1] in tokenizer.byte_token_ids  # its last character completes with the last token
    return [
        ScriptedStream(11, *english, opens_at_step=0),
        ScriptedStream(22, *cjk, opens_at_step=0),
        ScriptedStream(33, *emoji, opens_at_step=2, chunk=3),
        ScriptedStream(44, [], ends_in_emoji, opens_at_step=1, chunk=2),
        ScriptedStream(55, [], tokenizer.encode("The end.", add_special_tokens=False) + [2], opens_at_step=3,
                       skip_special=False),
    ]


async def test_detokenize_interleaved_streams_token_by_token(stub, reference: TextTokenizer) -> None:
    streams = scripted_streams(reference)
    by_id = {s.stream_id: s for s in streams}
    session = StreamSession(stub.Detokenize)
    step = 0
    while any(s.position < len(s.output_ids) for s in streams):
        new_streams, pieces, closed = [], [], []
        for s in streams:
            if s.opens_at_step == step:
                new_streams.append(tokenizer_pb2.DetokenizeStream(
                    stream_id=s.stream_id, prompt_token_ids=s.prompt_ids, skip_special_tokens=s.skip_special))
            if s.opens_at_step <= step and s.position < len(s.output_ids):
                piece = s.output_ids[s.position : s.position + s.chunk]
                s.position += len(piece)
                pieces.append((s.stream_id, piece))
                if s.position == len(s.output_ids):
                    closed.append(s.stream_id)  # closed in the message carrying its last tokens
        pieces.reverse()  # any order is allowed; the response must follow it
        stream_ids = [stream_id for stream_id, _ in pieces]
        counts = [len(piece) for _, piece in pieces]
        flat = [token for _, piece in pieces for token in piece]
        reply = await session.exchange(tokenizer_pb2.DetokenizeRequest(
            step_id=100 + step, new_streams=new_streams, stream_ids=stream_ids, token_counts=counts,
            token_ids=flat, closed_stream_ids=closed))
        assert reply.step_id == 100 + step
        assert list(reply.stream_ids) == stream_ids
        for stream_id, delta in zip(reply.stream_ids, reply.text_deltas):
            assert "\ufffd" not in delta  # never half a character
            by_id[stream_id].received.append(delta)
        step += 1
    assert await session.close() == grpc.StatusCode.OK
    for s in streams:
        assert "".join(s.received) == s.expected_text(reference), s.stream_id
    assert "".join(by_id[11].received).startswith(" the cat")  # the continuation keeps its space
    assert "".join(by_id[44].received) == "Bye now 👋🏽"  # the held-back emoji was flushed on close
    assert "".join(by_id[55].received) == "The end.</s>"
    # Byte-run characters arrive whole: some deltas were empty while a character was incomplete.
    assert "" in by_id[22].received and "中文" in "".join(by_id[22].received)


async def test_detokenize_close_without_tokens_and_reuse_of_ids(stub, reference: TextTokenizer) -> None:
    session = StreamSession(stub.Detokenize)
    ids = reference.encode("Hi 😀", add_special_tokens=False)
    text_ids, emoji_ids = ids[:-4], ids[-4:]  # the emoji is four byte-fallback pieces
    assert all(t in reference.byte_token_ids for t in emoji_ids)
    first = await session.exchange(tokenizer_pb2.DetokenizeRequest(
        step_id=1, new_streams=[tokenizer_pb2.DetokenizeStream(stream_id=7)], stream_ids=[7],
        token_counts=[len(text_ids)], token_ids=text_ids))
    assert list(first.text_deltas) == ["Hi "]
    held = await session.exchange(tokenizer_pb2.DetokenizeRequest(
        step_id=2, stream_ids=[7], token_counts=[4], token_ids=emoji_ids))
    assert list(held.text_deltas) == [""]  # complete, but held while its byte run may go on
    # Closed without tokens (an abort): nothing is reported for it, and the id is free again.
    second = await session.exchange(tokenizer_pb2.DetokenizeRequest(step_id=3, closed_stream_ids=[7, 999]))
    assert list(second.stream_ids) == [] and list(second.text_deltas) == []
    third = await session.exchange(tokenizer_pb2.DetokenizeRequest(
        step_id=4, new_streams=[tokenizer_pb2.DetokenizeStream(stream_id=7)], stream_ids=[7],
        token_counts=[2], token_ids=ids[:2]))
    assert list(third.text_deltas) == ["Hi"]
    assert await session.close() == grpc.StatusCode.OK


@pytest.mark.parametrize(
    ("request_fields", "details"),
    [
        ({"stream_ids": [1], "token_counts": [2], "token_ids": [5]},
         "token_ids has 1 entries but token_counts sums to 2"),
        ({"stream_ids": [1, 1], "token_counts": [1, 1], "token_ids": [5, 6]}, "stream_ids lists 1 more than once"),
        ({"stream_ids": [1], "token_counts": [1, 1], "token_ids": [5, 6]},
         "token_counts has 2 entries; expected 1 (one per entry of stream_ids)"),
    ],
)
async def test_malformed_detokenize_message_ends_the_stream(stub, request_fields: dict, details: str) -> None:
    session = StreamSession(stub.Detokenize)
    opened = await session.exchange(tokenizer_pb2.DetokenizeRequest(
        step_id=1, new_streams=[tokenizer_pb2.DetokenizeStream(stream_id=1)]))
    assert opened.step_id == 1
    got = await expect_status(
        session.exchange(tokenizer_pb2.DetokenizeRequest(step_id=2, **request_fields)), grpc.StatusCode.INVALID_ARGUMENT
    )
    assert got == details


@pytest.mark.parametrize(
    ("request_fields", "failed", "reason"),
    [
        ({"stream_ids": [9], "token_counts": [1], "token_ids": [5]}, 9, "stream_ids names 9, which is not open"),
        ({"stream_ids": [2], "token_counts": [1], "token_ids": [600]}, 2,
         "token_ids of stream 2 holds 600, outside the vocabulary [0, 512)"),
        ({"new_streams": [tokenizer_pb2.DetokenizeStream(stream_id=2)]}, 2,
         "new_streams[0].stream_id 2 is already open"),
        ({"new_streams": [tokenizer_pb2.DetokenizeStream(stream_id=3, prompt_token_ids=[-1])]}, 3,
         "new_streams[0].prompt_token_ids holds -1, outside the vocabulary [0, 512)"),
        ({"new_streams": [tokenizer_pb2.DetokenizeStream(stream_id=3, stop=["x" * 300])]}, 3,
         "new_streams[0].stop[0] has 300 characters; the limit MAX_STOP_STRING_CHARS is 256"),
    ],
)
async def test_a_bad_stream_fails_alone_and_the_call_serves_the_others(stub, request_fields: dict, failed: int,
                                                                       reason: str) -> None:
    # The scheduler's requests share one Detokenize call: one request's bad item (an id the
    # model may sample but the tokenizer lacks, say) must end that request, not every stream.
    session = StreamSession(stub.Detokenize)
    ids = await stub.Encode(tokenizer_pb2.EncodeRequest(text="the cat sat", add_special_tokens=False), timeout=10)
    opened = await session.exchange(tokenizer_pb2.DetokenizeRequest(
        step_id=1, new_streams=[tokenizer_pb2.DetokenizeStream(stream_id=1), tokenizer_pb2.DetokenizeStream(stream_id=2)]))
    assert opened.step_id == 1
    fields = dict(request_fields)
    fields.setdefault("stream_ids", [])
    fields.setdefault("token_counts", [])
    fields.setdefault("token_ids", [])
    fields["stream_ids"] = [1, *fields["stream_ids"]]
    fields["token_counts"] = [len(ids.token_ids), *fields["token_counts"]]
    fields["token_ids"] = [*ids.token_ids, *fields["token_ids"]]
    reply = await session.exchange(tokenizer_pb2.DetokenizeRequest(step_id=2, **fields))
    assert dict(zip(reply.failed_stream_ids, reply.failed_reasons)) == {failed: reason}
    assert dict(zip(reply.stream_ids, reply.text_deltas))[1] == "the cat sat"
    after = await session.exchange(tokenizer_pb2.DetokenizeRequest(step_id=3, stream_ids=[1], token_counts=[1],
                                                                   token_ids=ids.token_ids[:1]))
    assert after.step_id == 3 and list(after.stream_ids) == [1]
    assert await session.close() == grpc.StatusCode.OK


# --- a real process ----------------------------------------------------------------------------


@pytest.mark.timeout(60)
async def test_module_runs_as_a_process_and_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    port_file = tmp_path / "run" / "tokenizer.port"
    process = await launch_module("services.tokenizer", ["--port", "0", "--port-file", str(port_file),
                                                         "--allow-unauthenticated"])
    try:
        port = await wait_for_port_file(port_file, process)
        async with create_channel(f"127.0.0.1:{port}") as channel:
            assert await health_status(channel, SERVICE) == SERVING
            reply = await tokenizer_pb2_grpc.TokenizerStub(channel).Encode(
                tokenizer_pb2.EncodeRequest(text="Once upon a time"), timeout=10)
            assert list(reply.token_ids) == [1, 403, 407, 261, 378]
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), timeout=20) == 0
        assert not port_file.exists()  # removed on the way out
        events = [json.loads(line)["event"] for line in (await process.stderr.read()).decode().splitlines()]
        # Started with --allow-unauthenticated, it says first that any local process may call it.
        assert events[:2] == ["internal_service_unauthenticated", "server_started"]
        assert events[-2:] == ["server_stopping", "server_stopped"]
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
