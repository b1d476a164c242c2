"""Reasoning content end to end, with the official ``openai`` client: SmolLM2-135M-Instruct behind
a chat template that opens ``<think>`` itself in the generation prompt (DeepSeek-R1's shape: the
reply starts inside the section), tokenizer, executor and scheduler servers on loopback, the
gateway in front. Two worked examples in the history teach the pattern (reasoning, ``</think>``,
the answer), and greedy decoding follows it. A route with no reasoning parser shows the text the
model really wrote; a route with ``reasoning_parser: deepseek_r1`` answers the same text split at
``</think>`` into ``reasoning_content`` and ``content``, streamed and not, with nothing of the
reasoning in the content; the call the reasoning writes out is no call, though the route reads
calls (Hermes) and the request offers that function; a reply cut inside the section is reasoning
alone."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import openai
import pytest
import pytest_asyncio

from services.common.server import RunningServer
from tests.helpers.gateway_stack import serve_engine, serve_gateway_for, stop_all, wait_healthy, write_routes
from tests.helpers.tool_templates import SMOLLM2_DIR, smollm2_with_template

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

# ChatML as SmolLM2 writes it, an assistant turn opened with <think>: in the history and in the
# generation prompt alike, so the reply continues from inside the section.
THINK_TEMPLATE = """\
{%- for message in messages %}
{%- if message['role'] == 'assistant' %}
{{- '<|im_start|>assistant\\n<think>\\n' + message['content'] + '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}
"""


def worked(country: str, city: str) -> dict:
    """An answer as the pattern goes: reasoning that writes out a call it does not make, then the answer."""
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s"}}\n</tool_call>' % city
    return {"role": "assistant", "content": f"The user asks for the capital of {country}. I could call {call} "
                                            f"but I know it: {city}.\n</think>\n\nThe capital of {country} is {city}."}


MESSAGES = [{"role": "user", "content": "What is the capital of Italy?"}, worked("Italy", "Rome"),
            {"role": "user", "content": "What is the capital of Spain?"}, worked("Spain", "Madrid"),
            {"role": "user", "content": "What is the capital of France?"}]
# The functions the reasoning writes calls to (greedy decoding names get_travel): read as a call,
# either would be one.
TOOLS = [{"type": "function", "function": {
    "name": name, "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
    for name in ("get_weather", "get_travel")]
REQUEST = dict(messages=MESSAGES, tools=TOOLS, temperature=0, max_tokens=64)


@dataclass
class Stack:
    servers: list[RunningServer]
    client: openai.AsyncOpenAI


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stack(tmp_path_factory) -> AsyncIterator[Stack]:
    assert (SMOLLM2_DIR / "config.json").is_file(), f"{SMOLLM2_DIR} is absent: `make install` converts it"
    root = tmp_path_factory.mktemp("reasoning")
    model = smollm2_with_template(root, "think", THINK_TEMPLATE)
    engine = await serve_engine(model=model, num_blocks=64, max_model_len=512)
    routes = write_routes(root / "routes.json", {
        "targets": [{"name": "e1", "address": engine[-1].address}],
        "models": {"raw": "e1",
                   "r1": {"route": "e1", "reasoning_parser": "deepseek_r1", "tool_call_parser": "hermes"}}})
    gateway = await serve_gateway_for(routes)  # --reasoning-parser none: the route's setting decides
    await wait_healthy(gateway, ["e1"])
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gateway.http_port}/v1", api_key="none", max_retries=0,
                                timeout=300)
    yield Stack([gateway, *reversed(engine)], client)
    await client.close()
    await stop_all([gateway, *reversed(engine)])


async def test_reasoning_goes_to_reasoning_content_streamed_and_not_and_never_to_calls(stack):
    raw = await stack.client.chat.completions.create(model="raw", **REQUEST)
    written = raw.choices[0].message.content
    assert "</think>" in written, f"the worked examples should teach the pattern: {written!r}"
    thought, answer = (part.strip() for part in written.split("</think>", 1))
    assert "France" in thought and "<tool_call>" in thought and "Paris" in answer

    whole = await stack.client.chat.completions.create(model="r1", **REQUEST)
    message = whole.choices[0].message
    assert (message.reasoning_content, message.content) == (thought, answer)
    assert message.tool_calls is None, "the call written while thinking is reasoning, not a call"
    assert whole.choices[0].finish_reason == raw.choices[0].finish_reason
    assert whole.usage.completion_tokens == raw.usage.completion_tokens

    stream = await stack.client.chat.completions.create(model="r1", stream=True, **REQUEST)
    reasoning, content, order = [], [], []
    async for chunk in stream:
        for choice in chunk.choices:
            assert not choice.delta.tool_calls
            if getattr(choice.delta, "reasoning_content", None):
                reasoning.append(choice.delta.reasoning_content)
                order.append("reasoning")
            if choice.delta.content:
                content.append(choice.delta.content)
                order.append("content")
    assert ("".join(reasoning), "".join(content)) == (thought, answer)
    assert len(reasoning) > 1 and len(content) > 1, "both come in pieces, as the model writes them"
    assert order == sorted(order, key=lambda kind: kind == "content"), "all the reasoning, then the content"

    # Cut inside the section (here inside the call it writes out): all of it reasoning, no
    # content, no call.
    cut = await stack.client.chat.completions.create(model="r1", **dict(REQUEST, max_tokens=16))
    assert cut.choices[0].finish_reason == "length"
    assert len(cut.choices[0].message.reasoning_content) > len("The user asks")
    assert thought.startswith(cut.choices[0].message.reasoning_content)
    assert not cut.choices[0].message.content and not cut.choices[0].message.tool_calls


async def test_responses_api_answers_the_reasoning_as_a_reasoning_item(stack):
    """The Responses API over the same route: a ``reasoning`` output item before the message, whole and streamed."""
    chat = await stack.client.chat.completions.create(model="r1", **REQUEST)
    message = chat.choices[0].message
    request = dict(model="r1", input=MESSAGES, temperature=0, max_output_tokens=64)
    whole = await stack.client.responses.create(**request)
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == message.reasoning_content and whole.output_text == message.content
    async with stack.client.responses.stream(**request) as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_response()
    assert "response.reasoning_text.delta" in kinds and kinds.index("response.reasoning_text.done") < kinds.index(
        "response.output_text.delta")
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == message.reasoning_content and final.output_text == message.content
