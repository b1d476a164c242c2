"""LoRA adapters through every front end of the gateway, in front of two real stories260K engines
(tokenizer, executor and scheduler each, on loopback; the second engine's executor takes ranks up
to 4 only) behind API keys:

- an adapter chosen by ``model`` on Anthropic's Messages API (official ``anthropic`` SDK) and
  OpenAI's Responses API (official ``openai`` SDK), whole and streamed, answers as the chat path
  does with that adapter (itself checked against peft in tests/stack/test_up_lora.py), not as the
  base model; a key whose allow-list lacks it gets the same 404 as an unknown model;
- ``/v1/load_lora_adapter`` on the route of both engines is all-or-none: when one engine refuses
  (rank too large for it), the engine that loaded the adapter drops it again, and one that
  replaced an adapter gets the old files back.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import anthropic
import httpx
import openai
import pytest
import pytest_asyncio

from services.common.pb.tokenmill.v1 import admin_pb2, admin_pb2_grpc
from services.common.server import RunningServer, create_channel
from tests.helpers.gateway_stack import (serve_engine, serve_gateway_for, stop_all, stories_with_chat_template,
                                         wait_healthy, write_routes)
from tests.helpers.lora_adapters import write_adapter_set, write_private_json

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

USER, OTHER, OPS = "sk-lora-user-0123456789", "sk-lora-other-0123456789", "sk-lora-ops-0123456789"
KEYS = [{"key": USER, "tenant": "user", "adapters": ["r4"]}, {"key": OTHER, "tenant": "other", "adapters": []},
        {"key": OPS, "tenant": "ops", "admin": True}]
QUESTION = "Once upon a time"
NEW_TOKENS = 12


@dataclass
class Stack:
    servers: list[RunningServer]
    base_url: str
    engines: list[str]
    adapters: dict[str, str]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stack(tmp_path_factory) -> AsyncIterator[Stack]:
    root = tmp_path_factory.mktemp("lora-front-ends")
    keys = write_private_json(root / "keys.json", KEYS)
    adapters = write_adapter_set(root)
    model = stories_with_chat_template(root)
    # Loads while serving name adapters inside --lora-dir only, as an operator starts the engines.
    engines = [await serve_engine(model=model, num_blocks=64, scheduler={"lora_dir": str(root)},
                                  executor={"max_loras": 2, "max_lora_rank": rank, "lora_dir": str(root)})
               for rank in (16, 4)]
    routes = write_routes(root / "routes.json", {
        "targets": [{"name": "e1", "address": engines[0][-1].address},
                    {"name": "e2", "address": engines[1][-1].address}],
        "models": {"stories": {"strategy": "loadbalance", "targets": ["e1", "e2"]}}})
    gateway = await serve_gateway_for(routes, api_keys_file=str(keys))
    await wait_healthy(gateway, ["e1", "e2"])
    base_url = f"http://127.0.0.1:{gateway.http_port}"
    servers = [gateway, *reversed(engines[0]), *reversed(engines[1])]
    stack = Stack(servers, base_url, [engine[-1].address for engine in engines], adapters)
    loaded = await admin(stack, "load", {"lora_name": "r4", "lora_path": adapters["r4"]})
    assert loaded.status_code == 200, loaded.text
    yield stack
    await stop_all(servers)


async def admin(stack: Stack, verb: str, body: dict) -> httpx.Response:
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=180) as client:
        return await client.post(f"/v1/{verb}_lora_adapter", json=body, headers={"Authorization": f"Bearer {OPS}"})


async def served(address: str) -> dict[str, str]:
    """The adapters an engine serves now: name -> path."""
    async with create_channel(address) as channel:
        listed = await admin_pb2_grpc.AdminStub(channel).ListAdapters(admin_pb2.ListAdaptersRequest(), timeout=30)
    return {info.name: info.path for info in listed.adapters}


async def chat_text(stack: Stack, model: str) -> str:
    async with openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key=USER, max_retries=0) as client:
        reply = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTION}],
                                                     temperature=0, max_tokens=NEW_TOKENS)
    return reply.choices[0].message.content


async def test_messages_select_an_adapter_whole_and_streamed(stack):
    adapted, base = await chat_text(stack, "r4"), await chat_text(stack, "stories")
    assert adapted != base, "the adapter changes nothing: the test could not tell them apart"
    ask = dict(max_tokens=NEW_TOKENS, messages=[{"role": "user", "content": QUESTION}],
               extra_body={"temperature": 0})
    async with anthropic.AsyncAnthropic(base_url=stack.base_url, api_key=USER, max_retries=0) as client:
        whole = await client.messages.create(model="r4", **ask)
        assert whole.model == "r4" and whole.content[0].text == adapted
        async with client.messages.stream(model="r4", **ask) as stream:
            text = "".join([delta async for delta in stream.text_stream])
            final = await stream.get_final_message()
        assert text == adapted and final.model == "r4"
    async with anthropic.AsyncAnthropic(base_url=stack.base_url, api_key=OTHER, max_retries=0) as other:
        for stream in (False, True):
            with pytest.raises(anthropic.NotFoundError) as hidden:
                await other.messages.create(model="r4", stream=stream, **ask)
            assert hidden.value.body["error"]["type"] == "not_found_error"
            assert "the model 'r4' does not exist" in hidden.value.body["error"]["message"]


async def test_responses_select_an_adapter_whole_and_streamed(stack):
    adapted, base = await chat_text(stack, "r4"), await chat_text(stack, "stories")
    assert adapted != base
    ask = dict(input=QUESTION, temperature=0, max_output_tokens=NEW_TOKENS)
    async with openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key=USER, max_retries=0) as client:
        whole = await client.responses.create(model="r4", **ask)
        assert whole.model == "r4" and whole.output_text == adapted
        async with client.responses.stream(model="r4", **ask) as stream:
            deltas = [event.delta async for event in stream if event.type == "response.output_text.delta"]
            final = await stream.get_final_response()
        assert "".join(deltas) == adapted and final.output_text == adapted and final.model == "r4"
    async with openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key=OTHER, max_retries=0) as other:
        for stream in (False, True):
            with pytest.raises(openai.NotFoundError) as hidden:
                await other.responses.create(model="r4", stream=stream, **ask)
            assert hidden.value.body["code"] == "model_not_found"
            assert "the model 'r4' does not exist" in hidden.value.body["message"]


async def test_a_load_one_engine_refuses_is_rolled_back_on_the_others(stack):
    e1, e2 = stack.engines
    before = [await served(e1), await served(e2)]
    assert before[0] == before[1] == {"r4": stack.adapters["r4"]}
    refused = await admin(stack, "load", {"lora_name": "r8", "lora_path": stack.adapters["r8"]})
    assert refused.status_code == 400 and "rank 8 exceeds max_lora_rank=4" in refused.json()["error"]["message"]
    assert [await served(e1), await served(e2)] == before  # e1 had loaded it: dropped again
    replaced = await admin(stack, "load", {"lora_name": "r4", "lora_path": stack.adapters["r8"], "replace": True})
    assert replaced.status_code == 400, replaced.text
    assert [await served(e1), await served(e2)] == before  # e1 had replaced it: the old files are back
    async with openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key=OPS, max_retries=0) as client:
        assert "r8" not in {m.id for m in (await client.models.list()).data}
    loaded = await admin(stack, "load", {"lora_name": "r2", "lora_path": stack.adapters["r2"]})
    assert loaded.status_code == 200 and loaded.json()["engines"] == 2, loaded.text
    assert "r2" in await served(e1) and "r2" in await served(e2)
    assert (await admin(stack, "unload", {"lora_name": "r2"})).status_code == 200
